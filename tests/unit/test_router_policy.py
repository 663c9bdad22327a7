"""The router's pure parts: pair policy, rooms, DP ranks, body edits, config parsing, worker pool."""

import random

import msgspec
import pytest

from disagg.config import ConfigError
from disagg.http_edge import BadRequest
from disagg.router import bodies
from disagg.router.config import PdProtocol, PrefillEndpoint, RouterConfig, parse_prefill
from disagg.router.errors import DpRankMismatch, NoHealthyServer, ServerError, ServerUnreachable
from disagg.router.policy import (
    PairPicker, Policy, ServerLoad, ServerPicker, draw_bootstrap_room, draw_rooms, pick_dp_rank,
)
from disagg.router.workers import Health, Role, WorkerPool

UP = ServerLoad(True)
DOWN = ServerLoad(False)


def picks(picker: ServerPicker, loads, n: int) -> list:
    return [picker.pick(loads) for _ in range(n)]


# --- pair policy -----------------------------------------------------------------------------------


def test_round_robin_cycles_and_skips_unhealthy():
    picker = ServerPicker(Policy.ROUND_ROBIN, random.Random(0))
    assert picks(picker, [UP, UP, UP], 4) == [0, 1, 2, 0]
    assert picks(picker, [UP, DOWN, UP], 3) == [2, 0, 2]
    assert picks(picker, [DOWN, DOWN, UP], 2) == [2, 2]


def test_no_eligible_server_is_none():
    for policy in Policy:
        assert ServerPicker(policy, random.Random(0)).pick([DOWN, DOWN]) is None
        assert ServerPicker(policy, random.Random(0)).pick([]) is None


def test_least_load_picks_fewest_in_flight_and_rotates_ties():
    picker = ServerPicker(Policy.LEAST_LOAD, random.Random(0))
    assert picker.pick([ServerLoad(True, 3), ServerLoad(True, 1), ServerLoad(True, 2)]) == 1
    tied = [ServerLoad(True, 0), ServerLoad(True, 0), ServerLoad(True, 5)]
    assert picks(picker, tied, 3) == [0, 1, 0]
    assert picker.pick([ServerLoad(False, 0), ServerLoad(True, 4), ServerLoad(True, 9)]) == 1


def test_random_is_uniform_over_healthy_with_injected_rng():
    pair = PairPicker("random", random.Random(0))
    assert [pair.pick_pair([UP] * 3, [UP] * 3) for _ in range(4)] == [(1, 1), (0, 1), (2, 1), (1, 1)]
    picker = ServerPicker(Policy.RANDOM, random.Random(0))
    assert set(picks(picker, [DOWN, UP, DOWN, UP], 50)) == {1, 3}


def test_pair_picker_keeps_a_cursor_per_role_and_names_the_missing_role():
    pair = PairPicker(Policy.ROUND_ROBIN)
    assert [pair.pick_pair([UP, UP], [UP, UP, UP]) for _ in range(4)] == [(0, 0), (1, 1), (0, 2), (1, 0)]
    with pytest.raises(NoHealthyServer) as exc:
        pair.pick_pair([DOWN], [UP])
    assert (exc.value.status, exc.value.message) == (503, "no healthy prefill server")
    with pytest.raises(NoHealthyServer) as exc:
        pair.pick_pair([UP], [DOWN, DOWN])
    assert exc.value.message == "no healthy decode server"


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        PairPicker("cache_aware")


# --- rooms and DP ranks ----------------------------------------------------------------------------


def test_room_is_63_bits_from_injected_source():
    asked = []
    assert draw_bootstrap_room(lambda bits: asked.append(bits) or 12345) == 12345
    assert asked == [63]
    assert draw_bootstrap_room(random.Random(7).getrandbits) == 8742514861359412280
    room = draw_bootstrap_room()
    assert 0 <= room < 2**63 and isinstance(room, int)


def test_batched_rooms_are_distinct():
    values = iter([5, 5, 9, 5, 11])
    assert draw_rooms(3, lambda bits: next(values)) == [5, 9, 11]
    assert draw_rooms(None, lambda bits: 42) == 42


def test_dp_rank_is_in_range_with_injected_rng():
    rng = random.Random(1)
    assert [pick_dp_rank(4, rng) for _ in range(6)] == [1, 0, 2, 0, 3, 3]
    assert pick_dp_rank(1, rng) == 0
    with pytest.raises(ValueError):
        pick_dp_rank(0, rng)


# --- bodies ----------------------------------------------------------------------------------------


def test_bootstrap_fields_are_added_to_a_copy():
    body = {"text": "hi", "bootstrap_room": 1}
    out = bodies.with_bootstrap(body, bodies.Bootstrap("10.0.0.1", 8998, 77))
    assert out == {"text": "hi", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 77}
    assert body == {"text": "hi", "bootstrap_room": 1}


def test_batched_generate_gets_one_field_per_prompt():
    assert bodies.generate_batch_size("/generate", {"text": ["a", "b"]}) == 2
    assert bodies.generate_batch_size("/generate", {"input_ids": [[1], [2], [3]]}) == 3
    assert bodies.generate_batch_size("/generate", {"input_ids": [1, 2]}) is None
    assert bodies.generate_batch_size("/v1/completions", {"text": ["a"]}) is None
    assert bodies.generate_batch_size("/v1/completions", {"prompt": ["a", [1, 2]]}) == 2
    assert bodies.generate_batch_size("/v1/completions", {"prompt": ["a"]}) is None  # one prompt: one room
    assert bodies.generate_batch_size("/v1/completions", {"prompt": [1, 2]}) is None
    assert bodies.generate_batch_size("/v1/chat/completions", {"prompt": ["a", "b"]}) is None
    with pytest.raises(BadRequest) as exc:  # no prompt means no room to draw: the client's 400
        bodies.generate_batch_size("/generate", {"text": []})
    assert (exc.value.status, exc.value.message, exc.value.param) == (
        400, "text is an empty list: send a prompt (or a non-empty batch of prompts)", "text")
    fields = bodies.Bootstrap("h", None, [4, 5]).fields()
    assert fields == {"bootstrap_host": ["h", "h"], "bootstrap_port": [None, None], "bootstrap_room": [4, 5]}


CLIENT_BODY = {
    "text": "hi", "sampling_params": {"max_new_tokens": 2}, "kv_transfer_params": {"do_remote_decode": True},
    "bootstrap_host": "10.6.6.6", "bootstrap_port": 1, "bootstrap_room": 7, "routed_dp_rank": 1,
    "disagg_prefill_dp_rank": 0, "data_parallel_rank": 1,
}


def test_the_client_internal_fields_are_dropped_and_routing_kept_only_when_trusted():
    assert bodies.without_internal_fields(CLIENT_BODY, trust_routing=False) == {
        "text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert bodies.without_internal_fields(CLIENT_BODY, trust_routing=True) == {
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 1, "disagg_prefill_dp_rank": 0,
        "data_parallel_rank": 1}
    assert CLIENT_BODY["kv_transfer_params"] == {"do_remote_decode": True}  # the input is left as it was
    assert len(CLIENT_BODY) == 9
    assert bodies.without_internal_fields({"prompt": "x"}, trust_routing=False) == {"prompt": "x"}


def test_the_router_bootstrap_fields_replace_what_the_client_sent_after_the_drop():
    kept = bodies.without_internal_fields(CLIENT_BODY, trust_routing=False)
    assert bodies.with_bootstrap(kept, bodies.Bootstrap("10.0.0.1", 8998, 77)) == {
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
        "bootstrap_room": 77}


def test_dp_ranks_fork_the_body():
    prefill, decode = bodies.with_dp_ranks({"x": 1}, prefill_rank=2, decode_rank=0)
    assert prefill == {"x": 1, "routed_dp_rank": 2, "disagg_prefill_dp_rank": 2}
    assert decode == {"x": 1, "routed_dp_rank": 0, "disagg_prefill_dp_rank": 2}


def test_prompt_logprobs_are_copied_only_where_decode_lacks_them():
    decode = {"text": "x", "meta_info": {"output_token_logprobs": [[-1.0, 5, None]], "input_token_logprobs": []}}
    prefill = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}}
    assert bodies.merge_prompt_logprobs(decode, prefill) is True
    assert decode["meta_info"] == {"output_token_logprobs": [[-1.0, 5, None]],
                                   "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}
    kept = {"meta_info": {"input_token_logprobs": [[-9.0, 3, None]]}}
    assert bodies.merge_prompt_logprobs(kept, prefill) is False
    assert kept == {"meta_info": {"input_token_logprobs": [[-9.0, 3, None]]}}
    assert bodies.merge_prompt_logprobs({"choices": []}, prefill) is False
    assert bodies.wants_prompt_logprobs("/generate", {"return_logprob": True}) is True
    assert bodies.wants_prompt_logprobs("/v1/completions", {"return_logprob": True}) is False


def test_reported_dp_rank_precedence():
    assert bodies.reported_dp_ranks({"dp_rank": 1, "meta_info": {"dp_rank": 2}}, "3") == [1]
    assert bodies.reported_dp_ranks({"meta_info": {"dp_rank": 2}}, "3") == [2]
    assert bodies.reported_dp_ranks({"text": "x"}, " 3 ") == [3]
    assert bodies.reported_dp_ranks({"text": "x"}, None) == [None]
    assert bodies.reported_dp_ranks([{"meta_info": {"dp_rank": 0}}, {"meta_info": {"dp_rank": 1}}], None) == [0, 1]


def test_dp_rank_check_message():
    bodies.check_decode_dp_rank(1, {"dp_rank": 1}, None)
    with pytest.raises(DpRankMismatch) as exc:
        bodies.check_decode_dp_rank(1, {"meta_info": {"dp_rank": 0}}, None)
    assert exc.value.status == 500
    assert exc.value.message == "DP rank mismatch: sent routed_dp_rank=1 to decode, it reported 0"
    with pytest.raises(DpRankMismatch, match="it reported None$"):
        bodies.check_decode_dp_rank(0, {"text": "x"}, None)


def test_request_body_must_be_a_json_object():
    assert bodies.parse_request_body(b'{"a": 1}') == {"a": 1}
    for raw, message in ((b"[1]", "request body must be a JSON object, got list"), (b"{", "request body is not valid JSON")):
        with pytest.raises(Exception) as exc:
            bodies.parse_request_body(raw)
        assert exc.value.status == 400 and exc.value.message.startswith(message)


def test_bodies_nested_too_deeply_or_not_utf8_are_400_never_500():
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw, message in ((deep, "request body is not valid JSON: it is nested too deeply"),
                         (b'{"text": "\xff"}', "request body is not valid JSON: it is not valid UTF-8")):
        with pytest.raises(BadRequest) as exc:
            bodies.parse_request_body(raw)
        assert (exc.value.status, exc.value.message) == (400, message)
    nested: list = []
    for _ in range(5_000):  # decodable just under the limit, the body still has to be encoded again per leg
        nested = [nested]
    with pytest.raises(BadRequest) as exc:
        bodies.encode_body({"text": nested})
    assert (exc.value.status, exc.value.message) == (400, "request body is not valid JSON: it is nested too deeply")


# --- errors ----------------------------------------------------------------------------------------


def test_errors_are_openai_shaped_and_server_json_passes_through():
    err = ServerUnreachable("decode", "http://127.0.0.1:9", "ClientConnectorError: refused")
    assert err.status == 502
    assert msgspec.json.decode(err.body()) == {"error": {
        "message": "decode server http://127.0.0.1:9 unreachable: ClientConnectorError: refused",
        "type": "BadGatewayError", "param": None, "code": "upstream_unreachable"}}
    raw = b'{"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": null}}'
    assert ServerError("prefill", "http://p", 400, raw, "application/json; charset=utf-8").body() == raw
    wrapped = ServerError("prefill", "http://p", 500, b"boom", "text/plain").body()
    assert msgspec.json.decode(wrapped)["error"]["message"] == "prefill server http://p answered 500: boom"


# --- config ----------------------------------------------------------------------------------------


def test_prefill_argument_shapes():
    assert parse_prefill(["http://p:30001"]) == PrefillEndpoint("http://p:30001", 8998)
    assert parse_prefill(["http://p:30001/", "9000"]) == PrefillEndpoint("http://p:30001", 9000)
    assert parse_prefill(["http://p:30001", "none"]) == PrefillEndpoint("http://p:30001", None)
    assert PrefillEndpoint("http://10.1.2.3:30001").bootstrap_host == "10.1.2.3"
    standalone = parse_prefill(["http://10.1.2.3:30001", "10.1.2.9:8998"])  # a registry of its own
    assert standalone == PrefillEndpoint("http://10.1.2.3:30001", 8998, "10.1.2.9")
    assert standalone.bootstrap_host == "10.1.2.9"
    assert parse_prefill(["http://p:1", "[fd00::9]:7000"]) == PrefillEndpoint("http://p:1", 7000, "fd00::9")
    with pytest.raises(ConfigError, match="bootstrap port must be an integer, HOST:PORT or 'none', got 'h:x'"):
        parse_prefill(["http://p", "h:x"])
    for bad in (["http://p", "x"], ["http://p", "1", "2"], ["p:30001"], ["http://p", "70000"], ["http://p", "h:0"]):
        with pytest.raises(ConfigError):
            parse_prefill(bad)


def test_router_config_validation():
    ok = RouterConfig(prefill=(PrefillEndpoint("http://p:1"),), decode=("http://d:2/",))
    assert ok.decode == ("http://d:2",) and ok.policy == "round_robin" and ok.health_checks_enabled
    with pytest.raises(ConfigError, match="at least one --prefill and one --decode"):
        RouterConfig(prefill=(PrefillEndpoint("http://p:1"),))
    with pytest.raises(ConfigError, match="policy must be one of round_robin, random, least_load"):
        RouterConfig(prefill=(PrefillEndpoint("http://p:1"),), decode=("http://d:2",), policy="x")


def test_policy_and_protocol_are_members_that_read_as_their_values():
    servers = {"prefill": (PrefillEndpoint("http://p:1"),), "decode": ("http://d:2",)}
    default = RouterConfig(**servers)
    assert default.policy is Policy.ROUND_ROBIN and default.protocol is PdProtocol.PUSH
    config = RouterConfig(**servers, policy="least_load", protocol="pull")
    assert config.policy is Policy.LEAST_LOAD and config.protocol is PdProtocol.PULL
    assert (str(config.policy), f"{config.protocol}") == ("least_load", "pull")
    assert msgspec.json.encode({"policy": config.policy, "protocol": config.protocol}) == \
        b'{"policy":"least_load","protocol":"pull"}'
    with pytest.raises(ConfigError) as info:
        RouterConfig(**servers, protocol="tcp")
    assert str(info.value) == "protocol must be one of push, pull, got 'tcp'"


# --- worker pool -----------------------------------------------------------------------------------


def test_worker_pool_tracks_health_and_load():
    pool = WorkerPool([PrefillEndpoint("http://p:1", 7000)], ["http://d:1", "http://d:2"])
    assert pool.loads(Role.DECODE) == [ServerLoad(True, 0, 0), ServerLoad(True, 0, 1)]
    assert pool.num_healthy(Role.DECODE) == 0
    assert pool.set_health(Role.DECODE, 0, Health.UNHEALTHY, "/health answered 503") is Health.UNKNOWN
    pool.set_health(Role.DECODE, 1, Health.HEALTHY)
    pool.begin(Role.DECODE, 1)
    pool.begin(Role.DECODE, 1)
    pool.end(Role.DECODE, 1)
    assert pool.loads(Role.DECODE) == [ServerLoad(False, 0, 0), ServerLoad(True, 1, 1)]
    assert (pool.num_healthy(Role.DECODE), pool.first_eligible(Role.DECODE)) == (1, 1)
    assert pool.info(Role.DECODE, 0).as_json() == {
        "url": "http://d:1", "role": "decode", "health": "unhealthy", "healthy": False, "in_flight": 0,
        "dp_size": None, "last_error": "/health answered 503"}
    pool.set_dp_size(Role.PREFILL, 0, 4)
    assert pool.info(Role.PREFILL, 0).as_json()["bootstrap_port"] == 7000
    assert pool.info(Role.PREFILL, 0).dp_size == 4
    assert pool.loads(Role.PREFILL) == [ServerLoad(True, 0, server_id=0, dp_size=4)]
    pool.end(Role.DECODE, 1)
    with pytest.raises(AssertionError, match="ended twice"):
        pool.end(Role.DECODE, 1)
