"""ModelConfig: the few numbers of a Hugging Face config.json that our paged model needs.

Parsed once from a local model directory (config.json, plus generation_config.json for
EOS ids when present). The shape numbers are common to every family; what a family changes
in the layer comes from its entry in workers/families.py (mixtral, qwen3_moe, glm4_moe, gpt_oss and
others with mixture-of-experts MLPs, workers/moe.py).

Quantized checkpoints: config.json's `quantization_config` is parsed by workers/quant_formats.py
into a QuantSpec (fp8 from compressed-tensors or fbgemm_fp8, 4-bit awq and gptq; gpt-oss's MXFP4
experts, quant_method "mxfp4", for gpt_oss only). Anything else fails here, in one line that
names it and lists what is supported. The loader dequantizes the weights at load
(workers/quant_checkpoint.py, workers/mxfp4.py).

RoPE: both spellings are read, the older `rope_theta` + `rope_scaling` keys and the
transformers-5 `rope_parameters` dict. Supported scaling types: default (none), "linear",
"llama3", "dynamic" (NTK), which equals the default inside the original context
length, so for "dynamic" the usable context is capped at max_position_embeddings (with an
`alpha`, Hunyuan's, the base is fixed: theta * alpha ** (head_dim / (head_dim - 2)), no cap),
"longrope" (Phi-3): short_factor for positions inside original_max_position_embeddings,
long_factor past it, and "yarn" (gpt-oss): frequencies blended between the original and the
interpolated ones by beta_fast / beta_slow, cos and sin scaled by an attention factor
(workers/rope.py). `partial_rotary_factor` (top level or inside the
rope dict; or `rotary_dim` / head_dim; else the family's default) rotates only the first part of
each head.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.families import (
    EXPERTS_ONLY_FAMILIES,
    FAMILIES,
    MULTIMODAL_TEXT_MODELS,
    MXFP4_FAMILIES,
    PARTIAL_ROTARY_DEFAULTS,
    SUPPORTED_MODEL_TYPES,
    FamilyError,
    FamilyPaths,
    FamilyTraits,
    family_paths,
    rope_type_of,
)

if TYPE_CHECKING:
    from workers.quant_formats import QuantSpec

# config.json's activation names -> ours (gated MLPs: act(gate) * up)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn", "proportional")


class ModelConfigError(ValueError):
    """A config.json we cannot serve, with the path and the reason."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # position (linear, yarn) or wavelength (llama3) scale factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 / dynamic / longrope / yarn: pretraining context
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors inside the original context
    long_factor: tuple[float, ...] = ()  # longrope: the same past it
    attention_factor: float = 1.0  # longrope, yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: rotations per original context above which a frequency is kept as is
    beta_slow: float = 1.0  # yarn: rotations below which a frequency is fully interpolated (divided by factor)
    truncate: bool = True  # yarn: the correction range rounded outward to whole dimensions
    # proportional (Gemma 4's full-attention layers): the whole head rotates in halves, but only the first
    # int(proportion * head_dim) // 2 frequencies (theta ** (-2i / head_dim), / factor) are nonzero
    proportion: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # a key of workers.families.FAMILIES
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # model width
    intermediate_size: int  # dense MLP width (Llama 4's intermediate_size_mlp); an expert's is moe.intermediate_size
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # per-head width (MLA: the RoPE part's, qk_rope_head_dim; traits.mla has the others)
    rms_norm_eps: float
    rope_theta: float  # RoPE base
    rope_scaling: RopeScaling  # rope_type "default" when the config has none
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    mlp_bias: bool  # gate, up and down projections carry a bias
    max_position_embeddings: int  # context length the model was trained for
    eos_token_ids: tuple[int, ...]  # every id that ends generation, config + generation_config
    bos_token_id: int | None
    traits: FamilyTraits  # what the family differs by (biases, norms, windows, caps, multipliers, experts): once,
    #                       in workers/families.py
    partial_rotary_factor: float = 1.0  # the rotated share of each head (Phi-3)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (Gemma)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base (Gemma 3)
    text_model_of: str | None = None  # the multimodal model_type whose text model this is (gemma3); None: text only
    # the checkpoint's quant method: "fp8", "awq", "gptq", or "mxfp4" (gpt-oss's experts); None: none
    quantization: str | None = None
    quant_spec: QuantSpec | None = None  # its quantization_config, parsed (workers/quant_formats.py)

    @property
    def paths(self) -> FamilyPaths:
        """Which of our paths this model can take (C layer loop, native GGUF, packed quantized on CUDA)."""
        return family_paths(self.model_type, self.traits)

    def kv_elements_per_token(self, layer: int) -> int:
        """Values one token keeps in layer's pool: per-head keys and values, or MLA's latent and RoPE key."""
        if not self.has_attention(layer):
            return 0  # its state is per sequence (workers/recurrent.py)
        if self.kv_source(layer) is not None:
            return 0  # it reads another layer's pool
        if self.traits.mla is not None:
            return self.traits.mla.cache_width
        return 2 * self.layer_num_kv_heads(layer) * self.layer_head_dim(layer)

    def layer_head_dim(self, layer: int) -> int:
        """The layer's q/k/v head width (Gemma 4's full-attention layers have their own)."""
        dims = self.traits.layer_head_dims
        return self.head_dim if dims is None else dims[layer]

    @property
    def max_head_dim(self) -> int:
        """The widest head of any layer: what the attention backend must take."""
        dims = self.traits.layer_head_dims
        return self.head_dim if dims is None else max(dims)

    def layer_num_kv_heads(self, layer: int) -> int:
        heads = self.traits.layer_kv_heads
        return self.num_kv_heads if heads is None else heads[layer]

    def kv_source(self, layer: int) -> int | None:
        """The earlier layer whose K/V pool this layer reads and never writes (Gemma 4); None: its own."""
        sources = self.traits.kv_sources
        return None if sources is None else sources[layer]

    def layer_intermediate_size(self, layer: int) -> int:
        """The layer's dense MLP width (Gemma 4's double-wide MLPs on the layers sharing K/V)."""
        sizes = self.traits.layer_intermediate_sizes
        return self.intermediate_size if sizes is None else sizes[layer]

    def is_recurrent_layer(self, layer: int) -> bool:
        """The layer keeps a fixed-size state per sequence (a mixer: workers/recurrent.py), not keys and values."""
        return self.traits.mixers is not None and self.traits.mixers[layer] is not None

    def has_attention(self, layer: int) -> bool:
        """The layer attends over keys and values in the paged pool: every layer but a mixer in attention's
        place (a mixer beside attention, Falcon-H1's, keeps both)."""
        return not self.is_recurrent_layer(layer) or self.traits.mixers_beside_attention

    @property
    def has_recurrent_layers(self) -> bool:
        return self.traits.mixers is not None and any(kind is not None for kind in self.traits.mixers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.traits.moe is not None and self.traits.moe.layers[layer]

    @property
    def rotary_dim(self) -> int:
        """How many of a head's values RoPE rotates (the first ones); head_dim unless partial."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        windows = self.traits.layer_windows
        return None if windows is None else windows[layer]

    def layer_chunk(self, layer: int) -> int | None:
        chunks = self.traits.layer_chunks
        return None if chunks is None else chunks[layer]

    def uses_local_rope(self, layer: int) -> bool:
        return self.traits.local_rope_layers is not None and self.traits.local_rope_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        return self.traits.rope_layers is None or self.traits.rope_layers[layer]

    @property
    def max_model_len(self) -> int:
        """Longest sequence our attention computes exactly (see the module docstring)."""
        limit = self.max_position_embeddings
        if self.traits.sliding_window is not None:
            limit = min(limit, self.traits.sliding_window)
        return limit

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        raw = _read_json(config_path, "a Hugging Face config.json")
        generation_path = model_dir / "generation_config.json"
        generation = (
            _read_json(generation_path, "generation_config.json")
            if generation_path.is_file()
            else {}
        )
        try:
            return cls.from_dict(raw, generation)
        except ModelConfigError as error:
            raise ModelConfigError(f"{config_path}: {error}") from None

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        if raw.get("model_type") in MULTIMODAL_TEXT_MODELS:  # serve the text model inside
            text = dict(raw.get("text_config") or {})
            if text.get("model_type", MULTIMODAL_TEXT_MODELS[raw["model_type"]]) != MULTIMODAL_TEXT_MODELS[raw["model_type"]]:
                raise ModelConfigError(f"{raw['model_type']}'s text_config has model_type {text['model_type']!r}")
            text["model_type"] = MULTIMODAL_TEXT_MODELS[raw["model_type"]]
            for key in ("eos_token_id", "bos_token_id", "quantization_config"):
                if key in raw:
                    text.setdefault(key, raw[key])
            if "tie_word_embeddings" in raw:  # the outer model's (it owns lm_head)
                text["tie_word_embeddings"] = raw["tie_word_embeddings"]
            return dataclasses.replace(cls.from_dict(text, generation), text_model_of=raw["model_type"])
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        quant_spec = _quantization(raw)
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    *(() if model_type in EXPERTS_ONLY_FAMILIES else ("intermediate_size",)))
        missing = [key for key in required if key not in raw]
        if missing:
            raise ModelConfigError(f"missing keys {missing}")
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelConfigError(f"{num_heads} heads are not a multiple of {num_kv_heads} kv heads")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise ModelConfigError(f"the MLP activation {activation!r} is not supported; expected one of "
                                   f"{sorted(ACTIVATIONS)}")
        rope_theta, rope_scaling, partial_rotary_factor, local_rope_theta = _parse_rope(raw)
        try:
            traits = FAMILIES[model_type](raw)
        except FamilyError as error:
            raise ModelConfigError(str(error)) from None
        if traits.mla is not None and partial_rotary_factor != 1.0:
            raise ModelConfigError("partial_rotary_factor with multi-head latent attention is not supported")
        caps = {name: float(getattr(traits, name)) for name in ("attention_softcap", "logits_softcap")
                if getattr(traits, name) is not None}
        traits = dataclasses.replace(traits, **caps)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=traits.dense_intermediate_size or int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            # MLA (DeepSeek V3): the RoPE width, qk_rope_head_dim (the heads' other widths: traits.mla)
            head_dim=traits.mla.qk_rope_head_dim if traits.mla else _head_dim(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", False))),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", raw.get("model_max_length", 2048))),
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            traits=traits,
            partial_rotary_factor=partial_rotary_factor,
            activation=ACTIVATIONS[activation],
            local_rope_theta=local_rope_theta if traits.local_rope_layers is not None else None,
            quantization=None if quant_spec is None else quant_spec.method,
            quant_spec=quant_spec,
        )


def _quantization(raw: dict) -> QuantSpec | None:
    """config.json's quantization_config, parsed; a format we cannot serve fails in one line."""
    from workers.quant_formats import QuantConfigError, parse_quantization  # torch: imported on use

    try:
        spec = parse_quantization(raw.get("quantization_config"))
    except QuantConfigError as error:
        raise ModelConfigError(str(error)) from None
    if spec is not None and spec.method == "mxfp4" and raw["model_type"] not in MXFP4_FAMILIES:
        raise ModelConfigError(f"quantization 'mxfp4' is served for gpt_oss's experts only, not for "
                               f"model_type {raw['model_type']!r}")
    return spec


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ModelConfigError(f"{path} does not exist; expected {what}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelConfigError(f"{path} is not readable JSON ({what}): {error}") from None


def _parse_rope(raw: dict) -> tuple[float, RopeScaling, float, float]:
    """(theta, scaling, partial_rotary_factor, local theta) from either spelling of a config's
    RoPE keys; the local theta is the sliding-window layers' base where a family has one (Gemma 3:
    rope_parameters["sliding_attention"], or rope_local_base_freq), else theta."""
    # transformers >= 5 writes rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}, or one
    # such dict per layer type; older configs write rope_theta and rope_scaling (which uses "type"
    # or "rope_type").
    params = dict(raw.get("rope_parameters") or {})
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelConfigError(f"rope scaling {local['rope_type']!r} on sliding-window layers is not supported")
        params = dict(params.get("full_attention") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is None and raw.get("rotary_dim"):  # MiniMax-M2: the rotated width itself
        partial = int(raw["rotary_dim"]) / _head_dim(raw)
    partial = float(PARTIAL_ROTARY_DEFAULTS.get(raw.get("model_type"), 1.0) if partial is None else partial)
    if not 0.0 < partial <= 1.0:
        raise ModelConfigError(f"partial_rotary_factor {partial} is not in (0, 1]")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = rope_type_of(raw.get("model_type"), rope_type)
    if rope_type == "dynamic" and params.get("alpha"):  # Hunyuan's NTK alpha: a fixed base, whatever the length
        head_dim = _head_dim(raw)
        theta, rope_type = theta * float(params["alpha"]) ** (head_dim / (head_dim - 2)), "default"
    proportion = 1.0
    if rope_type == "proportional":  # the whole head rotates; the fraction only zeroes frequencies
        proportion, partial = partial, 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope scaling {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings")
                          if rope_type == "longrope" else None)
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        proportion=proportion,
    )
    if rope_type == "llama3" and scaling.original_max_position_embeddings is None:
        raise ModelConfigError("llama3 rope scaling needs original_max_position_embeddings")
    if rope_type == "longrope":
        scaling = _longrope(raw, params, scaling)
    if rope_type == "yarn":
        scaling = _yarn(raw, params, scaling)
    local_theta = float((local or {}).get("rope_theta", raw.get("rope_local_base_freq", theta)))
    return theta, scaling, partial, local_theta


def _head_dim(raw: dict) -> int:
    return int(raw.get("head_dim") or int(raw.get("hidden_size", 0)) // int(raw.get("num_attention_heads") or 1))


def _longrope(raw: dict, params: dict, scaling: RopeScaling) -> RopeScaling:
    """longrope's factors, and its attention factor as transformers derives it when absent."""
    original = scaling.original_max_position_embeddings
    if original is None or "short_factor" not in params or "long_factor" not in params:
        raise ModelConfigError("longrope scaling needs short_factor, long_factor and original_max_position_embeddings")
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dataclasses.replace(scaling, factor=float(factor), short_factor=tuple(map(float, params["short_factor"])),
                               long_factor=tuple(map(float, params["long_factor"])),
                               attention_factor=float(attention_factor))


def _yarn(raw: dict, params: dict, scaling: RopeScaling) -> RopeScaling:
    """yarn's numbers with transformers' defaults (_compute_yarn_parameters): the original context
    from the top level, else the rope dict, else max_position_embeddings; factor, when absent, the
    ratio of the two; the attention factor, when absent, from factor (and mscale / mscale_all_dim)."""
    max_positions = int(raw.get("max_position_embeddings", 2048))
    original = int(raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_positions)
    factor = float(params.get("factor") or max_positions / original)

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim) if mscale and mscale_all_dim
                            else mscale_of(factor))
    return dataclasses.replace(scaling, factor=factor, original_max_position_embeddings=original,
                               attention_factor=float(attention_factor),
                               beta_fast=float(params.get("beta_fast") or 32.0),
                               beta_slow=float(params.get("beta_slow") or 1.0),
                               truncate=bool(params.get("truncate", True)))


def _eos_token_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        values = source if isinstance(source, list) else [source]
        for value in values:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)
