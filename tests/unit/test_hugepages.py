"""disagg.ops.hugepages: tensors placed in memory advised for transparent huge pages, the kernel's
setting read, and the engine's weights and KV cache there unless --no-huge-pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from disagg.engine.core import EngineCore
from disagg.engine.models.linear_weights import placed
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.ops.hugepages import HUGE_PAGE, HugePageArena, huge_page_mode, huge_pages_note
from disagg.ops import load_ops
from disagg.ops.linear import TiledWeight, pack_tiles
from disagg.types import SamplingParams

MIB = 2**20


def huge_pages_in_use() -> int:
    """Bytes of this process's anonymous memory in huge pages (smaps_rollup's AnonHugePages)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no AnonHugePages line in /proc/self/smaps_rollup")


def test_the_kernels_setting_is_the_bracketed_word_and_pages_past_a_chunk_count_as_large(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert huge_page_mode(tmp_path) == "madvise"  # no hpage_pmd_size: 2 MB
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    assert huge_page_mode(tmp_path) == "always"
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    assert huge_page_mode(tmp_path) == "never"
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "hpage_pmd_size").write_text(f"{512 * MIB}\n")  # arm64 with 64 KB pages
    assert huge_page_mode(tmp_path) == "large"
    assert huge_page_mode(tmp_path / "missing") == "unavailable"


def test_the_note_says_what_went_to_huge_pages_and_why():
    assert huge_pages_note(True, True, 3 * MIB // 2, True, "madvise") == (
        "1.5 MiB of weights and the kv cache (transparent_hugepage madvise)")
    assert huge_pages_note(True, True, 513 * MIB, True, "always") == (
        "513.0 MiB of weights and the kv cache (transparent_hugepage always)")
    assert huge_pages_note(True, True, 0, True, "madvise") == "the kv cache (transparent_hugepage madvise)"
    assert huge_pages_note(True, True, MIB, False, "madvise") == "1.0 MiB of weights (transparent_hugepage madvise)"
    assert huge_pages_note(True, True, 0, False, "madvise") == "nothing placed (transparent_hugepage madvise)"
    assert huge_pages_note(True, True, MIB, True, "never") == "none: the kernel gives none (transparent_hugepage never)"
    assert huge_pages_note(True, True, MIB, True, "unavailable") == (
        "none: the kernel gives none (transparent_hugepage unavailable)")
    assert huge_pages_note(True, True, MIB, True, "large") == (
        "none: this kernel's huge pages are larger than the arena's 64 MiB chunks")
    assert huge_pages_note(False, True, MIB, True, "madvise") == "off (--no-huge-pages)"
    assert huge_pages_note(True, False, MIB, True, "madvise") == "off (not on CPU)"


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise advice for huge pages here")
def test_a_kernel_that_refuses_the_advice_gives_ordinary_pages(monkeypatch):
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 9999)  # advice no kernel knows: EINVAL, as from one without THP
    with pytest.raises(OSError):
        mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS).madvise(mmap.MADV_HUGEPAGE)
    t = HugePageArena().place(torch.arange(5, dtype=torch.int16))
    assert t.tolist() == [0, 1, 2, 3, 4]


def test_placed_tensors_keep_their_values_and_sit_on_cache_lines_one_after_another():
    arena = HugePageArena(chunk_bytes=4 * MIB)
    a = arena.place(torch.arange(10, dtype=torch.float32))  # 40 bytes: the next starts 64 on
    b = arena.place(torch.arange(6, dtype=torch.int64).view(2, 3))
    assert a.tolist() == list(range(10)) and a.dtype == torch.float32
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]] and b.dtype == torch.int64 and b.is_contiguous()
    assert a.data_ptr() % HUGE_PAGE == 0  # a chunk starts on a 2 MB edge
    assert b.data_ptr() - a.data_ptr() == 64
    assert arena.mapped_bytes == 4 * MIB


def test_a_tensor_past_the_chunks_room_starts_a_new_chunk_and_a_large_one_has_its_own():
    arena = HugePageArena(chunk_bytes=4 * MIB)
    first = arena.place(torch.zeros(MIB // 4, dtype=torch.float32))  # 1 MiB
    second = arena.place(torch.ones(7 * MIB // 8, dtype=torch.float32))  # 3.5 MiB: not in the 3 MiB left
    big = arena.empty((9 * MIB,), torch.uint8)  # 9 MiB: a chunk of 10 MiB
    assert arena.mapped_bytes == 4 * MIB + 4 * MIB + 10 * MIB
    assert second.data_ptr() % HUGE_PAGE == 0 and big.data_ptr() % HUGE_PAGE == 0
    assert int(first.sum()) == 0 and int(second.sum()) == 7 * MIB // 8 and int(big.sum()) == 0  # fresh memory: zeros


def test_a_placed_tensor_outlives_its_arena_and_a_cpu_less_tensor_is_left_alone():
    t = HugePageArena().place(torch.full((1000,), 7, dtype=torch.int32))
    assert int(t.sum()) == 7000
    empty = torch.zeros(0)
    assert HugePageArena().place(empty) is empty
    meta = torch.zeros(4, device="meta")
    assert HugePageArena().place(meta) is meta


@pytest.mark.skipif(huge_page_mode() not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason=f"this kernel gives no transparent huge pages ({huge_page_mode()})")
def test_memory_written_in_the_arena_is_in_huge_pages():
    before = huge_pages_in_use()
    t = HugePageArena().empty((16 * MIB,), torch.uint8)
    t.fill_(1)
    assert huge_pages_in_use() - before >= 8 * MIB  # at least half of it, however fragmented memory is
    del t


def test_a_tiled_weight_moves_with_its_kernel_and_numbers():
    w = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    tiled = TiledWeight(pack_tiles(w), 40, 16, matmul=None)
    moved = placed(tiled, HugePageArena())
    assert moved.packed.data_ptr() != tiled.packed.data_ptr()
    assert torch.equal(moved.packed, tiled.packed) and (moved.out_features, moved.in_features) == (40, 16)
    assert placed(tiled, None) is tiled
    assert placed(w, HugePageArena()) is w  # a dense weight may be the loader's own: a copy would hold it twice


@pytest.mark.timeout(120)
def test_the_engine_answers_the_same_with_and_without_huge_pages(tiny_loaded):
    def run(pages: bool):
        core = EngineCore(EngineConfig(model=ModelConfig(model="tiny", dtype="float32", huge_pages=pages),
                                       cache=CacheConfig(block_size=4, kv_cache_memory_mib=1)), tiny_loaded)
        core.add_request("r", [5, 9, 11, 3, 7, 2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens = []
        while core.has_unfinished():
            tokens += [t for out in core.step() for t in out.new_token_ids]
        return core, tokens

    (on, on_tokens), (off, off_tokens) = run(True), run(False)
    assert on_tokens == off_tokens and len(on_tokens) == 12
    assert on.runner.kv_cache.nbytes == off.runner.kv_cache.nbytes == MIB
    assert on.runner.kv_cache.data_ptr() % HUGE_PAGE == 0  # in an arena's chunk
    assert off.engine_summary.endswith(", huge pages off (--no-huge-pages)")
    assert off.runner.model.huge_page_bytes == 0
    # where csrc's dense_matmul runs float32 weights: every layer's tiles and the head's, rows padded to 32
    arch, tiled = tiny_loaded.arch, load_ops("auto").dense_matmul_preferred
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = [(q + 2 * kv, arch.hidden_size), (arch.hidden_size, q), (2 * arch.intermediate_size, arch.hidden_size),
              (arch.hidden_size, arch.intermediate_size)]
    weight_bytes = arch.num_layers * sum(-(-n // 32) * 32 * k * 4 for n, k in shapes)
    weight_bytes += -(-arch.vocab_size // 32) * 32 * arch.hidden_size * 4
    model = on.runner.model
    assert model.huge_page_bytes == (weight_bytes if tiled else 0)
    if tiled:
        assert model.layers[0]["qkv"].packed.data_ptr() % HUGE_PAGE == 0  # the first weight placed
    mode = huge_page_mode()
    assert on.engine_summary.endswith(", huge pages " + huge_pages_note(True, True, weight_bytes if tiled else 0, True))
    if mode in ("always", "madvise"):
        assert on.engine_summary.endswith(f"the kv cache (transparent_hugepage {mode})")
