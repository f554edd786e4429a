"""The decoder layers of a step in one C call (workers/kernels/csrc/forward.c), where every
product of the step has a C kernel: fp32 panels on AVX2 CPUs (up to their measured row limit,
workers/linear.py) and AVX-512 CPUs (every row count), bf16 panels on AVX512_BF16 CPUs (every
row count), or our GEMV (up to GEMV_MAX_ROWS rows, both dtypes); a projection kept in its GGUF
type (workers/gguf_weight.py) runs its own kernel (workers/kernels/gguf.py, below its
DENSE_MIN_ROWS: a prompt step runs the Python loop, where such products go dense), each
product of a layer in its own type.

The C loop calls the same kernels as PagedLlamaModel.forward, in the same order, with the
same arguments, so it returns the same hidden states bit for bit (a test compares them).
What it saves is the Python between the kernels: about ten ctypes crossings per layer,
each with its checks and a fresh output tensor. A step with more rows than the C products
take (oneDNN's, on the GEMV path; past the panels' row limit on the panel paths) runs the Python
loop.

    native = NativeForward.for_model(model)      # None where the model's parts are not all ours
    if native is not None and native.takes(num_tokens):
        hidden = native(input_ids, positions, metadata, kv_caches)
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from workers.gguf_weight import GgufWeight
from workers.kernels import check_variants, cpu_attention, gguf
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.native import (ACTIVATION_CODES, DTYPE_CODES, KV_DTYPE_CODES, ForwardArgs, LayerArgs, check_status,
                                    native_library)
from workers.layer_ops import NativeOps
from workers.linear import GEMV_MAX_ROWS, DualWeight, NativeLinear, PanelWeight, within_row_limit

LINEAR_PANELS, LINEAR_GEMV = 0, 1  # ForwardArgs.linear (csrc/forward.c)
SMALL_STEP_ROWS = 64  # steps of up to this many rows share one scratch (NativeForward._args)


def _type_code(weight) -> int:
    """LayerArgs' per-product type: 0 for a dense weight (the step's linear kind), else the ggml type."""
    return gguf.type_code(weight) if isinstance(weight, GgufWeight) else 0


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeForward:
    def __init__(self, model, linear_kind: int, max_rows: int | None) -> None:
        self.model = model
        self.linear_kind = linear_kind
        self.max_rows = max_rows  # rows per step at most that every product of the C loop takes; None: any
        self.function = native_library().rayllm_decoder_forward
        self._layers: ctypes.Array | None = None  # LayerArgs per layer, built for one set of pools
        self._pools: list[int] = []  # data_ptr of each layer's K pool, what _layers was built for
        self._sinks: list[torch.Tensor | None] = []  # each layer's sinks in fp32, which _layers points into
        self._pool_fields: dict[str, int] = {}  # AttentionArgs' pool fields, checked with _layers
        self._small_args: SimpleNamespace | None = None  # ForwardArgs for steps of up to SMALL_STEP_ROWS rows

    @classmethod
    def for_model(cls, model) -> NativeForward | None:
        """The C loop for this model, or None where one of its parts is not ours (torch ops or
        attention, F.linear or oneDNN alone, a GPU) or a layer's MLP has no C form yet (mixture of
        experts: the Python loop runs it, over our kernels and products)."""
        if any(layer.moe is not None for layer in model.layers):
            return None
        if (model.device.type != "cpu" or model.dtype not in DTYPE_CODES or model.attention is not cpu_attention
                or not isinstance(model.ops, NativeOps)):
            return None
        weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        quantized = [w for w in weights if isinstance(w, GgufWeight)]
        if not all(gguf.native_has(w) for w in quantized):
            return None
        # a prompt step whose GGUF products go dense (gguf.goes_dense) runs the Python loop, unless
        # such steps run on tiles
        goes_dense = any(gguf.goes_dense(w, gguf.DENSE_MIN_ROWS) for w in quantized)
        limits = [gguf.DENSE_MIN_ROWS - 1] if goes_dense and not gguf.tiles_take(quantized[0], gguf.DENSE_MIN_ROWS) else []
        dense = [w for w in weights if not isinstance(w, GgufWeight)]
        if not dense:  # every product is a GGUF weight's own kernel, whatever the backend
            return cls(model, LINEAR_GEMV, min(limits, default=None))
        if not isinstance(model.linear_backend, NativeLinear):
            return None
        if all(isinstance(w, PanelWeight) for w in dense):
            limits += [w.max_rows for w in dense if w.max_rows is not None]
            return cls(model, LINEAR_PANELS, min(limits, default=None))
        if all(isinstance(w, DualWeight) for w in dense):
            return cls(model, LINEAR_GEMV, min(limits + [GEMV_MAX_ROWS]))
        return None

    def takes(self, num_tokens: int) -> bool:
        return within_row_limit(num_tokens, self.max_rows)

    def _layer_args(self, kv_caches) -> ctypes.Array:
        pools = [k_cache.data_ptr() for k_cache, _ in kv_caches]
        if self._layers is None or pools != self._pools:
            self._pool_fields = self._checked_pool_fields(kv_caches)
            dense = (lambda w: w.panels) if self.linear_kind == LINEAR_PANELS else (lambda w: w.plain)
            operand = lambda w: w.blocks if isinstance(w, GgufWeight) else dense(w)  # noqa: E731
            num_heads, local = self.model.config.num_heads, self.model.local_rope
            for layer in self.model.layers:
                check_variants(num_heads, layer.window, layer.softcap, layer.sinks)
            self._sinks = [cpu_attention.fp32_sinks(layer.sinks) for layer in self.model.layers]
            self._layers = (LayerArgs * len(kv_caches))(*(
                LayerArgs(
                    _ptr(layer.input_norm), _ptr(layer.post_norm), _ptr(operand(layer.qkv)), _ptr(operand(layer.o)),
                    _ptr(operand(layer.gate_up)), _ptr(operand(layer.down)), _ptr(layer.qkv_bias),
                    _ptr(layer.o_bias), _ptr(layer.gate_up_bias), _ptr(layer.down_bias), _ptr(layer.q_norm),
                    _ptr(layer.k_norm), _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm), k_cache.data_ptr(),
                    v_cache.data_ptr(), int(layer.use_rope), int(layer.qk_norm_whole),
                    softcap=layer.softcap or 0.0, window=layer.window or 0, sinks=_ptr(sinks),
                    cos=_ptr(local.cos_f32) if layer.local_rope else None,
                    sin=_ptr(local.signed_sin_f32) if layer.local_rope else None,
                    **{f"{name}_type": _type_code(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")},
                )
                for layer, (k_cache, v_cache), sinks in zip(self.model.layers, kv_caches, self._sinks, strict=True)
            ))
            self._pools = pools
        return self._layers

    def _checked_pool_fields(self, kv_caches) -> dict[str, int]:
        """AttentionArgs' fields that describe the pools, after checking that the kernels take them."""
        c, dtype = self.model.config, self.model.dtype
        block_size, num_kv_heads, head_dim, block_stride = cpu_attention.pool_layout(*kv_caches[0])
        assert head_dim == c.head_dim and num_kv_heads == c.num_kv_heads
        kv_dtype = kv_caches[0][0].dtype  # the model's dtype, or fp16 under fp32 (a half pool)
        assert cpu_attention.supports(c.num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype)
        return dict(num_heads=c.num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    block_stride=block_stride, dtype=DTYPE_CODES[dtype], kv_dtype=KV_DTYPE_CODES[kv_dtype])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, kv_caches) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden]."""
        model = self.model
        num_tokens = input_ids.shape[0]
        assert self.takes(num_tokens) and positions.dtype == torch.int64 and positions.is_contiguous()
        step = cpu_attention.bind(metadata, model.scale)  # checks the metadata; its args carry it
        residual = model.embed_tokens(input_ids)
        out = torch.empty(num_tokens, model.config.hidden_size, dtype=model.dtype)
        args = self._args(kv_caches, num_tokens)
        attention = step.args
        for name, value in self._pool_fields.items():
            setattr(attention, name, value)
        args.attention = attention  # a copy of the struct
        args.residual, args.out, args.positions, args.slot_mapping = (
            residual.data_ptr(), out.data_ptr(), positions.data_ptr(), step.slots)
        args.num_tokens, args.num_threads = num_tokens, torch.get_num_threads()
        args.gguf_mode = gguf.GGUF_MODES[gguf.DEFAULT_MODE]
        plan = cpu_plan()
        args.tile_min_rows_bf16, args.tile_min_rows_gguf = plan.min_rows("bf16"), plan.min_rows("gguf")
        args.tile_min_rows_gguf_int8 = plan.min_rows("gguf_int8")
        check_status(self.function(ctypes.byref(args)), "rayllm_decoder_forward")
        return out

    def _args(self, kv_caches, num_tokens: int) -> ForwardArgs:
        """The step's ForwardArgs with everything but its own pointers and counts set: built,
        and the scratch allocated, once for all steps of up to SMALL_STEP_ROWS rows
        (a decode step's Python here took about 0.15 ms of a 5 ms step: the step's weights evict
        what the interpreter touches, so each call and check costs far more than in a loop). A
        larger step gets its own scratch, which it frees."""
        layers = self._layer_args(kv_caches)
        small = num_tokens <= SMALL_STEP_ROWS
        if small and self._small_args is not None and self._small_args.layers is layers:
            return self._small_args.args
        model, c = self.model, self.model.config
        dtype, head_dim = model.dtype, c.head_dim
        rows = SMALL_STEP_ROWS if small else num_tokens
        scratch = {
            name: torch.empty(rows, width, dtype=dtype)
            for name, width in (("x", c.hidden_size), ("qkv", (c.num_heads + 2 * c.num_kv_heads) * head_dim),
                                ("attended", c.num_heads * head_dim), ("delta", c.hidden_size),
                                ("gate_up", 2 * c.intermediate_size), ("act", c.intermediate_size))
        }
        args = ForwardArgs(
            layers=layers, final_norm=model.final_norm.data_ptr(),
            **{name: tensor.data_ptr() for name, tensor in scratch.items()},
            cos=model.rope.cos_f32.data_ptr(), sin=model.rope.signed_sin_f32.data_ptr(),
            num_layers=len(model.layers), hidden=c.hidden_size, intermediate=c.intermediate_size,
            rotary_dim=model.rope.rotary_dim, eps=c.rms_norm_eps, dtype=DTYPE_CODES[dtype], linear=self.linear_kind,
            activation=ACTIVATION_CODES[c.activation],
        )
        args._scratch = scratch  # alive as long as the args that point into it
        if small:
            self._small_args = SimpleNamespace(layers=layers, args=args)
        return args
