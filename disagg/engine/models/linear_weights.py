"""Which form each matmul weight takes (`ModelConfig.quantization`), and a one-line account of it.

- none: dense in the model dtype: float32, or bfloat16 where the CPU has no native bf16, in csrc
  dense_matmul's tiles where the model chose it (`packed`, csrc on avx512 or avx2), otherwise reordered
  for oneDNN's linear on CPU (`packed`; a bfloat16 weight widened to float32 where oneDNN has no bf16
  path here), or F.linear as the HF reference computes (`--kernels torch`).
- int8 / int4: dense float32 weights quantized on load (per-channel int8; asymmetric int4 in
  groups of 32 columns), run by csrc's quant_matmul where the model chose it, else torch's packed
  CPU kernels.
- gguf: the GGUF's own Q4_0/Q4_1 blocks as int4 (the same q and scales), Q8_0 as int8 (for
  torch's int8 kernel requantized per channel: it has one scale per row); other types dense.
- gguf_float: the same blocks on csrc's dequant_matmul (dequantized in registers, or from 22 rows
  into a buffer; float32 activations: the dense weight's numbers) where csrc runs its avx512 or avx2 code; dense elsewhere.
A weight whose input width does not split into int4 groups stays dense.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from disagg.ops.hugepages import HugePageArena
from disagg.ops.linear import DenseMatmul, OnednnWeight, PackedWeight, QuantMatmul, TiledWeight, Weight, dtype_name, pack_dense, prepare_weight
from disagg.ops.quant import INT4_GROUP_SIZE, QUANT_BLOCK, QuantizedWeight, concat_rows, dequantize, quantize_int4, quantize_int8

Part = torch.Tensor | QuantizedWeight


def linear_weight(parts: Sequence[Part], quantization: str, dtype: torch.dtype, device: torch.device,
                  packed: bool = False, quant_matmul: QuantMatmul | None = None,
                  dense_matmul: DenseMatmul | None = None) -> Weight:
    """The matmul-ready weight of `parts` stacked along the output dimension (fused q/k/v, gate/up);
    `packed`: a dense result goes to oneDNN's layout where the device has it, or with `dense_matmul`
    a float32 one to that kernel's tiles (disagg.ops.linear.pack_dense); `quant_matmul`: a quantized
    one runs on that kernel instead of torch's (disagg.ops.linear.prepare_weight)."""
    float_activations = quantization == "gguf_float"  # the blocks on dequant_matmul, else dense
    if all(isinstance(p, QuantizedWeight) for p in parts) and _fusable(parts) and (
            not float_activations or (quant_matmul is not None and parts[0].group_size % QUANT_BLOCK == 0)):
        return prepare_weight(concat_rows(list(parts)), device, quant_matmul, float_activations)
    dense = [dequantize(p) if isinstance(p, QuantizedWeight) else p for p in parts]
    dense = dense[0] if len(dense) == 1 else torch.cat(dense)
    if quantization == "int8":
        return prepare_weight(quantize_int8(dense), device, quant_matmul)
    if quantization == "int4" and dense.shape[1] % INT4_GROUP_SIZE == 0:
        return prepare_weight(quantize_int4(dense), device, quant_matmul)
    dense = dense.to(device=device, dtype=dtype).contiguous()
    return pack_dense(dense, dense_matmul) if packed else dense


def placed(w: Weight, arena: HugePageArena | None) -> Weight:
    """`w` with the tensors csrc's kernels stream moved into `arena` (huge pages; disagg.ops.hugepages),
    where there is one: a TiledWeight's tiles, a csrc PackedWeight's blocks and scales, packed afresh for
    this engine. Every other form stays (a oneDNN weight's tensor is opaque; a dense or torch-packed one
    may be the loader's own tensor, which a copy would hold twice)."""
    if arena is None:
        return w
    if isinstance(w, TiledWeight):
        return dataclasses.replace(w, packed=arena.place(w.packed))
    if isinstance(w, PackedWeight) and w.quant_matmul is not None:
        return dataclasses.replace(w, packed=arena.place(w.packed), scales=arena.place(w.scales))
    return w


def _fusable(parts: Sequence[QuantizedWeight]) -> bool:
    first = parts[0]
    return all((p.kind, p.group_size, p.in_features) == (first.kind, first.group_size, first.in_features) for p in parts)


def describe_weights(weights: Iterable[Weight]) -> str:
    """'7 Q4_1 as int4 g32 (torch int4pack, bfloat16 activations), 1 float32 dense (F.linear)': what runs each matmul."""
    counts = Counter(_describe(w) for w in weights)
    return ", ".join(f"{n} {what}" for what, n in counts.items())


def _describe(w: Weight) -> str:
    if isinstance(w, OnednnWeight):
        if w.widened:
            return f"bfloat16 dense as float32 ({w.kernel}; no oneDNN bf16 on this CPU)"
        return f"{dtype_name(w.dtype)} dense ({w.kernel})"
    if isinstance(w, TiledWeight):
        return f"{dtype_name(w.dtype)} dense ({w.kernel})"
    if isinstance(w, PackedWeight):
        layout = f"{w.kind.value} g{w.group_size}" if w.group_size != w.in_features else f"{w.kind.value} per channel"
        return f"{w.source} as {layout} ({w.kernel})"
    return f"{dtype_name(w.dtype)} dense (F.linear)"
