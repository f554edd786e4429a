"""rayllm-generate: offline generation from a prompt on the command line, no server, no Ray.

    rayllm-generate "What is the capital of France?"            # default model, greedy
    rayllm-generate --model ./my-llama --temperature 0.7 --seed 1 "Tell me a story"

The prompt goes through the model's chat template (unless --raw), then the scheduler's
in-process Engine drives our ModelRunner (or, with --driver simple, the minimal
SimpleDriver), and the completion is streamed to stdout.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: sleep, do not spin

import argparse  # noqa: E402
import asyncio  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from scheduler.outputs import EngineRequest  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rayllm-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--model", default=None,
                        help="local Hugging Face directory or .gguf file; default: SmolLM2-135M-Instruct")
    parser.add_argument("--cache-dir", default=None, help="where GGUF checkpoints are converted (~/.cache/rayllm)")
    parser.add_argument("--max-tokens", type=int, default=256, help="generated tokens at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    parser.add_argument("--system", default=None, help="a system message for the chat template")
    parser.add_argument("--raw", action="store_true", help="tokenize the prompt as is, no chat template")
    parser.add_argument("--max-model-len", type=int, default=4096, help="context length (sizes the KV pool)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--driver", choices=("engine", "simple"), default="engine",
                        help="engine: the scheduler's Engine; simple: the minimal SimpleDriver")
    parser.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    block_size = 16
    runner = ModelRunner(RunnerConfig(
        model=args.model, model_cache_dir=args.cache_dir, block_size=block_size,
        num_blocks=-(-args.max_model_len // block_size) + 1, max_model_len=args.max_model_len,
        num_threads=args.threads,
    ))
    tokenizer = AutoTokenizer.from_pretrained(runner.model_path)
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.system, args.raw)
    max_tokens = max(1, min(args.max_tokens, runner.max_model_len - len(prompt_ids)))
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    printer = StreamPrinter(tokenizer)
    started = time.perf_counter()
    if args.driver == "engine":
        asyncio.run(generate_with_engine(runner, prompt_ids, params, printer))
    else:
        generate_with_driver(runner, prompt_ids, params, printer)
    printer.finish()
    if args.stats:
        elapsed = time.perf_counter() - started
        print(f"[{len(prompt_ids)} prompt + {len(printer.token_ids)} generated tokens in {elapsed:.2f} s, "
              f"{len(printer.token_ids) / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def encode_prompt(tokenizer, prompt: str, system: str | None, raw: bool) -> list[int]:
    if raw or not tokenizer.chat_template:
        return tokenizer(prompt)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


class StreamPrinter:
    """Prints the completion as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.printed = ""

    def add(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        sys.stdout.write(text[len(self.printed):] + "\n")
        sys.stdout.flush()


async def generate_with_engine(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams,
                               printer: StreamPrinter) -> None:
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine

    info = runner.model_info
    config = SchedulerConfig(block_size=info.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
                             recurrent_state=info.has_recurrent_state, num_state_snapshots=info.num_state_snapshots)
    engine = Engine(config, runner, eos_token_ids=info.eos_token_ids)
    try:
        async for delta in engine.add_request(EngineRequest("cli-0", prompt_ids, params)):
            printer.add(delta.new_token_ids)
    finally:
        engine.close()


def generate_with_driver(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams,
                         printer: StreamPrinter) -> None:
    from workers.simple_driver import SimpleDriver

    driver = SimpleDriver(runner)
    request = driver.add_request("cli-0", prompt_ids, params)
    while driver.has_unfinished:
        before = len(request.output_token_ids)
        driver.step()
        printer.add(request.output_token_ids[before:])


if __name__ == "__main__":
    sys.exit(main())
