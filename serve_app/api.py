"""The FastAPI app: routes over a ServingContext. No Ray here, so tests run it in-process.

Routes: /v1/completions, /v1/chat/completions, /v1/responses (OpenAI's Responses API,
serve_app/responses.py), /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API,
serve_app/messages.py), /v1/models, /tokenize, /detokenize, /health, /version, and
(serve_app/observability.py) /metrics, /live, /v1/server_info, and with run-time LoRA updates
allowed, /v1/load_lora_adapter and /v1/unload_lora_adapter (serve_app/lora_api.py). Later layers (auth, metrics,
body limits) add middleware or routes to the app that create_api returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from serve_app import chat, completions, messages, responses
from serve_app.auth import ApiKeyMiddleware
from serve_app.context import ServingContext
from serve_app.errors import (
    UNAVAILABLE_RETRY_AFTER_S,
    anthropic_error_body,
    draining_error,
    error_response,
    install_error_handlers,
)
from serve_app.limits import BodySizeLimitMiddleware
from serve_app.lora_api import install_lora_routes
from serve_app.observability import install_observability
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
)
from serve_app.sse import named_sse_stream, sse_stream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LARGE_BODY_BYTES = 1 << 18  # JSON bodies above this are parsed on the app's JSON thread


def off_loop_json_route(executor: ThreadPoolExecutor) -> type[APIRoute]:
    """A route class that parses large JSON bodies on `executor`, so a burst of multi-
    megabyte prompts does not hold the event loop (FastAPI would json.loads them on the
    loop; Starlette caches the result in request._json, which FastAPI then reuses)."""

    class OffLoopJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route_handler(request: Request) -> Response:
                body = await request.body()
                if len(body) > LARGE_BODY_BYTES:
                    try:
                        loop = asyncio.get_running_loop()
                        request._json = await loop.run_in_executor(executor, json.loads, body)
                    except ValueError:
                        pass  # FastAPI parses again on the loop and reports the JSON error
                return await handler(request)

            return route_handler

    return OffLoopJSONRoute


# Answered as usual while draining: probes and scrapes (/health itself says 503 "draining").
OPEN_WHILE_DRAINING = frozenset({"/health", "/live", "/metrics", "/v1/server_info"})


class DrainingMiddleware:
    """Once the app is shutting down (ctx.draining), every HTTP request but the probes gets an
    OpenAI-shaped 503 with Retry-After, unknown paths included (never a 404 from us then)."""

    def __init__(self, app: Any, ctx: ServingContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.ctx.draining and scope.get("path") not in OPEN_WHILE_DRAINING:
            await error_response(draining_error(), scope.get("path", ""))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_api(ctx: ServingContext, api_keys: Sequence[str] = ()) -> FastAPI:
    """The app; with api_keys, every route but /health, /live and /metrics needs one (auth.py)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.draining = True  # the host stops the app (Serve: after its drain): late arrivals get 503

    app = FastAPI(title="rayllm-serve", version=ctx.version, lifespan=lifespan)
    # One thread: parses queue up instead of several threads contending with the loop for the GIL.
    app.router.route_class = off_loop_json_route(ThreadPoolExecutor(1, thread_name_prefix="json"))
    install_error_handlers(app)
    app.state.ctx = ctx
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=ctx.limits.max_body_bytes)
    app.add_middleware(DrainingMiddleware, ctx=ctx)  # after auth: a 503 tells only a client with a key
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys))  # added last: runs first

    async def generate(endpoint: Any, body: Any,
                       encode: Callable[[AsyncIterator[Any]], AsyncIterator[bytes]] = sse_stream) -> Any:
        """endpoint: the completions, chat, responses or messages module (prepare_stream / complete);
        encode: its stream as SSE bytes (the Responses and Messages APIs' are named events)."""
        if ctx.draining:  # began after DrainingMiddleware let the request in (its body was read meanwhile)
            raise draining_error()
        if body.stream:
            stream = await endpoint.prepare_stream(body, ctx)
            return StreamingResponse(encode(stream), media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await endpoint.complete(body, ctx))

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest) -> Any:
        return await generate(completions, body)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest) -> Any:
        return await generate(chat, body)

    @app.post("/v1/messages", response_model=None)
    async def create_message(body: messages.MessagesRequest) -> Any:
        return await generate(messages, body, functools.partial(named_sse_stream, error_body=anthropic_error_body))

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: responses.ResponsesRequest) -> Any:
        return await generate(responses, body, functools.partial(named_sse_stream, error_body=responses.error_event))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: messages.CountTokensRequest) -> dict[str, Any]:
        return await messages.count_tokens(body, ctx)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = ctx.card
        model = {
            "id": card.served_name,
            "object": "model",
            "created": card.created,
            "owned_by": "rayllm-serve",
            "root": card.root,
            "parent": None,
            "max_model_len": card.max_model_len,
            "backend": {**card.backend, "reasoning_parser": card.reasoning_parser,
                        "tool_call_parser": card.tool_call_parser, "sampling_defaults": card.sampling_defaults},
        }
        adapters = [{"id": name, "object": "model", "created": card.created, "owned_by": "rayllm-serve", "root": path,
                     "parent": card.served_name, "max_model_len": card.max_model_len}
                    for name, path in card.lora_adapters]  # as vLLM lists its LoRA modules
        return {"object": "list", "data": [model, *adapters]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest) -> dict[str, Any]:
        ctx.card.check_model(body.model)
        if isinstance(body, TokenizePromptRequest):
            tokens = await ctx.tokenizer.encode(body.prompt, body.add_special_tokens)
        else:
            messages = [message.as_template_dict() for message in body.messages]
            tokens = await ctx.tokenizer.encode_chat(messages, body.add_generation_prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.card.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.card.check_model(body.model)
        ctx.card.check_token_ids(body.tokens, "tokens")
        return {"prompt": await ctx.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.draining:
            return JSONResponse({"status": "unavailable", "reason": "draining for shutdown"}, status_code=503,
                                headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        if ctx.health is None:
            return JSONResponse({"status": "ok", "reason": "no engine monitor configured"})
        report = ctx.health.readiness()
        body: dict[str, Any] = {"status": "ok" if report.ready else "unavailable", "reason": report.reason}
        if report.status is not None and dataclasses.is_dataclass(report.status):
            body["engine"] = dataclasses.asdict(report.status)
        return JSONResponse(body, status_code=200 if report.ready else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ctx.version}

    if ctx.allow_runtime_lora_updates:
        install_lora_routes(app, ctx)
    install_observability(app, ctx)  # /metrics, /live, /v1/server_info; its middleware goes outermost
    return app
