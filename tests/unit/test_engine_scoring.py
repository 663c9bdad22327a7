"""Prompt-only requests (max_tokens 0, for scoring) and batches on the tiny random model, against HF."""

import dataclasses

import pytest
import torch

from disagg.types import FinishReason, InvalidRequest, SamplingParams
from engine_runs import finish
from test_engine_tiny import GREEDY, engine, run

SCORE = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=2)
PROMPTS = ["Score me, please.", "The quick brown fox", "0123456789 abc"]


@pytest.fixture(scope="module")
def hf_tiny(tiny_loaded):
    from hf_reference import hf_model_from_loaded

    return hf_model_from_loaded(tiny_loaded, torch.float32)


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_max_tokens_0_is_prompt_only_and_its_logprobs_equal_hf(tiny_loaded, hf_tiny):
    core = engine(tiny_loaded, budget=5)  # chunked: the prompt spans several steps
    ids = core.tokenizer.encode(PROMPTS[0])
    [out] = run(core, [ids], SCORE)
    assert (out.outputs.token_ids, out.outputs.text, out.outputs.finish_reason) == ([], "", FinishReason.LENGTH)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ref = hf_prompt_logprobs(hf_tiny, ids)
    for i in range(1, len(ids)):
        top2 = ref[i - 1].topk(2)
        expected = {ids[i]: ref[i - 1, ids[i]].item(), **dict(zip(top2.indices.tolist(), top2.values.tolist()))}
        assert set(out.prompt_logprobs[i]) == set(expected)
        torch.testing.assert_close(torch.tensor([out.prompt_logprobs[i][t] for t in expected]),
                                   torch.tensor(list(expected.values())), atol=1e-4, rtol=0)
    assert core.kv.num_free_blocks == 256
    core.kv.pool.check_integrity()


def test_prompt_only_requests_batch_with_generating_ones_without_changing_them(tiny_loaded):
    core = engine(tiny_loaded)
    alone = [o.outputs.token_ids for o in run(engine(tiny_loaded), PROMPTS)]
    ids = [core.tokenizer.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(ids):
        core.add_request(f"gen-{i}", prompt, GREEDY)
        core.add_request(f"score-{i}", prompt, SCORE)
    final = finish(core)
    assert [final[f"gen-{i}"].outputs.token_ids for i in range(3)] == alone
    assert [len(final[f"score-{i}"].outputs.token_ids) for i in range(3)] == [0, 0, 0]
    assert [len(final[f"score-{i}"].prompt_logprobs) for i in range(3)] == [len(p) for p in ids]


def test_prompt_only_without_logprobs_uses_the_prefix_cache(tiny_loaded):
    core = engine(tiny_loaded)
    prefix = list(range(40, 60))  # 5 full blocks of 4 tokens
    run(core, [prefix + [1]])
    [out] = run(core, [prefix + [2, 3]], SamplingParams(max_tokens=0))
    assert (out.num_cached_tokens, out.outputs.token_ids, out.prompt_logprobs) == (20, [], None)
    assert out.outputs.finish_reason is FinishReason.LENGTH


def test_remote_kv_admission_of_a_prompt_only_request_ends_it_with_the_remote_prompt_logprobs(tiny_loaded):
    prefill, decode = engine(tiny_loaded), engine(tiny_loaded)
    ids = prefill.tokenizer.encode(PROMPTS[1])
    [computed] = run(prefill, [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    assert decode.reserve_for_remote_kv("d", ids, SCORE) is not None
    assert decode.admit_remote_kv("d", computed.outputs.token_ids[0], None, computed.prompt_logprobs,
                                  prompt_ranks=computed.prompt_ranks)
    [out] = decode.step()
    assert (out.outputs.token_ids, out.outputs.finish_reason) == ([], FinishReason.LENGTH)
    assert out.prompt_logprobs == computed.prompt_logprobs
    assert out.prompt_ranks == computed.prompt_ranks and len(out.prompt_ranks) == len(ids)
    assert decode.kv.num_free_blocks == 256 and not decode.has_unfinished()


def test_negative_max_tokens_is_refused():
    with pytest.raises(InvalidRequest, match=r"^max_tokens must be at least 0, got -1$"):
        SamplingParams(max_tokens=-1)


def test_logprob_token_ids_are_returned_beside_the_top_n_and_equal_hf(tiny_loaded, hf_tiny):
    core = engine(tiny_loaded)
    ids = core.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1,
                            logprob_token_ids=(7, 300))
    [out] = run(core, [ids], params)
    ref = hf_prompt_logprobs(hf_tiny, ids + out.outputs.token_ids)
    for i in range(1, len(ids)):
        assert {7, 300, ids[i]} <= set(out.prompt_logprobs[i]) and len(out.prompt_logprobs[i]) <= 4
        torch.testing.assert_close(torch.tensor([out.prompt_logprobs[i][7], out.prompt_logprobs[i][300]]),
                                   ref[i - 1, [7, 300]], atol=1e-4, rtol=0)
    for k, top in enumerate(out.outputs.logprobs):
        torch.testing.assert_close(torch.tensor([top[7], top[300]]), ref[len(ids) - 1 + k, [7, 300]], atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequest, match=r"^token id 320 in token_ids_logprob is out of vocabulary \(vocab_size=320\)$"):
        core.add_request("bad", ids, SamplingParams(logprobs=0, logprob_token_ids=(320,)))


def test_prompt_logprobs_keep_their_places_when_a_preempted_prompt_is_recomputed_in_other_chunks(tiny_loaded):
    """Chunks of 5 record the prompt logprobs of tokens 1 to 10; preempted, the prompt is recomputed in chunks
    of 3 ([9, 12) straddles token 10): each later entry is computed once, in its place, so the answer is the
    first run's for tokens 1 to 10 and a chunks-of-3 run's from 11 on, logprobs and ranks alike."""
    ids = list(range(100, 123))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    [by5], [by3] = run(engine(tiny_loaded, budget=5), [ids], params), run(engine(tiny_loaded, budget=3), [ids], params)
    core = engine(tiny_loaded, budget=5)
    core.add_request("p", ids, params)
    core.step(), core.step()
    request = core.scheduler.requests["p"]
    assert len(request.prompt_logprobs) == 11
    core.scheduler._preempt(request)
    core.scheduler.config = dataclasses.replace(core.scheduler.config, max_num_batched_tokens=3)
    out = finish(core)["p"]
    assert out.num_preemptions == 1
    assert out.prompt_logprobs == by5.prompt_logprobs[:11] + by3.prompt_logprobs[11:]
    assert out.prompt_ranks == by5.prompt_ranks[:11] + by3.prompt_ranks[11:]
    assert len(out.prompt_ranks) == len(ids) and all(ids[i] in out.prompt_logprobs[i] for i in range(1, len(ids)))
