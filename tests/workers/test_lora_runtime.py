"""LoRA adapters loaded at run time: the real Scheduler decides each step's lora_loads and
lora_unloads (max_loras 2, max_cpu_loras 2, three adapters), the real ModelRunner applies them
before the forward, and greedy fp32 tokens still equal peft's. The worker starts with none
loaded, holds exactly what the scheduler's LRU says, and checks a bad adapter with a LoraError."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_oracle import HfOracle
from lora_adapters import build_adapters
from runner_helpers import greedy, make_runner, prompts_of_lengths
from tiny_model import build_tiny_model_dir

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.scheduler import Scheduler
from workers.lora import LoraError

MAX_TOKENS = 8
CFG = SchedulerConfig(block_size=4, num_blocks=512, max_model_len=128, max_num_batched_tokens=24,
                      max_loras=2, max_cpu_loras=2)


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-runtime")
    base = build_tiny_model_dir(root / "base")
    return base, build_adapters(base, root)


def run(scheduler: Scheduler, runner) -> tuple[dict[str, list[int]], list[tuple[dict[str, str], list[str]]]]:
    tokens: dict[str, list[int]] = {}
    changes = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if output.lora_loads or output.lora_unloads:
            changes.append((dict(output.lora_loads), list(output.lora_unloads)))
        for delta in scheduler.update_from_output(output, runner.execute(output)):
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        assert set(runner.lora_adapters) == set(scheduler.loras.loaded())
    return tokens, changes


def test_step_loads_and_evictions_keep_peft_tokens(llama_adapters) -> None:
    base, adapters = llama_adapters
    runner = make_runner(base)  # no start-time adapters: every one comes with a step
    assert runner.lora_adapters == {}
    scheduler = Scheduler(CFG)
    names = [None, "qv", "all", "mlp", "qv"]
    prompts = prompts_of_lengths([5, 23, 14, 11, 9], runner.model_config.vocab_size, seed=4)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        scheduler.add_request(EngineRequest(f"r{i}", prompt, greedy(MAX_TOKENS), lora_name=name,
                                            lora_path=None if name is None else str(adapters[name])))
    tokens, changes = run(scheduler, runner)
    # qv and all run first (max_loras 2); mlp waits, then evicts the least recently used one
    loads = [(name, path) for step_loads, _ in changes for name, path in step_loads.items()]
    assert loads == [(name, str(adapters[name])) for name in ("qv", "all", "mlp")]  # the second qv: a hit
    assert sum(len(unloads) for _, unloads in changes) == 1  # mlp's slot: the least recently used one
    assert runner.num_lora_loads == 3
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        oracle = HfOracle(base) if name is None else HfOracle(base, adapters[name])
        assert tokens[f"r{i}"] == oracle.greedy(prompt, MAX_TOKENS).token_ids, (i, name)


def test_a_bad_adapter_is_refused_by_check_lora(llama_adapters, tmp_path) -> None:
    base, adapters = llama_adapters
    runner = make_runner(base)
    assert runner.check_lora("qv", str(adapters["qv"]))["rank"] > 0
    assert runner.lora_adapters == {}  # checked, not kept
    with pytest.raises(LoraError, match="no adapter_config.json"):
        runner.check_lora("x", str(tmp_path / "nowhere"))
