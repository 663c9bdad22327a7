"""Scheduler and KV cache manager with exact block ids, token budgets and preemptions."""

import pytest

from disagg.config import ConfigError
from disagg.engine_config import SchedulerConfig
from disagg.engine.kv_cache_manager import KVCacheManager
from disagg.engine.request import Request, RequestStatus
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.types import FinishReason, SamplingParams

EOS = 99


def make(num_blocks=8, block_size=4, budget=64, max_seqs=8, caching=True, max_len=1000):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, max_len), kv


def req(rid, prompt, max_tokens=4, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **kw), (EOS,))


def step(sched, tokens: dict[str, int]):
    out = sched.schedule()
    sampled = {s.request_id: SampledToken(tokens[s.request_id]) for s in out.seqs if s.sample}
    sched.update(out, sampled)
    return out


def test_prefill_then_decode_blocks_and_positions():
    sched, kv = make()
    sched.add(req("a", range(6), max_tokens=10))
    out = step(sched, {"a": 10})
    [seq] = out.seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids, seq.sample) == ([0, 1, 2, 3, 4, 5], 0, [0, 1], True)
    out = step(sched, {"a": 11})
    [seq] = out.seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids) == ([10], 6, [0, 1])
    out = step(sched, {"a": 12})
    assert (out.seqs[0].start_pos, out.seqs[0].block_ids) == (7, [0, 1])
    out = step(sched, {"a": 13})
    assert (out.seqs[0].start_pos, out.seqs[0].block_ids) == (8, [0, 1, 2])  # position 8 opens block 2
    assert kv.num_free_blocks == 5
    kv.pool.check_integrity()


def test_chunked_prefill_respects_the_token_budget():
    sched, _ = make(budget=5)
    sched.add(req("a", range(12)))
    sched.add(req("b", range(100, 103)))
    out = step(sched, {})
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.seqs] == [("a", 5, 0, False)]
    out = step(sched, {})
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.seqs] == [("a", 5, 5, False)]
    out = step(sched, {"a": 50, "b": 51})
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.seqs] == [
        ("a", 2, 10, True), ("b", 3, 0, True)]
    assert sched.requests["a"].output_token_ids == [50]
    assert sched.requests["b"].output_token_ids == [51]


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token_to_compute():
    sched, kv = make()
    sched.add(req("a", range(9), max_tokens=1))
    step(sched, {"a": 7})
    assert sched.requests.get("a") is None  # finished: blocks freed but still cached
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    sched.add(req("b", list(range(8)) + [42, 43]))
    out = step(sched, {"b": 1})
    [seq] = out.seqs
    assert seq.block_ids == [0, 1, 3]
    assert (seq.token_ids, seq.start_pos) == ([42, 43], 8)
    assert sched.requests["b"].num_cached_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    # A prompt that is entirely cached still computes its last token.
    sched2, _ = make()
    sched2.add(req("c", range(8), max_tokens=1))
    step(sched2, {"c": 3})
    sched2.add(req("d", range(8), max_tokens=1))
    [seq] = step(sched2, {"d": 3}).seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids) == ([4, 5, 6, 7], 4, [0, 2])


def test_prompt_logprobs_requests_get_no_prefix_hits():
    sched, _ = make()
    sched.add(req("a", range(9), max_tokens=1))
    step(sched, {"a": 7})
    sched.add(req("b", range(9), max_tokens=1, prompt_logprobs=0))
    [seq] = step(sched, {"b": 1}).seqs
    assert (seq.start_pos, len(seq.token_ids)) == (0, 9)


def test_preemption_when_blocks_run_out_recomputes_the_last_request():
    sched, kv = make(num_blocks=4, block_size=2)
    sched.add(req("a", range(4), max_tokens=8))
    sched.add(req("b", range(10, 14), max_tokens=8))
    step(sched, {"a": 1, "b": 2})  # a: blocks 0,1; b: blocks 2,3
    assert kv.num_free_blocks == 0
    out = step(sched, {"a": 3, "b": 4})  # a needs a 3rd block: b is preempted
    assert out.preempted_ids == ["b"]
    assert [s.request_id for s in out.seqs] == ["a"]
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens, b.block_ids, b.output_token_ids) == (RequestStatus.PREEMPTED, 0, [], [2])
    assert sched.requests["a"].block_ids == [0, 1, 3]
    assert list(sched.waiting) == [b]
    kv.pool.check_integrity()


def test_a_request_alone_that_outgrows_the_cache_finishes_with_length():
    sched, kv = make(num_blocks=2, block_size=2)
    sched.add(req("a", range(3), max_tokens=10))
    step(sched, {"a": 5})
    step(sched, {"a": 6})
    assert sched.drain_finished() == []
    step(sched, {"a": 7})  # position 4 needs a 3rd block; only 2 exist
    assert sched.drain_finished()[0].finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == 2


def test_a_request_alone_waits_for_blocks_held_for_a_remote_reader():
    """A prefill worker holds each finished prompt's blocks until its KV went out: the next prompt,
    running alone, out of blocks, waits for them (preempted, recomputed from its cached blocks) and
    never ends before its first token."""
    sched, kv = make(num_blocks=4, block_size=2, budget=2)
    held = Request("p", list(range(3)), SamplingParams(max_tokens=1, temperature=0), (EOS,), hold_blocks=True)
    sched.add(held)
    step(sched, {})
    step(sched, {"p": 8})
    assert (held.status, held.block_ids, kv.num_free_blocks) == (RequestStatus.HOLDING, [0, 1], 2)
    b = Request("b", list(range(10, 16)), SamplingParams(max_tokens=1, temperature=0), (EOS,), hold_blocks=True)
    sched.add(b)
    step(sched, {})
    step(sched, {})  # 4 of 6 prompt tokens computed, in blocks 2 and 3
    out = step(sched, {})  # a third block: none free, "p" holds two
    assert (out.preempted_ids, out.seqs, sched.drain_finished()) == (["b"], [], [held])
    assert (b.status, b.num_computed_tokens, b.block_ids, list(sched.waiting)) == (RequestStatus.PREEMPTED, 0, [], [b])
    assert step(sched, {}).seqs == []  # still no room: it waits
    assert sched.release("p") is True
    [seq] = step(sched, {"b": 9}).seqs  # its two full blocks come back from the prefix cache
    assert (seq.token_ids, seq.start_pos, seq.sample) == ([14, 15], 4, True)
    [done] = sched.drain_finished()
    assert (done is b, b.output_token_ids, b.finish_reason, b.status) == (True, [9], FinishReason.LENGTH, RequestStatus.HOLDING)
    kv.pool.check_integrity()


def test_stops_eos_stop_ids_max_tokens_and_min_tokens():
    sched, _ = make()
    sched.add(req("eos", [1], max_tokens=5))
    sched.add(req("stopid", [2], max_tokens=5, stop_token_ids=(77,)))
    sched.add(req("len", [3], max_tokens=2))
    sched.add(req("min", [4], max_tokens=5, min_tokens=2))
    step(sched, {"eos": EOS, "stopid": 77, "len": 5, "min": EOS})
    finished = {r.request_id: (r.finish_reason, r.stop_reason) for r in sched.drain_finished()}
    assert finished == {"eos": (FinishReason.STOP, None), "stopid": (FinishReason.STOP, 77)}
    step(sched, {"len": 5, "min": EOS})
    finished = {r.request_id: r.finish_reason for r in sched.drain_finished()}
    assert finished == {"len": FinishReason.LENGTH, "min": FinishReason.STOP}


def test_abort_frees_blocks_at_every_stage():
    sched, kv = make()
    sched.add(req("waiting", range(3)))
    sched.add(req("running", range(5)))
    step(sched, {"waiting": 1, "running": 1})
    sched.add(req("queued", range(3)))
    remote = req("remote", range(10, 16))  # shares no block with "running" (a shared prefix would be reused)
    assert sched.reserve_for_remote_kv(remote)
    assert remote.block_ids == [3, 4]
    for rid in ("waiting", "running", "queued", "remote"):
        assert sched.abort(rid).finish_reason is FinishReason.ABORT
    # The remote writer may still write the reserved blocks: they are quarantined until release().
    assert (kv.num_free_blocks, sched.num_quarantined_blocks, list(sched.requests)) == (6, 2, ["remote"])
    assert sched.abort("remote") is None and kv.num_free_blocks == 6
    assert sched.release("remote") is True
    assert (kv.num_free_blocks, sched.num_quarantined_blocks) == (8, 0)
    assert sched.requests == {} and not sched.has_work()
    kv.pool.check_integrity()


def test_remote_kv_admission_and_holding_release():
    sched, kv = make()
    held = Request("p", list(range(5)), SamplingParams(max_tokens=1, temperature=0), (EOS,), hold_blocks=True)
    sched.add(held)
    step(sched, {"p": 8})
    assert (held.status, held.block_ids, held.output_token_ids) == (RequestStatus.HOLDING, [0, 1], [8])
    assert kv.num_free_blocks == 6
    assert sched.release("p") is True and kv.num_free_blocks == 8
    assert sched.release("p") is False
    d = req("d", range(5), max_tokens=3)
    # The released prompt's full block (tokens 0-3) is reused; only the block of token 4 is new.
    assert sched.reserve_for_remote_kv(d) and (d.block_ids, d.num_cached_tokens) == ([0, 2], 4)
    assert kv.num_free_blocks == 6
    assert sched.schedule().seqs == []  # waiting for KV: not scheduled
    sched.admit_remote_kv("d", SampledToken(8))
    [seq] = step(sched, {"d": 9}).seqs
    assert (seq.token_ids, seq.start_pos, seq.block_ids) == ([8], 5, [0, 2])
    assert d.output_token_ids == [8, 9]


def test_max_num_seqs_caps_running_requests():
    sched, _ = make(max_seqs=2)
    for rid in "abc":
        sched.add(req(rid, [1, 2]))
    out = step(sched, {"a": 1, "b": 1})
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_decoding_requests_take_their_token_before_an_earlier_prompt_takes_the_rest_of_the_budget():
    sched, _ = make(num_blocks=16, budget=5)
    sched.add(req("a", range(12), max_tokens=8))  # a decode's local prefill, started first
    step(sched, {})
    for rid in ("b", "c"):  # their KV lands from a prefill: they run after a, decoding from their first token
        assert sched.reserve_for_remote_kv(req(rid, range(100, 102), max_tokens=8))
        sched.admit_remote_kv(rid, SampledToken(7))
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    out = step(sched, {"b": 1, "c": 2})
    # a's chunk no longer takes the whole budget ahead of them: b and c get a token each, a what is left
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample) for s in out.seqs] == [
        ("b", 1, 2, True), ("c", 1, 2, True), ("a", 3, 5, False)]


def test_requests_whose_kv_landed_run_at_most_max_num_seqs_a_step_the_earliest_first():
    sched, _ = make(num_blocks=16, max_seqs=2)
    for rid in ("a", "b", "c"):
        assert sched.reserve_for_remote_kv(req(rid, range(10, 13), max_tokens=3))
        sched.admit_remote_kv(rid, SampledToken(7))
    assert (sched.num_running, sched.num_waiting) == (2, 1)  # as vLLM counts them: c waits for a slot
    assert [[s.request_id for s in step(sched, {"a": 1, "b": 2, "c": 3}).seqs] for _ in range(3)] == [
        ["a", "b"], ["a", "b"], ["c"]]  # a and b end with their third token; c runs in the step after
    assert (sched.requests["c"].output_token_ids, sched.requests["c"].is_finished) == ([7, 3], False)
    assert (sched.num_running, sched.num_waiting) == (1, 0)


def test_max_prefill_tokens_per_step_bounds_the_prompt_tokens_of_a_step_and_not_its_decodes():
    kv = KVCacheManager(32, 4, True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_per_step=5)
    sched = Scheduler(config, kv, 1000)
    for rid, start in (("b", 100), ("c", 200)):
        sched.add(req(rid, range(start, start + 2), max_tokens=8))
    step(sched, {"b": 1, "c": 2})  # 4 prompt tokens, within the 5
    sched.add(req("a", range(12), max_tokens=8))
    sched.add(req("d", range(300, 303), max_tokens=8))
    chunks = [[(s.request_id, len(s.token_ids)) for s in step(sched, {"a": 3, "b": 4, "c": 5, "d": 6}).seqs]
              for _ in range(4)]
    # b and c decode every step; a and d share 5 prompt tokens a step, a first (it arrived first)
    assert chunks == [[("b", 1), ("c", 1), ("a", 5)], [("b", 1), ("c", 1), ("a", 5)],
                      [("b", 1), ("c", 1), ("a", 2), ("d", 3)], [("b", 1), ("c", 1), ("a", 1), ("d", 1)]]
    with pytest.raises(ConfigError, match="max_prefill_tokens_per_step must be >= 0"):
        SchedulerConfig(max_prefill_tokens_per_step=-1)


def test_long_prefill_token_threshold_chunks_a_prompt_beside_a_decoding_request():
    kv = KVCacheManager(16, 4, True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=4)
    sched = Scheduler(config, kv, 1000)
    sched.add(req("a", range(3)))
    step(sched, {"a": 1})  # a's 3-token prompt fits under the cap: it decodes from now on
    sched.add(req("b", range(20, 30)))
    chunks = [[(s.request_id, len(s.token_ids), s.sample) for s in step(sched, {"a": 1, "b": 2}).seqs] for _ in range(3)]
    # b's 10 prompt tokens go in chunks of at most 4 (4, 4, 2; it samples with the last), a decodes one a step
    assert chunks == [[("a", 1, True), ("b", 4, False)], [("a", 1, True), ("b", 4, False)],
                      [("a", 1, True), ("b", 2, True)]]
    with pytest.raises(ConfigError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
