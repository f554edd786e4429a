"""Model path resolution and loading: clear errors for bad paths, an atomic default-model
conversion, and the converted SmolLM2 checkpoint itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from workers import loader
from workers.config import ModelConfig
from workers.loader import ModelPathError, load_model, resolve_model_path
from workers.model_runner import ModelRunner, RunnerConfig


def copy_model(source, target, skip=()):
    target.mkdir()
    for path in source.iterdir():
        if path.name not in skip:
            shutil.copy(path, target / path.name)
    return target


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelPathError, match=f"{missing} does not exist.*config.json"):
        resolve_model_path(str(missing))


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "model.bin"
    file.write_text("x")
    with pytest.raises(ModelPathError, match=f"{file} is not a directory"):
        resolve_model_path(str(file))


def test_directory_without_config_or_weights(tiny_model_dir, tmp_path):
    no_config = copy_model(tiny_model_dir, tmp_path / "no-config", skip={"config.json"})
    with pytest.raises(ModelPathError, match=f"{no_config} has no config.json"):
        resolve_model_path(str(no_config))
    no_weights = copy_model(tiny_model_dir, tmp_path / "no-weights", skip={"model.safetensors"})
    with pytest.raises(ModelPathError, match=f"{no_weights} has no \\*.safetensors"):
        ModelRunner(RunnerConfig(model=str(no_weights), num_blocks=8))


def test_corrupt_weight_file_names_the_file(tiny_model_dir, tmp_path):
    corrupt = copy_model(tiny_model_dir, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(ModelPathError, match=f"cannot read weight file {corrupt / 'model.safetensors'}"):
        load_model(corrupt)


def test_weights_that_do_not_fit_the_config(tiny_model_dir, tmp_path):
    mismatched = copy_model(tiny_model_dir, tmp_path / "mismatched")
    config = json.loads((mismatched / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (mismatched / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelPathError, match="missing tensor model.layers.3.input_layernorm.weight"):
        load_model(mismatched)
    config["num_hidden_layers"] -= 2
    (mismatched / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelPathError, match="unexpected tensors: model.layers.2"):
        load_model(mismatched)


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    fake_gguf = tmp_path / "package" / "model.gguf"
    fake_gguf.parent.mkdir()
    fake_gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "find_default_gguf", lambda: fake_gguf)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # what a Ctrl-C in the middle of dequantizing looks like

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", killed)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("default", cache)
    leftovers = [path.name for path in cache.iterdir() if not path.name.endswith(".lock")]
    assert leftovers == []  # neither a half model directory nor the temporary one


def test_stale_temporary_directory_is_cleaned_before_converting(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    stale = cache / f".{loader.DEFAULT_MODEL_NAME}.tmp-abc"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    converted = []
    monkeypatch.setattr(loader, "find_default_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(loader, "convert_gguf", lambda gguf, out: converted.append(out) or out.mkdir())
    resolve_model_path(None, cache)
    assert not stale.exists() and converted == [cache / loader.DEFAULT_MODEL_NAME]


@pytest.mark.slow
def test_converted_smollm2_is_the_expected_checkpoint(smollm2_dir):
    config = ModelConfig.from_model_dir(smollm2_dir)
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in raw
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.max_position_embeddings == 8192 and config.eos_token_ids == (2,)
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (smollm2_dir / "tokenizer.json").is_file()
    assert resolve_model_path("SmolLM2-135M-Instruct", smollm2_dir.parent) == smollm2_dir  # cached: no reconversion
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["temperature"] == 0.2 and generation["top_p"] == 0.9


def test_generation_values_are_added_where_missing_and_never_overwrite(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}))
    loader.add_generation_values(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2, "temperature": 0.7,
                                                                              "top_p": 0.9}
    bare = tmp_path / "bare"
    bare.mkdir()
    loader.add_generation_values(bare, loader.DEFAULT_MODEL_SAMPLING)
    assert json.loads((bare / "generation_config.json").read_text()) == loader.DEFAULT_MODEL_SAMPLING
    assert sorted(path.name for path in bare.iterdir()) == ["generation_config.json"]  # no temporary left


def test_sharded_checkpoint_loads_like_the_single_file(tiny_model_dir, tmp_path):
    from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests
    from transformers import AutoModelForCausalLM

    sharded = copy_model(tiny_model_dir, tmp_path / "sharded", skip={"model.safetensors"})
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = prompts_of_lengths([9, 20], 384, seed=2)
    expected = run_requests(make_runner(tiny_model_dir), prompts, greedy(6))
    assert run_requests(make_runner(sharded), prompts, greedy(6)) == expected


def test_model_info_and_kv_pool_sizing(tiny_model_dir):
    from workers.model_runner import kv_bytes_per_block, num_blocks_for_memory

    config = ModelConfig.from_model_dir(tiny_model_dir)
    per_block = kv_bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * 3 * 16 * 2 * 16 * 4  # k+v, layers, tokens, kv heads, head_dim, bytes
    assert num_blocks_for_memory(config, 16, 10 * per_block + 5, torch.float32) == 10
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), dtype="float32", block_size=16,
                                      kv_cache_memory_bytes=10 * per_block, max_model_len=4096,
                                      attention_backend="torch"))  # its pool layout is the one asserted
    info = runner.model_info
    assert (info.num_blocks, info.block_size, info.vocab_size, info.eos_token_ids) == (10, 16, 384, (2,))
    assert info.max_model_len == 1024  # capped by the model's max_position_embeddings
    assert runner.kv_caches[0][0].shape == (10, 16, 2, 16) and len(runner.kv_caches) == 3
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for_memory(config, 16, per_block, torch.float32)


def test_kv_cache_dtype_auto_is_a_half_pool_under_auto_fp32_activations(tiny_model_dir, monkeypatch, caplog):
    """dtype auto resolved to fp32 on a CPU with our attention kernel: "auto" allocates an fp16
    pool, twice the blocks in the same memory; an explicit float32 dtype keeps an fp32 pool (the
    exact path); a pool dtype the kernels cannot read fails at start, in one line."""
    import workers.model_runner as model_runner
    from workers.kernels.native import native_available
    from workers.model_runner import kv_bytes_per_block

    if not native_available():
        pytest.skip("the C kernels do not build here")
    monkeypatch.setattr(model_runner, "cpu_has_fast_bf16", lambda: False)  # as on an AVX2 CPU
    config = ModelConfig.from_model_dir(tiny_model_dir)
    memory = 20 * kv_bytes_per_block(config, 16, torch.float32)
    settings = dict(model=str(tiny_model_dir), block_size=16, kv_cache_memory_bytes=memory, attention_backend="cpu")
    half = ModelRunner(RunnerConfig(dtype="auto", **settings))
    assert (half.model_info.dtype, half.model_info.kv_cache_dtype, half.model_info.num_blocks) == ("float32",
                                                                                                "float16", 40)
    assert all(k.dtype == v.dtype == torch.float16 for k, v in half.kv_caches)
    exact = ModelRunner(RunnerConfig(dtype="float32", **settings))
    assert (exact.model_info.kv_cache_dtype, exact.model_info.num_blocks) == ("float32", 20)
    asked = ModelRunner(RunnerConfig(dtype="float32", kv_cache_dtype="float16", **settings))
    assert asked.model_info.kv_cache_dtype == "float16"
    reference = ModelRunner(RunnerConfig(dtype="auto", **{**settings, "attention_backend": "torch"}))
    assert reference.model_info.kv_cache_dtype == "float32"  # the torch reference reads the model's dtype only
    # blocks of 8: the AVX2 body would read a half pool with its portable C, so auto keeps fp32
    odd_blocks = ModelRunner(RunnerConfig(dtype="auto", **{**settings, "block_size": 8}))
    assert odd_blocks.model_info.kv_cache_dtype == "float32"
    with caplog.at_level("WARNING", logger="workers.model_runner"):  # asked for anyway: the log says what it costs
        ModelRunner(RunnerConfig(dtype="float32", kv_cache_dtype="float16", **{**settings, "block_size": 8}))
    assert "portable C body" in caplog.text
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs"):
        ModelRunner(RunnerConfig(dtype="float32", kv_cache_dtype="float16",
                                 **{**settings, "attention_backend": "torch"}))
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs"):
        ModelRunner(RunnerConfig(dtype="bfloat16", kv_cache_dtype="float16", **settings))
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        ModelRunner(RunnerConfig(dtype="float32", kv_cache_dtype="fp8", **settings))
