"""The decoder layers of a step in one C call (workers/kernels/csrc/forward.c), where every
product of the step has a C kernel: fp32 panels on AVX2 CPUs (up to their measured row limit,
workers/linear.py) and AVX-512 CPUs (every row count), bf16 panels on AVX512_BF16 CPUs (every
row count), or our GEMV (up to GEMV_MAX_ROWS rows, both dtypes); a projection kept in its GGUF
type (workers/gguf_weight.py) runs its own kernel (workers/kernels/gguf.py, below its
DENSE_MIN_ROWS: a prompt step runs the Python loop, where such products go dense), each
product of a layer in its own type. Each weight says what the loop reads and how many rows its
product takes (its native_operand(): workers/kernels/native.py, NativeOperand).

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

from workers.kernels import check_variants, cpu_attention, gguf
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.native import (ACTIVATION_CODES, DTYPE_CODES, KV_DTYPE_CODES, LINEAR_GEMV, MIXER_FN, ForwardArgs,
                                    LayerArgs, check_status, native_library)
from workers.layer_ops import NativeOps
from workers.linear import within_row_limit
from workers.lora import PRODUCTS  # a layer's products, in LayerArgs' order (and in LoraStep's)
from workers.recurrent import run_mixer

SMALL_STEP_ROWS = 64  # steps of up to this many rows share one scratch (NativeForward._args)


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
        # layers with a recurrent state (workers/recurrent.py): the loop calls back into Python for their mixer,
        # which reads and writes the step's tensors in _call; an exception waits in _mixer_error
        self._mixer_function = MIXER_FN(self._run_mixer)
        self._call: SimpleNamespace | None = None
        self._mixer_error: BaseException | None = None

    @classmethod
    def for_model(cls, model) -> NativeForward | None:
        """The C loop for this model, or None where one of its parts is not ours (torch ops or
        attention, F.linear or oneDNN alone, a GPU) or a layer's MLP has no C form yet (mixture of
        experts: the Python loop runs it, over our kernels and products)."""
        if model.config.paths.c_layer_loop is not None:
            return None
        if (model.device.type != "cpu" or model.dtype not in DTYPE_CODES or model.attention is not cpu_attention
                or not isinstance(model.ops, NativeOps)):
            return None
        weights = [getattr(layer, name) for layer in model.layers for name in PRODUCTS
                   if getattr(layer, name) is not None]  # a mixer's layer has no qkv or o: its mixer has products
        if any(isinstance(w, torch.Tensor) for w in weights):  # F.linear's or oneDNN's
            return None
        operands = [w.native_operand() for w in weights]
        if any(operand is None for operand in operands):
            return None
        # every dense product of a step runs one kind (panels or the GEMV); a GGUF weight's runs its own
        kinds = {operand.linear for operand in operands if operand.linear is not None}
        if len(kinds) > 1:
            return None
        max_rows = min((operand.max_rows for operand in operands if operand.max_rows is not None), default=None)
        return cls(model, kinds.pop() if kinds else LINEAR_GEMV, max_rows)

    def takes(self, num_tokens: int) -> bool:
        return within_row_limit(num_tokens, self.max_rows)

    def _layer_args(self, kv_caches) -> ctypes.Array:
        pools = [pool[0].data_ptr() for pool in kv_caches]
        if self._layers is None or pools != self._pools:
            self._pool_fields = self._checked_pool_fields(kv_caches)
            num_heads = self.model.config.num_heads
            for layer in self.model.layers:
                check_variants(num_heads, layer.window, layer.softcap, layer.sinks)
            self._sinks = [cpu_attention.fp32_sinks(layer.sinks) for layer in self.model.layers]
            self._layers = (LayerArgs * len(kv_caches))(*(
                self._one_layer_args(layer, pool, sinks)
                for layer, pool, sinks in zip(self.model.layers, kv_caches, self._sinks, strict=True)
            ))
            self._pools = pools
        return self._layers

    def _one_layer_args(self, layer, pool, sinks: torch.Tensor | None) -> LayerArgs:
        """A layer's LayerArgs; pool: its (K, V) pool, or a mixer's state pool (workers/recurrent.py)."""
        local = self.model.local_rope
        products = {name: getattr(layer, name).native_operand() for name in PRODUCTS
                    if getattr(layer, name) is not None}
        k_cache, v_cache = (None, None) if layer.mixer is not None else pool
        return LayerArgs(
            _ptr(layer.input_norm), _ptr(layer.post_norm),
            *(_ptr(products[name].tensor) if name in products else None for name in PRODUCTS),
            _ptr(layer.qkv_bias), _ptr(layer.o_bias), _ptr(layer.gate_up_bias), _ptr(layer.down_bias),
            _ptr(layer.q_norm), _ptr(layer.k_norm), _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm),
            _ptr(k_cache), _ptr(v_cache), int(layer.use_rope), int(layer.qk_norm_whole),
            softcap=layer.softcap or 0.0, window=layer.window or 0, sinks=_ptr(sinks),
            cos=_ptr(local.cos_f32) if layer.local_rope else None,
            sin=_ptr(local.signed_sin_f32) if layer.local_rope else None,
            **{f"{name}_type": operand.type_code for name, operand in products.items()},
            mixer=ctypes.cast(self._mixer_function, ctypes.c_void_p) if layer.mixer is not None else None,
        )

    def _checked_pool_fields(self, kv_caches) -> dict[str, int]:
        """AttentionArgs' fields that describe the pools, after checking that the kernels take them."""
        c, dtype = self.model.config, self.model.dtype
        first = next(pool for layer, pool in zip(self.model.layers, kv_caches) if layer.mixer is None)
        block_size, num_kv_heads, head_dim, block_stride = cpu_attention.pool_layout(*first)
        assert head_dim == c.head_dim and num_kv_heads == c.num_kv_heads
        kv_dtype = first[0].dtype  # the model's dtype, or fp16 under fp32 (a half pool)
        assert cpu_attention.supports(c.num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype)
        return dict(num_heads=c.num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    block_stride=block_stride, dtype=DTYPE_CODES[dtype], kv_dtype=KV_DTYPE_CODES[kv_dtype])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, kv_caches,
                 lora=None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden].
        lora: the step's LoRA adapters (workers/lora.py StepLora, on our kernel), or None."""
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
        args.lora = None if lora is None else ctypes.pointer(lora.native())
        self._call = SimpleNamespace(x=args._scratch["x"][:num_tokens], delta=args._scratch["delta"][:num_tokens],
                                     residual=residual, kv_caches=kv_caches, states=metadata.states)
        try:
            status = self.function(ctypes.byref(args))
        finally:
            self._call = None
        if self._mixer_error is not None:
            error, self._mixer_error = self._mixer_error, None
            raise error
        check_status(status, "rayllm_decoder_forward")
        return out

    def _run_mixer(self, index: int, num_tokens: int) -> int:
        """Layer index's mixer, called back by the C loop in attention's place: its branch's input
        (the normed x, or the residual stream) in, delta out (as the Python loop runs it)."""
        try:
            call, layer = self._call, self.model.layers[index]
            x = call.x if layer.input_norm is not None else call.residual
            call.delta.copy_(run_mixer(layer.mixer, self.model, x, call.kv_caches[index], call.states))
            return 0
        except BaseException as error:  # it cannot cross C: raised again when the loop returns
            self._mixer_error = error
            return 1

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
