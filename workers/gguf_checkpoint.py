"""Reading a GGUF checkpoint's tensors under Hugging Face names, projections kept quantized.

    checkpoint = read_gguf_checkpoint(path, torch.float32)
    checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]   # GgufWeight (Q4_1 blocks, rows as HF's)
    checkpoint.tensors["model.layers.0.input_layernorm.weight"]    # fp32 tensor [576]
    checkpoint.quantization                                         # "gguf:Q4_1" (the file's general.file_type)

What each tensor becomes:

- projection weights (q, k, v, o, gate, up, down, lm_head) in a quantized type we serve
  (QUANTIZED_TYPES: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) stay as the file's blocks, a GgufWeight;
- the token embedding too: the model dequantizes only the rows of a step's tokens, and a tied
  lm_head is the same GgufWeight (no dequantized table is ever held);
- everything else (norms, biases), and F32 / F16 / BF16 projections, become plain tensors in
  the model's dtype.

Any other type (Q5_0, Q2_K, IQ4_XS, ...) fails at once, naming the tensor and its type.

llama.cpp's converter reorders the rows of q and k within each head (its RoPE rotates
adjacent pairs, Hugging Face's the two halves). Each head of `dim` rows is stored as
[dim / 2, 2] pairs; the rows are put back as [2, dim / 2], as transformers does for its
own GGUF loading (modeling_gguf_pytorch_utils.LlamaTensorProcessor). A permutation of whole
rows moves whole rows of blocks, so it is exact on the quantized weight (GgufWeight.rows).

Only the llama architecture is read for now (Llama, SmolLM2, Mistral and others written as
"llama"); other architectures fail at once, naming theirs.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.gguf_weight import QUANTIZED_TYPES, GgufWeight, GGMLType

SUPPORTED_ARCHITECTURES = ("llama",)
PLAIN_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # read into the model's dtype
SUPPORTED_TYPES = (*PLAIN_TYPES, *QUANTIZED_TYPES)

# GGUF names -> Hugging Face names (llama); "{n}" is the layer index
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# tensors some converters write that our model derives from the config instead (Llama 3's
# rope_freqs is llama3 RoPE scaling, which workers/rope.py computes)
_SKIPPED = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


class GgufCheckpointError(ValueError):
    """A GGUF file we cannot serve natively; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class GgufCheckpoint:
    path: Path
    architecture: str  # general.architecture, e.g. "llama"
    quantization: str  # "gguf:<file type>", e.g. "gguf:Q4_1" or "gguf:Q4_K_M"
    tensors: dict[str, torch.Tensor | GgufWeight]  # Hugging Face name -> tensor


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor; None for one we skip; KeyError if unknown."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(gguf_name)
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _keeps_blocks(name: str) -> bool:
    """Whether a quantized tensor of this (HF) name stays quantized: the projections and the embedding."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over path (memory-mapped), or GgufCheckpointError if it is not a GGUF file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(Path(path))
    except (OSError, ValueError) as error:
        raise GgufCheckpointError(f"cannot read {path} as a GGUF file: {error}") from None


def check_architecture(reader, path: str | Path) -> str:
    architecture = _field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GgufCheckpointError(f"{path}: GGUF architecture {architecture!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def gguf_architecture(path: str | Path) -> str:
    """The file's architecture, checked (GgufCheckpointError names any we do not serve)."""
    return check_architecture(open_gguf(path), path)


def quantization_label(reader) -> str:
    """"gguf:" + llama.cpp's name of the file's type (general.file_type: MOSTLY_Q4_1 -> Q4_1), else
    the type most of its tensors have."""
    from gguf import LlamaFileType

    file_type = _field(reader, "general.file_type")
    try:
        name = LlamaFileType(int(file_type)).name
        return "gguf:" + name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        counts = Counter(tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) > 1)
        return "gguf:" + (counts.most_common(1)[0][0] if counts else "F32")


def read_gguf_checkpoint(path: str | Path, dtype: torch.dtype) -> GgufCheckpoint:
    """Every tensor of a llama GGUF file under its Hugging Face name (see the module docstring)."""
    reader = open_gguf(path)
    architecture = check_architecture(reader, path)
    num_heads = int(_field(reader, f"{architecture}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{architecture}.attention.head_count_kv", num_heads))
    tensors: dict[str, torch.Tensor | GgufWeight] = {}
    for tensor in reader.tensors:
        try:
            name = hf_name(tensor.name)
        except KeyError:
            raise GgufCheckpointError(f"{path}: tensor {tensor.name} has no place in a {architecture} model "
                                      "(mixture-of-experts and other layouts are not read yet)") from None
        if name is None:
            continue
        value = _read_tensor(tensor, name, dtype, path)
        if ".q_proj." in name:
            value = unpermute_rope_rows(value, num_heads)
        elif ".k_proj." in name:
            value = unpermute_rope_rows(value, num_kv_heads)
        tensors[name] = value
    return GgufCheckpoint(Path(path), architecture, quantization_label(reader), tensors)


def _read_tensor(tensor, name: str, dtype: torch.dtype, path: str | Path) -> torch.Tensor | GgufWeight:
    from gguf import GGMLQuantizationType, quants

    code = int(tensor.tensor_type)
    if code not in {int(t) for t in SUPPORTED_TYPES}:
        raise GgufCheckpointError(
            f"{path}: tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, which is not supported; "
            f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    ggml_type = GGMLType(code)
    if ggml_type in QUANTIZED_TYPES and _keeps_blocks(name):
        if len(shape) != 2:
            raise GgufCheckpointError(f"{path}: tensor {tensor.name} has shape {shape}; a quantized projection "
                                      "must be a matrix")
        # a copy (np.array): the blocks outlive the file's mapping
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(shape[0], -1)
        return GgufWeight(ggml_type, shape[0], shape[1], blocks)
    values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType(code))
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape).to(dtype)


def rope_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """[num_rows] int64: the file's row of each Hugging Face row of q or k (heads of dim rows,
    the file's [dim / 2, 2] order read back as [2, dim / 2])."""
    if num_rows % (2 * num_heads):
        raise GgufCheckpointError(f"{num_rows} rows of q or k do not split into {num_heads} heads of even width")
    return torch.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def unpermute_rope_rows(value: torch.Tensor | GgufWeight, num_heads: int) -> torch.Tensor | GgufWeight:
    """q's or k's rows (weight or bias) in Hugging Face's order."""
    order = rope_row_order(value.shape[0], num_heads)
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    return value.rows(order)
