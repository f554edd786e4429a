"""The segmented LoRA kernels (workers/kernels/triton_lora.py) in Triton's interpreter on CPU
tensors, against StepLora's torch products (the oracle; tests/workers/test_lora.py holds those to
peft): every layer and product of a tiny Llama, one step mixing base rows with three adapters of
ranks 8 (q and v), 16 (all seven projections, rsLoRA) and 4 (o, gate, down), each adapter's rows
scattered through the step, one layer where an adapter lacks a product, in fp32 and bf16. Then
greedy fp32 tokens of mixed steps through the runner with the kernels equal peft's; swapping two
segments' weights in the kernels' table, or dropping the scaling, fails the comparison; and the
launches compile for sm_80 and sm_90 (tests/gpu/cuda_compile_lora.py).

The interpreter is switched on as in tests/workers/test_triton_kernels.py (see its docstring):
TRITON_INTERPRET=1 before triton's first import on a machine without CUDA, the kernel module
imported privately under it, and otherwise a child pytest that reruns this file interpreted. bf16
uses the GPU-like dot and cast of tests/triton_interpreter.py.

Tolerances compare the LoRA's part of y (y after, minus y before) with the oracle's, against the
largest |oracle part|, so the base values in y cannot hide an error in the adapter's part.

Shapes: hidden 48 and intermediate 80 (q 48, k and v 24 columns), so the 32-wide K and N tiles
of the mixed step end in masked tails, and its "all" segment of 23 rows takes two 16-row tiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: see the module docstring
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]'): kernel tests skipped")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton_interpreter import import_interpreted, patch_bf16_like_a_gpu, run_file_in_interpreter  # noqa: E402
import triton.language.standard  # noqa: E402

from hf_oracle import HfOracle  # noqa: E402
from lora_adapters import ADAPTERS, build_adapters  # noqa: E402
from runner_helpers import greedy, make_runner, prompts_of_lengths  # noqa: E402
from tiny_model import build_tiny_model_dir  # noqa: E402

from workers import lora as lora_module  # noqa: E402
from workers import model_runner as runner_module  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.lora import PRODUCTS, StepLora, load_adapter, product_inputs, product_parts  # noqa: E402
from workers.simple_driver import SimpleDriver  # noqa: E402

IN_PROCESS = isinstance(triton.language.standard.zeros, InterpretedFunction)
NOT_IN_PROCESS_REASON = (
    "triton was imported compiled before this module (or a GPU is present), so the interpreter "
    "cannot run in this process: test_lora_kernels_in_interpreter_subprocess runs these tests instead"
)
SHAPE = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2)
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the largest |oracle's LoRA part|
# (adapter name or None: the base, first row, end row) per request: adapters' rows are not contiguous
STEP_ROWS = [(None, 0, 3), ("qv", 3, 9), ("all", 9, 30), (None, 30, 32), ("qv", 32, 35), ("mlp", 35, 38),
             ("all", 38, 40)]


@pytest.fixture(scope="module")
def kernels():
    """workers.kernels.triton_lora imported under TRITON_INTERPRET=1 (sys.modules restored)."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    module = import_interpreted("workers.kernels.triton_lora")
    assert isinstance(module._lora_shrink_kernel, InterpretedFunction)
    return module


def test_lora_kernels_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the interpreter runs in this process: the tests below ran here")
    run_file_in_interpreter(__file__)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A tiny Llama and ADAPTERS (ranks 8, 16, 4) made with peft's own classes."""
    root = tmp_path_factory.mktemp("triton-lora")
    base = build_tiny_model_dir(root / "base", **SHAPE)
    return base, build_adapters(base, root)


def load_all(model, dtype: torch.dtype) -> dict[str, lora_module.LoraAdapter]:
    """ADAPTERS loaded in dtype; the "all" adapter without layer 1's o product (a layer lacking one)."""
    base, paths = model
    config = ModelConfig.from_model_dir(base)
    adapters = {name: load_adapter(name, path, config, dtype) for name, path in paths.items()}
    del adapters["all"].layers[1]["o"]
    return adapters


def step_of(adapters: dict, rows=STEP_ROWS, triton_module=None) -> StepLora:
    step = StepLora.of_rows([(None if name is None else adapters[name], start, end) for name, start, end in rows],
                            torch.device("cpu"))
    step.use_kernel, step.triton = False, triton_module  # torch's products, or the kernels
    return step


def lora_parts(step: StepLora, config: ModelConfig, dtype: torch.dtype, seed: int = 0):
    """Per (layer, product): the LoRA's part of y that step.add makes, from random x and y."""
    generator = torch.Generator().manual_seed(seed)
    inputs = product_inputs(config)
    outputs = {product: sum(rows for _, rows in modules) for product, modules in product_parts(config).items()}
    parts = {}
    for layer in range(config.num_layers):
        for product in PRODUCTS:
            x = torch.randn(step.num_rows, inputs[product], generator=generator).to(dtype)
            y = torch.randn(step.num_rows, outputs[product], generator=generator).to(dtype)
            parts[layer, product] = step.add(y.clone(), x, layer, product).double() - y.double()
    return parts


def assert_parts_match(ours: dict, expected: dict, dtype: torch.dtype) -> None:
    for key, part in expected.items():
        err, scale = (ours[key] - part).abs().max().item(), part.abs().max().item()
        assert err <= REL_TOL[dtype] * scale, f"{key}: max abs error {err:.3g} > {REL_TOL[dtype]} x {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_torch_products(kernels, model, dtype, monkeypatch) -> None:
    if dtype == torch.bfloat16:
        patch_bf16_like_a_gpu(monkeypatch)
    adapters = load_all(model, dtype)
    config = ModelConfig.from_model_dir(model[0])
    expected = lora_parts(step_of(adapters), config, dtype)
    assert all(part[:3].abs().max() == 0 and part[30:32].abs().max() == 0 for part in expected.values())  # base rows
    assert all(part.abs().max() > 1 for part in expected.values())  # every product is adapted (values reach ~10)
    monkeypatch.setattr(kernels, "_choose_blocks", lambda max_rows, dtype: (16, 32, 32))  # tails (docstring)
    step = step_of(adapters, triton_module=kernels)
    assert_parts_match(lora_parts(step, config, dtype), expected, dtype)
    table = step.triton_table()
    assert table.max_segment_rows == 23 and table.row_ids.tolist()[:6] == [3, 4, 5, 6, 7, 8]  # qv's 9 rows first
    assert [shape.num_parts for shape in table.shapes] == [3, 1, 2, 1]


def test_one_adapter_on_every_row(kernels, model) -> None:
    """A segment of every row of the step (StepLora's rows None) and a decode-sized step."""
    adapters = load_all(model, torch.float32)
    config = ModelConfig.from_model_dir(model[0])
    for rows in ([("all", 0, 5)], [("qv", 0, 1), ("mlp", 1, 2), (None, 2, 3)]):
        expected = lora_parts(step_of(adapters, rows), config, torch.float32, seed=1)
        assert_parts_match(lora_parts(step_of(adapters, rows, kernels), config, torch.float32, seed=1), expected,
                           torch.float32)


def test_swapped_segments_or_dropped_scaling_fail(kernels, model, monkeypatch) -> None:
    """The comparison catches the kernels reading another segment's weights, and an unscaled adapter."""
    adapters = load_all(model, torch.float32)
    config = ModelConfig.from_model_dir(model[0])
    expected = lora_parts(step_of(adapters), config, torch.float32)
    swapped = step_of(adapters, triton_module=kernels)
    table = swapped.triton_table()
    table.weights[[1, 2]] = table.weights[[2, 1]]  # all's rows read mlp's weights and the reverse
    with pytest.raises(AssertionError, match="max abs error"):
        assert_parts_match(lora_parts(swapped, config, torch.float32), expected, torch.float32)

    read = lora_module.read_adapter_config
    monkeypatch.setattr(lora_module, "read_adapter_config", lambda *args: (*read(*args)[:1], 1.0, read(*args)[2]))
    unscaled = step_of(load_all(model, torch.float32), triton_module=kernels)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_parts_match(lora_parts(unscaled, config, torch.float32), expected, torch.float32)


def test_runner_greedy_tokens_with_the_kernels_equal_peft(kernels, model, monkeypatch) -> None:
    """fp32 greedy tokens of base and adapter requests in the same steps (chunked prompts beside
    decodes), the LoRA products on the kernels, equal peft's; /v1/models' backend.lora says so."""
    base, paths = model
    monkeypatch.setattr(lora_module, "lora_triton_kernels", lambda device: kernels)  # as on CUDA
    monkeypatch.setattr(runner_module, "lora_triton_kernels", lambda device: kernels)
    launches, lora_add = [], kernels.lora_add  # (layer, product) of each lora_add
    monkeypatch.setattr(kernels, "lora_add", lambda *args: launches.append(args[3:]) or lora_add(*args))
    runner = make_runner(base, lora_adapters=tuple((name, str(path)) for name, path in paths.items()))
    assert runner.model_info.lora.startswith("triton")
    names = [None, *ADAPTERS]
    prompts = prompts_of_lengths([5, 14, 9, 6], runner.model_config.vocab_size, seed=3)
    driver = SimpleDriver(runner, token_budget=16)
    for name, prompt in zip(names, prompts):
        driver.add_request(str(name), prompt, greedy(6), lora_name=name)
    finished = driver.run()
    assert all(adapter._stacks is not None for adapter in runner.lora_adapters.values())  # built at load
    assert set(launches) == {(layer, product) for layer in range(2) for product in range(4)}
    for name, prompt in zip(names, prompts):
        oracle = HfOracle(base) if name is None else HfOracle(base, paths[name])
        assert finished[str(name)].output_token_ids == oracle.greedy(prompt, 6).token_ids, name


def test_kernels_compile_for_cuda_targets():
    """The launchers' real arguments compile to cubins for sm_80 and sm_90 (tests/gpu/cuda_compile_lora.py,
    in a child process without TRITON_INTERPRET). Nothing runs on a GPU: this proves they compile."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    repo = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    child = subprocess.run([sys.executable, str(repo / "tests" / "gpu" / "cuda_compile_lora.py")],
                           env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    if child.returncode == 2:
        pytest.skip(child.stdout.strip())
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr[-3000:]}"
    assert child.stdout.count("ok   sm_") == 8, child.stdout
