"""Cold load time of one LoRA adapter on the default model's shapes (workers/lora.py load_adapter).

Builds a rank-16 PEFT adapter on all seven projections of the default checkpoint (SmolLM2-135M:
hidden 576, 30 layers) with peft's own classes, then times load_adapter from a cold start of
the call (file read, per-layer pairs, dtype cast) a number of times and prints the median.

    .venv/bin/python bench/bench_lora_load.py [--dtype bfloat16] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lora_adapters import ALL_TARGETS, build_adapter  # noqa: E402

from workers.config import ModelConfig  # noqa: E402
from workers.loader import resolve_model_path  # noqa: E402
from workers.lora import load_adapter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = Path(resolve_model_path(None))
    config = ModelConfig.from_model_dir(model_dir)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_adapter(model_dir, Path(tmp) / "adapter", ALL_TARGETS, args.rank, 2 * args.rank)
        size = (path / "adapter_model.safetensors").stat().st_size
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            adapter = load_adapter("bench", path, config, dtype, "cpu", max_rank=64)
            times.append(time.perf_counter() - started)
    print(f"model {model_dir.name}: hidden {config.hidden_size}, {config.num_layers} layers; adapter rank {args.rank} "
          f"on {len(ALL_TARGETS)} projections, {size / 2**20:.1f} MiB on disk, {adapter.num_bytes / 2**20:.1f} MiB "
          f"loaded as {args.dtype}")
    print(f"load_adapter: median {statistics.median(times) * 1e3:.1f} ms, first {times[0] * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms over {args.repeat} (1 thread)")


if __name__ == "__main__":
    main()
