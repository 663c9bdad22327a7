"""A request whose part of an engine step raises fails alone; the others get exactly their tokens.

Poison requests are put straight into the scheduler, past admission (which refuses these inputs),
so these tests exercise the step's isolation itself.
"""

import pytest

from disagg.engine.request import Request
from disagg.types import FinishReason, SamplingParams

from engine_runs import finish
from test_engine_tiny import GREEDY, PROMPTS, engine, run

SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)


def add_unchecked(core, request_id, prompt_ids, params):
    """Queue a request without admission checks (what a bug past admission would look like)."""
    request = Request(request_id, prompt_ids, params, core.eos_token_ids)
    core.scheduler.add(request)
    core.outputs.add(request)


def run_with_poison(core, prompts, params, poison):
    ids = []
    for p in prompts:
        rid = core.new_request_id()
        core.add_request(rid, core.tokenizer.encode(p), params)
        ids.append(rid)
    add_unchecked(core, "poison", *poison)
    final = finish(core)
    return [final[i] for i in ids], final["poison"]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_sampling_failure_fails_only_its_request(tiny_loaded, params):
    expected = [o.outputs.token_ids for o in run(engine(tiny_loaded), PROMPTS, params)]
    core = engine(tiny_loaded)
    vocab = core.arch.vocab_size
    poison_params = SamplingParams(max_tokens=8, min_tokens=2, temperature=0, stop_token_ids=(vocab + 7,))
    innocents, poison = run_with_poison(core, PROMPTS, params, ([5, 6, 7], poison_params))
    assert [o.outputs.token_ids for o in innocents] == expected
    assert poison.outputs.finish_reason is FinishReason.ABORT
    assert poison.error == (f"engine step failed for request poison: IndexError: index {vocab + 7} "
                            f"is out of bounds for dimension 0 with size {vocab}")
    assert core.kv.num_free_blocks == core.num_blocks
    assert core.scheduler.requests == {}


def test_a_nan_distribution_fails_only_its_request(tiny_loaded):
    expected = [o.outputs.token_ids for o in run(engine(tiny_loaded), PROMPTS, SEEDED)]
    core = engine(tiny_loaded)
    # A NaN temperature (admission refuses it; set past it here) makes softmax NaN: multinomial raises.
    nan_params = SamplingParams(max_tokens=8, temperature=0.5)
    object.__setattr__(nan_params, "temperature", float("nan"))
    innocents, poison = run_with_poison(core, PROMPTS, SEEDED, ([5, 6, 7], nan_params))
    assert [o.outputs.token_ids for o in innocents] == expected
    assert poison.error.startswith("engine step failed for request poison: RuntimeError: probability tensor contains")
    assert core.kv.num_free_blocks == core.num_blocks


def test_a_forward_failure_is_isolated_by_running_halves(tiny_loaded):
    expected = [o.outputs.token_ids for o in run(engine(tiny_loaded), PROMPTS)]
    core = engine(tiny_loaded)
    vocab = core.arch.vocab_size
    # A token id past the embedding table makes the batched forward raise for everyone.
    innocents, poison = run_with_poison(core, PROMPTS, GREEDY, ([5, vocab + 3, 7], SamplingParams(max_tokens=4)))
    assert [o.outputs.token_ids for o in innocents] == expected
    assert poison.error.startswith("engine step failed for request poison: IndexError: index out of range")
    assert core.kv.num_free_blocks == core.num_blocks


def test_seeded_request_admitted_from_remote_kv_draws_what_one_engine_draws(tiny_loaded):
    """P/D: the first token is drawn by the prefill engine; the decode's generator skips that draw."""
    prompt = engine(tiny_loaded).tokenizer.encode(PROMPTS[1])
    one = run(engine(tiny_loaded), [prompt], SEEDED)[0].outputs.token_ids
    prefill = engine(tiny_loaded)
    prefill.add_request("p", prompt, SamplingParams(**{**SEEDED.__dict__, "max_tokens": 1}), hold_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    decode = engine(tiny_loaded)
    assert decode.reserve_for_remote_kv("d", prompt, SEEDED) is not None
    # No KV copy here: the decode recomputes nothing, so copy the prefill's blocks by hand.
    src, dst = prefill.request_progress("p").block_ids, decode.request_progress("d").block_ids
    decode.runner.kv_cache[dst] = prefill.runner.kv_cache[src]
    assert decode.admit_remote_kv("d", one[0])
    tokens = []  # the first output carries the admitted first token
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == one
    assert not decode.admit_remote_kv("gone", 1)


def test_a_request_admitted_with_a_read_prefix_generates_what_one_engine_generates(tiny_loaded):
    """Pull flow: the decode reads the KV of all prompt tokens but the last, computes that one and
    samples the first token itself (seeded too, with no draw to skip)."""
    prompt = engine(tiny_loaded).tokenizer.encode(PROMPTS[1])
    one = run(engine(tiny_loaded), [prompt], SEEDED)[0].outputs.token_ids
    prefill = engine(tiny_loaded)
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), hold_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    decode = engine(tiny_loaded)
    dst = decode.reserve_for_remote_kv("d", prompt, SEEDED).block_ids
    src = prefill.request_progress("p").block_ids
    num_read = decode.kv.blocks_needed(len(prompt) - 1)
    decode.runner.kv_cache[dst[:num_read]] = prefill.runner.kv_cache[src[:num_read]]
    assert decode.admit_remote_prefix("d", len(prompt) - 1)
    tokens = []
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == one
    assert decode.kv.num_free_blocks == decode.num_blocks
