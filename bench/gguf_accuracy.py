"""A GGUF checkpoint served natively against the model it represents: next-token agreement and memory.

    .venv/bin/python -m bench.gguf_accuracy                         # the default model (Q4_1), 5 x 512 tokens
    .venv/bin/python -m bench.gguf_accuracy --model ./x.Q4_K_M.gguf --sequences 8 --threads 2

The reference is the GGUF's weights dequantized, in fp32 (dtype float32: the exact path). Each
other side is measured against it, teacher-forced on real text (CPython's pydoc_data topics, the
text tests/workers/test_bf16_agreement.py uses): at every position of --sequences sequences of
--seq-len tokens (one prefill each), does the side's most likely next token equal the
reference's? Sides (the configurations a deployment can pick):

    dequantized fp32   dtype float32                          the reference
    gguf fp32          dtype auto      (quantization auto)    the GGUF types, fp32 activations, an fp16 KV
                                                              pool (kv_cache_dtype auto): the default
    gguf fp32 kv32     the same with kv_cache_dtype float32   ... over an fp32 KV pool
    gguf bf16          dtype bfloat16  (quantization auto)    the GGUF types, bf16 activations and KV
    dequantized bf16   dtype bfloat16, quantization none      the dequantized weights in bf16

Each side runs in a process of its own, built as a worker builds it (ModelRunner), so its
resident memory is its own: RSS before the model (torch and our modules imported), after
loading it, and the peak (VmHWM) over the prefills (a product through the reference
gguf_linear dequantizes a whole weight for a moment; fast kernels do not). The KV pool is the
same small one on every side. The products are whatever workers/gguf_weight.py's gguf_linear
runs.

llama.cpp's own agreement on the same file and positions, for comparison (its tools built from
the llama.cpp tree, the text written out as this module reads it):

    llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf f32.gguf F32
    llama-perplexity -m f32.gguf -f topics.txt -c 512 --chunks 10 -t 2 --kl-divergence-base base.kld
    llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f topics.txt -c 512 --chunks 10 -t 2 \
        --kl-divergence-base base.kld --kl-divergence          # "Same top p"

It scores the second half of each 512-token context: compare with the "2nd halves" column of a
`--sequences 10` run. The f32 file is the Q4_1 weights dequantized, as this module's reference is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SIDES = {  # name -> RunnerConfig fields
    "dequantized fp32": dict(dtype="float32"),
    "gguf fp32": dict(dtype="auto", quantization="auto"),
    "gguf fp32 kv32": dict(dtype="auto", quantization="auto", kv_cache_dtype="float32"),
    "gguf bf16": dict(dtype="bfloat16", quantization="auto"),
    "dequantized bf16": dict(dtype="bfloat16", quantization="none"),
}
REFERENCE = "dequantized fp32"
BLOCK_SIZE = 16
# Logits are computed this many positions at a time: a decode step of 16 sequences. All of a
# 512-token prompt's at once would take a GGUF lm_head's prompt-step path (gguf.goes_dense: the
# weight dequantized, fp32), not the kernel every served token's logits come from.
LOGITS_ROWS = 16


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def text_sequences(tokenizer, num_sequences: int, seq_len: int) -> list[list[int]]:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < num_sequences * seq_len:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {num_sequences} x {seq_len}")
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_sequences)]


def top1(runner, token_ids: list[int]) -> list[int]:
    """The side's argmax next token at every position of one sequence (a single prefill), the
    logits LOGITS_ROWS positions at a time, as decode steps compute them."""
    import torch

    from workers.model import AttentionMetadata

    positions, metadata = AttentionMetadata.one_sequence(len(token_ids), BLOCK_SIZE)
    with torch.inference_mode():
        hidden = runner.model.forward(torch.tensor(token_ids), positions, metadata, runner.kv_caches)
        return [token for rows in hidden.split(LOGITS_ROWS)
                for token in runner.model.compute_logits(rows).argmax(dim=-1).tolist()]


def run_side(args: argparse.Namespace) -> dict:
    """One side, in this process: its predictions and memory."""
    import torch
    from transformers import AutoTokenizer

    from workers.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(args.threads)
    before, _ = rss_mib()
    runner = ModelRunner(RunnerConfig(model=args.model, model_cache_dir=args.cache_dir, block_size=BLOCK_SIZE,
                                      num_blocks=-(-args.seq_len // BLOCK_SIZE) + 1, **SIDES[args.side]))
    loaded, _ = rss_mib()
    tokenizer = AutoTokenizer.from_pretrained(runner.model_path)
    predictions = [top1(runner, sequence) for sequence in text_sequences(tokenizer, args.sequences, args.seq_len)]
    _, peak = rss_mib()
    info = runner.model_info
    return {"side": args.side, "dtype": info.dtype, "kv": info.kv_cache_dtype, "quantization": info.quantization,
            "linear_backend": info.linear_backend, "rss_before_mib": before, "rss_loaded_mib": loaded,
            "peak_mib": peak, "predictions": predictions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (llama architecture); default: SmolLM2-135M")
    parser.add_argument("--cache-dir", default=None, help="where GGUF checkpoints are converted (~/.cache/rayllm)")
    parser.add_argument("--sequences", type=int, default=5, help="sequences of real text (5 x 511 = 2,555 positions)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side is not None:  # a child: one side
        with open(args.out, "w") as out:
            json.dump(run_side(args), out)
        return 0
    sides = [REFERENCE] + [side for side in args.sides.split(",") if side != REFERENCE]
    unknown = [side for side in sides if side not in SIDES]
    if unknown:
        raise SystemExit(f"unknown sides {unknown}; expected some of {list(SIDES)}")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for side in sides:
            out = os.path.join(scratch, "side.json")
            command = [sys.executable, "-m", "bench.gguf_accuracy", "--side", side, "--out", out,
                       "--sequences", str(args.sequences), "--seq-len", str(args.seq_len),
                       "--threads", str(args.threads)]
            command += ["--model", args.model] if args.model else []
            command += ["--cache-dir", args.cache_dir] if args.cache_dir else []
            print(f"running {side} ...", file=sys.stderr, flush=True)
            subprocess.run(command, check=True)
            with open(out) as result:
                results[side] = json.load(result)
    report(results, args)
    return 0


def second_halves(predictions: list[list[int]]) -> list[int]:
    """The predictions llama.cpp's `llama-perplexity --kl-divergence` scores in each context of
    the same length: from the middle to the second-to-last position (each predicts a token of the
    sequence). With --sequences 10 --seq-len 512 these are the positions of its `-c 512 --chunks
    10` on the same text (module docstring), so its "Same top p" compares with this column."""
    return [token for sequence in predictions for token in sequence[len(sequence) // 2:-1]]


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    reference = [token for sequence in results[REFERENCE]["predictions"] for token in sequence]
    print(f"model {args.model or 'default (SmolLM2-135M-Instruct)'} | {args.sequences} x {args.seq_len} tokens of "
          f"pydoc_data.topics, {len(reference)} positions teacher-forced | {args.threads} threads")
    halves = second_halves(results[REFERENCE]["predictions"])
    print(f"{'side':>18} | {'dtype':>8} | {'KV':>8} | {'weights':>10} | {'top-1 vs ref':>12} | {'2nd halves':>10} | "
          f"{'RSS before':>10} | {'RSS loaded':>10} | {'model MiB':>9} | {'peak MiB':>8}")
    for side, result in results.items():
        ours = [token for sequence in result["predictions"] for token in sequence]
        agreement = sum(a == b for a, b in zip(ours, reference, strict=True)) / len(reference)
        ours_halves = second_halves(result["predictions"])
        on_halves = sum(a == b for a, b in zip(ours_halves, halves, strict=True)) / len(halves)
        print(f"{side:>18} | {result['dtype']:>8} | {result['kv']:>8} | {result['quantization']:>10} | "
              f"{agreement:12.4f} | {on_halves:10.4f} | "
              f"{result['rss_before_mib']:10.0f} | {result['rss_loaded_mib']:10.0f} | "
              f"{result['rss_loaded_mib'] - result['rss_before_mib']:9.0f} | {result['peak_mib']:8.0f}")


if __name__ == "__main__":
    sys.exit(main())
