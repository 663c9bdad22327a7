"""The pytest plugin (entry point `pytest11`: pytest loads it once disagg is installed).

Fixtures:
- `disagg_cluster`: one Cluster per test module (started on first use, stopped after the module's
  last test); `disagg_cluster_per_test`: one per test.
- Options (Cluster's arguments): an indirect parameter (`@pytest.mark.parametrize("disagg_cluster",
  [{"protocol": "pull"}], indirect=True)`) wins; else a `disagg_cluster(**options)` marker: the
  module's (`pytestmark`) for `disagg_cluster`, which the module's tests share, the closest one
  (test, class, module) for `disagg_cluster_per_test`.
- `disagg_cluster_factory`: `factory(**options)` starts a Cluster; every one is stopped after the test.

Importing this module imports nothing heavy: the servers load when a fixture first runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from disagg.testing.cluster import Cluster


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "disagg_cluster(**options): the options of the disagg_cluster fixtures "
                                       "(disagg.testing.Cluster's arguments)")


def cluster_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The options of the cluster a fixture starts: its indirect parameter, else the closest marker."""
    param = getattr(request, "param", None)
    if param is not None:
        return dict(param)
    marker = request.node.get_closest_marker("disagg_cluster")
    return {} if marker is None else dict(marker.kwargs)


def _run(options: dict[str, Any]) -> Iterator[Cluster]:
    from disagg.testing.cluster import Cluster

    with Cluster(**options) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def disagg_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A P/D cluster (tiny model, tcp, push, our router) for the whole module."""
    yield from _run(cluster_options(request))


@pytest.fixture
def disagg_cluster_per_test(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A P/D cluster of its own for one test."""
    yield from _run(cluster_options(request))


@pytest.fixture
def disagg_cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """`factory(**options)` -> a started Cluster; all are stopped after the test."""
    from disagg.testing.cluster import Cluster

    started: list[Cluster] = []

    def factory(**options: Any) -> Cluster:
        cluster = Cluster(**options).start()
        started.append(cluster)
        return cluster

    yield factory
    for cluster in reversed(started):
        cluster.stop()
