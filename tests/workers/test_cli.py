"""rayllm-generate end to end on the tiny model (the real default model is covered by the README command)."""

from __future__ import annotations

import pytest

from workers import cli


@pytest.mark.parametrize("driver", ["engine", "simple"])
def test_cli_generates_greedy_text_from_a_chat_prompt(tiny_model_dir, capsys, driver):
    argv = ["--model", str(tiny_model_dir), "--max-tokens", "12", "--driver", driver, "--stats", "Paris is"]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert first.out.strip()  # random weights: some text, not necessarily words
    assert "prompt +" in first.err and "generated tokens" in first.err
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first.out  # greedy by default: deterministic


def test_cli_chat_template_and_raw_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = cli.encode_prompt(tokenizer, "hello", "be brief", raw=False)
    raw = cli.encode_prompt(tokenizer, "hello", None, raw=True)
    text = tokenizer.decode(chat)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(raw) == "hello"


def test_cli_bad_model_path_fails_clearly(tmp_path):
    from workers.loader import ModelPathError

    with pytest.raises(ModelPathError, match="does not exist"):
        cli.main(["--model", str(tmp_path / "missing"), "hi"])
