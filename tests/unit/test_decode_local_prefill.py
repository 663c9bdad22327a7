"""The decode's local-prefill rule, on a real tiny engine: a request sent to the decode alone is
prefilled there while its uncached tokens and those of the local prefills still running stay within
`max_local_prefill_tokens`; past that it is refused, naming both counts."""

import asyncio

from decode.requests import DecodeRequest, DecodeState
from decode.role import DecodeRole
from disagg.pd_config import DecodeConfig, DisaggConfig
from disagg.types import FinishReason, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg

from test_engine_tiny import engine

REFUSAL = ("{uncached} of the prompt's {n} tokens are not in this decode's prefix cache{waiting}; it prefills at "
           "most 16 itself (--max-local-prefill-tokens): send the request with a prefill (bootstrap_room, "
           "bootstrap_host and bootstrap_port, or kv_transfer_params)")


def alone(request_id: str, ids: list[int]) -> GenerateMsg:
    return GenerateMsg(request_id, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), prompt_token_ids=ids)


def local(role: DecodeRole) -> dict[str, int]:
    """The local prefills the role holds: request id -> prompt tokens cached when it was admitted."""
    return {r.request_id: r.cached_tokens for r in role.requests.in_state(DecodeState.LOCAL)}


def test_local_prefills_share_one_budget_of_uncached_tokens(tiny_loaded):
    core = engine(tiny_loaded)
    role = DecodeRole(core, 0, "tiny", config=DisaggConfig(transfer_backend="tcp", decode=DecodeConfig(max_local_prefill_tokens=16)))
    submit = lambda msg: asyncio.run(role.submit(msg))  # noqa: E731
    assert submit(alone("a", list(range(40, 52)))) == []  # 12 uncached: taken, 12 now wait to be prefilled
    [refused] = submit(alone("b", list(range(60, 68))))
    assert (refused.request_id, refused.error_status, refused.error_param) == ("b", 400, "bootstrap_room")
    assert refused.error == REFUSAL.format(uncached=8, n=8, waiting=", and 12 of other requests wait to be prefilled here")
    core.step()  # a's prompt is computed: nothing of it waits any more
    assert local(role) == {"a": 0} and role._local_backlog() == 0 and local(role) == {}
    assert submit(alone("b", list(range(60, 68)))) == []
    # A prompt the decode holds 8 tokens of (a's first two blocks), with 9 new: 9 + b's 8 is over 16.
    [refused] = submit(alone("c", list(range(40, 48)) + list(range(80, 89))))
    assert refused.error == REFUSAL.format(uncached=9, n=17, waiting=", and 8 of other requests wait to be prefilled here")
    while core.has_unfinished():
        core.step()
    assert submit(alone("c", list(range(40, 48)) + list(range(80, 89)))) == [] and local(role) == {"c": 8}
    while core.has_unfinished():
        core.step()
    assert core.kv.num_free_blocks == core.num_blocks


def test_a_first_token_that_came_with_the_kv_goes_out_before_any_decode_step(tiny_loaded):
    """Push flow: the prefill's SUCCESS carries the first token; the decode's next poll sends it (with
    the request's KV figures), so the client does not wait for a decode step to see it."""
    import time
    from types import SimpleNamespace

    from decode.push import PushFetch
    from decode.waiting import PendingKV
    from disagg.wire.control_msgs import TransferState, TransferStatusMsg

    core = engine(tiny_loaded)
    role = DecodeRole(core, 0, "tiny", config=DisaggConfig(transfer_backend="tcp"))
    role.backend = SimpleNamespace(notifications=lambda: [])  # no transfer backend: the KV "landed" already
    role.push = PushFetch(core, 0, role.config, role.backend, None, role.fences)
    prompt = list(range(40, 52))
    msg = GenerateMsg("r", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), prompt_token_ids=prompt,
                      bootstrap_room=7, bootstrap_host="127.0.0.1", bootstrap_port=1)
    assert core.reserve_for_remote_kv("r", prompt, msg.sampling).new_block_ids == [0, 1, 2]
    role.requests.add(DecodeRequest("r", DecodeState.QUEUED, PendingKV(msg, None, time.monotonic())))
    role.requests.move("r", DecodeState.FETCHING)
    role.requests.move("r", DecodeState.LANDED).verdict = TransferStatusMsg(
        room=7, state=TransferState.SUCCESS, first_token_id=42, num_bytes=6144)
    [first] = asyncio.run(role.poll())
    assert (first.request_id, first.new_token_ids, first.finish_reason, first.kv.kv_bytes) == ("r", [42], None, 6144)
    assert len(role.requests) == 0  # its first output carried the KV figures: the role holds it no more
    assert role.step()[0].num_output_tokens == 2  # the next step brings the second token alone
    while core.has_unfinished():
        core.step()
    assert core.kv.num_free_blocks == core.num_blocks


def test_a_request_marked_prefill_here_is_prefilled_whole_whatever_the_limit(tiny_loaded):
    """`disagg_prefill_here` (our router, while no prefill serves): taken past the limit and the backlog,
    on a decode with no limit at all too; with a room or a ticket it is refused (it names no prefill)."""
    for limit in (16, 0):
        core = engine(tiny_loaded)
        role = DecodeRole(core, 0, "tiny", config=DisaggConfig(transfer_backend="tcp",
                                                               decode=DecodeConfig(max_local_prefill_tokens=limit)))
        submit = lambda msg: asyncio.run(role.submit(msg))  # noqa: E731
        whole = lambda rid, ids: GenerateMsg(rid, alone(rid, ids).sampling, prompt_token_ids=ids,  # noqa: E731
                                             disagg_prefill_here=True)
        assert submit(whole("a", list(range(40, 80)))) == []  # 40 uncached
        assert submit(whole("b", list(range(100, 130)))) == []  # 30 more, behind a's 40
        assert local(role) == {"a": 0, "b": 0} and role._local_backlog() == 70
        [refused] = submit(GenerateMsg("c", alone("c", [1]).sampling, prompt_token_ids=list(range(5, 9)),
                                       bootstrap_room=7, bootstrap_host="127.0.0.1", bootstrap_port=1,
                                       disagg_prefill_here=True))
        assert (refused.request_id, refused.error_status, refused.error_param) == ("c", 400, "disagg_prefill_here")
        assert refused.error == ("disagg_prefill_here asks this decode to prefill the prompt itself: send it without "
                                 "bootstrap_room and kv_transfer_params (those name a prefill that computes it)")
        tokens = {"a": [], "b": []}
        while core.has_unfinished():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        assert [len(t) for t in tokens.values()] == [4, 4]
        assert core.kv.num_free_blocks == core.num_blocks


def test_requests_sent_whole_run_under_a_unified_servers_limits(tiny_loaded):
    """A decode with 2 seqs and 4 prompt tokens a step beside KV from a prefill: requests sent whole run
    3 at once (--whole-max-num-seqs) with no per-step prompt cap; a short rest sent beside them restores
    4 prompt tokens a step and 2 requests once the three running end (none stalls meanwhile); closing the
    role (a role switch) hands the engine on with its own limits."""
    core = engine(tiny_loaded, max_seqs=2)
    core.set_scheduler_limits(max_num_seqs=2, max_prefill_tokens_per_step=4)
    role = DecodeRole(core, 0, "tiny", config=DisaggConfig(transfer_backend="tcp", decode=DecodeConfig(
        max_local_prefill_tokens=16, whole_max_num_seqs=3)))
    limits = lambda: (core.scheduler.config.max_num_seqs, core.scheduler.config.max_prefill_tokens_per_step)  # noqa: E731
    for i in range(3):
        assert asyncio.run(role.submit(GenerateMsg(f"w{i}", alone("w", [1]).sampling, prompt_token_ids=list(range(
            40 + 10 * i, 50 + 10 * i)), disagg_prefill_here=True))) == []
    assert limits() == (3, 0)
    step = core.step()
    assert sorted(out.request_id for out in step) == ["w0", "w1", "w2"]  # 30 prompt tokens in one step, 3 running
    asyncio.run(role.submit(GenerateMsg("short", alone("short", [1]).sampling, prompt_token_ids=list(range(40, 44)))))
    assert limits() == (3, 4)  # the decode's own limits, but not below the three running: none stalls
    steps = []
    while core.has_unfinished():
        steps.append(sorted(out.request_id for out in role.step()))
    assert steps == [["w0", "w1", "w2"]] * 3 + [["short"]] * 4 and limits() == (2, 4)  # short waited for a slot
    assert core.kv.num_free_blocks == core.num_blocks
    asyncio.run(role.submit(GenerateMsg("again", alone("again", [1]).sampling, prompt_token_ids=[5, 6],
                                        disagg_prefill_here=True)))
    assert limits() == (3, 0)
    role._schedule_as(whole=False)  # what close() does first
    assert limits() == (2, 4)


def test_with_the_pace_on_requests_sent_whole_start_only_as_it_allows(tiny_loaded):
    """--itl-objective-ms 60 on a decode whose steps cost 10 ms plus a second a request (so that the tiny
    engine's own fast steps, added to the fit as they run, cannot raise it): the pace allows one request.
    Three requests sent whole (--whole-max-num-seqs 3) already running keep their tokens every step (a
    lower limit would stall the newest), one of them aborted frees no slot past the pace, a fourth
    starts only once the others ended; the decode's own limits
    come back for KV from a prefill, the pace's for the next whole request, and every block is freed."""
    from decode.pace import MIN_STEPS
    from disagg.engine.step_metrics import StepMetrics

    core = engine(tiny_loaded, max_seqs=2)
    core.set_scheduler_limits(max_num_seqs=2, max_prefill_tokens_per_step=4)
    role = DecodeRole(core, 0, "tiny", config=DisaggConfig(transfer_backend="tcp", decode=DecodeConfig(
        max_local_prefill_tokens=16, whole_max_num_seqs=3, itl_objective_ms=60)))
    limits = lambda: (core.scheduler.config.max_num_seqs, core.scheduler.config.max_prefill_tokens_per_step)  # noqa: E731
    whole = lambda rid, ids: GenerateMsg(rid, alone(rid, ids).sampling, prompt_token_ids=ids,  # noqa: E731
                                         disagg_prefill_here=True)
    for i in range(3):
        assert asyncio.run(role.submit(whole(f"w{i}", list(range(40 + 10 * i, 50 + 10 * i))))) == []
    assert limits() == (3, 0)  # nothing measured yet: the limit as given
    assert sorted(out.request_id for out in role.step()) == ["w0", "w1", "w2"]  # their prompts, a first token each
    for i in range(2 * MIN_STEPS):  # 1 request a step, at least, whatever its cost
        role.limits.pace.add(StepMetrics(0.010 + 1.0 * (1 + i % 3), 0, 1 + i % 3, 0, 1 + i % 3, 0))
    assert asyncio.run(role.submit(whole("w3", list(range(80, 90))))) == []
    steps = [sorted(out.request_id for out in role.step())]  # the pace learns its cap of 1 here
    assert [out.finish_reason for out in asyncio.run(role.abort("w2"))] == [FinishReason.ABORT]
    scheduled_under = [limits()[0]]  # each step's limit, set before it from the requests running
    while core.has_unfinished():
        steps.append(sorted(out.request_id for out in role.step()))
        scheduled_under.append(limits()[0])
    assert steps == [["w0", "w1", "w2"]] + [["w0", "w1"]] * 2 + [["w3"]] * 4  # none stalled; w3 after, alone
    assert role.limits.cap == 1 and scheduled_under == [3, 2, 2, 1, 1, 1, 1]
    asyncio.run(role.submit(GenerateMsg("short", alone("short", [1]).sampling, prompt_token_ids=list(range(40, 44)))))
    assert limits() == (2, 4)  # a short rest beside a prefill: the decode's own limits, paced at admission instead
    while core.has_unfinished():
        role.step()
    asyncio.run(role.submit(whole("again", [5, 6])))
    assert limits() == (1, 0)
    role._schedule_as(whole=False)
    assert limits() == (2, 4)
    while core.has_unfinished():
        role.step()
    assert core.kv.num_free_blocks == core.num_blocks
