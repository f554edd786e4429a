"""CPU tensors backed by 2 MB pages where Linux offers them (transparent huge pages).

A decode step streams every weight once (hundreds of MB) and, at batch 16, about as many
bytes of KV blocks. With 4 KB pages each page is a TLB entry and a stop for the hardware
prefetchers, which do not follow a stream across a page boundary; Linux backs an anonymous
mapping with 2 MB pages only where it is told to (`transparent_hugepage/enabled` is usually
`madvise`, as on the machines this was measured on), and only for memory not yet touched.
So big, long-lived tensors are allocated empty, advised, and only then written; the packed
weights, most of them a few MB (an aligned 2 MB page or none inside each), are carved one
after another out of large advised chunks (HugeArena). SmolLM2's bf16 products, all 30
layers and the lm_head from memory, 4 KB pages vs an arena (median of 7, in one process):
1 row 14.9 -> 13.3 ms on 1 thread, 11.6 -> 10.2 on 2; 16 rows 32.8 -> 32.0, 21.5 -> 20.4.

    weights = empty_huge((rows, cols), torch.bfloat16)   # then weights.copy_(...) fills it
    arena = HugeArena()                                  # many tensors, carved from 2 MB-paged chunks
    panel = arena.empty((64, 288, 16, 2), torch.bfloat16)

Where the OS says no (not Linux, THP off, a tensor too small to hold an aligned 2 MB page)
this is a plain torch.empty: nothing depends on it but speed.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise():
    if os.environ.get("RAYLLM_HUGE_PAGES", "1") == "0":  # for measuring the difference
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks for 2 MB pages under the whole 2 MB pages inside this CPU tensor's storage (only
    memory not yet touched gets them). True if the OS took the advice."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, advised to 2 MB pages before anything touches it."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor


class HugeArena:
    """Tensors carved one after another from chunks of chunk_bytes advised to 2 MB pages (a
    bump allocator: nothing is freed before the arena is). A tensor larger than a chunk gets
    its own advised allocation."""

    ALIGN = 64  # bytes: every tensor starts on a cache line

    def __init__(self, chunk_bytes: int = 32 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.chunk_bytes // 2:
            return empty_huge(shape, dtype)
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._chunk is None or start + nbytes > self.chunk_bytes:
            self._chunk, start = empty_huge((self.chunk_bytes,), torch.uint8), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of tensor (CPU, contiguous) in the arena."""
        return self.empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)
