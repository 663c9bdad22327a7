"""The harness as others install it: a wheel built from this tree with `python -m build`, installed
with pip into a fresh venv, starts a cluster there and serves the pytest plugin. The fresh venv
takes its dependencies (torch, aiohttp, ...) from this venv through a path file, so pip installs the
wheel alone (`--no-deps`) and nothing is downloaded; `disagg` itself is the wheel's copy (checked)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("build", reason="`build` is a dev dependency: pip install -e '.[dev]'")

CLUSTER_SCRIPT = """
import json, urllib.request
import disagg
from disagg.testing import Cluster

if __name__ == "__main__":
    with Cluster() as cluster:
        body = {"model": "tiny", "prompt": "from a wheel", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(cluster.router_url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        cluster.assert_no_leaks()
        print(json.dumps({"disagg": disagg.__file__, "tokens": answer["usage"]["completion_tokens"],
                          "same": answer["choices"][0]["text"] == cluster.reference("/v1/completions", body)["choices"][0]["text"]}))
"""
PLUGIN_TEST = """
def test_fixture_from_the_wheel(disagg_cluster):
    import disagg
    assert "/fresh/" in disagg.__file__
    assert [w.rank for w in disagg_cluster.decode.workers()] == [0]
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """The python of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", "build", ".git", "*.egg-info", "__pycache__",
                                                                   "bench-out", ".pytest_cache"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(source)],
                   cwd=tmp, check=True, capture_output=True, timeout=240)
    [wheel] = dist.glob("disagg-*.whl")
    env_dir = tmp / "fresh"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "deps_from_the_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: pip must not touch the running venv's own disagg (it would uninstall it first)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--prefix", str(env_dir),
                    str(wheel)],
                   check=True, capture_output=True, timeout=240)
    return python


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: nothing but the fresh venv may provide disagg."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_cluster_starts_from_the_installed_wheel(fresh, tmp_path):
    script = tmp_path / "use_the_wheel.py"
    script.write_text(CLUSTER_SCRIPT)
    run = subprocess.run([str(fresh), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env=clean_env())
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["disagg"].startswith(str(fresh.parent.parent)) and result["disagg"].endswith("/disagg/__init__.py")
    assert (result["tokens"], result["same"]) == (4, True)


def test_the_wheels_pytest_plugin_serves_a_test_file_that_imports_nothing(fresh, tmp_path):
    (tmp_path / "test_router.py").write_text(PLUGIN_TEST)
    run = subprocess.run([str(fresh), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_router.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240, env=clean_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
