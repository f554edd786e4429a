"""ModelConfig: the few numbers of a Hugging Face config.json that our paged model needs.

Parsed once from a local model directory (config.json, plus generation_config.json for
EOS ids when present). The shape numbers are common to every family; what a family changes
in the layer comes from its entry in workers/families.py (llama, mistral, qwen2, qwen3,
smollm3, granite; mixtral and qwen3_moe with mixture-of-experts MLPs).

RoPE: both spellings are read, the older `rope_theta` + `rope_scaling` keys and the
transformers-5 `rope_parameters` dict. Supported scaling types: default (none), "linear",
"llama3", and "dynamic" (NTK), which equals the default inside the original context
length, so for "dynamic" the usable context is capped at max_position_embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.families import FAMILIES, FamilyError, MoeTraits

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class ModelConfigError(ValueError):
    """A config.json we cannot serve, with the path and the reason."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # position (linear) or wavelength (llama3) scale factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 / dynamic: pretraining context


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # a key of workers.families.FAMILIES
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # model width
    intermediate_size: int  # dense MLP width (an expert's width is moe.intermediate_size)
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # per-head width
    rms_norm_eps: float
    rope_theta: float  # RoPE base
    rope_scaling: RopeScaling  # rope_type "default" when the config has none
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q, k and v projections carry a bias
    o_bias: bool  # the output projection carries a bias
    mlp_bias: bool  # gate, up and down projections carry a bias
    max_position_embeddings: int  # context length the model was trained for
    sliding_window: int | None  # attention window in tokens, None when attention is full
    eos_token_ids: tuple[int, ...]  # every id that ends generation, config + generation_config
    bos_token_id: int | None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    rope_layers: tuple[bool, ...] | None = None  # per layer: applies RoPE; None: every layer (SmolLM3)
    embedding_multiplier: float = 1.0  # Granite's multipliers (workers/families.py); 1: none
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_scale: float = 1.0
    moe: MoeTraits | None = None  # the mixture-of-experts MLP and its layers (workers/moe.py); None: dense only

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    @property
    def max_model_len(self) -> int:
        """Longest sequence our attention computes exactly (see the module docstring)."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
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
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        quantization = raw.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
            raise ModelConfigError(f"quantized checkpoints ({method!r}) are not supported yet; serve the unquantized "
                                   "weights (docs/models.md)")
        missing = [
            key
            for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads")
            if key not in raw
        ]
        if missing:
            raise ModelConfigError(f"missing keys {missing}")
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelConfigError(f"{num_heads} heads are not a multiple of {num_kv_heads} kv heads")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        rope_theta, rope_scaling = _parse_rope(raw)
        try:
            traits = FAMILIES[model_type](raw)
        except FamilyError as error:
            raise ModelConfigError(str(error)) from None
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias,
            o_bias=traits.o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            sliding_window=traits.sliding_window,
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            qk_norm=traits.qk_norm,
            rope_layers=traits.rope_layers,
            embedding_multiplier=traits.embedding_multiplier,
            residual_multiplier=traits.residual_multiplier,
            attention_scale=traits.attention_scale,
            logits_scale=traits.logits_scale,
            moe=traits.moe,
        )


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ModelConfigError(f"{path} does not exist; expected {what}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelConfigError(f"{path} is not readable JSON ({what}): {error}") from None


def _parse_rope(raw: dict) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes rope_parameters = {"rope_theta": ..., "rope_type": ..., ...};
    # older configs write rope_theta and rope_scaling (which uses "type" or "rope_type").
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope scaling {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    original = params.get("original_max_position_embeddings")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
    )
    if rope_type == "llama3" and scaling.original_max_position_embeddings is None:
        raise ModelConfigError("llama3 rope scaling needs original_max_position_embeddings")
    return theta, scaling


def _eos_token_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        values = source if isinstance(source, list) else [source]
        for value in values:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)
