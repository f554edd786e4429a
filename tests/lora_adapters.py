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
