"""Layers with a fixed-size state per sequence (workers/recurrent.py), on the lfm2 family.

The catalog's tiny lfm2 checkpoint equals transformers in tests/workers/test_families.py
(chunked prompts beside decodes). Here: the causal convolution cut anywhere equals it whole;
the scheduler's prefix-cache hits (restored from a state snapshot), n>1 forks (the parent's
state copied) and preemption give transformers' tokens; a stale snapshot and a convolution
state one token off both fail them; a step that does not continue a state is refused; and
the recurrent layers add nothing to the KV pool's bytes per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_hits_forks_and_preemption_answer_as_transformers,
                            engine_of, greedy, make_runner, prompts_of_lengths)
from tiny_model import build_tiny_model_dir

from workers import recurrent
from workers.config import ModelConfig
from workers.model_runner import kv_bytes_per_token
from workers.recurrent import StateLostError, StateRows, StateStep, causal_conv, causal_conv_step, run_mixer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("recurrent") / "lfm2", **FAMILIES["lfm2"])


def test_a_causal_convolution_cut_anywhere_equals_it_whole():
    torch.manual_seed(0)
    channels, width, n = 6, 4, 13
    weight, bias, x = torch.randn(channels, width), torch.randn(channels), torch.randn(n, channels)
    whole = F.conv1d(x.t()[None], weight[:, None], bias, padding=width - 1, groups=channels)[0, :, :n].t()
    state = torch.zeros(width - 1, channels)
    pieces = [causal_conv(x[:1], weight, bias, state), causal_conv(x[1:8], weight, bias, state)]
    states = torch.zeros(3, width - 1, channels)
    states[2] = state
    for t in range(8, n):  # one token at a time, the sequence in row 2 of a batch's pool
        pieces.append(causal_conv_step(x[t:t + 1], weight, bias, states, torch.tensor([2])))
    torch.testing.assert_close(torch.cat(pieces), whole)


class _Doubling:
    """A toy mixer: out = x + 2 * (its state: the sum of the tokens before), to see cuts and rows."""

    def state_specs(self):
        return (((3,), torch.float32),)

    def prefill(self, model, x, pool, row):
        before = pool[0][row] + torch.cumsum(x, 0) - x
        pool[0][row] += x.sum(0)
        return x + 2 * before

    def decode(self, model, x, pool, rows):
        out = x + 2 * pool[0][rows]
        pool[0].index_add_(0, rows, x)
        return out


def test_a_snapshot_is_the_state_at_its_cut_and_the_outputs_do_not_change():
    x = torch.arange(24, dtype=torch.float32).view(8, 3)
    pool = (torch.zeros(5, 3),)
    step = StateStep(query_start_loc=[0, 1, 6, 7, 8], rows=[3, 4, 2, 1], saves={1: (2, 0)})
    out = run_mixer(_Doubling(), None, x, pool, step)
    plain = run_mixer(_Doubling(), None, x, (torch.zeros(5, 3),), StateStep([0, 1, 6, 7, 8], [3, 4, 2, 1]))
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(pool[0][0], x[1:3].sum(0))  # sequence 1's state after 2 of its 5 tokens
    torch.testing.assert_close(pool[0][4], x[1:6].sum(0))


def test_a_step_that_does_not_continue_a_state_is_refused():
    rows = StateRows([(((2,), torch.float32),), None], num_seqs=2, num_snapshots=1, device=torch.device("cpu"))
    rows.start("a", 0, None)
    rows.step(["a"], [0], [5], [0, 5], {})
    with pytest.raises(StateLostError, match="from token 4, its state holds 5"):
        rows.step(["a"], [4], [1], [0, 1], {})
    with pytest.raises(StateLostError, match="no snapshot, no fork"):
        rows.start("b", 8, None)


def test_forks_grow_the_rows_and_keep_every_state():
    rows = StateRows([(((2,), torch.float32),)], num_seqs=1, num_snapshots=1, device=torch.device("cpu"))
    rows.start("p", 0, None)
    rows.pools[0][0][rows.row_of["p"]] = torch.tensor([1.0, 2.0])
    rows.step(["p"], [0], [3], [0, 3], {})
    for child in ("p-0", "p-1", "p-2"):
        rows.fork("p", child)
    rows.release("p")
    assert rows.num_grows == 1 and rows.num_rows > 2 and {rows.position[c] for c in ("p-0", "p-1", "p-2")} == {3}
    for child in ("p-0", "p-1", "p-2"):
        assert rows.pools[0][0][rows.row_of[child]].tolist() == [1.0, 2.0]
        rows.release(child)
    assert not rows.row_of and sorted(rows.free) == list(range(1, rows.num_rows))  # row 0: the snapshot


def test_prefix_hits_forks_and_preemption_continue_the_states(model_dir):
    runner = make_runner(model_dir, num_blocks=400, state_snapshots=4)
    assert runner.model_info.has_recurrent_state and runner.model_info.num_state_snapshots == 4
    oracle = HfOracle(model_dir)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, oracle)
    prefix, tail = prompts_of_lengths([30, 5], runner.model_info.vocab_size, seed=6)
    engine = engine_of(runner)
    engine.generate([prefix], greedy(8))
    other = engine.generate([prefix[:20] + tail], greedy(8))[0]  # shares 5 cached blocks, but no state there
    assert other.num_cached_tokens == 0
    assert_greedy_matches(other.sequences[0].token_ids, oracle.greedy(prefix[:20] + tail, 8))


def test_a_stale_snapshot_fails(model_dir, monkeypatch):
    """A hit that restores a snapshot never written (the save skipped): its tokens leave transformers'."""
    runner = make_runner(model_dir, num_blocks=400, state_snapshots=4)
    prompt = prompts_of_lengths([30], runner.model_info.vocab_size, seed=6)[0]
    expected = HfOracle(model_dir).greedy(prompt, 8).token_ids
    engine = engine_of(runner)
    copy_rows = recurrent.copy_rows
    monkeypatch.setattr(recurrent, "copy_rows", lambda pools, src, dst: None if len(pools) == 1 else
                        copy_rows(pools, src, dst))  # run_mixer's save copies one layer's pool at a time
    engine.generate([prompt], greedy(8))
    hit = engine.generate([prompt], greedy(8))[0]
    assert hit.num_cached_tokens == 28 and hit.sequences[0].token_ids != expected


def test_a_convolution_state_one_token_off_fails(model_dir, monkeypatch):
    """Each decode's convolution state shifted by one token too many: chunked prompts beside decodes leave
    transformers' tokens."""
    prompts = prompts_of_lengths([17, 40], 384, seed=1)
    oracle = HfOracle(model_dir)

    from workers.layer_ops import NativeOps, TorchOps

    for ops in (NativeOps, TorchOps):  # whichever the runner took
        def shifted(self, x, weight, bias, states, rows, silu, conv_step=ops.conv_step):
            y = conv_step(self, x, weight, bias, states, rows, silu)  # right, then the window one token on
            window = states.index_select(0, rows)
            states.index_copy_(0, rows, torch.cat([window[:, 1:], torch.zeros_like(window[:, :1])], dim=1))
            return y

        monkeypatch.setattr(ops, "conv_step", shifted)
    engine = engine_of(make_runner(model_dir, num_blocks=400))
    results = engine.generate(prompts, greedy(8))
    assert all(r.sequences[0].token_ids != oracle.greedy(p, 8).token_ids for r, p in zip(results, prompts))


def test_recurrent_layers_add_no_bytes_per_token(model_dir):
    config = ModelConfig.from_model_dir(model_dir)
    attention_only = dataclasses.replace(config, traits=dataclasses.replace(config.traits, mixers=None))
    assert kv_bytes_per_token(config, torch.float32) * 4 == kv_bytes_per_token(attention_only, torch.float32)


def test_lora_adapters_are_refused_in_one_line(model_dir):
    from workers.lora import LoraError

    with pytest.raises(LoraError, match=r"recurrent layers \(lfm2\) are not supported yet"):
        make_runner(model_dir, lora_adapters=(("adapter", str(model_dir / "adapter")),))


def test_decay_weights_are_exact_zeros_below_the_floor_never_subnormal():
    log_decay = torch.tensor([0.0, -1.0, -59.9, -60.1, -95.0, -float("inf")])
    weights = recurrent.decay_weights(log_decay)
    assert torch.equal(weights[:3], torch.exp(log_decay[:3]))
    assert torch.equal(weights[3:], torch.zeros(3))  # exp(-95) alone would be subnormal
    assert bool((weights[:3] >= torch.finfo(torch.float32).tiny).all())
