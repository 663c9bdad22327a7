"""csrc kernels against their pure-torch twins (disagg/ops/reference.py), on every instruction set this CPU runs
(up to the level DISAGG_CPU_ISA caps it at).

Exact where the op only moves bytes (cache writes, block gather/scatter) or picks an index (argmax_rows); float32 within a few ulp
and bfloat16 within one rounding step elsewhere (the kernels sum in a different order than torch).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from disagg.ops import KernelsUnavailable, csrc_status, load_ops
from disagg.ops.cpu import Isa, cpu_features
from disagg.ops.reference import TorchOps, rope_cos_sin

REF = TorchOps()
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def _isas() -> list[str]:
    if csrc_status() is not None:
        return []
    in_force, cap = torch.ops.disagg.isa(), cpu_features().isa
    isas = [isa.value for isa in reversed(Isa) if isa.rank <= cap.rank and _supported(isa.value)]
    torch.ops.disagg.set_isa(in_force)
    return isas


def _supported(isa: str) -> bool:
    try:
        torch.ops.disagg.set_isa(isa)
        return True
    except RuntimeError:
        return False


@pytest.fixture(params=_isas() or ["unbuilt"])
def csrc(request):
    if request.param == "unbuilt":
        pytest.fail(f"csrc kernels unavailable although a compiler is installed: {csrc_status()}")
    best = torch.ops.disagg.isa()
    torch.ops.disagg.set_isa(request.param)
    yield load_ops("csrc")
    torch.ops.disagg.set_isa(best)


def test_the_kernels_build_wherever_a_compiler_is_installed():
    assert shutil.which("g++") or shutil.which("c++"), "this suite expects a C++ compiler (see README)"
    assert csrc_status() is None
    assert load_ops("auto").name == f"csrc-{torch.ops.disagg.isa()}"
    assert load_ops("torch").name == "torch"


def test_an_unknown_choice_and_a_cuda_device_are_refused():
    with pytest.raises(ValueError, match="kernels must be one of auto, csrc, torch, got 'fast'"):
        load_ops("fast")
    with pytest.raises(KernelsUnavailable, match="csrc kernels are built for the CPU only"):
        load_ops("csrc", "cuda")
    assert load_ops("auto", "cuda").name == "torch"


def test_an_unbuilt_library_falls_back_to_torch_and_says_why_once(monkeypatch, tmp_path):
    from disagg.ops import build, loader

    missing = tmp_path / "disagg_ops.so"
    monkeypatch.setattr(build, "library_path", lambda: missing)
    loader.csrc_status.cache_clear()
    loader._log_fallback_once.cache_clear()
    try:
        why = f"csrc kernels not built ({missing} is missing; `make install` or `python -m disagg.ops` builds them)"
        assert csrc_status() == why
        with pytest.raises(KernelsUnavailable) as err:
            load_ops("csrc")
        assert str(err.value) == why
        assert load_ops("auto").name == load_ops("auto").name == "torch"
        assert loader._log_fallback_once.cache_info().misses == 1  # logged once, however often it is asked
    finally:
        monkeypatch.undo()
        loader.csrc_status.cache_clear()
        loader._log_fallback_once.cache_clear()
    assert csrc_status() is None


# (model dtype, KV cache dtype): the cache holds the model's dtype, or bfloat16 under float32.
KV_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


def _cache(num_blocks, block_size, kv_heads, dim, dtype, gen, layers=3):
    full = torch.randn(num_blocks, layers, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    return full, full[:, 1, 0], full[:, 1, 1]  # a middle layer's strided K and V views


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 1), (8, 2, 128, 5), (6, 1, 16, 32)])
def test_paged_decode_attention(csrc, dtype, kv_dtype, heads, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(heads * 100 + block_size)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size + 2, 7, 41])  # 41: tiles of 16 and a tail
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    _, k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, dim, kv_dtype, gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    got = csrc.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    want = REF.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    assert got.dtype == dtype and got.shape == (len(lens), heads, dim)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_paged_decode_attention_refuses_a_context_past_its_blocks(csrc):
    _, k_cache, v_cache = _cache(4, 16, 1, 16, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="context length 33 of row 0 does not fit its 2 blocks"):
        csrc.paged_decode_attention(torch.zeros(1, 1, 16), k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([33]), 1.0)
    with pytest.raises(RuntimeError, match=r"block id 4 out of range \[0, 4\)"):
        csrc.paged_decode_attention(torch.zeros(1, 1, 16), k_cache, v_cache, torch.tensor([[4]]), torch.tensor([3]), 1.0)


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 128, 1), (8, 2, 128, 5), (6, 1, 64, 32), (40, 1, 64, 16)])
@pytest.mark.parametrize("tokens,start_pos", [(1, 0), (37, 0), (100, 0), (5, 23), (70, 41)])
def test_paged_prefill_attention(csrc, dtype, kv_dtype, heads, kv_heads, dim, block_size, tokens, start_pos):
    """Causal over the cached context and the segment itself, in place from shuffled blocks; work items
    of 64 query vectors (several items at 37 and 100 tokens; one token's 40 heads and its padding), key
    tiles of 32 with a tail, masked where a tile reaches past an item's first query."""
    gen = torch.Generator().manual_seed(heads * 1000 + tokens + start_pos)
    blocks = (start_pos + tokens + block_size - 1) // block_size
    _, k_cache, v_cache = _cache(blocks + 4, block_size, kv_heads, dim, kv_dtype, gen)
    block_ids = torch.randperm(blocks + 4, generator=gen)[:blocks]
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    got = csrc.paged_prefill_attention(q, k_cache, v_cache, block_ids, start_pos, dim**-0.5)
    want = REF.paged_prefill_attention(q, k_cache, v_cache, block_ids, start_pos, dim**-0.5)
    assert got.dtype == dtype and got.shape == (tokens, heads, dim)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if start_pos == 0:  # what the torch path computes: scaled_dot_product_attention on the new keys
        keys = k_cache[block_ids].flatten(0, 1)[:tokens].float().transpose(0, 1)[None]
        values = v_cache[block_ids].flatten(0, 1)[:tokens].float().transpose(0, 1)[None]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], keys, values, is_causal=True, scale=dim**-0.5, enable_gqa=True)
        torch.testing.assert_close(got, sdpa[0].transpose(0, 1).to(dtype), **TOL[dtype])


def test_paged_prefill_attention_refuses_what_it_cannot_read(csrc):
    _, k_cache, v_cache = _cache(4, 16, 1, 64, torch.float32, torch.Generator().manual_seed(0))
    q = torch.zeros(20, 2, 64)
    with pytest.raises(RuntimeError, match="start_pos 20 and 20 tokens do not fit 2 blocks of 16"):
        csrc.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 20, 1.0)
    with pytest.raises(RuntimeError, match=r"block id 4 out of range \[0, 4\)"):
        csrc.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 4]), 0, 1.0)
    with pytest.raises(RuntimeError, match="prefill attention takes head_dim 64 or 128, not 32"):
        csrc.paged_prefill_attention(q[..., :32], k_cache[..., :32], v_cache[..., :32], torch.tensor([0, 1]), 0, 1.0)
    with pytest.raises(RuntimeError, match="q heads 3 x 64 do not fit the cache's 2 x 64"):
        csrc.paged_prefill_attention(torch.zeros(4, 3, 64), k_cache.expand(-1, -1, 2, -1), v_cache.expand(-1, -1, 2, -1),
                                     torch.tensor([0]), 0, 1.0)
    assert csrc.paged_prefill_attention(q[:0], k_cache, v_cache, torch.tensor([0]), 3, 1.0).shape == (0, 2, 64)
    with pytest.raises(RuntimeError, match="start_pos 9223372036854775707 and 20 tokens do not fit 2 blocks of 16"):
        csrc.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 2**63 - 101, 1.0)  # no wrap-around
    with pytest.raises(RuntimeError, match="at most 64 query heads per KV head, not 72"):
        csrc.paged_prefill_attention(torch.zeros(2, 72, 64), k_cache, v_cache, torch.tensor([0]), 0, 1.0)
    with pytest.raises(RuntimeError, match="q heads 0 x 64 do not fit the cache's 1 x 64"):
        csrc.paged_prefill_attention(torch.zeros(2, 0, 64), k_cache, v_cache, torch.tensor([0]), 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 100)])
def test_rms_norm_and_its_residual_add(csrc, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, dim, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(dim, generator=gen).to(dtype)
    torch.testing.assert_close(csrc.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5), **TOL[dtype])
    ours, theirs = residual.clone(), residual.clone()
    got = csrc.add_rms_norm(x, ours, weight, 1e-5)
    want = REF.add_rms_norm(x, theirs, weight, 1e-5)
    assert torch.equal(ours, theirs)  # one rounded add, as torch does it
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (2, 1, 8, 3)])
def test_rope_and_cache_write(csrc, dtype, kv_dtype, heads, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(dim)
    num_tokens = 11
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos_sin = rope_cos_sin(inv_freq, 300)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen)
    slot_blocks = torch.randperm(6, generator=gen).repeat(2)[:num_tokens]
    slot_offsets = torch.randint(0, block_size, (num_tokens,), generator=gen)
    results = []
    for ops in (csrc, REF):
        buf = qkv.clone()
        q = buf[:, : heads * dim].view(-1, heads, dim)
        k = buf[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
        v = buf[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
        full, k_cache, v_cache = _cache(6, block_size, kv_heads, dim, kv_dtype, torch.Generator().manual_seed(1))
        ops.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_blocks, slot_offsets)
        results.append((buf, full))
    (buf, full), (ref_buf, ref_full) = results
    # Each rotated element is rounded exactly where torch rounds it (and once more, to nearest even,
    # into a narrower cache), so the two agree bit for bit.
    assert torch.equal(buf, ref_buf)
    assert full.dtype == kv_dtype and torch.equal(full, ref_full)


def test_a_cache_wider_than_the_model_or_a_mixed_pair_is_refused(csrc):
    gen = torch.Generator().manual_seed(0)
    _, k32, v32 = _cache(4, 16, 1, 64, torch.float32, gen)
    _, k16, v16 = _cache(4, 16, 1, 64, torch.bfloat16, gen)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    tables, lens = torch.tensor([[0]]), torch.tensor([3])
    wider = r"k_cache dtype Float does not fit BFloat16 \(a cache holds the model's dtype, or bfloat16 under float32\)"
    with pytest.raises(RuntimeError, match=wider):
        csrc.paged_decode_attention(q, k32, v32, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match=wider):
        csrc.paged_prefill_attention(q, k32, v32, torch.tensor([0]), 0, 1.0)
    with pytest.raises(RuntimeError, match="k_cache and v_cache differ in shape or dtype"):
        csrc.paged_decode_attention(q.float(), k16, v32, tables, lens, 1.0)
    k = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=wider):
        csrc.rope_and_cache(q.clone(), k, k.clone(), torch.tensor([0]), rope_cos_sin(torch.ones(32), 4), k32, v32,
                            torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="k_cache and v_cache differ in dtype"):
        csrc.rope_and_cache(q.float(), k.float(), k.float(), torch.tensor([0]), rope_cos_sin(torch.ones(32), 4), k16, v32,
                            torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1536, 77, 5])  # whole vectors of exp, and a scalar tail after them or alone
def test_silu_and_mul(csrc, dtype, dim):
    x = (torch.randn(5, 2 * dim, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    torch.testing.assert_close(csrc.silu_and_mul(x), REF.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 49152), (3, 63), (16, 49152), (40, 1000)])  # 16 x 49152: threaded
def test_argmax_rows_is_torchs_argmax(csrc, rows, cols):
    logits = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert torch.equal(csrc.argmax_rows(logits), REF.argmax_rows(logits))
    logits[rows // 2, cols // 3] = float("nan")  # one row with a NaN, in the threaded case too
    assert torch.equal(csrc.argmax_rows(logits), REF.argmax_rows(logits))
    assert csrc.argmax_rows(logits)[rows // 2].item() == cols // 3


def test_argmax_rows_takes_the_first_of_ties_and_the_first_nan(csrc):
    logits = torch.full((9, 130), -1.0)
    logits[0, [5, 64, 129]] = 2.0                   # ties: the first
    logits[1, [3, 100]] = float("nan")              # NaN counts as the largest: the first NaN
    logits[1, 2] = float("inf")
    logits[2] = float("-inf")                       # nothing above -inf: index 0
    logits[3, 0], logits[3, 1] = -0.0, 0.0          # -0.0 == 0.0: the first
    logits[3, 2:] = -5.0
    logits[4, 129] = float("inf")                   # the last value, past the last full 64-value step
    logits[5, 127] = float("nan")
    logits[6, 64] = 0.5                             # the first value of the second step
    logits[7, 0] = float("nan")                     # a NaN first, larger values after it
    logits[7, 1] = 9.0
    logits[8] = float("nan")                        # only NaN
    got = csrc.argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == [5, 3, 0, 0, 129, 127, 64, 0, 0]
    assert torch.equal(got, REF.argmax_rows(logits))
    assert csrc.argmax_rows(logits[:, ::2]).tolist() == REF.argmax_rows(logits[:, ::2]).tolist() == [32, 50, 0, 0, 0, 0, 32, 0, 0]


def test_argmax_rows_refuses_what_it_cannot_read(csrc):
    assert csrc.argmax_rows(torch.zeros(0, 5)).tolist() == []
    with pytest.raises(RuntimeError, match=r"argmax_rows takes float32 logits \[rows, vocab\] with vocab > 0, got BFloat16 \[2, 3\]"):
        csrc.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"got Float \[2, 0\]"):
        csrc.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match=r"got Float \[6\]"):
        csrc.argmax_rows(torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gather_and_scatter_move_exact_bytes(csrc, dtype):
    full, k_cache, _ = _cache(9, 4, 2, 8, dtype, torch.Generator().manual_seed(5))
    ids = torch.tensor([7, 0, 3])
    assert torch.equal(csrc.gather_blocks(k_cache, ids), REF.gather_blocks(k_cache, ids))
    assert torch.equal(csrc.gather_blocks(full, ids), full[[7, 0, 3]])
    src = torch.randn(3, *full.shape[1:]).to(dtype)
    ours, theirs = full.clone(), full.clone()
    csrc.scatter_blocks(ours, ids, src)
    REF.scatter_blocks(theirs, ids, src)
    assert torch.equal(ours, theirs)
    with pytest.raises(RuntimeError, match=r"block id 9 out of range \[0, 9\)"):
        csrc.gather_blocks(full, torch.tensor([9]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 96), (17, 576), (64, 576)])  # 64 x 576: threaded
def test_activations_round_to_int8_blocks_exactly(csrc, dtype, rows, cols):
    gen = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=gen) * 4).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0, q 0
    x[-1, -32:] = torch.tensor([1.0] * 31 + [-127.0]).to(dtype)  # scale exactly 1: q is x itself
    q, d, s = csrc.quantize_q8(x)
    assert (q.dtype, q.shape, d.shape, s.shape) == (torch.int8, (rows, cols), (rows, cols // 32), (rows, cols // 32))
    for got, want in zip((q, d, s), REF.quantize_q8(x)):
        assert torch.equal(got, want)
    assert (d[0, 0].item(), s[0, 0].item(), q[0, :32].abs().sum().item()) == (0.0, 0.0, 0)
    assert q[-1, -32:].tolist() == [1] * 31 + [-127] and (d[-1, -1].item(), s[-1, -1].item()) == (1.0, -96.0)
    assert q.abs().max().item() == 127  # each block's largest value maps to +-127


def test_activations_with_nan_inf_or_tiny_blocks_round_without_undefined_casts(csrc):
    """A NaN makes its block's scale NaN (the product is NaN, as a float matmul's would be), an inf makes
    it inf (q 0, s NaN); a block below ~4e-37 has 1 / d = inf and clamps to +-127. Every q is defined."""
    x = torch.zeros(1, 128)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 5] = float("nan")
    x[0, 40] = float("inf")
    x[0, 64:96] = torch.linspace(-1e-38, 1e-38, 32)
    x[0, 96:] = 2.0
    q, d, s = csrc.quantize_q8(x)
    for got, want in zip((q, d, s), REF.quantize_q8(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert d[0, 0].isnan() and s[0, 0].isnan() and q[0, :32].abs().sum().item() == 0
    assert d[0, 1].isinf() and s[0, 1].isnan() and q[0, 32:64].abs().sum().item() == 0
    assert q[0, 64].item() == -127 and q[0, 95].item() == 127
    scale = torch.tensor(2.0) / 127  # float32, as the kernel divides
    assert q[0, 96:].tolist() == [127] * 32 and (d[0, 3].item(), s[0, 3].item()) == (scale.item(), (scale * 4064).item())
    w = torch.randn(16, 128)
    from disagg.ops.quant import pack_blocks, quantize_int4

    packed, scales = pack_blocks(quantize_int4(w))
    out = csrc.quant_matmul(x, packed, scales, 16, 4)
    torch.testing.assert_close(out, REF.quant_matmul(x, packed, scales, 16, 4), rtol=0, atol=0, equal_nan=True)
    assert out.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int4", "int8", "q8_0"])
@pytest.mark.parametrize("rows,n,k", [(1, 16, 32), (2, 45, 96), (5, 129, 64), (6, 24, 64), (7, 31, 96),
                                      (9, 9, 160), (17, 77, 576), (37, 264, 288)])  # the last one threaded
def test_quant_matmul_is_bit_exact_to_its_twin(csrc, dtype, kind, rows, n, k):
    """Integer sums, then one float32 rounding per op in the same order: every instruction set gives
    the twin's bits, for passes of 1-8 rows (a remainder of each size on AVX2's passes of 4 and
    VNNI's of 8), partial last tiles and half tiles, threaded; and it stays within the int8
    rounding of activations (2^-6 of sum |x| |w|) of the float32 dequantize-then-matmul."""
    from disagg.ops.quant import QuantizedWeight, QuantKind, dequantize, pack_blocks, quantize_int4, quantize_int8

    gen = torch.Generator().manual_seed(rows * n + k)
    dense = torch.randn(n, k, generator=gen) * 0.1
    if kind == "q8_0":  # int8 values with one scale per 32, as a GGUF holds them, the full range -128..127
        values = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        w = QuantizedWeight(QuantKind.INT8, n, k, 32, values, torch.rand(n, k // 32, generator=gen) / 100, None, "Q8_0")
    else:
        w = quantize_int4(dense) if kind == "int4" else quantize_int8(dense)
    packed, scales = pack_blocks(w)
    bits = 4 if kind == "int4" else 8
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = csrc.quant_matmul(x, packed, scales, n, bits)
    assert (got.shape, got.dtype) == ((rows, n), dtype)
    assert torch.equal(got, REF.quant_matmul(x, packed, scales, n, bits))
    exact = x.float() @ dequantize(w).t()
    assert ((got.float() - exact).abs() <= 2**-6 * (x.float().abs() @ dequantize(w).abs().t()) + 1e-6).all()


def _packed_weight(kind: str, n: int, k: int, gen: torch.Generator):
    from disagg.ops.quant import QuantizedWeight, QuantKind, quantize_int4

    if kind == "q8_0":  # int8 values with one scale per 32, as a GGUF holds them, the full range -128..127
        values = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight(QuantKind.INT8, n, k, 32, values, torch.rand(n, k // 32, generator=gen) / 100, None, "Q8_0")
    return quantize_int4(torch.randn(n, k, generator=gen) * 0.1)  # q 0..15, d and m per group of 32


@pytest.mark.parametrize("kind", ["int4", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (45, 96), (77, 576)])
def test_dequant_matmul_dequantizes_as_dequantize_does_to_the_bit(csrc, kind, n, k):
    """Rows of the identity pick the weight's columns out one at a time: each output is 1 x w + 0 x the
    rest, so the kernel's dequantized weight itself comes back, equal to quant.dequantize's: all k rows
    at once (the path for many rows, its dequantized buffer), 8, 2 and 1 at a time (a decode step's passes:
    the blocks' scales applied to their sums, at 1 and 2 rows on avx512, at every size on avx2 and base)."""
    from disagg.ops.quant import dequantize, pack_blocks

    w = _packed_weight(kind, n, k, torch.Generator().manual_seed(n + k))
    packed, scales = pack_blocks(w)
    bits = 4 if kind == "int4" else 8
    assert torch.equal(csrc.dequant_matmul(torch.eye(k), packed, scales, n, bits).t(), dequantize(w))
    for size in (8, 2, 1):
        few = torch.cat([csrc.dequant_matmul(rows, packed, scales, n, bits) for rows in torch.eye(k).split(size)])
        assert torch.equal(few.t(), dequantize(w)), size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int4", "q8_0"])
@pytest.mark.parametrize("rows,n,k", [(1, 16, 32), (2, 45, 96), (5, 129, 64), (7, 31, 96), (9, 9, 160),
                                      (17, 77, 576), (15, 33, 64), (21, 40, 64), (31, 40, 64), (37, 264, 288),
                                      (64, 16, 96), (45, 57, 96)])
def test_dequant_matmul_is_the_dense_matmul_of_the_dequantized_weight(csrc, dtype, kind, rows, n, k):
    """Float32 activations times the dequantized weight: each block's scales applied to its sum (1 or 2 rows on
    avx512, every pass on avx2 and base), under 22 rows in passes of 1-16 (15 and 21 rows: VNNI's last
    pass of 15 and 5, the others' of 7 and 5; 4 chains a row under 4), from 22 rows over
    pairs of tiles dequantized once (passes of 12 rows over the pair's 32 columns or 6 over each half of
    them, and one pass of the rows left; a lone last tile; a last pair of 25 columns; threaded), partial last tiles and
    half tiles: the twin's float32 matmul within float32 summation order, in
    x's dtype."""
    from disagg.ops.quant import pack_blocks

    gen = torch.Generator().manual_seed(rows * n + k)
    packed, scales = pack_blocks(_packed_weight(kind, n, k, gen))
    bits = 4 if kind == "int4" else 8
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = csrc.dequant_matmul(x, packed, scales, n, bits)
    assert (got.shape, got.dtype) == ((rows, n), dtype)
    torch.testing.assert_close(got, REF.dequant_matmul(x, packed, scales, n, bits), **TOL[dtype])


@pytest.mark.parametrize("kind", ["int4", "q8_0"])
@pytest.mark.parametrize("rows,n,k", [(22, 45, 64), (34, 77, 96), (37, 57, 64), (29, 16, 32), (47, 264, 96)])
def test_from_22_rows_dequant_matmul_is_one_chain_per_output_of_the_dequantized_weight(csrc, kind, rows, n, k):
    """From 22 rows every output is one chain of multiply-adds over the dequantized weight's columns in
    order, as dense_matmul's (fused on avx2 and avx512): the rows left past the last whole pass (10, 10, 1,
    5 and 11 of VNNI's passes of 12; 4, 4, 1, 5 and 5 of the others' 6) run as one pass of their own, over
    last pairs of 13, 13, 25, 16 and 8 columns."""
    from disagg.ops.quant import dequantize, pack_blocks

    gen = torch.Generator().manual_seed(rows * n + k)
    w = _packed_weight(kind, n, k, gen)
    packed, scales = pack_blocks(w)
    x = torch.randn(rows, k, generator=gen)
    got = csrc.dequant_matmul(x, packed, scales, n, 4 if kind == "int4" else 8)
    assert torch.equal(got, _fma_chain(x, dequantize(w), fused=torch.ops.disagg.isa() != "base"))


@pytest.mark.parametrize("op", ["quant_matmul", "dequant_matmul"])
def test_the_packed_matmuls_refuse_what_they_cannot_read(csrc, op):
    from disagg.ops.quant import pack_blocks, quantize_int4

    matmul = getattr(csrc, op)
    packed, scales = pack_blocks(quantize_int4(torch.randn(20, 64)))
    x = torch.randn(3, 64)
    assert matmul(torch.zeros(0, 64), packed, scales, 20, 4).shape == (0, 20)
    with pytest.raises(RuntimeError, match="weights of 4 or 8 bits, not 2"):
        matmul(x, packed, scales, 20, 2)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous uint8 \[tiles, k / 32, 512\]"):
        matmul(x, packed, scales, 20, 8)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\], got \[3, 32\]"):
        matmul(x[:, :32], packed, scales, 20, 4)
    with pytest.raises(RuntimeError, match="16 output rows do not fill 2 tiles of 16"):
        matmul(x, packed, scales, 16, 4)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float32 \[2, 2, 2, 16\]"):
        matmul(x, packed, scales[:, :1].contiguous(), 20, 4)
    with pytest.raises(RuntimeError, match="disagg ops support float32 and bfloat16, got Half"):
        matmul(x.half(), packed, scales, 20, 4)


def test_quantize_q8_refuses_a_width_past_its_blocks(csrc):
    with pytest.raises(RuntimeError, match=r"x must be \[rows, k\] with k a multiple of 32, got \[3, 48\]"):
        csrc.quantize_q8(torch.randn(3, 48))


def _fma_chain(x: torch.Tensor, w: torch.Tensor, fused: bool) -> torch.Tensor:
    """out[r, j] = one chain over the columns in order: acc = fma(x, w, acc) rounded to float32 once per
    step (fused: the product and sum in float64, where a float32 product is exact) or twice (base)."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(x.shape[1]):
        if fused:
            acc = (acc.double() + x[:, i, None].double() * w[None, :, i].double()).float()
        else:
            acc = acc + x[:, i, None] * w[None, :, i]
    return acc


@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (2, 31, 5), (3, 32, 96), (4, 33, 64), (5, 77, 33), (7, 64, 40),
                                      (8, 40, 17), (9, 95, 24), (17, 33, 8), (33, 600, 16),  # the last one threaded
                                      (9, 600, 64), (261, 40, 16),  # and three blocks of up to 128 rows
                                      (140, 70, 37),  # passes past the 8 that fetch: k not a multiple of 4
                                      (128, 30, 96),  # threaded, one tile: a thread without tiles
                                      (2, 600, 256), (8, 64, 40)])  # AVX2's 2-row passes of a whole tile
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_dense_matmul_is_one_multiply_add_chain_per_output(csrc, rows, n, k, w_dtype):
    """Every pass size (remainders of AVX-512's passes of 8 rows, AVX2's of 6 and base's of 4), partial
    last tiles, threaded, blocks of rows: the kernel's bits are those of one chain per output over the columns in
    order, fused on avx2 and avx512; within k 2^-24 sum |x w| of the float64 product. A bfloat16 weight is
    widened exactly: the same bits as its float32 values."""
    from disagg.ops.linear import pack_tiles

    gen = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    x = torch.randn(rows, k, generator=gen)
    got = csrc.dense_matmul(x, pack_tiles(w), n)
    assert (got.shape, got.dtype) == ((rows, n), torch.float32)
    w = w.float()
    assert torch.equal(got, _fma_chain(x, w, fused=torch.ops.disagg.isa() != "base"))
    exact = x.double() @ w.double().t()
    assert ((got.double() - exact).abs() <= k * 2**-24 * (x.double().abs() @ w.double().abs().t())).all()
    torch.testing.assert_close(got, REF.dense_matmul(x, pack_tiles(w.to(w_dtype)), n), **TOL[torch.float32])


def test_dense_matmul_refuses_what_it_cannot_read(csrc):
    from disagg.ops.linear import pack_tiles

    packed = pack_tiles(torch.randn(40, 24))
    assert packed.shape == (2, 24, 32) and packed[1, :, 8:].abs().sum().item() == 0  # rows past 40 are zero
    x = torch.randn(3, 24)
    assert csrc.dense_matmul(torch.zeros(0, 24), packed, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="dense_matmul takes float32 x, got BFloat16"):
        csrc.dense_matmul(x.bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous \[tiles, k, 32\]"):
        csrc.dense_matmul(x, packed.transpose(0, 1), 40)
    with pytest.raises(RuntimeError, match="disagg ops support float32 and bfloat16, got Half"):
        csrc.dense_matmul(x, packed.half(), 40)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 24\], got \[3, 16\]"):
        csrc.dense_matmul(x[:, :16], packed, 40)
    with pytest.raises(RuntimeError, match="32 output rows do not fill 2 tiles of 32"):
        csrc.dense_matmul(x, packed, 32)
    with pytest.raises(RuntimeError, match="65 output rows do not fill 2 tiles of 32"):
        csrc.dense_matmul(x, packed, 65)


@pytest.mark.parametrize("rows", [0, 1, 16, 1024, 2047, 2048])  # from 2048 rows oneDNN on the weight unpacked
def test_tiled_linear_equals_f_linear(rows):
    from disagg.ops.linear import TILED_MAX_ROWS, TiledWeight, linear, pack_dense, unpack_tiles

    assert TILED_MAX_ROWS == 2048
    ops = load_ops("csrc")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(77, 96, generator=gen)
    bias = torch.randn(77, generator=gen)
    x = torch.randn(rows, 1, 96, generator=gen)  # leading dimensions are kept
    packed = pack_dense(w, ops.dense_matmul)
    assert isinstance(packed, TiledWeight) and (packed.out_features, packed.in_features) == (77, 96)
    assert torch.equal(unpack_tiles(packed.packed, 77), w)
    got = linear(x, packed, bias)
    assert got.shape == (rows, 1, 77) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), **TOL[torch.float32])


@pytest.mark.parametrize("rows", [1, 16, 1024])
def test_a_bfloat16_weight_runs_in_float32_tiles_where_the_cpu_has_no_native_bf16(monkeypatch, rows):
    """No bf16 dot product (AVX2, or AVX-512 without AVX512_BF16): the bfloat16 weight stays bfloat16 in
    dense_matmul's tiles and is computed in float32; the answer is rounded to x's bfloat16. Where the CPU
    has native bf16, oneDNN's bf16 linear keeps it (as a CPU of that level answers; checked here only
    where this CPU runs oneDNN's bf16 path)."""
    from disagg.ops import linear as linear_mod
    from disagg.ops.cpu import features_of

    ops = load_ops("csrc")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(77, 96, generator=gen).bfloat16()
    bias = torch.randn(77, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    monkeypatch.setattr(linear_mod, "cpu_features", lambda: features_of(frozenset({"avx2", "fma"})))
    packed = linear_mod.pack_dense(w, ops.dense_matmul)
    assert (packed.kernel, packed.dtype, packed.packed.dtype) == ("csrc dense_matmul", torch.bfloat16, torch.bfloat16)
    got = linear_mod.linear(x, packed, bias)
    assert (got.shape, got.dtype) == ((rows, 77), torch.bfloat16)
    want = (torch.nn.functional.linear(x.float(), w.float()).bfloat16() + bias)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])  # float32 sums in another order, rounded
    if cpu_features().onednn_bf16:
        native = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
        monkeypatch.setattr(linear_mod, "cpu_features", lambda: features_of(native))
        assert linear_mod.pack_dense(w, ops.dense_matmul).kernel == "oneDNN packed"


def test_tiled_linear_of_many_rows_without_onednn_is_f_linear(monkeypatch):
    from disagg.ops.linear import TILED_MAX_ROWS, linear, pack_dense

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 24, generator=gen), torch.randn(TILED_MAX_ROWS, 24, generator=gen)
    packed = pack_dense(w, load_ops("csrc").dense_matmul)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert torch.equal(linear(x, packed), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 16, 33])
def test_onednn_packed_linear_equals_f_linear(dtype, rows):
    from disagg.ops.linear import OnednnWeight, linear, pack_dense

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(77, 96, generator=gen).to(dtype)
    bias = torch.randn(77, generator=gen).to(dtype)
    x = torch.randn(2, rows, 96, generator=gen).to(dtype)  # leading dimensions are kept
    packed = pack_dense(w)
    assert isinstance(packed, OnednnWeight) and (packed.out_features, packed.in_features) == (77, 96)
    # A bfloat16 weight stays bfloat16 only where oneDNN's bf16 path runs (else float32 compute).
    assert packed.dtype == (torch.float32 if dtype == torch.float32 or not cpu_features().onednn_bf16 else dtype)
    got = linear(x, packed, bias)
    assert got.shape == (2, rows, 77) and got.dtype == dtype
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), **TOL[dtype])


def test_weights_that_onednn_does_not_take_stay_dense():
    from disagg.ops.linear import pack_dense

    w = torch.randn(4, 8, dtype=torch.float64)
    assert pack_dense(w) is w
