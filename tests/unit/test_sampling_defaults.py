"""A model's generation_config.json sampling values are the defaults of requests that leave them out."""

import json

import pytest

from serve_app.config import AppArgs
from serve_app.model_card import ModelCard
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.sampling import to_sampling_params
from serve_app.sampling_defaults import read_sampling_defaults

MESSAGES = [{"role": "user", "content": "hi"}]


def card_with(defaults: dict) -> ModelCard:
    return ModelCard("m", "/models/m", 1024, 1000, (2,), sampling_defaults=defaults)


def test_the_sampling_fields_of_generation_config_are_read_and_the_rest_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 2048}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                                "repetition_penalty": 1.1}


@pytest.mark.parametrize("bad", [{"temperature": 3.0}, {"top_p": 0.0}, {"top_k": 2.5}, {"temperature": "hot"},
                                 {"repetition_penalty": 0}, {"min_p": True}])
def test_a_value_no_request_could_set_is_not_a_default(tmp_path, bad):
    good = {"min_p": 0.1} if "min_p" not in bad else {"top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({**good, **bad}))
    assert read_sampling_defaults(tmp_path) == good


def test_no_or_a_broken_generation_config_leaves_openais_defaults(tmp_path):
    assert read_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) == {}


def test_a_field_left_out_takes_the_models_value_and_one_set_keeps_its_own():
    card = card_with({"temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    left_out = to_sampling_params(ChatCompletionRequest(messages=MESSAGES), 5, card)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p, left_out.repetition_penalty) == (
        0.2, 0.9, 20, 0.05, 1.1)
    # OpenAI's default values, sent explicitly, are the client's choice and win
    explicit = to_sampling_params(CompletionRequest(prompt="x", temperature=1.0, top_p=1.0, top_k=None, min_p=0.0,
                                                    repetition_penalty=1.0), 5, card)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p, explicit.repetition_penalty) == (
        1.0, 1.0, None, 0.0, 1.0)
    greedy = to_sampling_params(ChatCompletionRequest(messages=MESSAGES, temperature=0), 5, card)
    assert greedy.temperature == 0.0 and greedy.top_p == 0.9


def test_without_model_defaults_a_request_gets_openais():
    params = to_sampling_params(CompletionRequest(prompt="x"), 5, card_with({}))
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        1.0, 1.0, None, 0.0, 1.0)


def test_the_app_reads_generation_config_unless_told_off():
    assert AppArgs().generation_config == "auto"
    assert AppArgs(generation_config="off").generation_config == "off"
    with pytest.raises(ValueError):
        AppArgs(generation_config="vllm")
