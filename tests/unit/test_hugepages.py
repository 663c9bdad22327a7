"""disagg.ops.hugepages: tensors placed in memory advised for transparent huge pages, the kernel's
setting read, and the engine's weights and KV cache there unless --no-huge-pages."""

from __future__ import annotations

import mmap

import pytest
import torch

from disagg.engine.core import EngineCore
from disagg.engine.models.linear_weights import placed
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.ops.hugepages import (HUGE_PAGE, HugePageArena, huge_page_mode, huge_pages_in_use, huge_pages_note)
from disagg.ops.linear import TiledWeight, pack_tiles
from disagg.types import SamplingParams
from kernel_summary import huge_pages

MIB = 2**20


def test_the_kernels_setting_is_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_page_mode(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert huge_page_mode(setting) == "always"
    setting.write_text("always madvise [never]\n")
    assert huge_page_mode(setting) == "never"
    assert huge_page_mode(tmp_path / "missing") == "unavailable"


def test_the_note_says_what_was_asked_and_what_the_kernel_gives():
    assert huge_pages_note(True, True, "madvise") == "weights and kv cache (transparent_hugepage madvise)"
    assert huge_pages_note(True, True, "always") == "weights and kv cache (transparent_hugepage always)"
    assert huge_pages_note(True, True, "never") == "none: the kernel gives none (transparent_hugepage never)"
    assert huge_pages_note(True, True, "unavailable") == "none: the kernel gives none (transparent_hugepage unavailable)"
    assert huge_pages_note(False, True, "madvise") == "off (--no-huge-pages)"
    assert huge_pages_note(True, False, "madvise") == "off (not on CPU)"


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
    assert on.engine_summary.endswith(huge_pages())
    assert off.engine_summary.endswith(", huge pages off (--no-huge-pages)")
    assert on.runner.kv_cache.data_ptr() % HUGE_PAGE == 0  # in an arena's chunk
