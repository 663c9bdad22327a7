"""Memory in transparent huge pages: the weights a decode step streams and the KV cache it reads.

A decode step reads every weight once, front to back. On 4 KB pages that is a TLB miss every 4 KB, and
the hardware prefetchers stop at each page's edge; on 2 MB pages neither happens. SmolLM2's 30 layers'
float32 matmuls, both threads, the same kernel and bytes: 1 row 30.0 -> 21.1 ms as avx2 and 32.0 ->
19.9 as avx512, 16 rows 45.8 -> 35.3 and 40.4 -> 31.1 (docs/engine.md, "Huge pages").

Linux gives huge pages to anonymous memory advised for them (MADV_HUGEPAGE) where
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (most distributions' default); with
`never`, a kernel built without them (it refuses the advice) or off Linux, the same memory is ordinary
pages and nothing else changes. An arena maps chunks
of private anonymous memory aligned to 2 MB, advises them, and hands out tensors placed in them: a
tensor's memory lives as long as any tensor placed in its chunk.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86's: chunks start on this edge
CHUNK_BYTES = 64 << 20  # a tensor larger than this gets a chunk of its own
ALIGN = 64  # every placed tensor starts on a cache line
_THP = Path("/sys/kernel/mm/transparent_hugepage")


def huge_page_mode(thp: Path = _THP) -> str:
    """The kernel's transparent huge page setting: always, madvise, never, or unavailable (no such file),
    or `large` where its huge pages are larger than a chunk (arm64 with 64 KB pages: 512 MB)."""
    try:
        text = (thp / "enabled").read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    try:
        size = int((thp / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        size = HUGE_PAGE
    if size > CHUNK_BYTES:
        return "large"
    return chosen[0] if chosen else "unavailable"


def huge_pages_note(asked: bool, on_cpu: bool, weight_bytes: int, kv_cache: bool, mode: str | None = None) -> str:
    """For the ready line: what went to huge pages (`weight_bytes` of the matmul weights, the KV cache
    or not: a TP group's shared one does not), and why (`mode`: the kernel's setting, read where None)."""
    if not on_cpu:
        return "off (not on CPU)"
    if not asked:
        return "off (--no-huge-pages)"
    mode = huge_page_mode() if mode is None else mode
    if mode == "large":
        return f"none: this kernel's huge pages are larger than the arena's {CHUNK_BYTES >> 20} MiB chunks"
    if mode not in ("always", "madvise"):
        return f"none: the kernel gives none (transparent_hugepage {mode})"
    placed = [f"{weight_bytes / 2**20:.1f} MiB of weights"] if weight_bytes else []
    placed += ["the kv cache"] if kv_cache else []
    return f"{' and '.join(placed) or 'nothing placed'} (transparent_hugepage {mode})"


class HugePageArena:
    """Tensors placed in memory advised for transparent huge pages, in chunks of CHUNK_BYTES (a chunk's
    untouched tail takes no memory). CPU tensors only."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 view of the chunk being filled, from its 2 MB edge
        self._used = 0
        self.mapped_bytes = 0
        self.placed_bytes = 0  # of the tensors handed out

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (contiguous, same dtype and shape) in the arena; `t` itself where it is not on CPU
        or is empty."""
        if t.device.type != "cpu" or t.numel() == 0:
            return t
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed contiguous CPU tensor in the arena (fresh anonymous memory reads as zeros)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = self._map(max(nbytes, self.chunk_bytes)), 0
        start = self._used
        self._used = -(-(start + nbytes) // ALIGN) * ALIGN
        self.placed_bytes += nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)

    def _map(self, nbytes: int) -> torch.Tensor:
        """A new chunk of at least `nbytes`, starting on a 2 MB edge."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # Never closed nor resized: views of it would dangle. It is unmapped when the last view dies.
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None:
            try:
                region.madvise(advice)
            except OSError:  # a kernel built without transparent huge pages: EINVAL; ordinary pages then
                pass
        whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view lives
        edge = -whole.data_ptr() % HUGE_PAGE
        self.mapped_bytes += size
        return whole[edge:edge + size]
