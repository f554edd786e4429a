"""The CUDA-graph decode path's static buffers and padding, on CPU.

DecodeGraphs(capture=False) runs the very forward a graph would capture, eagerly, on the
padded static buffers; so these tests check everything but capture/replay itself (that is
tests/gpu/test_gpu.py::test_runner_greedy_cuda_graphs_equal_eager, which needs a GPU).
"""

from __future__ import annotations

import pytest
import torch

from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from workers.cuda_graphs import DecodeGraphs
from workers.model_runner import ModelRunner, RunnerConfig

SIZES = (1, 2, 4, 8)


def _with_static_decode(runner: ModelRunner, sizes: tuple[int, ...] = SIZES) -> DecodeGraphs:
    max_blocks = -(-runner.max_model_len // runner.block_size)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, sizes, max_blocks, capture=False)
    return runner.decode_graphs


def test_padded_static_decode_greedy_equals_eager(tiny_model_dir):
    # prompts of different lengths, prefilled in chunks of 5: early steps mix prefill chunks
    # with decodes (eager); different max_tokens make the decode batch shrink 7 -> 1, so
    # sizes 7, 6, 5 pad to 8 and 3 pads to 4
    prompts = prompts_of_lengths([3, 9, 14, 6, 11, 4, 17], vocab_size=256, seed=3)
    params = [greedy(max_tokens) for max_tokens in (6, 20, 9, 14, 25, 12, 17)]
    eager = run_requests(make_runner(tiny_model_dir), prompts, params, prefill_chunk_size=5)

    runner = make_runner(tiny_model_dir)
    graphs = _with_static_decode(runner)
    static = run_requests(runner, prompts, params, prefill_chunk_size=5)

    assert static == eager
    assert graphs.replays[8] > 0 and graphs.replays[4] > 0, graphs.replays  # padding happened
    assert all(count > 0 for count in graphs.replays.values()), graphs.replays


def test_mixed_and_oversized_steps_fall_back_to_eager(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    graphs = _with_static_decode(runner, (1, 2))
    assert graphs.padded_size(num_tokens=5, num_seqs=2) is None  # prefill chunk in the step
    assert graphs.padded_size(num_tokens=3, num_seqs=3) is None  # above the largest size
    assert graphs.padded_size(num_tokens=1, num_seqs=1) == 1
    assert graphs.padded_size(num_tokens=2, num_seqs=2) == 2
    prompts = prompts_of_lengths([5, 7, 6], vocab_size=256, seed=1)
    eager = run_requests(make_runner(tiny_model_dir), prompts, greedy(8))
    assert run_requests(runner, prompts, greedy(8)) == eager  # 3 decodes > 2: never the static path
    assert graphs.replays == {1: 0, 2: 0}


def test_padding_writes_only_the_null_block(tiny_model_dir):
    """A decode of 3 requests padded to 4: the pool changes at the 3 new tokens' slots and in
    block 0, nowhere else; block 0 was never in a real request's table."""
    runner = make_runner(tiny_model_dir)  # block_size 4
    _with_static_decode(runner)
    block_size = runner.block_size
    prompts = prompts_of_lengths([6, 9, 3], vocab_size=256, seed=2)
    tables = {f"r{i}": [1 + 4 * i + j for j in range(4)] for i in range(3)}
    params = greedy(4)
    new = [NewRequestData(f"r{i}", prompt, [], params, tables[f"r{i}"], 0) for i, prompt in enumerate(prompts)]
    scheduled = {f"r{i}": len(prompt) for i, prompt in enumerate(prompts)}
    first = runner.execute(SchedulerOutput(new, [], scheduled, sum(scheduled.values())))  # prefill: eager
    assert runner.decode_graphs.replays[4] == 0

    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    cached = [CachedRequestData(f"r{i}", [], len(prompt)) for i, prompt in enumerate(prompts)]
    decode = {f"r{i}": 1 for i in range(3)}
    runner.execute(SchedulerOutput([], cached, decode, 3))
    assert runner.decode_graphs.replays[4] == 1

    expected_slots = {tables[f"r{i}"][len(p) // block_size] * block_size + len(p) % block_size
                      for i, p in enumerate(prompts)}
    touched_null = False
    for (k_before, v_before), (k_after, v_after) in zip(before, runner.kv_caches):
        for old, new_pool in ((k_before, k_after), (v_before, v_after)):
            changed = (old != new_pool).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slot ids
            assert set(changed) - set(range(block_size)) == expected_slots
            touched_null |= any(slot < block_size for slot in changed)
    assert touched_null  # the padding row did write, into block 0
    assert len(first.sampled_token_ids) == 3


def test_capture_refused_without_cuda_and_triton(tiny_model_dir):
    with pytest.raises(ValueError, match="needs device cuda and attention_backend triton"):
        ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64, attention_backend="torch",
                                 cuda_graph_batch_sizes=(1, 2)))


def test_auto_sizes_capture_only_on_cuda_with_triton(tiny_model_dir):
    from workers.model_runner import AUTO_CUDA_GRAPH_SIZES, resolve_graph_sizes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_graph_sizes("auto", cuda, "triton") == AUTO_CUDA_GRAPH_SIZES
    assert resolve_graph_sizes("auto", cuda, "torch") == ()  # torch_ref syncs with the host: no capture
    assert resolve_graph_sizes("auto", cpu, "cpu") == ()
    assert resolve_graph_sizes((4, 1), cpu, "cpu") == (4, 1)  # explicit: DecodeGraphs judges them
    with pytest.raises(ValueError, match="auto"):
        resolve_graph_sizes("all", cuda, "triton")
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64))  # the default: auto
    assert runner.config.cuda_graph_batch_sizes == "auto" and runner.decode_graphs is None


def test_bad_sizes_refused(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    with pytest.raises(ValueError, match="positive"):
        DecodeGraphs(runner.model, runner.kv_caches, (0, 2), 8, capture=False)
    assert torch.equal(runner.kv_caches[0][0], torch.zeros_like(runner.kv_caches[0][0]))
