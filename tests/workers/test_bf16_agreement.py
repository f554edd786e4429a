"""bf16 is the CPU default where the hardware has it (dtype auto): how far it drifts from fp32.

Teacher-forced top-1 agreement on real text (the Python language reference shipped with
CPython, pydoc_data.topics, about 2,500 positions in sequences of 512 tokens): at each
position, does the bf16 model's most likely next token equal the fp32 reference's? Hugging
Face's own bf16 model is measured the same way, and ours must agree at least as well, minus
half a point. Measured on this machine: printed by the test (-s).
"""

from __future__ import annotations

import pydoc_data.topics
import pytest
import torch

from workers.model import AttentionMetadata
from workers.model_runner import ModelRunner, RunnerConfig

SEQUENCE_LEN = 512
NUM_SEQUENCES = 5  # 2,555 predicted positions
MARGIN = 0.005  # ours >= HF bf16 agreement - 0.5 points


def real_text_sequences(tokenizer) -> list[list[int]]:
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= SEQUENCE_LEN * NUM_SEQUENCES
    return [ids[i * SEQUENCE_LEN:(i + 1) * SEQUENCE_LEN] for i in range(NUM_SEQUENCES)]


@torch.inference_mode()
def our_top1(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """Our model's argmax next token at every position of one sequence (a single prefill)."""
    positions, metadata = AttentionMetadata.one_sequence(len(token_ids), runner.block_size)
    hidden = runner.model.forward(torch.tensor(token_ids), positions, metadata, runner.kv_caches)
    return runner.model.compute_logits(hidden).argmax(dim=-1)


@torch.inference_mode()
def hf_top1(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].argmax(dim=-1)


@pytest.mark.slow
def test_bf16_top1_agreement_with_fp32_is_at_least_hf_bf16s(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    sequences = real_text_sequences(tokenizer)
    blocks = -(-SEQUENCE_LEN // 16) + 1
    ours_bf16 = ModelRunner(RunnerConfig(model=str(smollm2_dir), dtype="bfloat16", num_blocks=blocks))
    ours_fp32 = ModelRunner(RunnerConfig(model=str(smollm2_dir), dtype="float32", num_blocks=blocks))
    assert ours_bf16.model_info.attention_backend == "cpu"  # the fast path is what is measured
    hf_fp32 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    agree = {"hf_bf16": 0, "ours_bf16": 0, "ours_fp32": 0}
    positions = 0
    for token_ids in sequences:
        reference = hf_top1(hf_fp32, token_ids)
        agree["hf_bf16"] += int((hf_top1(hf_bf16, token_ids) == reference).sum())
        agree["ours_bf16"] += int((our_top1(ours_bf16, token_ids) == reference).sum())
        agree["ours_fp32"] += int((our_top1(ours_fp32, token_ids) == reference).sum())
        positions += len(token_ids)
    rates = {name: count / positions for name, count in agree.items()}
    print(f"top-1 agreement with HF fp32 over {positions} positions: "
          + ", ".join(f"{name} {rate:.2%}" for name, rate in rates.items()))
    assert positions >= 2000
    assert rates["ours_fp32"] >= 0.995  # our fp32 path is the same model as HF's (near-ties aside)
    assert rates["ours_bf16"] >= rates["hf_bf16"] - MARGIN, rates
