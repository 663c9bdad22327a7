"""Kernels of the forward pass: the csrc/ extension where it is built, pure torch everywhere else.

The only loader of csrc/ (docs/architecture.md, the import rule). `load_ops(kernels, device)` returns an object with
the fused ops (`rms_norm`, `add_rms_norm`, `rope_and_cache`, `silu_and_mul`,
`paged_decode_attention`, `paged_prefill_attention`, `quantize_q8`, `quant_matmul`, `dense_matmul`,
`argmax_rows`, `gather_blocks`, `scatter_blocks`) and a `name` for logs and the ready line. Every op
has a pure-torch twin in `disagg.ops.reference`; tests/unit/test_ops.py checks that the two agree.
"""

from __future__ import annotations

from disagg.ops.loader import KernelsUnavailable, csrc_status, load_ops

__all__ = ["KernelsUnavailable", "csrc_status", "load_ops"]
