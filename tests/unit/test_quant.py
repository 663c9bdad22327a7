"""Quantized weights: exact integer packing, GGUF blocks kept bit-exactly, `linear` against the reference."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from disagg.config import ConfigError
from disagg.engine_config import ModelConfig
from disagg.engine.loader import load_model
from disagg.ops import quant
from disagg.ops.linear import PackedWeight, linear, prepare_weight
from disagg.ops.quant import QuantKind
from disagg.ops.reference import TorchOps

# torch's kernels take bfloat16 activations and scales and round each dequantized weight and the
# output to bfloat16: every output is within 2^-7 of sum_k |x_k| |w_nk| of the float32
# dequantize-then-matmul (measured at most 4.2e-3 of it over the shapes below).
KERNEL_TOLERANCE = 2**-7


def test_nibbles_pack_low_first_and_round_trip():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 9]])
    packed = quant.pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0x90]]
    assert packed.dtype == torch.uint8
    assert quant.unpack_nibbles(packed).tolist() == q.tolist()
    q = torch.randint(0, 16, (37, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant.unpack_nibbles(quant.pack_nibbles(q)), q.to(torch.uint8))


def test_quantize_int8_is_symmetric_per_channel():
    w = torch.tensor([[127.0, -63.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.54, -1.27, 0.0, 0.5]])
    qw = quant.quantize_int8(w)
    assert (qw.kind, qw.shape, qw.group_size, qw.mins) == (QuantKind.INT8, (3, 4), 4, None)
    assert qw.scales.flatten().tolist() == pytest.approx([1.0, 0.0, 0.02])
    assert qw.qweight.tolist() == [[127, -64, 0, 1], [0, 0, 0, 0], [127, -64, 0, 25]]  # round half to even


def test_quantize_int4_recovers_a_weight_on_its_grid_exactly():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (5, 64), generator=gen)
    q[:, 0::32], q[:, 1::32] = 0, 15  # every group spans the full range
    scales = torch.tensor([0.5, 0.25, 2.0, 1.0, 0.125])[:, None].expand(5, 2)
    mins = torch.tensor([-1.0, 3.0, -8.0, 0.0, -0.5])[:, None].expand(5, 2)
    w = (scales[..., None] * q.view(5, 2, 32).float() + mins[..., None]).view(5, 64)
    qw = quant.quantize_int4(w)
    assert (qw.kind, qw.shape, qw.group_size) == (QuantKind.INT4, (5, 64), 32)
    assert torch.equal(quant.integer_values(qw), q.to(torch.uint8))
    assert torch.equal(qw.scales, scales) and torch.equal(qw.mins, mins)
    assert torch.equal(quant.dequantize(qw), w)


def test_quantize_int4_needs_whole_groups():
    with pytest.raises(ValueError, match=r"weight of shape \(4, 48\) does not split into groups of 32 columns"):
        quant.quantize_int4(torch.zeros(4, 48))


def gguf_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return gguf_quantize((rng.standard_normal((rows, cols)) * 0.05 + 0.01).astype(np.float32), kind)


@pytest.mark.parametrize("kind, build", [
    (GGMLQuantizationType.Q4_0, quant.from_gguf_q4_0),
    (GGMLQuantizationType.Q4_1, quant.from_gguf_q4_1),
    (GGMLQuantizationType.Q8_0, quant.from_gguf_q8_0),
])
def test_gguf_blocks_dequantize_bit_exactly_as_gguf_does(kind, build):
    blocks = gguf_blocks(kind, 7, 96, seed=2)
    qw = build(torch.from_numpy(blocks).reshape(-1), 7, 96)
    assert (qw.shape, qw.group_size, qw.source) == ((7, 96), 32, kind.name)
    expected = gguf_dequantize(blocks, kind).reshape(7, 96)
    assert np.array_equal(quant.dequantize(qw).numpy(), expected)


def test_gguf_q4_1_keeps_the_blocks_own_integers_and_fp16_scales():
    blocks = gguf_blocks(GGMLQuantizationType.Q4_1, 2, 64, seed=3)
    qw = quant.from_gguf_q4_1(torch.from_numpy(blocks).reshape(-1), 2, 64)
    first = blocks[0, :20]  # row 0, block 0: fp16 d, fp16 m, 16 bytes (value j low nibble, j + 16 high)
    assert qw.scales[0, 0].item() == float(first[0:2].view(np.float16)[0])
    assert qw.mins[0, 0].item() == float(first[2:4].view(np.float16)[0])
    nibbles = np.concatenate([first[4:] & 0x0F, first[4:] >> 4]).tolist()
    assert quant.integer_values(qw)[0, :32].tolist() == nibbles


def test_gguf_blocks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match=r"expected 40 uint8 bytes for a \[2, 32\] tensor, got 39 torch.uint8"):
        quant.from_gguf_q4_1(torch.zeros(39, dtype=torch.uint8), 2, 32)


def test_concat_rows_stacks_integers_and_scales():
    a, b = quant.quantize_int4(torch.randn(3, 64)), quant.quantize_int4(torch.randn(5, 64))
    both = quant.concat_rows([a, b])
    assert both.shape == (8, 64)
    assert torch.equal(quant.dequantize(both), torch.cat([quant.dequantize(a), quant.dequantize(b)]))
    with pytest.raises(ValueError, match="only weights of one kind, group size and input width can be fused"):
        quant.concat_rows([a, quant.quantize_int8(torch.randn(2, 64))])


def test_q8_0_runs_requantized_per_channel():
    blocks = gguf_blocks(GGMLQuantizationType.Q8_0, 4, 64, seed=4)
    qw = quant.from_gguf_q8_0(torch.from_numpy(blocks).reshape(-1), 4, 64)
    per_channel = quant.to_per_channel_int8(qw)
    assert (per_channel.group_size, per_channel.scales.shape, per_channel.source) == (64, (4, 1), "Q8_0 requantized")
    assert torch.equal(per_channel.scales, quant.dequantize(qw).abs().amax(1, keepdim=True) / 127)
    assert prepare_weight(qw).source == "Q8_0 requantized"


def random_weight(kind: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quant.quantize_int4(w) if kind == "int4" else quant.quantize_int8(w)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n, k", [(45, 32), (77, 96), (129, 256), (16, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_dequantize_then_matmul(kind, n, k, dtype):
    qw = random_weight(kind, n, k, seed=n + k)
    packed = prepare_weight(qw)
    dense = quant.dequantize(qw)
    for m in (1, 3, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = linear(x, packed)
        assert (out.shape, out.dtype) == ((m, n), dtype)
        error = (out.float() - x.float() @ dense.t()).abs()
        assert (error <= KERNEL_TOLERANCE * (x.float().abs() @ dense.abs().t())).all()


def test_linear_adds_bias_and_keeps_leading_dimensions():
    qw = random_weight("int4", 48, 64, seed=5)
    packed = prepare_weight(qw)
    x, bias = torch.randn(2, 3, 64), torch.arange(48, dtype=torch.float32)
    out = linear(x, packed, bias)
    assert out.shape == (2, 3, 48)
    assert torch.equal(out, linear(x.reshape(6, 64), packed).view(2, 3, 48) + bias)
    assert linear(torch.zeros(0, 64), packed).shape == (0, 48)


def test_prepared_weight_pads_int4_rows_to_sixteen():
    packed = prepare_weight(random_weight("int4", 45, 64, seed=6))
    assert isinstance(packed, PackedWeight)
    assert (packed.out_features, packed.scales.shape, packed.scales.dtype) == (45, (2, 48, 2), torch.bfloat16)
    assert packed.kernel == "torch int4pack, bfloat16 activations"


def test_pack_blocks_puts_each_value_where_the_kernel_reads_it():
    n, k = 20, 64
    q = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :]) % 16
    d, m = torch.rand(n, k // 32), -torch.rand(n, k // 32)
    w4 = quant.QuantizedWeight(QuantKind.INT4, n, k, 32, quant.pack_nibbles(q), d, m, "Q4_1")
    packed, scales = quant.pack_blocks(w4)
    assert (packed.shape, scales.shape) == ((2, 2, 256), (2, 2, 2, 16))
    # tile 0, block 1, chunk 2: byte 4i + j holds column 32 + 16 + j (low nibble) and 32 + 20 + j (high) of row i
    i, j = 5, 3
    assert packed[0, 1, 128 + 4 * i + j].item() == q[i, 48 + j].item() | (q[i, 52 + j].item() << 4)
    assert (scales[1, 0, 0, 3].item(), scales[1, 0, 1, 3].item()) == (d[19, 0].item(), m[19, 0].item())
    assert packed[1, :, :].view(2, 4, 16, 4)[:, :, 4:].count_nonzero() == 0  # rows 20..31 are padding
    assert scales[1, :, :, 4:].count_nonzero() == 0
    values, d2, m2 = quant.unpack_blocks(packed, scales)
    assert torch.equal(values[:n], q.to(torch.uint8)) and torch.equal(d2[:n], d) and torch.equal(m2[:n], m)

    i8 = (torch.arange(n * k) % 256 - 128).to(torch.int8).view(n, k)  # the whole range, -128..127
    w8 = quant.QuantizedWeight(QuantKind.INT8, n, k, 32, i8, d, None, "Q8_0")
    packed, scales = quant.pack_blocks(w8)
    assert packed.shape == (2, 2, 512)
    # block 0, chunk 7: byte 4i + j holds column 28 + j of row i, plus 128; m = -128 d
    assert packed[0, 0, 7 * 64 + 4 * i + j].item() == w8.qweight[i, 28 + j].item() + 128
    assert scales[0, 1, 1, i].item() == -128 * d[i, 1].item()
    values, _, _ = quant.unpack_blocks(packed, scales)
    assert torch.equal(values[:n].to(torch.int16) - 128, w8.qweight.to(torch.int16))
    with pytest.raises(ValueError, match="groups of 8 columns do not split into blocks of 32"):
        quant.pack_blocks(quant.quantize_int4(torch.randn(4, 64), group_size=8))


@pytest.mark.parametrize("kind", ["int4", "int8", "q8_0"])
def test_quant_matmul_weights_keep_their_integers_at_every_row_count(kind):
    """With quant_matmul (here its torch twin) a weight runs on it at every row count: Q8_0 keeps its
    own blocks (no per-channel requantizing), a per-channel int8 weight repeats its scale per block,
    and every output is within 2^-6 of sum |x| |w| of the exact product."""
    if kind == "q8_0":
        blocks = gguf_blocks(GGMLQuantizationType.Q8_0, 77, 96, seed=11)
        qw = quant.from_gguf_q8_0(torch.from_numpy(blocks).reshape(-1), 77, 96)
    else:
        qw = random_weight(kind, 77, 96, seed=11)
    packed = prepare_weight(qw, quant_matmul=TorchOps.quant_matmul)
    assert (packed.kernel, packed.source) == ("csrc quant_matmul, int8 activations in blocks of 32", qw.source)
    values, d, m = quant.unpack_blocks(packed.packed, packed.scales)
    dense = quant.dequantize(qw)
    unpacked = d.repeat_interleave(32, dim=1) * values.float() + m.repeat_interleave(32, dim=1)
    torch.testing.assert_close(unpacked[:77], dense, rtol=0, atol=1e-6)
    for rows in (1, 3, 16, 200):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        got = linear(x, packed)
        assert (got.shape, got.dtype) == ((rows, 77), torch.float32)
        assert ((got - x @ dense.t()).abs() <= 2**-6 * (x.abs() @ dense.abs().t())).all()


def test_groups_that_are_not_blocks_of_32_stay_on_torchs_kernel():
    packed = prepare_weight(quant.quantize_int4(torch.randn(16, 64), group_size=8), quant_matmul=TorchOps.quant_matmul)
    assert (packed.quant_matmul, packed.kernel) == (None, "torch int4pack, bfloat16 activations")


def test_quantization_config_names_the_choices():
    with pytest.raises(ConfigError, match=r"^quantization must be one of none, int8, int4, gguf, gguf_float, auto, "
                                          r"got 'int3'$"):
        ModelConfig(quantization="int3")
    with pytest.raises(ConfigError, match=r"^quantization 'int4' runs on CPU only \(torch's int4/int8 CPU kernels\); "
                                          r"use quantization none on cuda$"):
        ModelConfig(quantization="int4", device="cuda")
    assert ModelConfig().quantization == "auto"


def test_gguf_quantization_needs_a_gguf_file():
    with pytest.raises(ConfigError, match=r"^quantization 'gguf' needs a .gguf model, but the tiny model is built "
                                          r"in code; use int8 or int4 to quantize on load$"):
        load_model(ModelConfig(model="tiny", quantization="gguf"))
    with pytest.raises(ConfigError, match=r"^quantization 'gguf_float' needs a .gguf model, but the tiny model is "
                                          r"built in code; use int8 or int4 to quantize on load$"):
        load_model(ModelConfig(model="tiny", quantization="gguf_float"))
