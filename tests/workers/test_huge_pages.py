"""workers/huge_pages.py: advised allocations and the arena the packed weights are carved from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.huge_pages import HUGE_PAGE, HugeArena, advise_huge_pages, empty_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_arena_carves_aligned_disjoint_tensors_and_gives_big_ones_their_own():
    arena = HugeArena(chunk_bytes=1 << 20)
    small = [arena.empty((3, 5), torch.bfloat16), arena.empty((7,), torch.float32), arena.empty((100, 33), torch.float32)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in small)
    assert all(start % HugeArena.ALIGN == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))  # no overlap
    for index, tensor in enumerate(small):
        tensor.fill_(index)
    assert [t.float().mean().item() for t in small] == [0.0, 1.0, 2.0]  # each keeps what was written
    big = arena.empty((300_000,), torch.float32)  # more than half a chunk: an allocation of its own
    assert big.untyped_storage().data_ptr() != small[0].untyped_storage().data_ptr()
    full = [arena.empty((100_000,), torch.float32) for _ in range(4)]  # 400 KB each: a new chunk when one is full
    assert len({t.untyped_storage().data_ptr() for t in full}) == 2


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_os_takes_the_advice_for_whole_2mb_pages():
    assert advise_huge_pages(torch.empty(3 * HUGE_PAGE, dtype=torch.uint8))  # holds at least two aligned pages
    assert not advise_huge_pages(torch.empty(1000, dtype=torch.uint8))  # holds none
    tensor = empty_huge((HUGE_PAGE,), torch.float32)
    assert tensor.shape == (HUGE_PAGE,) and tensor.dtype == torch.float32


def _vm_flags(address: int) -> list[str]:
    """The VmFlags in /proc/self/smaps of the mapping that holds address."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_cpu_kv_pool_is_zeroed_and_advised_to_2mb_pages():
    """A decode step reads its KV blocks scattered over the whole pool: on 4 KB pages each block
    is a TLB miss (bench.bench_attention --threads 2 with a 1 GB pool: bf16 6.3-8.8 -> 6.0-6.4 ms,
    fp32 10.4-10.7 -> 9.7-9.9). Whether Linux finds free 2 MB pages is up to it; the advice
    ("hg" in the mapping's VmFlags) is ours."""
    from workers.kernels import cpu_attention

    # 36 MB, a layer's pool at the shipped 1 GB for SmolLM2's 30 layers: above glibc's largest
    # mmap threshold (32 MB), so always fresh memory that the advice applies to; a smaller pool
    # may reuse heap pages a long-running process (this test session) has touched already
    k_cache, v_cache = cpu_attention.allocate_kv_cache(3000, 16, 3, 64, torch.bfloat16)
    assert not k_cache.any() and not v_cache.any()
    assert "hg" in _vm_flags(k_cache.data_ptr() + 8 * HUGE_PAGE)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_gguf_weight_packed_for_the_native_kernels_is_a_copy_on_advised_pages():
    """The GGUF blocks a decode step streams (bench: SmolLM2's Q4_1 products and Q8_0 head at one
    row, 2 threads, 0.84-1.00x the time on 2 MB pages, median 0.93) are copied into the linear's
    arena: the same bytes, in a mapping advised to 2 MB pages."""
    from bench.bench_gguf import random_weight
    from workers.gguf_weight import GGMLType
    from workers.kernels.native import native_available
    from workers.linear import NativeLinear

    if not native_available():
        pytest.skip("no native kernels here")
    weight = random_weight(GGMLType.Q4_1, 8192, 576)  # 2.9 MB: past its chunk's first 2 MB boundary
    placed = NativeLinear().pack(weight)
    assert torch.equal(placed.blocks, weight.blocks) and placed.blocks.data_ptr() != weight.blocks.data_ptr()
    assert (placed.ggml_type, placed.out_features, placed.in_features) == (GGMLType.Q4_1, 8192, 576)
    assert "hg" in _vm_flags(placed.blocks.data_ptr() + placed.blocks.numel() - 1)
