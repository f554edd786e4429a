"""bench/bench_gpu.py on CPU with a small model: GPU machines are lent rarely and briefly, so the
benchmark they run must not fail there for a reason a CPU could have shown."""

from __future__ import annotations

import argparse

from bench import bench_gpu


def test_decode_rows_compare_our_runner_with_hf_on_the_same_random_weights(tmp_path, capsys):
    config = bench_gpu.SMOLLM2_135M | {"num_hidden_layers": 2, "vocab_size": 512, "hidden_size": 128,
                                        "intermediate_size": 256, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 32}
    bench_gpu.write_random_model(tmp_path / "model", config)
    args = argparse.Namespace(device="cpu", dtype="float32", attention_backend="torch", prompt_len=12,
                              new_tokens=6, repeats=1, skip_hf=False)
    bench_gpu._decode_rows(args, tmp_path / "model", [1, 3])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.count("|") == 5]
    cells = {(row[0].strip(), row[1].strip()): row for row in rows[1:]}
    assert set(cells) == {(batch, side) for batch in ("1", "3") for side in ("ours eager", "HF generate")}
    # fp32 on CPU: HF's greedy tokens equal ours for every sequence
    assert cells["3", "HF generate"][5].strip() == "3/3" and cells["1", "HF generate"][5].strip() == "1/1"
    assert float(cells["3", "ours eager"][2].split()[0]) > 0
