"""A tiny random Llama-family model directory, built in-process (no downloads).

The directory looks like any Hugging Face checkpoint: config.json, generation_config.json,
model.safetensors, and a self-contained tokenizer (tokenizer.json: byte-level BPE trained
here on a few paragraphs; tokenizer_config.json with a ChatML chat_template). So the same
directory serves the worker tests (our runner vs transformers on the same weights) and
the HTTP integration tests.

Weights are drawn with a fixed seed and a larger init scale than usual (std 0.3 instead of
0.02), so the next-token distributions are peaked and greedy decoding rarely meets near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (as in SmolLM2)
EOS_TOKEN_ID = 2  # <|im_end|>
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A paged key value cache stores attention keys
and values in fixed size blocks, so many sequences of different lengths share one pool.
The scheduler hands out a token budget every step; prefills are cut into chunks and decodes
ride along in the same batch. Paris is the capital of France. Berlin is the capital of Germany.
Rome, Madrid, Lisbon and Vienna are capitals too. One, two, three, four, five, six, seven,
eight, nine, ten. What is the capital of France? Tell me a story about a robot who learns to
paint. Once upon a time there was a small robot that lived in a quiet town by the sea.
def add(a, b): return a + b  # numbers 0123456789 and symbols !?.,;:()[]{}<>+-*/=_'"
"""
# multimodal model_types: the text model's model_type, and a tiny vision tower's config
MULTIMODAL = {
    "gemma3": ("gemma3_text", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)),
    "gemma4": ("gemma4_text", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                                   pooling_kernel_size=2)),
    "llama4": ("llama4_text", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                   projector_output_dim=32)),
    "qwen3_5": ("qwen3_5_text", dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                                     out_hidden_size=64, num_position_embeddings=16)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             patch_size=14, out_hidden_size=64, num_position_embeddings=16)),
}
# multimodal model_types whose checkpoint AutoModelForCausalLM would build as the text model alone: built whole
WHOLE_MULTIMODAL = ("llama4", "qwen3_5", "qwen3_5_moe")
DEFAULT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE PreTrainedTokenizerFast with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line for line in TRAINING_TEXT.splitlines() if line], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model_dir(path: Path, model_type: str = "llama", seed: int = 0, init_std: float = 0.3,
                         save_original_format: bool = True, **config_overrides) -> Path:
    """Write a random model of `model_type` ("llama", "qwen2", "mistral") + tokenizer into path.
    save_original_format=False saves transformers' own tensor layout (e.g. a MoE's experts
    stacked into 3-D tensors) instead of the checkpoint names the family ships with."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from workers.loader import inline_chat_template

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    inline_chat_template(path)
    config_kwargs = dict(DEFAULT_SHAPE, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
                         pad_token_id=EOS_TOKEN_ID, tie_word_embeddings=False, initializer_range=init_std)
    config_kwargs.update(config_overrides)
    if model_type in MULTIMODAL:  # the shape goes to the text model; a tiny vision tower beside it
        text_type, vision = MULTIMODAL[model_type]
        text = {key: value for key, value in config_kwargs.items() if key not in ("tie_word_embeddings",)}
        config_kwargs = dict(text_config=dict(text, model_type=text_type), vision_config=vision,
                             tie_word_embeddings=config_kwargs["tie_word_embeddings"], mm_tokens_per_image=4,
                             eos_token_id=EOS_TOKEN_ID, bos_token_id=1, pad_token_id=EOS_TOKEN_ID)
    config = AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(seed)
    if model_type in WHOLE_MULTIMODAL:  # transformers' causal-LM class for it is the text model alone: the whole one
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make the norms and biases non-trivial too, so they are tested
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                parameter.normal_(0.0, init_std)
            elif name.endswith(".mamba.A_log"):  # Mamba-2's decay rates (default log 1..H) and skips (default 1)
                parameter.uniform_(-1.0, 1.5)
            elif name.endswith(".mamba.D"):
                parameter.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():  # a correction bias large enough to change experts' choice
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, init_std)
            elif name.endswith("layer_scalar"):  # Gemma 4's, 1 at init: made to matter
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True, save_original_format=save_original_format)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID).save_pretrained(path)
    (path / "tiny_model.json").write_text(json.dumps({"model_type": model_type, "seed": seed}) + "\n")
    return path
