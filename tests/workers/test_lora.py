"""LoRA adapters on the worker (workers/lora.py): greedy tokens in fp32 equal peft's own model
with the adapter applied, for requests of the base model and of three adapters computed in
the same steps (chunked prompts beside decodes), on each path: the C layer loop with our LoRA
kernel (csrc/lora.c), the Python loop with that kernel, and the Python loop with torch's
products (the GPU's way). Breaking the adapter math on purpose (the scaling dropped, one
adapter's rows given another's weights) changes the tokens, and an adapter we cannot apply is
refused at load with one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from families_catalog import FAMILIES
from hf_oracle import HfOracle
from lora_adapters import ADAPTERS, build_adapter, build_adapters
from runner_helpers import greedy, make_runner, prompts_of_lengths
from tiny_model import build_tiny_model_dir

from workers import lora as lora_module
from workers.config import ModelConfig
from workers.kernels.native import native_available
from workers.lora import LoraError, StepLora, load_adapter
from workers.simple_driver import SimpleDriver

# how a step's LoRA runs: (attention backend: "cpu" gives the C layer loop, our LoRA kernel or torch's products)
PATHS = {"c_loop": ("cpu", True), "python_loop": ("torch", True), "torch_products": ("torch", False)}

LORA_FAMILIES = {"llama": dict(model_type="llama"), "qwen3": FAMILIES["qwen3"],
                 "gemma3_text": FAMILIES["gemma3_text"], "phi3": FAMILIES["phi3"], "granite": FAMILIES["granite"]}
PROMPT_LENGTHS = [5, 23, 40, 11]  # base, then the three adapters in ADAPTERS' order
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(LORA_FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A tiny checkpoint of the family and its ADAPTERS (Phi-3's on its fused modules)."""
    root = tmp_path_factory.mktemp("lora") / request.param
    base = build_tiny_model_dir(root / "base", **LORA_FAMILIES[request.param])
    return base, build_adapters(base, root, fused=request.param == "phi3")


def served_tokens(base: Path, adapters: dict[str, Path], token_budget: int = 16,
                  path: str = "c_loop") -> dict[str | None, list[int]]:
    """Greedy tokens of one prompt per lora_name (None: the base), all in the same steps, on PATHS[path]."""
    attention, kernel = PATHS[path]
    if kernel and not native_available():
        pytest.skip("our C kernels do not build here")
    runner = make_runner(base, lora_adapters=tuple((name, str(path)) for name, path in adapters.items()),
                         attention_backend=attention)
    assert (runner.model.native_forward is not None) == (path == "c_loop")
    names = [None, *adapters]
    prompts = prompts_of_lengths(PROMPT_LENGTHS, runner.model_config.vocab_size, seed=3)
    driver = SimpleDriver(runner, token_budget=token_budget)  # chunked prompts beside decodes, every adapter mixed
    for name, prompt in zip(names, prompts):
        driver.add_request(str(name), prompt, greedy(MAX_TOKENS), lora_name=name)
    with mock.patch.object(lora_module, "lora_kernel_available", lambda: kernel):  # off: torch's products, as off CPU
        finished = driver.run()
    return {name: finished[str(name)].output_token_ids for name in names}


def peft_tokens(base: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """peft's (and for the base, transformers') greedy tokens of the same prompts, one at a time."""
    vocab_size = ModelConfig.from_model_dir(base).vocab_size
    prompts = prompts_of_lengths(PROMPT_LENGTHS, vocab_size, seed=3)
    expected = {None: HfOracle(base).greedy(prompts[0], MAX_TOKENS).token_ids}
    for (name, path), prompt in zip(adapters.items(), prompts[1:]):
        expected[name] = HfOracle(base, path).greedy(prompt, MAX_TOKENS).token_ids
    return expected


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mixed_steps_of_base_and_three_adapters_equal_peft(family, path) -> None:
    base, adapters = family
    ours = served_tokens(base, adapters, path=path)
    expected = peft_tokens(base, adapters)
    assert ours == expected
    # each adapter changes its request's tokens: the base model on the same prompt answers otherwise
    vocab_size = ModelConfig.from_model_dir(base).vocab_size
    prompts = prompts_of_lengths(PROMPT_LENGTHS, vocab_size, seed=3)
    base_oracle = HfOracle(base)
    for name, prompt in zip(adapters, prompts[1:]):
        assert base_oracle.greedy(prompt, MAX_TOKENS).token_ids != expected[name], name


def test_alone_equals_mixed(family) -> None:
    """One adapter's request alone gives the tokens it gets in a step shared with the others."""
    base, adapters = family
    mixed = served_tokens(base, adapters)
    runner = make_runner(base, lora_adapters=tuple((name, str(path)) for name, path in adapters.items()))
    prompts = prompts_of_lengths(PROMPT_LENGTHS, runner.model_config.vocab_size, seed=3)
    for name, prompt in zip(adapters, prompts[1:]):
        driver = SimpleDriver(runner)
        driver.add_request("alone", prompt, greedy(MAX_TOKENS), lora_name=name)
        assert driver.run()["alone"].output_token_ids == mixed[name], name


def test_q_and_k_adapters_under_interleaved_rope_equal_peft(tmp_path) -> None:
    """ERNIE 4.5 rotates interleaved pairs, so its q and k rows are reordered at load; an adapter's
    q_proj and k_proj B rows are reordered alike, and its tokens equal peft's (the Python loop: a MoE model)."""
    from families_catalog import MOE_FAMILIES

    base = build_tiny_model_dir(tmp_path / "base", **MOE_FAMILIES["ernie4_5_moe"])
    adapters = {"qkv": build_adapter(base, tmp_path / "qkv", ("q_proj", "k_proj", "v_proj"), 8, 16)}
    assert served_tokens(base, adapters, path="python_loop") == peft_tokens(base, adapters)


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-llama")
    base = build_tiny_model_dir(root / "base")
    return base, build_adapters(base, root)


def test_dropping_the_scaling_breaks_the_tokens(llama_adapters, monkeypatch) -> None:
    base, adapters = llama_adapters
    expected = peft_tokens(base, adapters)
    read = lora_module.read_adapter_config
    monkeypatch.setattr(lora_module, "read_adapter_config", lambda *args: (*read(*args)[:1], 1.0, read(*args)[2]))
    for path in PATHS:
        broken = served_tokens(base, adapters, path=path)
        assert broken[None] == expected[None]
        assert any(broken[name] != expected[name] for name in adapters), path


def test_rows_given_another_adapters_weights_break_the_tokens(llama_adapters, monkeypatch) -> None:
    base, adapters = llama_adapters
    expected = peft_tokens(base, adapters)
    of_rows = StepLora.of_rows.__func__

    def rotated(cls, row_adapters, device):
        step = of_rows(cls, row_adapters, device)
        if step is not None and len(step.segments) > 1:  # each adapter's rows get the next adapter's weights
            adapters_in_step = [adapter for adapter, _ in step.segments]
            rows = [rows for _, rows in step.segments]
            step.segments = list(zip(adapters_in_step[1:] + adapters_in_step[:1], rows))
        return step

    monkeypatch.setattr(StepLora, "of_rows", classmethod(rotated))
    for path in PATHS:
        broken = served_tokens(base, adapters, path=path)
        assert any(broken[name] != expected[name] for name in adapters), path


def test_adapters_we_cannot_apply_are_refused_at_load(llama_adapters, tmp_path) -> None:
    base, adapters = llama_adapters
    config = ModelConfig.from_model_dir(base)

    def refused(path: Path, match: str, **kwargs) -> None:
        with pytest.raises(LoraError, match=match):
            load_adapter("x", path, config, torch.float32, **kwargs)

    refused(tmp_path / "nowhere", "no adapter_config.json")
    refused(adapters["all"], "above this server's max_lora_rank 8", max_rank=8)
    lm_head = build_adapter(base, tmp_path / "lm_head", ("q_proj", "lm_head"), 4, 8)
    refused(lm_head, r"not ones we apply LoRA to \(lm_head")
    other_base = build_tiny_model_dir(tmp_path / "other", hidden_size=32, intermediate_size=64)
    refused(build_adapter(other_base, tmp_path / "other-adapter", ("q_proj",), 4, 8), "an adapter of another base")
    dora = tmp_path / "dora"
    dora.mkdir()
    raw = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**raw, "use_dora": True}))
    refused(dora, "DoRA adapters are not supported")
    loaded = load_adapter("qv", adapters["qv"], config, torch.float32)
    targets, rank, alpha, _ = ADAPTERS["qv"]
    assert (loaded.rank, loaded.scaling, loaded.target_modules) == (rank, alpha / rank, tuple(sorted(targets)))
    assert all(set(layer) == {"qkv"} for layer in loaded.layers)  # q and v: one pair on the fused qkv product


def test_an_unknown_adapter_name_is_a_clear_worker_error(llama_adapters) -> None:
    base, adapters = llama_adapters
    runner = make_runner(base, lora_adapters=(("qv", str(adapters["qv"])),))
    driver = SimpleDriver(runner)
    driver.add_request("r", [5, 6, 7], greedy(2), lora_name="nope")
    with pytest.raises(ValueError, match="names LoRA adapter 'nope', which this worker has not loaded"):
        driver.run()


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])  # x86-64-v3: AVX2, the plain loops of CPUs without AVX-512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_a_float64_oracle_on_awkward_shapes(dtype, march, monkeypatch) -> None:
    """csrc/lora.c on shapes the tiny models never make: ranks not a multiple of its 4-rank panels,
    an input width not a multiple of 16, output columns ending inside a 32-column panel, parts that
    start mid-row, and segments of 1 to 19 rows (past its 16-row blocks), against float64."""
    from workers.kernels import native

    if not native_available():
        pytest.skip("our C kernels do not build here")
    if march != "native":
        library = native.load(native.build(march=march))
        monkeypatch.setattr(native, "native_library", lambda: library)
    generator = torch.Generator().manual_seed(11)
    in_features, part_rows = 37, (40, 9, 24)  # a qkv product of three parts; out 73 columns
    adapters = []
    for index, ranks in enumerate([(3, 5, 8), (16, 0, 1), (6, 7, 0)]):  # rank 0: the part is not targeted
        found = [(f"m{k}", rows, *((torch.randn(rank, in_features, generator=generator),
                                    torch.randn(rows, rank, generator=generator)) if rank else (None, None)))
                 for k, (rows, rank) in enumerate(zip(part_rows, ranks))]
        pair = lora_module._pair(Path("x"), 0, found, in_features, 0.5, torch.float32, "cpu", kernel_dtype=dtype)
        a, bt = pair.parts[0].dense()  # the kernel's panels hold the adapter's A and B
        assert torch.equal(a[:, :in_features], found[0][2].to(dtype)) and not a[:, in_features:].any()
        assert torch.equal(bt, (found[0][3] * 0.5).T.to(dtype))
        adapters.append(lora_module.LoraAdapter(f"a{index}", Path("x"), max(ranks), 0.5, (), layers=[{"qkv": pair}]))
    rows = torch.randperm(40, generator=generator)
    segments = [(adapters[0], rows[:19].sort().values), (adapters[1], rows[19:20]), (adapters[2], rows[20:33])]
    x = torch.randn(40, in_features, generator=generator).to(dtype)
    y = torch.randn(40, sum(part_rows), generator=generator).to(dtype)
    expected = y.double()
    for adapter, segment_rows in segments:
        for part in adapter.layers[0]["qkv"].parts:
            a, bt = part.dense()
            delta = (x[segment_rows].double() @ a[:, :in_features].double().T) @ bt.double()
            expected[segment_rows, part.start:part.start + part.len] += delta
    ours = StepLora(segments, 40, use_kernel=True).add(y.clone(), x, 0, "qkv")
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(ours.double(), expected.to(dtype).double(), **tolerance)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows[:33]] = False
    assert torch.equal(ours[untouched], y[untouched])  # rows of no adapter keep the base's output
