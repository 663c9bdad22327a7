"""What the ready line and /server_info say about kernels on this machine: the expected text, from the
choices the ops loader made (csrc is built wherever tests run: tests/unit/test_ops.py)."""

from __future__ import annotations

from disagg.engine.resolve import cpu_summary  # its text is asserted exactly in tests/unit/test_cpu_features.py
from disagg.ops import load_ops
from disagg.ops.hugepages import huge_pages_note
from disagg.ops.linear import OnednnWeight, TiledWeight


def auto_kernels() -> str:
    isa = load_ops("csrc").name.removeprefix("csrc-")
    return f"kernels csrc-{isa} (auto: csrc built, runs its {isa} code)"


def dense_kernel() -> str:
    """What runs float32 dense weights with auto kernels: csrc's dense_matmul on avx512 and avx2."""
    return (TiledWeight if load_ops("csrc").dense_matmul_preferred else OnednnWeight).kernel


def huge_pages() -> str:
    """The summary's last clause on CPU with huge pages asked (the default): its text for this kernel's
    setting is asserted in tests/unit/test_hugepages.py."""
    return f", huge pages {huge_pages_note(True, True)}"
