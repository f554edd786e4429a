"""Which instruction set runs each CPU path, chosen once per process from one table.

    plan = cpu_plan()                       # CPUID, this build of the kernels, the OS's tile permission
    plan.tiles_take("bf16", num_rows)       # this product runs on AMX tiles
    plan.isa(dtype, quantized)              # {"products": ..., "attention": ..., "gguf": ...}: /v1/models

Our kernels are compiled for the CPU they run on (workers/kernels/native.py: -march=native), so
the vector bodies (AVX2, AVX-512, AVX512_BF16, VNNI) are fixed when the library is built. AMX
tiles need one more thing at run time: the OS's permission for tile data (Linux 5.16 on, asked
once per process: rayllm_amx_enable). Where the CPU has AMX and the OS refuses, the log says so
once and every product stays on the vector kernels.

A tile product pays a fixed cost per call (the tile configuration, and for a GGUF weight the
dequantization of its blocks to bf16 once per group and row span), which many rows repay and a
few do not: TILE_MIN_ROWS holds, per path, the rows from which the tiles take a product over
the vector kernel, measured side by side (`bench.bench_linear --dtype bfloat16 --tiles` and
`bench.bench_gguf --tiles`, docs/cpu.md). That table is the only place the choice is made: the
Python products (workers/linear.py, workers/kernels/gguf.py) ask tiles_take, and the C layer
loop gets the same rows in its arguments (workers/native_forward.py).

RAYLLM_AMX=off (read once, at the first call) keeps the tiles off on a CPU that has them: the
vector kernels' side of a comparison, served or in-process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# CPU_* bits of csrc/entry_points.h (rayllm_cpu_features)
FEATURE_BITS = {"avx2": 1, "avx512": 2, "avx512_bf16": 4, "avx512_vnni": 8, "amx_bf16": 16, "amx_int8": 32}
# rayllm_amx_enable's answers (AMX_* of csrc/entry_points.h)
AMX_STATUS = {0: "granted", 1: "not built: the kernels were compiled for a CPU without AMX",
              2: "this CPU has no AMX-BF16", 3: "refused by the OS (tile data needs Linux 5.16 or later)"}

# Rows from which a path's products run on AMX tiles rather than the vector kernel below them,
# measured on a 2-core Sapphire Rapids-class Xeon, 2 threads, weights streamed from memory:
# - bf16 (rayllm_amx_gemm_bf16 against the bf16 panels, `bench.bench_linear --dtype bfloat16
#   --threads 2`, SmolLM2's 30 layers and lm_head): tiles / panels 1.09x at 1 row, 1.07x at 2,
#   0.98x at 4, 0.87x at 6, 0.75x at 8, 0.50x at 16, 0.24x at 64;
# - gguf (rayllm_amx_gguf_gemm against the packed Q4_1 int8 kernel, `bench.bench_gguf --threads 2
#   --tiles`, SmolLM2's four layer shapes): 1.2-2.4x at 16 rows, 0.89-1.21x at 32, 0.73-1.04x at
#   48, 0.61-0.95x at 64, 0.43-0.57x at 256 (the blocks' dequantization to bf16 is paid per call);
# - gguf_int8 (rayllm_amx_gguf_int8_gemm: the same int8 product bit for bit, the integer dot
#   products on int8 tiles, packed Q4_0 and Q4_1 only), up to gguf's rows: 0.77-1.00x at 8 rows,
#   0.62-0.79x at 16, 0.51-0.68x at 32, 0.40-0.62x at 64 (the bf16 tiles 0.64-0.78x there; at 128
#   0.47-0.53x against 0.55-0.69x, level at 256). Inside the default model's decode steps (tile rows
#   toggled every 8 steps): 22.31 / 22.08 ms a step of 16 against 23.07 / 22.91 on the vectors,
#   19.60 against 19.16 at 12, 16.96 against 14.99 at 8;
# - gguf_int16 (rayllm_amx_gguf_int16_gemm: a packed Q8_0 lm_head's int16 product bit for bit, each
#   x block cut into its high and low bytes, two int8 tile products a block), against the packed
#   int16 vector kernel, SmolLM2's 49152 x 576 head. Streamed from memory (`bench.bench_gguf
#   --threads 2 --tiles`): 1.10x at 8 rows, 0.93x at 16, 0.74x at 32, 0.69x at 64. Inside the
#   default model's decode steps (its logits timed, the rows toggled every 8 steps), where the head
#   comes from memory behind the layers: 1.17x at 8 sequences, 1.01x at 12, 0.82-0.86x at 16 (the
#   kernel before it widened its blocks beside the tile instructions: 0.95x, 0.82-0.94x, 0.75x).
#   12 rows, where the two measured level or better;
# - attention (csrc/attention_amx.c against paged_attention.c's vector body, a bf16 pool under bf16
#   queries or an fp16 pool under fp32 ones): the queries a sequence computes in the step.
# - gguf_prompt: a step that computes prompt tokens runs its GGUF products on the bf16 tiles from
#   this many rows, chosen for what its rows decide, not for speed: a prompt's last row picks the
#   answer's first token, and its rows fill the KV every later token reads. bf16 rounds each value
#   of x to 8 bits of its own; int8 rounds it to 1/127 of its 32-block's largest, and the normed
#   inputs of SmolLM2's q/k/v and gate/up products have outlier channels 10-30x the median. On the
#   default model, "What is the capital of France?" after a cached system prompt: int8 gives
#   "The" 0.126 and "L" 0.146 (answered "L'Étoile, la Marseillaise..."), the bf16 tiles 0.154 and
#   0.138, the dequantized fp32 model 0.152 and 0.140. The tiles cost 1.3-1.9x the int8 product
#   at 16-32 rows and the same from 48 (`bench.bench_gguf --tiles`), once per prompt chunk.
TILE_MIN_ROWS: dict[str, int] = {"bf16": 6, "gguf": 64, "gguf_int8": 16, "gguf_int16": 12, "attention": 16,
                                 "gguf_prompt": 1}


@dataclass(frozen=True, slots=True)
class CpuPlan:
    features: frozenset[str]  # what the CPU has (CPUID, and XCR0 for the OS's saved state)
    vector_width: int  # fp32 lanes of the built vector bodies: 16 (AVX-512), 8 (AVX2), 1 (portable C)
    bf16_vectors: bool  # the build has the AVX512_BF16 bodies (vdpbf16ps panels and attention)
    amx_status: str  # AMX_STATUS's answer, or "off (RAYLLM_AMX=off)"
    tile_min_rows: dict[str, int] = field(default_factory=lambda: dict(TILE_MIN_ROWS))

    @property
    def amx(self) -> bool:
        """Products may run on tiles: built, on this CPU, granted by the OS, not switched off."""
        return self.amx_status == "granted"

    def tiles_take(self, path: str, num_rows: int) -> bool:
        return self.amx and num_rows >= self.tile_min_rows[path]

    def for_prompt_step(self) -> CpuPlan:
        """The plan of a step that computes prompt tokens: its GGUF products take the bf16 tiles
        from gguf_prompt's rows."""
        rows = self.tile_min_rows
        return dataclasses.replace(self, tile_min_rows={**rows, "gguf": min(rows["gguf"], rows["gguf_prompt"])})

    def min_rows(self, path: str) -> int:
        """The C layer loop's form of tiles_take: rows from which the path runs on tiles, 0: never."""
        return self.tile_min_rows[path] if self.amx else 0

    def vector_isa(self) -> str:
        if self.vector_width == 16:
            return "avx512-bf16" if self.bf16_vectors else "avx512"
        return "avx2" if self.vector_width == 8 else "portable"

    def isa(self, dtype: torch.dtype, gguf: bool) -> dict[str, str]:
        """What runs each path, in words: the products of dense weights, attention, and (for a
        GGUF checkpoint served in its blocks) its products."""
        vectors = self.vector_isa()
        dense = f"{vectors} panels" if vectors != "portable" else "oneDNN"
        if dtype == torch.bfloat16 and self.amx:
            dense = f"amx-bf16 from {self.tile_min_rows['bf16']} rows, {dense} below"
        attention = vectors
        if self.amx and (dtype == torch.bfloat16 or gguf):  # a bf16 pool, or a GGUF model's fp16 one
            attention = f"amx-bf16 for prompts of {self.tile_min_rows['attention']} tokens or more, {vectors} below"
        isa = {"products": dense, "attention": attention}
        if gguf:
            integer = "avx512-vnni" if "avx512_vnni" in self.features and self.vector_width == 16 else vectors
            isa["gguf"] = (f"amx-bf16 for prompt steps and from {self.tile_min_rows['gguf']} rows, amx-int8 from "
                           f"{self.tile_min_rows['gguf_int8']} (packed Q4_0/Q4_1) and for a Q8_0 lm_head from "
                           f"{self.tile_min_rows['gguf_int16']}, {integer} int8 below" if self.amx
                           else f"{integer} int8")
        return isa


def plan_from(library) -> CpuPlan:
    """The plan for a loaded build of the kernels (cpu_plan's, or a test's other build)."""
    bits = int(library.rayllm_cpu_features())
    features = frozenset(name for name, bit in FEATURE_BITS.items() if bits & bit)
    if os.environ.get("RAYLLM_AMX", "").lower() in ("0", "off", "false", "no"):
        status = "off (RAYLLM_AMX=off)"
    else:
        status = AMX_STATUS.get(int(library.rayllm_amx_enable()), "unknown")
    return CpuPlan(features, int(library.rayllm_vector_width()), bool(library.rayllm_panel_gemm_bf16_available()),
                   status)


_override: list[CpuPlan] = []  # using_plan's, innermost last


@contextlib.contextmanager
def using_plan(plan: CpuPlan) -> Iterator[CpuPlan]:
    """Every product in the block chooses by `plan` (tests and benchmarks: tiles off, other rows)."""
    _override.append(plan)
    try:
        yield plan
    finally:
        _override.pop()


def without_tiles(plan: CpuPlan) -> CpuPlan:
    return dataclasses.replace(plan, amx_status="off")


def cpu_plan() -> CpuPlan:
    """This process's plan (using_plan's inside one)."""
    return _override[-1] if _override else detected_plan()


@functools.cache
def detected_plan() -> CpuPlan:
    """This process's own plan (asks the OS for tile data once); a plan with no tiles where our
    kernels do not build."""
    from workers.kernels.native import NativeBuildError, native_library

    try:
        plan = plan_from(native_library())
    except NativeBuildError:
        return CpuPlan(frozenset(), 1, False, "no kernels")
    if plan.amx:
        logger.info("AMX tiles: bf16 products from %d rows and GGUF products from %d rows run on them",
                    plan.tile_min_rows["bf16"], plan.tile_min_rows["gguf"])
    elif "amx_bf16" in plan.features:
        logger.warning("this CPU has AMX tiles but they stay unused: %s; products run on %s", plan.amx_status,
                       plan.vector_isa())
    return plan
