"""LoRA adapters on CUDA through the segmented Triton kernels (workers/kernels/triton_lora.py).

Skips as a whole without a CUDA device. Written on a machine without a GPU: the kernels are
checked there in Triton's interpreter (tests/workers/test_triton_lora.py) and compiled for
sm_80/sm_90 (tests/gpu/cuda_compile_lora.py); these tests have not run on a GPU yet.

- Every layer and product of a small Llama, steps of base rows and three adapters (ranks 8, 16, 4;
  rows scattered; a decode-sized step and a prefill-sized one): the kernels' LoRA part of y
  equals the torch products' in fp32, fp16 and bf16.
- The runner on CUDA (Triton attention, CUDA graphs for base-only decode steps): fp32 greedy
  tokens of base and adapter requests in the same steps equal peft's (where peft is installed;
  else the CPU runner's, which tests/workers/test_lora.py holds to peft), and the torch
  products' on CUDA; /v1/models' backend.lora says triton.

    pytest tests/gpu/test_gpu_lora.py -ra       # in a process of its own (not under TRITON_INTERPRET)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests need torch.cuda.is_available()", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: these tests must run the compiled kernels", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

from lora_adapters import ADAPTERS, build_adapters, write_adapters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from runner_helpers import greedy, make_runner, prompts_of_lengths  # noqa: E402  (tests/workers/)
from tiny_model import build_tiny_model_dir  # noqa: E402

from workers import lora as lora_module  # noqa: E402
from workers import model_runner as runner_module  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.kernels import triton_lora  # noqa: E402
from workers.lora import PRODUCTS, StepLora, load_adapter, product_inputs, product_parts  # noqa: E402
from workers.simple_driver import SimpleDriver  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("lora")]
DEVICE = torch.device("cuda")
HAS_PEFT = importlib.util.find_spec("peft") is not None
SHAPE = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # of the largest |torch's LoRA part|
# (adapter name or None, first row, end row) per request
DECODE_ROWS = [(None, 0, 1), ("qv", 1, 2), ("all", 2, 3), ("mlp", 3, 4), ("qv", 4, 5), (None, 5, 6), ("all", 6, 7)]
PREFILL_ROWS = [(None, 0, 40), ("qv", 40, 140), ("all", 140, 300), ("mlp", 300, 301), ("qv", 301, 302),
                ("all", 302, 380)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("gpu-lora")
    base = build_tiny_model_dir(root / "base", **SHAPE)
    return base, build_adapters(base, root) if HAS_PEFT else write_adapters(base, root)


def lora_parts(model, dtype: torch.dtype, rows, triton: bool) -> dict:
    base, paths = model
    config = ModelConfig.from_model_dir(base)
    adapters = {name: load_adapter(name, path, config, dtype, DEVICE) for name, path in paths.items()}
    step = StepLora.of_rows([(None if name is None else adapters[name], start, end) for name, start, end in rows],
                            DEVICE)
    assert step.triton is triton_lora and not step.use_kernel
    if not triton:
        step.triton = None
    generator = torch.Generator().manual_seed(0)
    outputs = {product: sum(n for _, n in modules) for product, modules in product_parts(config).items()}
    parts = {}
    for layer in range(config.num_layers):
        for product in PRODUCTS:
            x = torch.randn(step.num_rows, product_inputs(config)[product], generator=generator).to(DEVICE, dtype)
            y = torch.randn(step.num_rows, outputs[product], generator=generator).to(DEVICE, dtype)
            parts[layer, product] = (step.add(y.clone(), x, layer, product).double() - y.double()).cpu()
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS], ids=["decode", "prefill"])
def test_kernels_equal_torch_products_on_cuda(model, dtype, rows) -> None:
    expected = lora_parts(model, dtype, rows, triton=False)
    ours = lora_parts(model, dtype, rows, triton=True)
    for key, part in expected.items():
        err, scale = (ours[key] - part).abs().max().item(), part.abs().max().item()
        assert scale > 0 and err <= REL_TOL[dtype] * scale, (
            f"{key}: max abs error {err:.3g} > {REL_TOL[dtype]} x {scale:.3g} ({dtype})")


def served_tokens(base: Path, paths: dict, device: str, triton: bool, monkeypatch) -> dict:
    """fp32 greedy tokens of a base request and one per adapter, in the same steps."""
    if not triton:
        monkeypatch.setattr(lora_module, "lora_triton_kernels", lambda device: None)
        monkeypatch.setattr(runner_module, "lora_triton_kernels", lambda device: None)
    extra = dict(device="cuda", attention_backend="triton", block_size=16, num_blocks=256) if device == "cuda" else {}
    runner = make_runner(base, lora_adapters=tuple((name, str(path)) for name, path in paths.items()), **extra)
    if device == "cuda":
        assert runner.model_info.lora.startswith("triton" if triton else "torch products")
    names = [None, *ADAPTERS]
    prompts = prompts_of_lengths([5, 40, 23, 11], runner.model_config.vocab_size, seed=3)
    driver = SimpleDriver(runner, token_budget=32)
    for name, prompt in zip(names, prompts):
        driver.add_request(str(name), prompt, greedy(12), lora_name=name)
    finished = driver.run()
    monkeypatch.undo()
    return {name: finished[str(name)].output_token_ids for name in names}


def test_runner_greedy_tokens_with_triton_lora_equal_peft(model, monkeypatch) -> None:
    base, paths = model
    ours = served_tokens(base, paths, "cuda", True, monkeypatch)
    assert ours == served_tokens(base, paths, "cuda", False, monkeypatch)  # torch's products on CUDA
    if HAS_PEFT:
        from hf_oracle import HfOracle

        prompts = prompts_of_lengths([5, 40, 23, 11], ModelConfig.from_model_dir(base).vocab_size, seed=3)
        for name, prompt in zip([None, *ADAPTERS], prompts):
            oracle = HfOracle(base) if name is None else HfOracle(base, paths[name])
            assert ours[name] == oracle.greedy(prompt, 12).token_ids, name
    else:
        assert ours == served_tokens(base, paths, "cpu", False, monkeypatch)
