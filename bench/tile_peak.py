"""The AMX tiles' peak on this machine, the rate a prompt step's products are judged against.

    .venv/bin/python -m bench.tile_peak                 # 1 thread, then 2 (or --threads-list)

The C loop (csrc/amx.c, rayllm_amx_tile_peak) issues 4 TDPBF16PS a round on tiles loaded once,
no memory in the loop, on every thread of the pool at once: on cores of their own, two threads
reach about twice one's rate. `bench.bench_runner --breakdown --prefill 16` prints a prompt step's
rate against this peak at the same thread count.
"""

from __future__ import annotations

import argparse
import time

from workers.kernels.native import native_available, native_library

ITEMS_PER_THREAD = 4
FLOP_PER_ROUND = 4 * 16 * 16 * 32 * 2  # four 16 x 16 sums, 32 bf16 products each, multiply and add


def tile_peak_tflops(threads: int, seconds: float = 0.4) -> float | None:
    """The tiles' TFLOP/s on `threads` threads at once, or None where this CPU, build or OS has none."""
    if not native_available():
        return None
    library = native_library()
    items = threads * ITEMS_PER_THREAD

    def timed(rounds: int) -> float | None:
        start = time.perf_counter()
        if library.rayllm_amx_tile_peak(items, rounds, threads) != 0:
            return None
        return time.perf_counter() - start

    rounds = 20_000
    spent = timed(rounds)
    if spent is None:
        return None
    rounds = max(rounds, int(rounds * seconds / max(spent, 1e-6)))
    best = min(timed(rounds) for _ in range(3))
    return items * rounds * FLOP_PER_ROUND / best / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads-list", default="1,2")
    args = parser.parse_args()
    for threads in (int(t) for t in args.threads_list.split(",")):
        peak = tile_peak_tflops(threads)
        if peak is None:
            print("no AMX tiles here (CPU, build or OS): nothing to measure")
            return
        print(f"threads {threads}: {peak:.2f} TFLOP/s bf16 on tiles ({peak / threads:.2f} a thread)")


if __name__ == "__main__":
    main()
