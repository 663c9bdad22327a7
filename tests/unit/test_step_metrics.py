"""Per-step engine metrics: what each step computed, from what it scheduled, on a real tiny engine."""

from disagg.engine.scheduler import ScheduledSeq, SchedulerOutput
from disagg.engine.step_metrics import StepLog, StepMetrics, measure
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.types import SamplingParams
from disagg.wire.engine_msgs import StepsMsg, decode_from_worker, encode
from disagg.worker.step_reports import StepReporter

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def seq(start_pos: int, num_tokens: int, num_prompt_tokens: int) -> ScheduledSeq:
    return ScheduledSeq("r", list(range(num_tokens)), start_pos, [], True, False, GREEDY, 0, num_prompt_tokens, None)


def test_a_step_counts_prompt_tokens_as_prefill_and_the_rest_as_decode_over_its_context():
    scheduled = SchedulerOutput([seq(0, 16, 40), seq(32, 8, 40), seq(40, 1, 40), seq(57, 1, 12), seq(10, 3, 11)])
    # 16 + 8 prompt tokens, a chunk's last 1 of 3 (10..12 past a prompt of 11: one prompt token, then decode).
    assert measure(scheduled, 0.25, 3, 2) == StepMetrics(0.25, 16 + 8 + 1, 3, 41 + 58 + 13, 3, 2)
    assert measure(SchedulerOutput([]), 0.0, 0, 0) == StepMetrics(0.0, 0, 0, 0, 0, 0)


def test_the_log_keeps_the_last_steps_until_taken():
    log = StepLog(max_kept=2)
    for n in range(3):
        log.add(StepMetrics(0.1, n, 0, 0, 0, 0))
    assert [s.num_prefill_tokens for s in log.take()] == [1, 2] and log.take() == []


def test_the_engine_records_each_step_that_ran_the_model(tiny_loaded):
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8))
    core = EngineCore(config, tiny_loaded)
    core.warm_up()
    assert core.take_step_metrics() == []  # the warm-up's steps are not the served ones'
    core.add_request("a", list(range(3, 14)), GREEDY)  # 11 prompt tokens: chunks of 8 and 3
    while core.has_unfinished():
        core.step()
    steps = core.take_step_metrics()
    assert [(s.num_prefill_tokens, s.num_decode_seqs, s.num_decode_kv_tokens, s.num_running) for s in steps] == [
        (8, 0, 0, 1), (3, 0, 0, 1), (0, 1, 12, 1), (0, 1, 13, 1), (0, 1, 14, 0)]
    assert all(s.wall_s > 0 for s in steps) and core.take_step_metrics() == []
    report = StepReporter(5).report(steps)
    assert (report.dp_rank, report.seq, len(report.steps)) == (5, 0, 5)
    again = decode_from_worker(encode(report))
    assert isinstance(again, StepsMsg) and again == report
    assert StepReporter(0).report([]) is None


def test_the_final_output_says_how_long_the_request_queued_and_its_preemptions(tiny_loaded):
    """vLLM's queue phase: arrival until the request first ran. The second request waits behind the
    first (max_num_seqs 1); the final OutputMsg carries the figures, the others none."""
    from disagg.worker.outputs import to_output_msg

    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1))
    core = EngineCore(config, tiny_loaded)
    core.add_request("a", list(range(3, 14)), GREEDY)
    core.add_request("b", list(range(3, 9)), GREEDY)
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    final = {out.request_id: out for out in outputs if out.finished}
    assert [(rid, out.num_preemptions) for rid, out in sorted(final.items())] == [("a", 0), ("b", 0)]
    assert 0 <= final["a"].queued_s < final["b"].queued_s  # b ran once a had finished its 4 tokens
    messages = [to_output_msg(out, first=False) for out in outputs if out.request_id == "b"]
    assert [m.queued_s is not None for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].queued_s == final["b"].queued_s
