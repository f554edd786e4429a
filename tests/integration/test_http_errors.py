"""Every error case over real HTTP: its status, OpenAI's error body, and the server serves on."""

from __future__ import annotations

import httpx
import openai
import pytest

LONG_PROMPT = "word " * 3000  # > the tiny model's 1024-token context

CASES = [
    # (path, body (str = raw bytes), status, expected param prefix or None)
    ("/v1/completions", "{\"prompt\": ", 400, None),
    ("/v1/completions", "not json at all", 400, None),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "max_tokens": 4000}, 400, "max_tokens"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_error_status_and_body_then_next_request_works(server, path, body, status, param) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if isinstance(body, str):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = http.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert (error["param"] or "").startswith(param), error
        follow_up = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert follow_up.status_code == 200, follow_up.text


def test_sdk_sees_openai_errors(server) -> None:
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    assert bad.value.status_code == 400 and bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices[0].finish_reason
