"""The run-time LoRA routes (serve_app/lora_api.py) in-process over HTTP: absent unless allowed,
behind API keys, OpenAI-shaped 400/404 for bad input, and the model list follows loads."""

import json

import httpx
import pytest

from scheduler.engine_group import UnknownLoraError
from serve_app.api import create_api
from serve_app.errors import OpenAIError
from serve_app.testing import make_test_context

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeLoras:
    """The engine client's load_lora/unload_lora over a plain registry (what EngineGroup keeps)."""

    def __init__(self, ctx) -> None:
        self.adapters: dict[str, str] = {}
        self.version = 0
        self.refuse: str | None = None  # a worker's refusal (LoraError text)

    async def load_lora(self, name, path):
        if self.refuse:
            raise OpenAIError(self.refuse, 400, param="lora_path", code="invalid_lora_adapter")
        self.adapters[name] = path
        self.version += 1
        return {"rank": 8, "num_bytes": 1, "adapters": dict(self.adapters), "version": self.version}

    async def unload_lora(self, name):
        if self.adapters.pop(name, None) is None:
            from serve_app.engine_client_ray import engine_error
            raise engine_error(UnknownLoraError(f"the LoRA adapter {name!r} cannot be found"))
        self.version += 1
        return {"adapters": dict(self.adapters), "version": self.version}


def make(tmp_path, allow=True, keys=()):
    ctx = make_test_context()
    ctx.allow_runtime_lora_updates = allow
    fake = FakeLoras(ctx)
    ctx.engine.load_lora, ctx.engine.unload_lora = fake.load_lora, fake.unload_lora
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    app = create_api(ctx, list(keys))
    return ctx, fake, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"), adapter


async def model_ids(client, headers=None):
    return [m["id"] for m in (await client.get("/v1/models", headers=headers)).json()["data"]]


async def test_load_list_use_and_unload(tmp_path):
    ctx, fake, client, adapter = make(tmp_path)
    async with client:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
        assert response.status_code == 200 and "added successfully" in response.text
        assert await model_ids(client) == ["test-model", "sql"]
        assert ctx.card.check_model("sql") == "sql"
        again = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert response.status_code == 200 and await model_ids(client) == ["test-model"]
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_bad_input_is_a_400_in_openai_shape(tmp_path):
    ctx, fake, client, adapter = make(tmp_path)
    async with client:
        for body, param in (({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "lora_path"),
                            ({"lora_name": "test-model", "lora_path": str(adapter)}, "lora_name"),
                            ({"lora_name": "", "lora_path": str(adapter)}, None),
                            ({"lora_path": str(adapter)}, None)):
            response = await client.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["message"] and (param is None or error["param"] == param)
        fake.refuse = "rank 128 is above this server's max_lora_rank 64"
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapter)})
        assert response.status_code == 400 and "max_lora_rank" in response.json()["error"]["message"]
        assert await model_ids(client) == ["test-model"]


async def test_routes_are_absent_unless_allowed_and_need_a_key(tmp_path):
    _, _, client, adapter = make(tmp_path, allow=False)
    async with client:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
        assert response.status_code == 404
    (tmp_path / "k").mkdir()
    _, _, client, adapter = make(tmp_path / "k", keys=["secret"])
    async with client:
        body = {"lora_name": "a", "lora_path": str(adapter)}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 401
        ok = await client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
