"""Our CPU kernels in C (workers/kernels/csrc/*.c): compiled once per machine, loaded with ctypes.

The sources are plain C with OpenMP, built with the system C compiler for the CPU they run
on (`-O3 -march=native -fopenmp`), so a fresh machine needs nothing beyond what installing
Python packages with C extensions already needs. The shared library is cached under
`~/.cache/rayllm/kernels/`, named by a hash of the sources, the flags, the compiler's version
and the CPU's flags: each node of a cluster builds its own once (about a second), and a change
of any of them builds a new one. Building writes to a temporary file and renames it into
place, so concurrent workers never load a half-written library.

OpenMP: torch's wheel ships libgomp.so.1, already loaded when this runs, so our library
binds to the same runtime (one thread pool, not two competing ones).

    library = native_library()          # NativeBuildError if there is no working compiler
    library.rayllm_paged_attention(...)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch  # loaded before our library, so it binds to torch's libgomp (see above)

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.c", "layer_ops.c", "panel_avx512.c", "forward.c", "sampler.c", "thread_pool.c",
           "gguf_gemm.c", "amx.c", "attention_amx.c", "gguf_amx.c", "lora.c",
           "recurrent.c")  # compiled together; they include csrc/*.h
# Not -ffast-math: GCC 12 then links crtfastmath.o even into a shared library, whose constructor
# sets flush-to-zero and denormals-are-zero for the whole process on load (Python floats,
# numpy and every other library lose subnormals). These are the parts of it the kernels want.
FAST_MATH_PARTS = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
                   "-freciprocal-math", "-ffp-contract=fast")
CFLAGS = ("-O3", "-march=native", *FAST_MATH_PARTS, "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


class NativeBuildError(RuntimeError):
    """The C kernels could not be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rayllm" / "kernels"


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _flags(march: str) -> tuple[str, ...]:
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS)


def _build_key(cc: str, march: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.[ch]")):  # the sources and the headers they include
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    for part in (" ".join(_flags(march)), version, _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build(target_dir: Path | None = None, march: str = "native") -> Path:
    """Compiles the sources into target_dir (default: cache_dir()) unless already there. march:
    the CPU to compile for (tests build an older one too, e.g. "x86-64-v3": AVX2 without AVX-512)."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install gcc): the CPU kernels need one")
    target_dir = target_dir or cache_dir()
    path = target_dir / f"rayllm_kernels_{_build_key(cc, march)}.so"
    if path.exists():
        return path
    target_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=target_dir, suffix=".so.tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    command = [cc, *_flags(march), "-o", str(tmp_path), *(str(SOURCE_DIR / name) for name in SOURCES), "-lm"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeBuildError(f"building the CPU kernels failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
    logger.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - started, path)
    return path


@functools.cache
def native_library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use); NativeBuildError if that fails."""
    return load(build())


def load(path: Path) -> ctypes.CDLL:
    """A built library loaded and its entry points declared (native_library's, or another build's)."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeBuildError(f"loading the CPU kernels from {path} failed: {error}") from error
    _declare(library)
    check_layouts(library)
    return library


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype argument of every entry point (csrc/simd.h)
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float16: 2}  # a KV pool's (kv_dtype): a half pool under fp32 queries too
# rayllm_gated_mul's activation (csrc/entry_points.h): act(gate) * up; "swiglu_oai" is gpt-oss's clamped SwiGLU
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def check_status(status: int, entry_point: str) -> None:
    """Every entry point returns 0, or an error code (bad arguments, out of memory)."""
    if status != 0:
        raise RuntimeError(f"{entry_point} failed with status {status}")


def native_available() -> bool:
    try:
        native_library()
    except NativeBuildError as error:
        logger.warning("%s; falling back to the torch reference kernels", error)
        return False
    return True


class AttentionArgs(ctypes.Structure):
    """Mirror of AttentionArgs in csrc/paged_attention.c (same order, same types)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("query_start_loc", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("max_blocks_per_seq", ctypes.c_int64),
        ("q_stride_token", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("out_stride_token", ctypes.c_int64),
        ("out_stride_head", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int32),  # q and out
        ("kv_dtype", ctypes.c_int32),  # the pool's: dtype, or fp16 under fp32 queries (KV_DTYPE_CODES)
        ("num_threads", ctypes.c_int32),
        ("window", ctypes.c_int64),  # 0: no sliding window
        ("attention_chunk", ctypes.c_int64),  # 0: no chunked attention
        ("softcap", ctypes.c_float),  # 0: no soft-cap
        ("sinks", ctypes.c_void_p),  # [num_heads] fp32, or None: no sinks
        ("tile_min_queries", ctypes.c_int64),  # sequences of this many queries on AMX tiles (cpu_isa); 0: never
    ]


class LayerArgs(ctypes.Structure):
    """Mirror of LayerArgs in csrc/forward.c: one decoder layer's weights and KV pool."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias",
            "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "k_cache", "v_cache")),
        ("use_rope", ctypes.c_int32),
        ("qk_norm_whole", ctypes.c_int32),
        ("softcap", ctypes.c_float),  # the layer's attention variants: 0 / None: none
        ("window", ctypes.c_int64),
        ("sinks", ctypes.c_void_p),  # [num_heads] fp32
        ("cos", ctypes.c_void_p),  # this layer's RoPE tables, or None: the step's
        ("sin", ctypes.c_void_p),
        # each product's weight type: 0: the step's dense kind; else its ggml type code (GGUF blocks)
        *((name, ctypes.c_int32) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")),
        ("mixer", ctypes.c_void_p),  # a MIXER_FN: the layer's recurrent mixer (workers/native_forward.py), or None
    ]


# csrc/forward.c's MixerFn: (layer, num_tokens) -> 0, or nonzero when the mixer failed
MIXER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int64)


LORA_PRODUCTS, LORA_MAX_PARTS, LORA_MAX_RANK = 4, 3, 512  # csrc/entry_points.h's


class LoraPart(ctypes.Structure):
    """Mirror of LoraPart in csrc/entry_points.h: one part (q, k, v, gate, up, o or down) of an
    adapter's product: out[:, start:start + len] += (x @ a.T) @ bt."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("rank", ctypes.c_int64), ("start", ctypes.c_int64),
                ("len", ctypes.c_int64), ("dtype", ctypes.c_int32)]  # dtype: a's and bt's (DTYPE_CODES)


class LoraSegment(ctypes.Structure):
    """Mirror of LoraSegment: one adapter's parts and the step's rows of it."""

    _fields_ = [("parts", ctypes.POINTER(LoraPart)), ("rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64)]


class LoraStep(ctypes.Structure):
    """Mirror of LoraStep: a step's adapters (csrc/lora.c)."""

    _fields_ = [("segments", ctypes.POINTER(LoraSegment)), ("num_segments", ctypes.c_int64),
                ("num_layers", ctypes.c_int64)]


class ForwardArgs(ctypes.Structure):
    """Mirror of ForwardArgs in csrc/forward.c (same order, same types)."""

    _fields_ = [
        ("layers", ctypes.POINTER(LayerArgs)),
        *((name, ctypes.c_void_p) for name in (
            "final_norm", "residual", "out", "x", "qkv", "attended", "delta", "gate_up", "act", "positions",
            "slot_mapping", "cos", "sin")),
        ("attention", AttentionArgs),
        ("num_tokens", ctypes.c_int64),
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("rotary_dim", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int32),
        ("linear", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("gguf_mode", ctypes.c_int32),  # GGUF_MODES (workers/kernels/gguf.py): the GGUF products' mode
        ("tile_min_rows_bf16", ctypes.c_int64),  # steps from this many rows run on AMX tiles (cpu_isa), 0: never
        ("tile_min_rows_gguf", ctypes.c_int64),
        ("tile_min_rows_gguf_int8", ctypes.c_int64),  # packed Q4_0/Q4_1 on int8 tiles, below tile_min_rows_gguf
        ("lora", ctypes.POINTER(LoraStep)),  # the step's LoRA adapters (csrc/lora.c), or None
    ]


LINEAR_PANELS, LINEAR_GEMV = 0, 1  # ForwardArgs.linear (csrc/forward.c): the step's dense products


class NativeOperand(NamedTuple):
    """How the C layer loop (workers/native_forward.py) runs one weight's products."""

    tensor: torch.Tensor  # what LayerArgs points at: panels, a plain [out, in] weight, or GGUF blocks
    type_code: int  # LayerArgs' *_type: 0 for a dense weight (the step's ForwardArgs.linear), else its ggml type
    linear: int | None  # the ForwardArgs.linear a dense weight needs (LINEAR_PANELS, LINEAR_GEMV); None: any
    max_rows: int | None  # rows per step at most that its C product takes; None: any


class SampleArgs(ctypes.Structure):
    """Mirror of SampleArgs in csrc/sampler.c (same order, same types)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "logits", "workspace", "params", "bitmask", "history", "history_spans", "out")),
        ("num_rows", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("logits_stride", ctypes.c_int64),
        ("bitmask_words", ctypes.c_int64),
        ("num_threads", ctypes.c_int32),
        ("status", ctypes.c_int32),
    ]


class Mamba2StepArgs(ctypes.Structure):
    """Mirror of Mamba2StepArgs: Mamba-2's decode step (csrc/recurrent.c)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("xbc", "dt", "gate", "norm", "dt_bias", "decay_rate", "skip",
                                                        "states", "scratch", "out", "rows")),
                *((name, ctypes.c_int64) for name in ("num_rows", "num_seqs", "num_heads", "head_dim", "state_size",
                                                       "num_groups", "xbc_stride", "dt_stride", "gate_stride")),
                *((name, ctypes.c_float) for name in ("time_step_min", "time_step_max", "eps")),
                *((name, ctypes.c_int32) for name in ("norm_mode", "dtype", "num_threads"))]


class GatedDeltaStepArgs(ctypes.Structure):
    """Mirror of GatedDeltaStepArgs: the Gated DeltaNet's decode step (csrc/recurrent.c)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("mixed", "z", "b", "a", "norm", "dt_bias", "neg_decay_rate",
                                                        "states", "out", "rows")),
                *((name, ctypes.c_int64) for name in ("num_rows", "num_seqs", "num_k_heads", "num_v_heads",
                                                       "head_k_dim", "head_v_dim", "mixed_stride", "z_stride",
                                                       "ba_stride")),
                ("eps", ctypes.c_float), ("dtype", ctypes.c_int32), ("num_threads", ctypes.c_int32)]


# Mamba2StepArgs.norm_mode, by Mamba2Traits.gated_norm (csrc/entry_points.h)
MAMBA2_NORM_MODES = {None: 0, "after_gate": 1, "before_gate": 2}


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
LAYOUT_MIRRORS = {"rayllm_layout_attention_args": AttentionArgs, "rayllm_layout_layer_args": LayerArgs,
                  "rayllm_layout_forward_args": ForwardArgs, "rayllm_layout_sample_args": SampleArgs,
                  "rayllm_layout_lora_part": LoraPart, "rayllm_layout_lora_segment": LoraSegment,
                  "rayllm_layout_lora_step": LoraStep, "rayllm_layout_mamba2_step_args": Mamba2StepArgs,
                  "rayllm_layout_gated_delta_step_args": GatedDeltaStepArgs}
_SIGNATURES = {  # argument types of each entry point (pointers are data_ptr() ints); all return int status
    **{entry_point: [_P, _P, _I64] for entry_point in LAYOUT_MIRRORS},  # offsets, names, capacity -> count
    "rayllm_paged_attention": [ctypes.POINTER(AttentionArgs)],
    # k, v, k_stride, v_stride, k_cache, v_cache, block_stride, slot_mapping, num_tokens, num_kv_heads,
    # head_dim, block_size, dtype, kv_dtype, num_threads
    "rayllm_write_kv": [_P, _P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32],
    # residual, delta, weight, out, num_rows, hidden, eps, dtype, num_threads
    "rayllm_add_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F32, _I32, _I32],
    # qkv, positions, cos, sin, num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, num_threads
    "rayllm_rope": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _I32],
    # qkv, q_weight, k_weight, num_rows, num_heads, num_kv_heads, head_dim, whole, eps, dtype, num_threads
    "rayllm_head_rms_norm": [_P, _P, _P, _I64, _I64, _I64, _I64, _I32, _F32, _I32, _I32],
    # gate_up, out, num_rows, width, activation, alpha, limit, dtype, num_threads
    "rayllm_gated_mul": [_P, _P, _I64, _I64, _I32, _F32, _F32, _I32, _I32],
    # x, out, num_rows, width, num_threads
    "rayllm_argmax": [_P, _P, _I64, _I64, _I32],
    # x, w, bias, out, num_rows, N, K, dtype, out_dtype, num_threads
    "rayllm_gemv": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32],
    # x, panels, bias, out, num_rows, N, K, num_threads (fp32)
    "rayllm_panel_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32],
    "rayllm_panel_gemm_available": [],
    # x, panels, bias, out, num_rows, N, K, out_dtype, num_threads (bf16 in)
    "rayllm_panel_gemm_bf16": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32],
    "rayllm_panel_gemm_bf16_available": [],
    "rayllm_vector_width": [],
    "rayllm_pool_caller_sleeps": [],  # waits of the thread pool's caller that slept (csrc/thread_pool.c)
    # x, blocks, bias, out, num_rows, N, K, ggml_type, dtype, out_dtype, mode, num_threads
    "rayllm_gguf_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _I32, _I32],
    # blocks, out, N, K, ggml_type, num_threads (fp32 out)
    "rayllm_gguf_dequantize": [_P, _P, _I64, _P, _I64, _I64, _I32, _I32],
    # the CPU's features (CPU_* bits of csrc/entry_points.h), whether this build has the tile kernels,
    # and the OS's permission for tile data (AMX_* codes)
    "rayllm_cpu_features": [],
    "rayllm_amx_built": [],
    "rayllm_amx_enable": [],
    # items, rounds, num_threads: the tiles' peak (bench/tile_peak.py)
    "rayllm_amx_tile_peak": [_I64, _I64, _I32],
    # x, panels, bias, out, num_rows, N, K, dtype, out_dtype, num_threads (bf16 panels, x bf16 or fp32)
    "rayllm_amx_gemm_bf16": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32],
    # x, gate_up panels, bias, out, num_rows, width, K, activation, alpha, limit, num_threads (bf16)
    "rayllm_amx_gated_gemm_bf16": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _F32, _F32, _I32],
    # x, gate_up blocks, bias, out, num_rows, width, K, ggml_type, dtype, activation, alpha, limit, num_threads
    "rayllm_amx_gguf_gated_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _F32, _F32, _I32],
    # x, blocks, bias, out, num_rows, N, K, ggml_type, dtype, out_dtype, num_threads (packed Q4_0/Q4_1, int8 tiles)
    "rayllm_amx_gguf_int8_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _I32],
    # the same arguments (a packed Q8_0 lm_head's int16 product, int8 tiles)
    "rayllm_amx_gguf_int16_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _I32],
    # x, blocks, bias, out, num_rows, N, K, ggml_type, dtype, out_dtype, num_threads
    "rayllm_amx_gguf_gemm": [_P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _I32],
    "rayllm_decoder_forward": [ctypes.POINTER(ForwardArgs)],
    # step, layer, product (LORA_PRODUCTS' index), x, out, N, K, dtype, num_threads
    "rayllm_lora_add": [ctypes.POINTER(LoraStep), _I64, _I32, _P, _P, _I64, _I64, _I32, _I32],
    "rayllm_sample": [ctypes.POINTER(SampleArgs)],
    # x, x_stride, weight, bias, states, rows, num_rows, out, num_seqs, channels, kernel, silu, dtype, num_threads
    "rayllm_conv_step": [_P, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I32, _I32, _I32],
    "rayllm_mamba2_step": [ctypes.POINTER(Mamba2StepArgs)],
    "rayllm_gated_delta_step": [ctypes.POINTER(GatedDeltaStepArgs)],
    # A, B, batch, L, M, num_threads (fp32)
    "rayllm_unit_lower_solve": [_P, _P, _I64, _I64, _I64, _I32],
}


def struct_layout(structure: type[ctypes.Structure]) -> list[int]:
    """A ctypes struct's layout as the C side reports its own: sizeof, then the fields' offsets."""
    return [ctypes.sizeof(structure), *(getattr(structure, name).offset for name, *_ in structure._fields_)]


def check_layouts(library: ctypes.CDLL, mirrors: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Each ctypes mirror has its C struct's size and field offsets (rayllm_layout_*), else
    NativeBuildError: a field added, dropped or retyped on one side only would pass wrong values."""
    for entry_point, structure in (mirrors or LAYOUT_MIRRORS).items():
        offsets, names = (ctypes.c_int64 * 128)(), ctypes.create_string_buffer(4096)
        count = getattr(library, entry_point)(offsets, names, len(names))
        c_layout = (names.value.decode().split(), list(offsets[:count]))
        mirror = ([name for name, *_ in structure._fields_], struct_layout(structure))
        if c_layout != mirror:
            raise NativeBuildError(
                f"{structure.__name__} in workers/kernels/native.py does not match the C struct ({entry_point}: "
                f"fields, sizeof and offsets {c_layout}; the mirror's {mirror}): change both together")


def _declare(library: ctypes.CDLL) -> None:
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
