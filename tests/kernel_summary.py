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



def huge_pages(engine) -> str:
    """The summary's last clause for `engine` (an EngineCore) with huge pages asked (the default): the
    weights' bytes as its model counted them placed; the text is pinned in tests/unit/test_hugepages.py."""
    model = engine.runner.model
    return f", huge pages {huge_pages_note(True, True, model.huge_page_bytes, engine.shared_kv is None)}"


# the same clause where no engine is at hand (a server's /server_info): the kv cache, and the weights'
# MiB where any were placed, on a kernel that gives huge pages; or why none
HUGE_PAGES_CLAUSE = (r", huge pages (\d+\.\d MiB of weights and )?the kv cache \(transparent_hugepage (always|madvise)\)"
                     r"|, huge pages none: .*")


def split_huge_pages(summary: str) -> tuple[str, str]:
    """(the summary before its huge pages clause, the clause)."""
    head, sep, tail = summary.partition(", huge pages ")
    return head, sep + tail
