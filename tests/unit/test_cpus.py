"""CPU lists, their split among DP ranks and `disagg serve`'s prefill/decode split: exact sets and
error text; and the worker spec a pinned controller builds (its CPUs, its thread count)."""

import os
import shutil

import pytest

from disagg.config import ConfigError, ServerConfig
from disagg.cpus import (
    check_usable, format_cpu_list, parse_cpu_list, plan_cluster_cpus, split_cpus, usable_cpus, worker_cpu_sets,
)
from disagg.dp.controller import DPController
from disagg.engine_config import EngineConfig


def test_parse_cpu_list_takes_numbers_and_ranges():
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list(" 5 , 1-2,2") == {1, 2, 5}
    assert parse_cpu_list("7") == {7}


@pytest.mark.parametrize("text, message", [
    ("", "--cpus '': '' is not a CPU number or a range such as 0-3 (write a Linux CPU list, e.g. 0-3,8,10-11)"),
    ("0-3,", "--cpus '0-3,': '' is not a CPU number or a range such as 0-3 (write a Linux CPU list, e.g. 0-3,8,10-11)"),
    ("a", "--cpus 'a': 'a' is not a CPU number or a range such as 0-3 (write a Linux CPU list, e.g. 0-3,8,10-11)"),
    ("-1", "--cpus '-1': '-1' is not a CPU number or a range such as 0-3 (write a Linux CPU list, e.g. 0-3,8,10-11)"),
    ("1-", "--cpus '1-': '1-' is not a CPU number or a range such as 0-3 (write a Linux CPU list, e.g. 0-3,8,10-11)"),
    ("3-1", "--cpus '3-1': the range '3-1' runs backwards"),
])
def test_parse_cpu_list_refuses_what_is_not_a_list(text, message):
    with pytest.raises(ConfigError) as info:
        parse_cpu_list(text)
    assert str(info.value) == message


def test_format_cpu_list_is_the_shortest_list():
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpu_list({4}) == "4"
    assert format_cpu_list(set()) == ""


def test_cpus_this_process_may_not_use_are_refused():
    assert check_usable(frozenset({0, 1}), frozenset({0, 1, 2})) == {0, 1}
    with pytest.raises(ConfigError) as info:
        check_usable(frozenset({0, 1, 2, 3, 9}), frozenset({0, 1}))
    assert str(info.value) == "--cpus 0-3,9: CPU 2-3,9 is not usable by this process (it may use 0-1)"
    with pytest.raises(ConfigError) as info:
        check_usable(frozenset({0}), None)
    assert str(info.value) == "--cpus needs an OS that pins processes to CPUs (Linux's sched_setaffinity)"


def test_split_gives_contiguous_runs_the_earlier_ranks_one_more():
    assert split_cpus(frozenset(range(8)), 2) == ({0, 1, 2, 3}, {4, 5, 6, 7})
    assert split_cpus(frozenset(range(7)), 3) == ({0, 1, 2}, {3, 4}, {5, 6})
    assert split_cpus(frozenset({0, 1, 2, 3, 8}), 2) == ({0, 1, 2}, {3, 8})
    assert split_cpus(frozenset({5}), 1) == ({5},)


def test_split_with_fewer_cpus_than_ranks_shares_one_cpu_each():
    assert split_cpus(frozenset({0, 1}), 5) == ({0}, {1}, {0}, {1}, {0})
    assert split_cpus(frozenset({3}), 2) == ({3}, {3})


def test_worker_cpu_sets_of_a_server():
    assert worker_cpu_sets(None, 2, frozenset({0, 1})) is None
    assert worker_cpu_sets("0-1", 2, frozenset({0, 1})) == ({0}, {1})
    with pytest.raises(ConfigError, match=r"^--cpus 0-2: CPU 2 is not usable by this process \(it may use 0-1\)$"):
        worker_cpu_sets("0-2", 2, frozenset({0, 1}))


def test_serve_splits_the_machine_in_halves_prefill_first():
    assert plan_cluster_cpus(frozenset({0, 1})) == ({0}, {1})
    assert plan_cluster_cpus(frozenset(range(5))) == ({0, 1, 2}, {3, 4})
    assert plan_cluster_cpus(frozenset({2})) == ({2}, {2})  # one CPU: both share it
    assert plan_cluster_cpus(None) == (None, None)  # no pinning where the OS cannot


def test_serve_cpu_lists_given_for_one_role_leave_the_other_the_rest():
    usable = frozenset(range(4))
    assert plan_cluster_cpus(usable, prefill="0") == ({0}, {1, 2, 3})
    assert plan_cluster_cpus(usable, decode="3") == ({0, 1, 2}, {3})
    assert plan_cluster_cpus(usable, "0-3", "0-3") == (usable, usable)
    with pytest.raises(ConfigError) as info:
        plan_cluster_cpus(usable, decode="0-3")
    assert str(info.value) == ("--decode-cpus 0-3 leaves no CPU for prefill: give --prefill-cpus too "
                               "(the lists may overlap)")
    with pytest.raises(ConfigError) as info:
        plan_cluster_cpus(usable, prefill="4")
    assert str(info.value) == "--prefill-cpus 4: CPU 4 is not usable by this process (it may use 0-3)"


USABLE = usable_cpus() or frozenset()
needs_two_cpus = pytest.mark.skipif(not {0, 1} <= USABLE, reason="needs CPUs 0 and 1 in this process's affinity")


def make_controller(engine: EngineConfig = EngineConfig(), **server) -> DPController:
    controller = DPController(ServerConfig(port=0, **server), engine)
    shutil.rmtree(controller._tmpdir)  # never started: nothing else to close
    return controller


def worker_specs(controller: DPController) -> list[tuple[frozenset[int] | None, int]]:
    return [(s.cpus, s.engine.num_threads) for s in map(controller.worker_spec, range(controller.dp_size))]


@needs_two_cpus
def test_a_pinned_controller_gives_each_worker_its_cpus_and_as_many_threads():
    assert worker_specs(make_controller(dp_size=1, cpus="0-1")) == [({0, 1}, 2)]
    assert worker_specs(make_controller(dp_size=3, cpus="0-1")) == [({0}, 1), ({1}, 1), ({0}, 1)]


@needs_two_cpus
def test_num_threads_given_wins_over_the_cpu_share():
    assert worker_specs(make_controller(EngineConfig(num_threads=3), dp_size=2, cpus="0-1")) == [({0}, 3), ({1}, 3)]


def test_an_unpinned_controller_pins_nothing():
    (cpus, threads), = worker_specs(make_controller(dp_size=1))
    assert cpus is None and threads == max(1, os.cpu_count() or 1)
