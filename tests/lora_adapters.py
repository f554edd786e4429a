"""Random LoRA adapters made by peft's own classes (LoraConfig + get_peft_model) on a tiny
base checkpoint, saved as PEFT saves them; shared by the worker and the served tests."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (target modules, rank, lora_alpha, rsLoRA): attention only, everything with rsLoRA, the MLP and o
ADAPTERS = {
    "qv": (("q_proj", "v_proj"), 8, 16, False),
    "all": (ALL_TARGETS, 16, 8, True),
    "mlp": (("o_proj", "gate_proj", "down_proj"), 4, 8, False),
}
FUSED_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}  # Phi-3's modules


def build_adapter(base_dir: Path, out_dir: Path, target_modules: tuple[str, ...], rank: int, alpha: float,
                  use_rslora: bool = False, seed: int = 0, std: float = 0.2, fused: bool = False) -> Path:
    """A LoRA adapter of base_dir with random A and B (B too, so the adapter changes the tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if fused:
        target_modules = tuple(sorted({FUSED_TARGETS.get(module, module) for module in target_modules}))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def build_adapters(base_dir: Path, root: Path, fused: bool = False) -> dict[str, Path]:
    """ADAPTERS of base_dir under root: name -> directory."""
    return {name: build_adapter(base_dir, root / name, targets, rank, alpha, rslora, seed=index, fused=fused)
            for index, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items())}


def write_adapter(base_dir: Path, out_dir: Path, target_modules: tuple[str, ...], rank: int, alpha: float,
                  use_rslora: bool = False, seed: int = 0, std: float = 0.2) -> Path:
    """build_adapter's random adapter without peft (for machines that lack it): the files PEFT's
    save_pretrained writes, tensors named and shaped as it names and shapes them."""
    import json

    from safetensors.torch import save_file

    from workers.config import ModelConfig
    from workers.lora import PEFT_PREFIX, product_inputs, product_parts

    config = ModelConfig.from_model_dir(base_dir)
    inputs = product_inputs(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(config.num_layers):
        for product, modules in product_parts(config).items():
            for module, rows in modules:
                if module.rsplit(".", 1)[1] in target_modules:
                    name = f"{PEFT_PREFIX}model.layers.{index}.{module}"
                    tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs[product], generator=generator) * std
                    tensors[f"{name}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * std
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=sorted(target_modules), use_rslora=use_rslora,
        bias="none", base_model_name_or_path=str(base_dir), task_type="CAUSAL_LM")))
    return out_dir


def write_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """ADAPTERS of base_dir under root without peft: name -> directory."""
    return {name: write_adapter(base_dir, root / name, targets, rank, alpha, rslora, seed=index)
            for index, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items())}
