"""The decode's bounds before any authentication: the addresses a request may name (push: the
registry; pull: the ticket's prefill), refused before any connection; the registry clients requests
ask for, held in a bounded LRU cache that never closes one in use."""

import pytest

from decode.pull import PullFetch, ticket_of
from decode.push import PushFetch
from decode.registries import InUseLru, Registries
from disagg.pd_config import DecodeConfig, DisaggConfig
from disagg.types import InvalidRequest, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg

pytestmark = pytest.mark.timeout(10)
ALLOWED = ("10.0.0.0/8:8998", "prefill-*.svc", "[::1]:17001")


def push_check(host: str, port: int) -> None:
    fetch = PushFetch(None, 0, DisaggConfig(decode=DecodeConfig(allowed_bootstrap_hosts=ALLOWED)), None, None, None)
    fetch.check(GenerateMsg("r1", SamplingParams(), prompt="hi", bootstrap_host=host, bootstrap_port=port,
                            bootstrap_room=7))


def pull_check(host: str, port: int) -> None:
    msg = GenerateMsg("r1", SamplingParams(), prompt="hi", kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": host, "remote_port": port,
        "remote_request_id": "p-1", "remote_block_ids": [1, 2]})
    PullFetch(None, DisaggConfig(decode=DecodeConfig(allowed_bootstrap_hosts=ALLOWED)), None, None, None).check(msg, ticket_of(msg))


@pytest.mark.parametrize("check, host, port", [
    (push_check, "10.0.0.5", 8998), (push_check, "10.255.0.1", 8998), (push_check, "prefill-3.svc", 1),
    (push_check, "PREFILL-3.svc", 8998), (pull_check, "::1", 17001), (pull_check, "10.0.0.9", 8998),
    (pull_check, "prefill-0.svc", 40000),
])
def test_an_allowed_registry_or_ticket_passes(check, host, port):
    check(host, port)


PUSH, PULL = "bootstrap_host:bootstrap_port", "kv_transfer_params remote_host:remote_port"


@pytest.mark.parametrize("check, host, port, named, param", [
    (push_check, "10.0.0.5", 8999, f"{PUSH} '10.0.0.5:8999'", "bootstrap_host"),
    (push_check, "11.0.0.5", 8998, f"{PUSH} '11.0.0.5:8998'", "bootstrap_host"),
    (push_check, "::1", 8998, f"{PUSH} '[::1]:8998'", "bootstrap_host"),
    (push_check, "prefill-3.evil.svc", 8998, f"{PUSH} 'prefill-3.evil.svc:8998'", "bootstrap_host"),
    (push_check, "localhost", 8998, f"{PUSH} 'localhost:8998'", "bootstrap_host"),
    (pull_check, "::1", 17002, f"{PULL} '[::1]:17002'", "kv_transfer_params"),
    (pull_check, "10.0.0.9", 17001, f"{PULL} '10.0.0.9:17001'", "kv_transfer_params"),
    (pull_check, "127.0.0.1", 17001, f"{PULL} '127.0.0.1:17001'", "kv_transfer_params"),
])
def test_another_registry_or_ticket_is_refused_naming_its_host_and_port(check, host, port, named, param):
    with pytest.raises(InvalidRequest) as info:
        check(host, port)
    assert (info.value.message, info.value.param) == (
        f"{named} is not allowed on this decode server (see its --allowed-bootstrap-hosts)", param)


# ---- the registry clients: a bounded LRU cache --------------------------------------------------


def test_idle_values_are_evicted_least_recently_used_first():
    lru = InUseLru(2)
    made = []

    def make(name):
        return lambda: made.append(name) or name

    assert lru.acquire("a", make("a")) == ("a", [])
    assert lru.release("a") == []
    assert lru.acquire("b", make("b")) == ("b", [])
    assert lru.release("b") == []
    assert lru.acquire("a", make("a")) == ("a", [])  # reused, now the most recent
    assert lru.release("a") == []
    assert lru.acquire("c", make("c")) == ("c", ["b"])
    assert lru.release("c") == []
    assert (lru.keys(), made) == (["a", "c"], ["a", "b", "c"])
    assert lru.take_all() == ["a", "c"] and lru.keys() == []


def test_values_in_use_are_never_evicted_and_go_once_their_requests_end():
    lru = InUseLru(1)
    assert lru.acquire("a", lambda: "a") == ("a", [])
    assert lru.acquire("a", lambda: "a2") == ("a", [])  # a second request on the same registry
    assert lru.acquire("b", lambda: "b") == ("b", [])  # over capacity: both in use
    assert lru.acquire("c", lambda: "c") == ("c", [])
    assert (lru.keys(), lru.num_in_use("a"), lru.num_in_use("b")) == (["a", "b", "c"], 2, 1)
    assert lru.release("b") == ["b"]
    assert lru.release("a") == []  # one request still on it
    assert lru.release("c") == ["c"]
    assert lru.keys() == ["a"]
    assert lru.release("a") == []  # back within capacity: kept
    assert (lru.keys(), lru.num_in_use("a")) == (["a"], 0)
    with pytest.raises(AssertionError, match="'a' released more often than acquired"):
        lru.release("a")


async def test_registries_close_what_they_evict_and_never_one_in_use():
    registries = Registries(2)
    seen = {}
    for port in (1, 2, 3):
        async with registries.using("10.0.0.5", port) as registry:
            seen[port] = registry
    assert registries.keys() == [("10.0.0.5", 2), ("10.0.0.5", 3)]
    assert [seen[port].closed for port in (1, 2, 3)] == [True, False, False]
    async with registries.using("10.0.0.5", 2) as held:
        assert held is seen[2]
        for port in (4, 5, 6):
            async with registries.using("10.0.0.6", port) as registry:
                seen[port] = registry
        assert registries.keys() == [("10.0.0.5", 2), ("10.0.0.6", 6)]
        assert held.closed is False
    assert [seen[port].closed for port in (3, 4, 5, 6)] == [True, True, True, False]
    await registries.close()
    assert registries.keys() == [] and held.closed and seen[6].closed
