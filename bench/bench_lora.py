"""LoRA serving cost in-process, side by side in one run: decode steps of 16 streams on the base
model against 16 streams spread over 4 adapters, and an adapter's cold load.

    .venv/bin/python -m bench.bench_lora                       # the default model (GGUF Q4_1), rank 16, 4 adapters
    .venv/bin/python -m bench.bench_lora --dtype bfloat16 --quantization none --rank 16 --adapters 4

The adapters are random, made with peft's own classes on every projection (q, k, v, o, gate, up,
down) of the model and saved as PEFT saves them (under --workdir, reused). The two workloads
alternate, --repeats times each; each reports its median decode step (16 rows) and decode
tokens/s, and the ratio adapters / base is what the issue's target (0.85x) is about. A cold load
is load_adapter's time for one adapter directory (safetensors read, checks, our pairs built),
median of --repeats.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from scheduler.sampling_params import SamplingParams  # noqa: E402
from workers.loader import resolve_model_path  # noqa: E402
from workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from workers.simple_driver import SimpleDriver  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: Path, root: Path, count: int, rank: int, targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """count random PEFT adapters of model_dir on targets (made once under root)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    label = "all" if targets == TARGETS else "-".join(targets)
    paths = {f"a{index}": root / f"r{rank}-{label}-a{index}" for index in range(count)}
    missing = [name for name, path in paths.items() if not (path / "adapter_model.safetensors").is_file()]
    if missing:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for index, name in enumerate(missing):
            peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                          init_lora_weights=False))
            generator = torch.Generator().manual_seed(index)
            with torch.no_grad():
                for parameter_name, parameter in peft_model.named_parameters():
                    if "lora_" in parameter_name:
                        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
            peft_model.save_pretrained(paths[name])
            model = peft_model.unload()  # the base without the adapter, for the next one
    return paths


def decode_steps(runner: ModelRunner, prompts: list[list[int]], lora_names: list[str | None],
                 new_tokens: int) -> list[float]:
    """Seconds of each decode step (every row a decode) of the prompts run together."""
    driver = SimpleDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index, (prompt, name) in enumerate(zip(prompts, lora_names)):
        driver.add_request(f"r{index}", prompt, params, lora_name=name)
    times = []
    while driver.has_unfinished:
        started = time.perf_counter()
        driver.step()
        elapsed = time.perf_counter() - started
        if all(len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens <= 1
               for r in driver.requests.values()) and any(r.output_token_ids for r in driver.requests.values()):
            times.append(elapsed)
    return times[1:]  # the first decode step may still carry a prompt's tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local model directory or .gguf (default: SmolLM2's GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--targets", default=",".join(TARGETS), help="the adapters' target modules")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "rayllm" / "bench-lora"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    adapters = make_adapters(model_dir, Path(args.workdir), args.adapters, args.rank, tuple(args.targets.split(",")))
    runner = ModelRunner(RunnerConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                      num_threads=args.threads, block_size=16, num_blocks=1024,
                                      lora_adapters=tuple((name, str(path)) for name, path in adapters.items())))
    info = runner.model_info
    print(f"model {info.model_type} {info.quantization} dtype {info.dtype}, layer loop {info.layer_loop}, "
          f"{args.threads} threads; {args.adapters} adapters of rank {args.rank}, {args.streams} streams")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, info.vocab_size, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.streams)]
    names = list(adapters)
    workloads = {"base": [None] * args.streams,
                 "adapters": [names[index % len(names)] for index in range(args.streams)],
                 "one": [names[0]] * args.streams}  # every stream on one adapter: its weights read once a step
    steps: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.repeats):
        for name, lora_names in workloads.items():
            steps[name].append(statistics.median(decode_steps(runner, prompts, lora_names, args.new_tokens)))
    for name, medians in steps.items():
        best = min(medians)
        print(f"{name:>9}: decode step {best * 1e3:.2f} ms (medians {', '.join(f'{m * 1e3:.2f}' for m in medians)}), "
              f"{args.streams / best:.0f} tok/s")
    for name in ("adapters", "one"):
        print(f"{name} / base: {min(steps['base']) / min(steps[name]):.2f}x")
    loads = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        runner.load_lora("cold", str(adapters[names[0]]))
        loads.append(time.perf_counter() - started)
    print(f"cold load of one adapter: {statistics.median(loads) * 1e3:.1f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
