"""LoRA adapters in PEFT's format, applied beside the base model's products, many per step.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes them. For each projection it targets, an adapter adds

    y += scaling * (x @ A.T) @ B.T          A [rank, in], B [out, rank]
    scaling = lora_alpha / rank             (lora_alpha / sqrt(rank) with use_rslora)

We run q, k and v as one product (qkv) and gate and up as another (gate_up). So an adapter's
parts for one of our products are kept as one pair: their A matrices stacked, and their B
matrices on the block diagonal, with the scaling folded in (and a residual multiplier, for
o_proj and down_proj, as the base weights have it: workers/model.py). A part that the adapter
does not target is simply absent from the pair.

    our product   the checkpoint modules it runs        (Phi-3 ships them fused already)
    qkv           self_attn.q_proj, k_proj, v_proj      self_attn.qkv_proj
    o             self_attn.o_proj
    gate_up       mlp.gate_proj, mlp.up_proj            mlp.gate_up_proj
    down          mlp.down_proj

What we refuse at load, with one error naming the reason (never a partial adapter): another
PEFT method than LoRA, DoRA, trained biases, modules_to_save, per-module rank or alpha
patterns, a rank above the server's max_lora_rank, any tensor on a module we do not run as
a LoRA product (embeddings, lm_head, MoE experts and routers), and a shape that does not fit
the base model (an adapter trained on another base).

A step's rows are grouped by adapter (StepLora): every product adds, per adapter in the step,
the shrink (x[rows] @ A.T) and the expand (@ B.T) over that adapter's rows only. On CPU that is
one call of our C kernel per product (workers/kernels/csrc/lora.c: each part on its own, so the
block diagonal's zeros cost nothing), which the C layer loop makes too. On CUDA it is one launch
of our Triton shrink and one of our expand per product, over every adapter and part of the step
(workers/kernels/triton_lora.py), reading each adapter's LoraStacks: its parts stacked per
product over the layers, built when the worker loads it. Elsewhere (or without triton) one pair
of torch products per adapter in the step, which is also the kernels' oracle. Never a loop over
requests, never a merged weight.
"""

from __future__ import annotations

import ctypes
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from workers.config import ModelConfig
from workers.rope import deinterleave_rows

PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in the order it runs them (csrc: LayerArgs, LoraStep)
PEFT_PREFIX = "base_model.model."  # PEFT's prefix on every tensor name
_TEXT_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")  # a multimodal base's text model
DEFAULT_MAX_LORA_RANK = 64


class LoraError(ValueError):
    """An adapter we cannot apply as it is: the message says why, and what to do."""


# the C kernel's panels (csrc/lora.c): A by 4 ranks x 16 inputs, Bt by 32 columns x the whole rank
A_PANEL_RANKS, A_PANEL_INPUTS, BT_PANEL_COLUMNS = 4, 16, 32


@dataclass(frozen=True, slots=True)
class LoraPart:
    """One targeted module of a product, y[:, start:start + len] += (x @ A.T) @ Bt in fp32, as the C
    kernel reads it: A and Bt (B transposed, times the scaling) cut into zero-padded panels, so that
    each is read front to back, one stream, however the kernel walks its rows and columns."""

    start: int  # the module's first output column in our product
    rank: int
    len: int  # its output columns
    a_panels: torch.Tensor  # [ceil(rank / 4), ceil(in / 16), 4, 16], fp32 or bf16 (load_adapter's kernel_dtype)
    bt_panels: torch.Tensor  # [ceil(len / 32), rank rounded up to 4, 32], as a_panels

    @classmethod
    def of(cls, start: int, a: torch.Tensor, bt: torch.Tensor, dtype: torch.dtype) -> LoraPart:
        """From A [rank, in] and Bt [rank, len]."""
        rank, inputs = a.shape
        length = bt.shape[1]
        ranks = -(-rank // A_PANEL_RANKS) * A_PANEL_RANKS
        a = torch.nn.functional.pad(a, (0, -inputs % A_PANEL_INPUTS, 0, ranks - rank))
        a_panels = a.reshape(ranks // A_PANEL_RANKS, A_PANEL_RANKS, -1, A_PANEL_INPUTS).transpose(1, 2)
        bt = torch.nn.functional.pad(bt, (0, -length % BT_PANEL_COLUMNS, 0, ranks - rank))
        bt_panels = bt.reshape(ranks, -1, BT_PANEL_COLUMNS).transpose(0, 1)
        return cls(start, rank, length, a_panels.to(dtype).contiguous(), bt_panels.to(dtype).contiguous())

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A [rank, in rounded up to 16] and Bt [rank, len] back from the panels."""
        blocks, chunks = self.a_panels.shape[:2]
        a = self.a_panels.transpose(1, 2).reshape(blocks * A_PANEL_RANKS, chunks * A_PANEL_INPUTS)
        bt = self.bt_panels.transpose(0, 1).reshape(self.bt_panels.shape[1], -1)
        return a[:self.rank], bt[:self.rank, :self.len]


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One of our products' LoRA: y += (x @ a.T) @ b.T."""

    a: torch.Tensor  # [sum of the parts' ranks, in]: the parts' A, stacked (the model's dtype and device)
    b: torch.Tensor  # [out, sum of ranks]: the parts' B on the block diagonal, times the scaling
    parts: tuple[LoraPart, ...] = ()  # the same, part by part (CPU)
    columns: tuple[tuple[int, int], ...] = ()  # per targeted part, in a's order: (first output column, columns)


@dataclass(frozen=True, slots=True)
class LoraStack:
    """One product's LoRA over every layer, as our Triton kernels read it (workers/kernels/triton_lora.py):
    part k of layer l is y[:, start:start + columns] += (x @ a[l, k].T) @ bt[l, k, :, :columns],
    with (start, columns) = spans[l, k]. A layer's parts are packed from k = 0 in output order; the
    slots past them (a layer without the product: all of them) have 0 columns and zero weights."""

    a: torch.Tensor  # [layers, parts, rank, in]: each part's A (the pair's dtype and device)
    bt: torch.Tensor  # [layers, parts, rank, width]: its B transposed, times the scaling, zero-padded to width
    spans: torch.Tensor  # int32 [layers, parts, 2]: (first output column, columns) of each part
    num_columns: int  # the product's output columns its parts reach (the largest start + columns)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.bt, self.spans))


@dataclass(slots=True)
class LoraAdapter:
    name: str  # the name requests select it by ("model": name)
    path: Path
    rank: int
    scaling: float  # lora_alpha / rank, or / sqrt(rank) with rsLoRA
    target_modules: tuple[str, ...]  # as its checkpoint names them: q_proj, v_proj, ...
    layers: list[dict[str, LoraPair]] = field(default_factory=list)  # per layer: product -> its pair
    _native_parts: ctypes.Array | None = None  # the C kernel's LoraPart array, built on first use
    _stacks: tuple[LoraStack | None, ...] | None = None  # per product in PRODUCTS order (Triton), built on first use

    @property
    def num_bytes(self) -> int:
        stacked = sum(stack.num_bytes for stack in self._stacks or () if stack is not None)
        return stacked + sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values()
                             for t in (pair.a, pair.b, *(x for part in pair.parts for x in (part.a_panels, part.bt_panels))))

    def stacks(self) -> tuple[LoraStack | None, ...]:
        """Per product (PRODUCTS' order): its LoraStack, or None where no layer has the product. Built
        once, on the pairs' device (the worker builds them at load on CUDA), freed with the adapter.
        The pairs stay beside them (torch's products: the fallback), so a CUDA adapter is held twice."""
        if self._stacks is None:
            self._stacks = tuple(self._stack(product) for product in PRODUCTS)
        return self._stacks

    def _stack(self, product: str) -> LoraStack | None:
        pairs = [layer.get(product) for layer in self.layers]
        present = [pair for pair in pairs if pair is not None]
        if not present:
            return None
        num_parts = max(len(pair.columns) for pair in present)
        width = max(columns for pair in present for _, columns in pair.columns)
        num_columns = max(start + columns for pair in present for start, columns in pair.columns)
        like = present[0].a
        a = torch.zeros(len(pairs), num_parts, self.rank, like.shape[1], dtype=like.dtype, device=like.device)
        bt = torch.zeros(len(pairs), num_parts, self.rank, width, dtype=like.dtype, device=like.device)
        spans = [[[0, 0]] * num_parts for _ in pairs]
        for index, pair in enumerate(pairs):
            for k, (start, columns) in enumerate(pair.columns if pair is not None else ()):
                ranks = slice(k * self.rank, (k + 1) * self.rank)
                a[index, k] = pair.a[ranks]
                bt[index, k, :, :columns] = pair.b[start:start + columns, ranks].T
                spans[index][k] = [start, columns]
        return LoraStack(a, bt, torch.tensor(spans, dtype=torch.int32, device=like.device), num_columns)

    def native_parts(self) -> ctypes.Array:
        """Its parts as csrc/lora.c reads them: [layers][products][LORA_MAX_PARTS] LoraParts (rank 0: none)."""
        if self._native_parts is None:
            from workers.kernels.native import DTYPE_CODES, LORA_MAX_PARTS, LORA_PRODUCTS, LoraPart as CPart

            parts = (CPart * (len(self.layers) * LORA_PRODUCTS * LORA_MAX_PARTS))()
            for index, layer in enumerate(self.layers):
                for p, product in enumerate(PRODUCTS):
                    pair = layer.get(product)
                    for k, part in enumerate(pair.parts if pair is not None else ()):
                        parts[(index * LORA_PRODUCTS + p) * LORA_MAX_PARTS + k] = CPart(
                            part.a_panels.data_ptr(), part.bt_panels.data_ptr(), part.rank, part.start, part.len,
                            DTYPE_CODES[part.a_panels.dtype])
            self._native_parts = parts
        return self._native_parts


def product_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Per product: its checkpoint modules (under model.layers.N.) and each one's output rows."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    if config.traits.fused_projections:
        qkv = (("self_attn.qkv_proj", q + 2 * kv),)
        gate_up = (("mlp.gate_up_proj", 2 * inter),)
    else:
        qkv = (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv))
        gate_up = (("mlp.gate_proj", inter), ("mlp.up_proj", inter))
    return {"qkv": qkv, "o": (("self_attn.o_proj", config.hidden_size),), "gate_up": gate_up,
            "down": (("mlp.down_proj", config.hidden_size),)}


def product_inputs(config: ModelConfig) -> dict[str, int]:
    return {"qkv": config.hidden_size, "o": config.num_heads * config.head_dim, "gate_up": config.hidden_size,
            "down": config.intermediate_size}


def read_adapter_config(path: Path, max_rank: int = DEFAULT_MAX_LORA_RANK) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, target modules) from adapter_config.json, or a LoraError."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"{path} is not a PEFT adapter directory: it has no adapter_config.json")
    raw = json.loads(config_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: PEFT type {raw.get('peft_type')!r} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
        "modules_to_save": "modules_to_save (whole trained modules)", "lora_bias": "trained LoRA biases",
        "alpha_pattern": "per-module alpha (alpha_pattern)", "rank_pattern": "per-module rank (rank_pattern)",
        "trainable_token_indices": "trained token embeddings", "layer_replication": "layer replication",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise LoraError(f"{path}: {what} are not supported ({key} = {raw[key]!r})")
    if raw.get("bias", "none") != "none":
        raise LoraError(f"{path}: trained biases are not supported (bias = {raw['bias']!r}; only 'none')")
    rank, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    if not 1 <= rank <= max_rank:
        raise LoraError(f"{path}: rank {rank} is above this server's max_lora_rank {max_rank}; raise max_lora_rank")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    targets = raw.get("target_modules") or ()
    return rank, scaling, tuple([targets] if isinstance(targets, str) else sorted(targets))


def load_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu", max_rank: int = DEFAULT_MAX_LORA_RANK,
                 kernel_dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter at path, checked against the base model's config and kept as our products' pairs
    (in dtype), and on CPU as our kernel's parts (in kernel_dtype: fp32 beside the exact fp32 model,
    bf16 beside bf16 or quantized weights, half the bytes each step reads)."""
    from safetensors.torch import load_file

    path = Path(path)
    if config.traits.mla is not None:  # its products are not qkv's and o's shapes (workers/mla.py)
        raise LoraError(f"{path}: LoRA adapters on a model with latent attention ({config.model_type}) are not "
                        "supported yet")
    if config.has_recurrent_layers:  # their products (a convolution's in_proj, ...) are not ours to adapt yet
        raise LoraError(f"{path}: LoRA adapters on a model with recurrent layers ({config.model_type}) are not "
                        "supported yet")
    rank, scaling, targets = read_adapter_config(path, max_rank)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (adapter_model.bin: save it again with safe_serialization=True)" if (
            path / "adapter_model.bin").is_file() else ""
        raise LoraError(f"{path} has no adapter_model.safetensors{hint}")
    tensors = {_module_key(key): tensor for key, tensor in load_file(weights_file).items()}
    parts, inputs = product_parts(config), product_inputs(config)
    residual = config.traits.residual_multiplier
    layers: list[dict[str, LoraPair]] = []
    for index in range(config.num_layers):
        layer: dict[str, LoraPair] = {}
        for product, modules in parts.items():
            found = [(module, rows, tensors.pop(f"model.layers.{index}.{module}.lora_A.weight", None),
                      _lora_b(tensors.pop(f"model.layers.{index}.{module}.lora_B.weight", None), module, config))
                     for module, rows in modules]
            if all(a is None and b is None for _, _, a, b in found):
                continue
            if product in ("gate_up", "down") and config.is_moe_layer(index):
                raise LoraError(f"{path}: layer {index}'s MLP is a mixture of experts here, and LoRA on experts is "
                                "not supported")
            multiplier = scaling * (residual if product in ("o", "down") else 1.0)
            layer[product] = _pair(path, index, found, inputs[product], multiplier, dtype, device, kernel_dtype)
        layers.append(layer)
    if tensors:
        leftover = sorted({key.rsplit(".lora_", 1)[0] for key in tensors})
        shown = ", ".join(leftover[:4]) + (" ..." if len(leftover) > 4 else "")
        raise LoraError(f"{path}: {len(leftover)} adapted modules are not ones we apply LoRA to ({shown}); we apply it "
                        f"to {', '.join(module for modules in parts.values() for module, _ in modules)} of each layer, "
                        "or the base has fewer layers than the adapter")
    if not any(layers):
        raise LoraError(f"{path}: the adapter holds no LoRA weights")
    return LoraAdapter(name, path, rank, scaling, targets, layers)


def _lora_b(b: torch.Tensor | None, module: str, config: ModelConfig) -> torch.Tensor | None:
    """A LoRA B as the base's product sees it: q_proj's and k_proj's rows reordered as the base's
    own where RoPE rotates interleaved pairs (ERNIE 4.5: workers/rope.py, deinterleave_rows)."""
    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}.get(module)
    if b is None or heads is None or not config.traits.rope_interleaved or b.shape[0] != heads * config.head_dim:
        return b
    return deinterleave_rows(b, heads, config)


def _module_key(key: str) -> str:
    """PEFT's tensor name as the base checkpoint's module name + .lora_A/B.weight."""
    key = key.removeprefix(PEFT_PREFIX)
    for prefix in _TEXT_MODEL_PREFIXES:
        if key.startswith(prefix):
            return "model." + key[len(prefix):]
    return key


def _pair(path: Path, index: int, found: list, in_features: int, multiplier: float, dtype: torch.dtype,
          device: str | torch.device, kernel_dtype: torch.dtype = torch.float32) -> LoraPair:
    """Our product's pair from its parts' (module, out rows, A or None, B or None)."""
    present = []  # (first output row, A, B times the multiplier) of each part the adapter targets
    start = 0
    for module, rows, a, b in found:
        if (a is None) != (b is None):
            raise LoraError(f"{path}: layer {index} {module} has lora_{'B' if a is None else 'A'} without its pair")
        if a is not None:
            if a.shape[1] != in_features or b.shape[0] != rows or a.shape[0] != b.shape[1]:
                raise LoraError(f"{path}: layer {index} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but "
                                f"the base model needs A [rank, {in_features}] and B [{rows}, rank]: an adapter of "
                                "another base")
            present.append((start, a.float(), b.float() * multiplier))
        start += rows
    b_diagonal = torch.zeros(start, sum(a.shape[0] for _, a, _ in present))  # start: the product's output rows
    column = 0
    for first, a, b in present:
        b_diagonal[first:first + b.shape[0], column:column + a.shape[0]] = b
        column += a.shape[0]
    parts = () if torch.device(device).type != "cpu" else tuple(
        LoraPart.of(first, a, b.T, kernel_dtype) for first, a, b in present)
    return LoraPair(torch.cat([a for _, a, _ in present]).to(device=device, dtype=dtype).contiguous(),
                    b_diagonal.to(device=device, dtype=dtype).contiguous(), parts,
                    tuple((first, b.shape[0]) for first, _, b in present))


@dataclass(slots=True)
class StepLora:
    """The adapters of one step and the rows each one's requests have: add(y, x, layer, product)
    adds each adapter's LoRA of that product over its rows."""

    segments: list[tuple[LoraAdapter, torch.Tensor | None]]  # (adapter, its rows; None: every row of the step)
    num_rows: int  # the step's rows
    use_kernel: bool = False  # CPU: our C kernel runs the products (csrc/lora.c), and the C layer loop may too
    triton: ModuleType | None = None  # CUDA: workers.kernels.triton_lora, whose kernels run the products
    _native: tuple | None = None  # (LoraStep, what it points into), built on first use
    _triton_table: object | None = None  # the Triton kernels' LoraStepTable of the step, built on first use

    @classmethod
    def of_rows(cls, row_adapters: list[tuple[LoraAdapter | None, int, int]], device: torch.device) -> StepLora | None:
        """From each scheduled request's (adapter or None, first row, end row); None when no row has one."""
        by_adapter: dict[str, tuple[LoraAdapter, list[int]]] = {}
        num_rows = 0
        for adapter, start, end in row_adapters:
            num_rows = max(num_rows, end)
            if adapter is not None:
                by_adapter.setdefault(adapter.name, (adapter, []))[1].extend(range(start, end))
        if not by_adapter:
            return None
        segments = []
        for adapter, rows in by_adapter.values():
            whole = len(rows) == num_rows  # the step's every row: no gather, no scatter
            segments.append((adapter, None if whole else torch.tensor(rows, dtype=torch.long, device=device)))
        triton = lora_triton_kernels(device)
        return cls(segments, num_rows, use_kernel=triton is None and device.type == "cpu" and lora_kernel_available(),
                   triton=triton)

    def adapts(self, layer: int, product: str) -> bool:
        return any(product in adapter.layers[layer] for adapter, _ in self.segments)

    def native(self) -> ctypes.Structure:
        """The step as csrc/lora.c reads it (a LoraStep), built once."""
        if self._native is None:
            from workers.kernels.native import LoraSegment, LoraStep

            rows = [torch.arange(self.num_rows) if rows is None else rows for _, rows in self.segments]
            segments = (LoraSegment * len(rows))(*(LoraSegment(adapter.native_parts(), r.data_ptr(), len(r))
                                                   for (adapter, _), r in zip(self.segments, rows)))
            step = LoraStep(segments, len(rows), len(self.segments[0][0].layers))
            self._native = (step, (segments, rows))
        return self._native[0]

    def triton_table(self) -> object:
        """The step as the Triton kernels read it (triton_lora.LoraStepTable), built once per step."""
        if self._triton_table is None:
            self._triton_table = self.triton.LoraStepTable.build(
                [(rows, adapter.stacks()) for adapter, rows in self.segments], self.num_rows)
        return self._triton_table

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, product: str) -> torch.Tensor:
        """y [rows, out] += each adapter's LoRA of x [rows, in] over its rows, in place; returns y."""
        if self.triton is not None and self.triton.takes(x, y):
            if self.adapts(layer, product):
                self.triton.lora_add(y, x, self.triton_table(), layer, PRODUCTS.index(product))
            return y
        if self.use_kernel and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() and y.is_contiguous():
            from workers.kernels.native import DTYPE_CODES, check_status, native_library

            status = native_library().rayllm_lora_add(ctypes.byref(self.native()), layer, PRODUCTS.index(product),
                                                      x.data_ptr(), y.data_ptr(), y.shape[1], x.shape[1],
                                                      DTYPE_CODES[x.dtype], torch.get_num_threads())
            check_status(status, "rayllm_lora_add")
            return y
        for adapter, rows in self.segments:
            pair = adapter.layers[layer].get(product)
            if pair is None:
                continue
            if rows is None:
                y.addmm_(x @ pair.a.T, pair.b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ pair.a.T) @ pair.b.T)
        return y


def lora_triton_kernels(device: torch.device) -> ModuleType | None:
    """workers.kernels.triton_lora where its kernels run a step's products (CUDA, triton installed), else None."""
    if device.type != "cuda":
        return None
    try:
        from workers.kernels import triton_lora
    except ImportError:  # no triton: torch's products
        return None
    return triton_lora


def lora_kernel_available() -> bool:
    """Whether our C kernels (csrc/lora.c among them) built here."""
    from workers.kernels.native import native_available

    return native_available()
