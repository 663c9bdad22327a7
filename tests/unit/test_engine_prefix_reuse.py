"""Decode-side prefix reuse at the engine: a remote-KV reservation reuses the decode's own cached
prefix, only the blocks after it take the remote KV, and the output equals one engine's."""

import pytest
import torch

from disagg.types import SamplingParams

from test_engine_tiny import GREEDY, PROMPTS, engine, run

FIRST_TURN = PROMPTS[1]  # 136 tokens with BOS (the tiny tokenizer is byte-level)


def decode_after_first_turn(tiny_loaded):
    """A decode engine that served the first turn (computed here): its prompt and answer are cached."""
    decode = engine(tiny_loaded)
    [out] = run(decode, [FIRST_TURN])
    return decode, decode.tokenizer.encode(FIRST_TURN) + out.outputs.token_ids


def prefill_held(tiny_loaded, prompt):
    prefill = engine(tiny_loaded)
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), hold_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    return prefill


def decode_rest(decode, request_id):
    tokens = []
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_later_turn_takes_only_the_blocks_after_the_decodes_own_prefix(tiny_loaded, flow):
    decode, history = decode_after_first_turn(tiny_loaded)
    prompt = history + decode.tokenizer.encode(" and then?")[1:]  # a new turn, without a second BOS
    one = run(engine(tiny_loaded), [prompt])[0].outputs.token_ids
    prefill = prefill_held(tiny_loaded, prompt)
    reservation = decode.reserve_for_remote_kv("d", prompt, GREEDY)
    # 136 + 16 history tokens, 10 new. The decode computed 151 of them (not the last answer token):
    # 37 full blocks, 148 tokens, are cached; 14 prompt tokens in 4 blocks need the remote KV.
    assert (len(history), len(prompt)) == (152, 162)
    assert (reservation.num_cached_tokens, reservation.num_cached_blocks, len(reservation.block_ids)) == (148, 37, 41)
    assert reservation.new_block_ids == reservation.block_ids[37:]
    src = prefill.request_progress("p").block_ids
    new = reservation.new_block_ids
    decode.runner.kv_cache[new] = torch.nan  # nothing of the prefix may come from these
    if flow == "push":  # the prefill writes the blocks after the decode's 37
        decode.runner.kv_cache[new] = prefill.runner.kv_cache[src[37:]]
        assert decode.admit_remote_kv("d", one[0])
    else:  # the decode reads the blocks of every prompt token but the last, after its own 37
        end = decode.kv.blocks_needed(len(prompt) - 1)
        assert end == 41
        decode.runner.kv_cache[new[: end - 37]] = prefill.runner.kv_cache[src[37:end]]
        assert decode.admit_remote_prefix("d", len(prompt) - 1)
    assert decode_rest(decode, "d") == one
    assert decode.kv.num_free_blocks == decode.num_blocks


def test_a_prompt_logprobs_request_reuses_nothing(tiny_loaded):
    decode, history = decode_after_first_turn(tiny_loaded)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    reservation = decode.reserve_for_remote_kv("d", history, params)
    assert (reservation.num_cached_tokens, reservation.new_block_ids) == (0, reservation.block_ids)
    assert decode.abort("d") and decode.release("d")
    assert decode.kv.num_free_blocks == decode.num_blocks


def test_an_abort_quarantines_the_new_blocks_and_keeps_the_shared_prefix_cached(tiny_loaded):
    decode, history = decode_after_first_turn(tiny_loaded)
    reservation = decode.reserve_for_remote_kv("d", history + [7, 8, 9], GREEDY)
    assert reservation.num_cached_tokens == 148
    assert decode.abort("d")
    assert decode.scheduler.num_quarantined_blocks == len(reservation.block_ids) == 39
    assert decode.release("d") and decode.kv.num_free_blocks == decode.num_blocks
    again = decode.reserve_for_remote_kv("e", history + [7, 8, 9], GREEDY)
    assert again.num_cached_tokens == 148 and again.block_ids[:37] == reservation.block_ids[:37]


def test_the_engine_counts_prefix_cache_queries_and_hits_as_vllm_does(tiny_loaded):
    core = engine(tiny_loaded)
    prompt = core.tokenizer.encode(FIRST_TURN)  # 136 tokens
    run(core, [prompt, prompt])  # one batch: the second finds nothing yet
    run(core, [prompt])  # the first request's 33 full blocks (132 tokens; never the last token's) are cached
    stats = core.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 * 136, 132)
    reservation = core.reserve_for_remote_kv("d", prompt, GREEDY)  # a decode's lookup counts too
    assert reservation.num_cached_tokens == 132
    assert (core.stats().prefix_cache_queries, core.stats().prefix_cache_hits) == (4 * 136, 264)
    assert core.abort("d") and core.release("d")
    # A request that wants prompt logprobs may not read the cache: no query, as vLLM skips it.
    run(core, [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    assert (core.stats().prefix_cache_queries, core.stats().prefix_cache_hits) == (4 * 136, 264)
    uncached = engine(tiny_loaded, caching=False)
    run(uncached, [prompt, prompt])
    assert (uncached.stats().prefix_cache_queries, uncached.stats().prefix_cache_hits) == (0, 0)
