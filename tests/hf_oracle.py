"""transformers as the oracle: its own model's greedy tokens and logits on the same weights,
shared by the worker tests (tests/workers) and the served tests (tests/integration)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# fp32 batching can flip a near-tie: a differing greedy token is accepted only where
# the reference's top-2 logit gap was below this
NEAR_TIE_EPSILON = 1e-3


@dataclass
class HfGreedy:
    token_ids: list[int]
    logits: list[torch.Tensor]  # [vocab] raw logits at each generated position


class HfOracle:
    """transformers' LlamaForCausalLM (or Qwen2/Mistral) on the same weights."""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None):
        """adapter_dir: a PEFT LoRA adapter applied by peft's own PeftModel (unmerged)."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter_dir)
        self.model.eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> HfGreedy:
        """HF generate greedy, one prompt at a time (no padding), with the logits of each step."""
        generated = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
        return HfGreedy(generated.sequences[0, len(prompt):].tolist(), [step[0] for step in generated.logits])

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] raw logits of one full forward."""
        return self.model(torch.tensor([token_ids])).logits[0]


def assert_greedy_matches(ours: list[int], reference: HfGreedy, epsilon: float = NEAR_TIE_EPSILON) -> int:
    """Equal tokens, or a first difference at a near-tie (after which the sequences may diverge).
    Returns how many leading tokens matched."""
    for position, (our_token, hf_token) in enumerate(zip(ours, reference.token_ids)):
        if our_token != hf_token:
            top2 = reference.logits[position].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < epsilon, (
                f"greedy token {position} differs (ours {our_token}, HF {hf_token}) and HF's top-2 "
                f"logit gap there is {gap:.3g} >= {epsilon}: not a near-tie"
            )
            return position
    assert len(ours) == len(reference.token_ids), (len(ours), len(reference.token_ids))
    return len(ours)


def prompts_of_lengths(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (special ids 0-2 excluded) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def token_ids_of_texts(model_dir: Path) -> dict[str, int]:
    """Token text (as logprobs show it) -> token id: one-to-one for the tiny byte-level tokenizer."""
    from serve_app.tokenizer import TokenizerService
    from workers.config import ModelConfig

    service = TokenizerService.from_model_dir(str(model_dir))
    vocab_size = ModelConfig.from_model_dir(model_dir).vocab_size
    ids = {service.token_text(token_id): token_id for token_id in range(vocab_size)}
    assert len(ids) == vocab_size, "two tokens show the same text: served texts cannot name token ids"
    return ids
