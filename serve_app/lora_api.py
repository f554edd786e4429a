"""Loading and unloading LoRA adapters at run time, as vLLM's API has it. No torch here.

    POST /v1/load_lora_adapter    {"lora_name": "...", "lora_path": "/dir"}  -> 200 text
    POST /v1/unload_lora_adapter  {"lora_name": "..."}                       -> 200 text

The routes exist only with AppArgs.allow_runtime_lora_updates (else an unknown path: 404, as
vLLM registers them only when run-time updates are allowed), behind the API keys when keys
are set. The ingress checks what it can without torch (a name that is free, a directory with
a readable adapter_config.json of a LoRA adapter); a worker then loads the adapter to check
it fits the model (rank, shapes, target modules: workers/lora.py) before any request may name
it. Every refusal is OpenAI's error shape: 400 for a bad name or path (an adapter that does
not fit included), 404 for unloading a name not served. Unloading an adapter that requests
are using lets them finish on the copy their worker holds; new requests naming it get 404.

Every ingress replica learns the new list from the engine's published stats (within
metrics_poll_interval_s); the replica that took the call knows it at once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from serve_app.context import ServingContext
from serve_app.errors import OpenAIError


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256, description="The name requests select it by ('model').")
    lora_path: str = Field(min_length=1, description="The adapter's directory, as PEFT's save_pretrained writes it.")


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's clients may send it; unused


def check_adapter_dir(path: str) -> None:
    """OpenAIError 400 unless path is a directory with a LoRA adapter_config.json (no torch: the
    worker checks the weights)."""
    config_file = Path(path) / "adapter_config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise OpenAIError(f"{path} is not a PEFT adapter directory: it has no adapter_config.json", 400,
                          param="lora_path", code="invalid_lora_adapter") from None
    except (OSError, ValueError) as error:
        raise OpenAIError(f"{config_file} cannot be read as JSON: {error}", 400, param="lora_path",
                          code="invalid_lora_adapter") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise OpenAIError(f"{path}: not a LoRA adapter (peft_type {raw.get('peft_type') if isinstance(raw, dict) else None!r})",
                          400, param="lora_path", code="invalid_lora_adapter")


def set_adapters(ctx: ServingContext, adapters: dict[str, str], version: int) -> None:
    """The model card lists these adapters, unless it already has a newer list."""
    if version < ctx.lora_version:
        return
    ctx.lora_version = version
    listed = tuple(adapters.items())
    if listed != ctx.card.lora_adapters:
        ctx.card = dataclasses.replace(ctx.card, lora_adapters=listed)


def sync_adapters(ctx: ServingContext, latest: list[Any]) -> None:
    """EngineStatsCache.on_refresh: the adapters the first shard publishes (every shard gets
    every load and unload)."""
    stats = latest[0] if latest else None
    if stats is not None and getattr(stats, "lora_version", 0) > 0:
        set_adapters(ctx, stats.lora_adapters, stats.lora_version)


def install_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> str:
        name, path = body.lora_name, body.lora_path
        if name in (ctx.card.served_name, ctx.card.root):
            raise OpenAIError(f"{name!r} is the base model's name; choose another lora_name", 400, param="lora_name",
                              code="invalid_lora_adapter")
        if any(name == listed for listed, _ in ctx.card.lora_adapters):
            raise OpenAIError(f"The lora adapter {name!r} has already been loaded; unload it first", 400,
                              param="lora_name", code="invalid_lora_adapter")
        check_adapter_dir(path)
        result = await ctx.engine.load_lora(name, path)
        set_adapters(ctx, result["adapters"], result["version"])
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> str:
        result = await ctx.engine.unload_lora(body.lora_name)
        set_adapters(ctx, result["adapters"], result["version"])
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
