"""What the ingress knows about the served model: its name and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_app.errors import OpenAIError


@dataclass(frozen=True, slots=True)
class ModelCard:
    served_name: str  # the id clients put in "model" (also listed by /v1/models)
    root: str  # the local directory the weights and tokenizer come from
    max_model_len: int  # tokens, prompt + output
    vocab_size: int  # token ids must be in [0, vocab_size)
    eos_token_ids: tuple[int, ...] = ()  # ids that end a sequence unless ignore_eos
    created: int = 0  # unix seconds, for /v1/models
    # worker device, dtype, kernels, model type, layer loop, quantization ("none", "gguf:<type>", e.g. "gguf:Q4_1",
    # or a quantized checkpoint's label, e.g. "awq:4bit-g128 (dequantized at load)"), what runs each path
    # ("isa": {"products", "attention", "gguf"}) and the step costs measured at start ("step_costs")
    backend: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None  # serve_app/reasoning.py's parser for this template; None: none
    tool_call_parser: str = "hermes"  # serve_app/tool_parsers.py's parser for this template's tool calls
    # the model's generation_config.json sampling values that a request leaving the field out gets
    # (serve_app/sampling_defaults.py); {}: OpenAI's defaults (generation_config: off, or none set)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) of each LoRA adapter the workers load

    def check_model(self, requested: str | None) -> str | None:
        """The LoRA adapter the request names (None: the base model: it names this model, its root
        path, or nothing); 404 for any other name."""
        if requested is None or requested in (self.served_name, self.root):
            return None
        if any(requested == name for name, _ in self.lora_adapters):
            return requested
        served = ", ".join(repr(name) for name in (self.served_name, *(name for name, _ in self.lora_adapters)))
        raise OpenAIError(
            f"the model {requested!r} does not exist; this server serves {served}",
            404,
            param="model",
            code="model_not_found",
        )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for token_id in token_ids:
            if token_id >= self.vocab_size:
                raise OpenAIError(
                    f"{param}: token id {token_id} is out of range [0, {self.vocab_size})",
                    param=param,
                    code="invalid_value",
                )
