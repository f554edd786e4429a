"""Where a decode step's time goes, against what its math and memory traffic cost.

    .venv/bin/python -m bench.bench_runner --breakdown                      # fp32+bf16, 1+2 threads, batch 1 and 16
    .venv/bin/python -m bench.bench_runner --breakdown --dtypes bfloat16 --threads-list 1

For each dtype, thread count and batch size (sequences decoding together, each with a
context of --prompt-len tokens), all in one process and one run:

- step: the median wall time of ModelRunner.execute for a decode step (everything: input
  preparation, the forward, the lm_head on every row, sampling);
- GEMM-only: the same step's matrix products alone, with the model's own packed weights
  and the step's shapes (per layer qkv, o, gate_up, down at M = batch, then the lm_head as
  the model computes it), timed back to back in the same run;
- step / GEMM: the target is <= 1.3 at batch 16;
- attention: the time inside the attention kernel and the rotary + KV-cache write of
  as many steps right after (measured by timing those calls in place, on the Python layer
  loop: the shipped C loop has no Python between its kernels to time), and its share of
  the step (target <= 15% at batch 16);
- weights: the bytes a step must read once (every projection weight and the lm_head, not
  the embedding rows), over the read bandwidth measured here with the same threads
  (a sum over a 512 MB tensor); step / weights-read is the batch-1 target (<= 1.2);
- bytes: what the step must read besides, its KV (every sequence's keys and values in every
  layer, at the timed steps' mean context), its share of the step's bytes, and the byte floor
  (weights + KV) / weights: the step / GEMM-only of a step that moves all its bytes at the rate
  the products move the weights (their GB/s is printed beside the sum's). A step beats it only
  by reading its KV faster than that, or while arithmetic runs (docs/cpu.md, "Where the time
  goes on AMX").

With `--prefill N` (`bench_runner --breakdown --prefill 8`), also a step that computes N
prompts of --prompt-len tokens whole (8 x 256: the 2048-token steps of a c16 wave), against
its products alone (the lm_head on N rows) and its attention, and the rates both reach: the
products' FLOP over GEMM-only, the step's (products and causal attention) over the step, each
against the tiles' peak at the same threads (bench/tile_peak.py) where the CPU has AMX.
`--prefill 16 --prompt-len 256` is the step the AMX tile-use target is about.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from bench.tile_peak import tile_peak_tflops
from scheduler.sampling_params import SamplingParams
from workers.kernels import bind_attention
from workers.model_runner import ModelRunner, RunnerConfig
from workers.simple_driver import SimpleDriver

BANDWIDTH_BYTES = 512 << 20


@dataclass
class Breakdown:
    dtype: str
    threads: int
    batch: int
    step_s: float  # median decode step (ModelRunner.execute)
    gemm_s: float  # the step's matrix products alone
    attention_s: float  # attention kernel + rotary/KV write, per step
    weight_read_s: float  # weight bytes / measured bandwidth
    weight_bytes: int  # what weight_read_s reads
    kv_bytes: int  # the KV a decode step reads (all sequences, all layers, the timed steps' mean context)

    @property
    def byte_floor(self) -> float:
        """(weights + KV) / weights: the least step / GEMM-only where the products move bytes at
        their limit (module docstring)."""
        return (self.weight_bytes + self.kv_bytes) / self.weight_bytes

    def row(self) -> str:
        return (f"{self.dtype:>8} | {self.threads:>7} | {self.batch:>5} | {self.step_s * 1e3:8.2f} | "
                f"{self.gemm_s * 1e3:8.2f} | {self.step_s / self.gemm_s:8.2f} | {self.attention_s * 1e3:8.2f} "
                f"({self.attention_s / self.step_s:5.1%}) | {self.weight_read_s * 1e3:8.2f} | "
                f"{self.step_s / self.weight_read_s:7.2f} | {self.weight_bytes / self.gemm_s / 1e9:7.1f} "
                f"({self.weight_bytes / self.weight_read_s / 1e9:4.1f}) | {self.kv_bytes / 1e6:5.0f} MB "
                f"({self.kv_bytes / (self.weight_bytes + self.kv_bytes):5.1%}) | {self.byte_floor:5.2f}")


HEADER = (f"{'dtype':>8} | {'threads':>7} | {'batch':>5} | {'step ms':>8} | {'GEMM ms':>8} | {'step/GEMM':>8} | "
          f"{'attention ms (share)':>20} | {'weights ms':>8} | {'step/weights':>7} | "
          f"GEMM GB/s (read) | KV (its bytes share) | byte floor")


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second that a sum over a 512 MB tensor reads, with torch's current threads."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    data.sum()
    best = min(_timed(lambda: data.sum()) for _ in range(repeats))
    return BANDWIDTH_BYTES / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of every weight a decode step reads once: the layers' and the lm_head's (each packed
    weight's nbytes: a GGUF weight's blocks, as the file holds them, panels, or the GEMV's plain
    copy; plain tensors and oneDNN's opaque ones: from the config's shapes)."""
    model = runner.model
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]
    if not any(isinstance(w, torch.Tensor) for w in weights):
        return sum(w.nbytes for w in weights)
    element = torch.empty(0, dtype=model.dtype).element_size()
    c = runner.model_config
    per_layer = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size + c.num_heads * c.head_dim * c.hidden_size
    per_layer += 3 * c.intermediate_size * c.hidden_size
    return (c.num_layers * per_layer + c.vocab_size * c.hidden_size) * element


def gemm_only_s(runner: ModelRunner, batch: int, repeats: int, sampled_rows: int | None = None) -> float:
    """The step's matrix products alone: per layer qkv, o, gate_up, down at M = batch, then the
    lm_head on sampled_rows rows (a prompt step samples one row per sequence; default: every row)."""
    model, c = runner.model, runner.model_config
    x = torch.randn(batch, c.hidden_size).to(model.dtype)
    sampled = x[:sampled_rows] if sampled_rows is not None else x
    attended = torch.randn(batch, c.num_heads * c.head_dim).to(model.dtype)
    act = torch.randn(batch, c.intermediate_size).to(model.dtype)

    def run() -> None:
        for layer in model.layers:
            model.linear(x, layer.qkv, layer.qkv_bias)
            model.linear(attended, layer.o, layer.o_bias)
            model.linear(x, layer.gate_up, layer.gate_up_bias)
            model.linear(act, layer.down, layer.down_bias)
        model.compute_logits(sampled)

    with torch.inference_mode():
        run()
        return statistics.median(_timed(run) for _ in range(repeats))


@contextmanager
def timing_attention(model):
    """Adds the seconds spent in rotary, the KV write and attention to the yielded list's [0]."""
    spent = [0.0]
    backend, ops = model.attention, model.ops

    def timed(function):
        def call(*args, **kwargs):
            started = time.perf_counter()
            out = function(*args, **kwargs)
            spent[0] += time.perf_counter() - started
            return out
        return call

    class TimedBackend:  # the backend, with each step's bound write/attend and the rotary timed
        allocate_kv_cache = staticmethod(backend.allocate_kv_cache)

        @staticmethod
        def bind(metadata, scale):
            step = bind_attention(backend, metadata, scale)
            return SimpleNamespace(write=timed(step.write), attend=timed(step.attend))

    model.attention, ops.rope = TimedBackend, timed(ops.rope)
    try:
        yield spent
    finally:
        model.attention = backend
        del ops.rope  # back to the class's method


def add_random_prompts(driver: SimpleDriver, num: int, prompt_len: int, params: SamplingParams, seed: int,
                       prefix: str) -> None:
    """Queues num requests of prompt_len random token ids (seeded), named prefix + index."""
    generator = torch.Generator().manual_seed(seed)
    for index in range(num):
        prompt = torch.randint(3, driver.runner.model_info.vocab_size, (prompt_len,), generator=generator).tolist()
        driver.add_request(f"{prefix}{index}", prompt, params)


def kv_bytes(runner: ModelRunner, batch: int, prompt_len: int, num_steps: int) -> int:
    """The KV that decode_steps' timed steps read, per step: batch sequences at their mean
    context (the prompt, the first sampled token, the warm step's and half the timed steps' tokens)."""
    c = runner.model_config
    element = runner.kv_caches[0][0].element_size()  # the pool's dtype (fp16 under fp32 activations by default)
    mean_keys = prompt_len + 1 + (num_steps + 1) / 2
    return int(batch * mean_keys * c.num_layers * 2 * c.num_kv_heads * c.head_dim * element)


def decode_steps(runner: ModelRunner, batch: int, prompt_len: int, num_steps: int) -> tuple[float, float]:
    """(median step seconds, mean attention seconds per step) over num_steps decode steps."""
    driver = SimpleDriver(runner, token_budget=max(2048, batch * prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 3, ignore_eos=True)
    add_random_prompts(driver, batch, prompt_len, params, seed=batch, prefix="b")
    driver.step()  # prefill
    driver.step()  # a first decode (warm)
    steps = []
    for _ in range(num_steps):
        driver.step()
        steps.append(runner.last_timing.total_s)
    # attention is timed on the Python loop (the C loop of workers/native_forward.py runs the
    # same kernels with no Python between them to time): steps after the timed ones
    with python_layer_loop(runner.model), timing_attention(runner.model) as spent:
        for _ in range(num_steps):
            driver.step()
    while driver.has_unfinished:
        driver.step()
    return statistics.median(steps), spent[0] / num_steps


@contextmanager
def python_layer_loop(model):
    """Runs the model's forward on its Python layer loop, where attention can be timed (the
    shipped C loop of workers/native_forward.py has no Python between its kernels)."""
    native = model.native_forward
    model.native_forward = None
    try:
        yield
    finally:
        model.native_forward = native


@dataclass
class PrefillBreakdown:
    dtype: str
    threads: int
    num_seqs: int
    prompt_len: int
    step_s: float  # the best prompt step (ModelRunner.execute)
    gemm_s: float  # its matrix products alone (M = num_seqs x prompt_len, the lm_head on num_seqs rows)
    attention_s: float  # attention kernel + rotary/KV write in such a step
    product_flop: float  # the step's matrix products (what gemm_s computes)
    attention_flop: float  # its causal attention (QK^T and PV)
    tile_peak_tflops: float | None  # bench.tile_peak at the same threads; None without AMX

    def row(self) -> str:
        text = (f"{self.dtype:>8} | {self.threads:>7} | prompt step {self.num_seqs} x {self.prompt_len}: "
                f"{self.step_s * 1e3:.0f} ms, GEMM-only {self.gemm_s * 1e3:.0f} ms, step / GEMM "
                f"{self.step_s / self.gemm_s:.2f}, attention {self.attention_s * 1e3:.0f} ms "
                f"({self.attention_s / self.step_s:.1%})")
        products = self.product_flop / self.gemm_s / 1e12
        step = (self.product_flop + self.attention_flop) / self.step_s / 1e12
        text += f" | products {products:.2f} TFLOP/s, step {step:.2f} TFLOP/s"
        if self.tile_peak_tflops:
            text += (f": {products / self.tile_peak_tflops:.0%} and {step / self.tile_peak_tflops:.0%} of the "
                     f"tiles' peak ({self.tile_peak_tflops:.2f} TFLOP/s, bench.tile_peak)")
        return text


def prompt_step_flop(config, num_seqs: int, prompt_len: int) -> tuple[float, float]:
    """(products, attention) floating-point operations of a step computing num_seqs prompts of
    prompt_len tokens whole: every layer's qkv, o, gate_up and down on every token, the lm_head on
    one row a sequence; causal attention's QK^T and PV over the prompt (position i sees i + 1 keys)."""
    tokens = num_seqs * prompt_len
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = (config.hidden_size * (q_width + 2 * kv_width) + q_width * config.hidden_size
                 + config.hidden_size * 2 * config.intermediate_size + config.intermediate_size * config.hidden_size)
    products = 2.0 * (tokens * per_token * config.num_layers + num_seqs * config.hidden_size * config.vocab_size)
    pairs = prompt_len * (prompt_len + 1) / 2  # (query, key) pairs of one head
    attention = 2.0 * 2 * config.num_layers * num_seqs * config.num_heads * config.head_dim * pairs
    return products, attention


def prefill_step(runner: ModelRunner, num_seqs: int, prompt_len: int, repeats: int) -> tuple[float, float]:
    """(best step seconds, attention seconds) of a step computing num_seqs prompts whole."""
    def one_step(seed: int) -> float:
        driver = SimpleDriver(runner, token_budget=num_seqs * prompt_len)
        add_random_prompts(driver, num_seqs, prompt_len, SamplingParams(temperature=0.0, max_tokens=1), seed,
                           prefix=f"p{seed}-")
        driver.step()
        spent = runner.last_timing.total_s
        while driver.has_unfinished:
            driver.step()
        return spent

    one_step(0)  # warm
    step_s = min(one_step(seed) for seed in range(1, repeats + 1))
    with python_layer_loop(runner.model), timing_attention(runner.model) as spent:
        one_step(repeats + 1)
    return step_s, spent[0]


def run(model_dir: str, dtypes: list[str], threads_list: list[int], batches: list[int], prompt_len: int,
        num_steps: int = 16, repeats: int = 5, prefill_seqs: int = 0,
        quantization: str = "none", kv_cache_dtype: str = "auto") -> list[Breakdown | PrefillBreakdown]:
    """quantization "auto": a GGUF model_dir ("default", a .gguf path) served with its quantized weights."""
    results = []
    for dtype in dtypes:
        blocks = max(max(batches), prefill_seqs) * (-(-(prompt_len + 2 * num_steps + 8) // 16)) + 1
        runner = ModelRunner(RunnerConfig(model=model_dir, dtype=dtype, num_blocks=blocks, quantization=quantization,
                                          kv_cache_dtype=kv_cache_dtype))
        if runner.model_info.quantization != "none":
            dtype = f"{dtype}, {runner.model_info.quantization}"
        if runner.model_info.kv_cache_dtype != runner.model_info.dtype:
            dtype = f"{dtype}, kv {runner.model_info.kv_cache_dtype}"
        weights = weight_bytes(runner)
        for threads in threads_list:
            torch.set_num_threads(threads)
            bandwidth = read_bandwidth()
            for batch in batches:
                step_s, attention_s = decode_steps(runner, batch, prompt_len, num_steps)
                results.append(Breakdown(dtype, threads, batch, step_s, gemm_only_s(runner, batch, repeats),
                                         attention_s, weights / bandwidth, weights,
                                         kv_bytes(runner, batch, prompt_len, num_steps)))
                print(results[-1].row(), flush=True)
            if prefill_seqs:
                step_s, attention_s = prefill_step(runner, prefill_seqs, prompt_len, repeats=3)
                gemm_s = gemm_only_s(runner, prefill_seqs * prompt_len, 3, sampled_rows=prefill_seqs)
                product_flop, attention_flop = prompt_step_flop(runner.model_config, prefill_seqs, prompt_len)
                results.append(PrefillBreakdown(dtype, threads, prefill_seqs, prompt_len, step_s, gemm_s, attention_s,
                                                product_flop, attention_flop, tile_peak_tflops(threads)))
                print(results[-1].row(), flush=True)
        del runner
    return results
