"""Reference quantizers and checkpoint packers for the quantized-linear tests
(tests/workers/test_triton_quant.py in the interpreter, tests/gpu/test_gpu_quant.py on CUDA).

Each make_* quantizes a random [N, K] weight the way its format's own tools do (round to
nearest on a min/max grid per group, scales rounded to the stored dtype first, so that the
expected dense weight is exact), packs it into the checkpoint's tensors by the format's rules
(written here from the formats' descriptions, independently of workers/quant_formats.py) and
returns (tensors by checkpoint name, the expected dense [N, K] fp32 weight). `weight=` quantizes a
given weight (a checkpoint's) instead of a random one. write_checkpoints turns a tiny model
directory into a quantized checkpoint of one of CHECKPOINT_FORMATS and its dequantized twin.
"""

from __future__ import annotations

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its 8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, N] ints in [0, 16) -> int32 [R, N / 8]: nibble i of word c = values[:, 8c + order[i]]."""
    values = values.long()
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= values[:, column::8] << (4 * i)
    return to_int32(words)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] ints in [0, 16) -> int32 [K / 8, N]: nibble i of word (r, n) = values[8r + i, n]."""
    return pack_columns(values.t().contiguous()).t().contiguous()


def _weight(n: int, k: int, generator: torch.Generator, weight: torch.Tensor | None) -> torch.Tensor:
    """The [N, K] weight to quantize: the given one (a checkpoint's), else a random one."""
    if weight is None:
        return torch.randn(n, k, generator=generator) * 0.05
    assert tuple(weight.shape) == (n, k), (tuple(weight.shape), (n, k))
    return weight.float()


def _min_max_int4(weight: torch.Tensor, groups: torch.Tensor, num_groups: int, *, sym: bool, min_zero: int = 0):
    """Per (row, group) asymmetric (or symmetric, zero 8) 4-bit grid -> (q [N, K], zeros [N, G],
    scales fp16 [N, G])."""
    n = weight.shape[0]
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups, dtype=torch.int64)
    for g in range(num_groups):
        block = weight[:, groups == g]
        if sym:
            scales[:, g] = block.abs().amax(1) / 7.5
            zeros[:, g] = 8
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scales[:, g] = (hi - lo) / 15
            zeros[:, g] = (-lo / scales[:, g].half().float()).round().clamp(min_zero, 15).long()
    scales = scales.half()
    q = (weight / scales.float()[:, groups]).round() + zeros[:, groups]
    return q.clamp(0, 15).long(), zeros, scales


def make_awq(n: int, k: int, group_size: int, *, seed: int = 0, prefix: str = "layer",
             weight: torch.Tensor | None = None):
    generator = torch.Generator().manual_seed(seed)
    weight = _weight(n, k, generator, weight)
    groups = torch.arange(k) // group_size
    q, zeros, scales = _min_max_int4(weight, groups, k // group_size, sym=False)
    expected = (q - zeros[:, groups]).float() * scales.float()[:, groups]
    tensors = {f"{prefix}.qweight": pack_columns(q.t().contiguous(), AWQ_ORDER),
               f"{prefix}.qzeros": pack_columns(zeros.t().contiguous(), AWQ_ORDER),
               f"{prefix}.scales": scales.t().contiguous()}
    return tensors, expected


def make_gptq(n: int, k: int, group_size: int, *, v1: bool = True, sym: bool = False, act_order: bool = False,
              seed: int = 0, prefix: str = "layer", weight: torch.Tensor | None = None):
    """v1 ("gptq") stores zero - 1, so its zeros are kept in [1, 15] (a zero of 0 does not survive
    v1's packing in the original tools either); v2 stores zeros as they are."""
    generator = torch.Generator().manual_seed(seed)
    weight = _weight(n, k, generator, weight)
    if act_order:
        groups = torch.argsort(torch.randperm(k, generator=generator)) // group_size
    else:
        groups = torch.arange(k) // group_size
    q, zeros, scales = _min_max_int4(weight, groups, k // group_size, sym=sym, min_zero=1 if v1 else 0)
    expected = (q - zeros[:, groups]).float() * scales.float()[:, groups]
    stored_zeros = zeros - 1 if v1 else zeros
    tensors = {f"{prefix}.qweight": pack_rows(q.t().contiguous()),
               f"{prefix}.qzeros": pack_columns(stored_zeros.t().contiguous()),
               f"{prefix}.scales": scales.t().contiguous(),
               f"{prefix}.g_idx": groups.to(torch.int32)}
    return tensors, expected


def make_mxfp4(n: int, k: int, *, seed: int = 0, prefix: str = "layer", experts: int | None = None):
    """Per 32 inputs: the scale 2 ** e with e = ceil(log2(amax / 6)), values rounded to the nearest e2m1."""
    generator = torch.Generator().manual_seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    weight = torch.randn(*shape, generator=generator)
    groups = weight.view(*shape[:-1], k // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled[..., None] - E2M1).abs().argmin(-1)  # nearest e2m1 value (a tie goes to the lower index)
    expected = (E2M1[index] * torch.exp2(exponent)[..., None]).view(shape)
    blocks = (index[..., 0::2] | (index[..., 1::2] << 4)).to(torch.uint8)  # [.., G, 16], low nibble first
    scales = (exponent + 127).to(torch.uint8)
    return {f"{prefix}_blocks": blocks, f"{prefix}_scales": scales}, expected


def make_fp8(n: int, k: int, *, per_channel: bool = True, seed: int = 0, prefix: str = "layer",
             input_scale: float | None = None, weight: torch.Tensor | None = None):
    generator = torch.Generator().manual_seed(seed)
    weight = _weight(n, k, generator, weight)
    amax = weight.abs().amax(1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
    scale = amax / 448.0
    q = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = q.float() * scale
    tensors = {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.float()}
    if input_scale is not None:
        tensors[f"{prefix}.input_scale"] = torch.tensor([input_scale])
    return tensors, expected


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
FBGEMM_CONFIG = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}


def compressed_tensors_config(strategy: str = "channel", activations: str | None = "dynamic") -> dict:
    inputs = {"dynamic": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
              "static": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
              None: None}[activations]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": inputs,
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "dynamic": False, "symmetric": True}}}}


# ----------------------------------------------------------------------------- tiny quantized checkpoints

CHECKPOINT_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
CHECKPOINT_GROUP = 32

# format -> (quantization_config, (weight, prefix) -> (checkpoint tensors, dequantized weight), /v1/models label)
CHECKPOINT_FORMATS = {
    "awq": (AWQ_CONFIG, lambda w, p: make_awq(*w.shape, CHECKPOINT_GROUP, prefix=p, weight=w), "awq:4bit-g32"),
    "gptq": (GPTQ_CONFIG, lambda w, p: make_gptq(*w.shape, CHECKPOINT_GROUP, prefix=p, weight=w), "gptq:4bit-g32"),
    "gptq-v2-act-order": (
        {**GPTQ_CONFIG, "desc_act": True, "checkpoint_format": "gptq_v2"},
        lambda w, p: make_gptq(*w.shape, CHECKPOINT_GROUP, v1=False, act_order=True, prefix=p, weight=w),
        "gptq:4bit-g32-act-order"),
    "compressed-tensors-fp8": (compressed_tensors_config("channel", "dynamic"),
                               lambda w, p: make_fp8(*w.shape, prefix=p, weight=w),
                               "compressed-tensors:fp8-channel"),
    "compressed-tensors-fp8-static": (
        compressed_tensors_config("tensor", "static"),
        lambda w, p: make_fp8(*w.shape, per_channel=False, input_scale=0.02, prefix=p, weight=w),
        "compressed-tensors:fp8-tensor"),
    "fbgemm_fp8": (FBGEMM_CONFIG, lambda w, p: make_fp8(*w.shape, prefix=p, weight=w), "fbgemm_fp8:fp8-channel"),
}


def write_checkpoints(plain_dir, root, config: dict, quantize) -> tuple:
    """(quantized dir, dense dir with the reference's dequantized weights, name -> dequantized weight)."""
    quantized_dir, dense_dir = root / "quantized", root / "dense"
    shutil.copytree(plain_dir, quantized_dir)
    shutil.copytree(plain_dir, dense_dir)
    tensors = load_file(plain_dir / "model.safetensors")
    quantized, dense, expected = dict(tensors), dict(tensors), {}
    for name in sorted(tensors):
        if CHECKPOINT_LINEAR.fullmatch(name):
            packed, dequantized = quantize(tensors[name], name.removesuffix(".weight"))
            del quantized[name]
            quantized.update(packed)
            dense[name] = expected[name] = dequantized
            assert not torch.equal(dequantized, tensors[name])  # the quantization changed the weight
    save_file(quantized, quantized_dir / "model.safetensors")
    save_file(dense, dense_dir / "model.safetensors")
    raw = json.loads((quantized_dir / "config.json").read_text())
    raw["quantization_config"] = config
    (quantized_dir / "config.json").write_text(json.dumps(raw))
    return quantized_dir, dense_dir, expected


# the formats whose whole model the CUDA path runs on packed weights with transformers' greedy
# tokens (on the dequantized weights): the 4-bit ones and weights-only fp8
KERNEL_CHECKPOINT_FORMATS = {
    "awq": CHECKPOINT_FORMATS["awq"],
    "gptq-v2-act-order": CHECKPOINT_FORMATS["gptq-v2-act-order"],
    "compressed-tensors-fp8-weights-only": (compressed_tensors_config("channel", None),
                                            CHECKPOINT_FORMATS["compressed-tensors-fp8"][1], "compressed-tensors:fp8-channel"),
    # act-order with another input order in every projection: q, k and v (gate and up) cannot share
    # one g_idx, so the model dequantizes those fused products and keeps o and down packed
    "gptq-act-order-per-projection": (
        {**GPTQ_CONFIG, "desc_act": True},
        lambda w, p: make_gptq(*w.shape, CHECKPOINT_GROUP, act_order=True, seed=sum(map(ord, p)), prefix=p, weight=w),
        "gptq:4bit-g32-act-order"),
}


def use_packed_model_on_cpu(runner, model_dir, quant_linear) -> None:
    """Gives a CPU runner of a quantized checkpoint the model a CUDA worker builds (linears kept
    packed, fused products stacked in their format, workers/quant_checkpoint.pack_checkpoint), on
    CPU tensors, its quantized products by quant_linear (the interpreter's kernels or a torch
    reference), the rest in torch."""
    from workers.config import ModelConfig
    from workers.kernels import get_attention_backend
    from workers.layer_ops import TorchOps
    from workers.linear import TorchLinear
    from workers.loader import read_safetensors
    from workers.model import PagedLlamaModel
    from workers.quant_checkpoint import pack_checkpoint

    class QuantLinear(TorchLinear):
        """TorchLinear with every kernel-ready weight's product by quant_linear, not by the weight's own."""

        def linear(self, x, weight, bias=None):
            if isinstance(weight, torch.Tensor):
                return super().linear(x, weight, bias)
            out = quant_linear(x, weight)
            return out if bias is None else out + bias

        def logits(self, x, weight):
            return self.linear(x, weight).float()

    model_config = ModelConfig.from_model_dir(model_dir)
    tensors = pack_checkpoint(model_config.quant_spec, read_safetensors(model_dir, None), torch.float32, "cpu")
    runner.model = PagedLlamaModel.from_hf_weights(
        model_config, tensors, "cpu", get_attention_backend("torch"), runner.max_model_len,
        linear=QuantLinear(), ops=TorchOps())
