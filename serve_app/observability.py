"""Per-request observability at the ingress: request ids, HTTP metrics, one log line per
generation request, and the /metrics, /live and /v1/server_info routes.

    client --x-request-id: abc--> ObservabilityMiddleware (pure ASGI, outermost)
        sets a RequestRecord in a ContextVar for the request's task (and the tasks it spawns)
        -> routes: ctx.new_id("cmpl") = "cmpl-abc"; stream_choices calls observe_output()
           for every engine delta (tokens, cached tokens, worker, first token time)
        <- response: status code counted, duration observed, x-request-id echoed
           (Serve's proxy echoes it itself, so under Serve echo_request_id is False),
           `server-timing: app;dur=<ms to the response headers>` added
        -> one INFO line for /v1/completions and /v1/chat/completions:
           request finished: id=abc route=/v1/completions status=200 finish=length
           prompt_tokens=7 output_tokens=16 cached_tokens=0 ttft=0.012s total=0.090s worker=0

Request ids: the client's `x-request-id` (Serve's proxy generates one when absent), else a
uuid. Characters outside [A-Za-z0-9._:-] become "_" and it is cut to 128 characters; the
engine request id is "<prefix>-<request id>", so a client reusing an id that is still
streaming gets a 400 from the engine. The log goes to the `ray.serve.rayllm.requests`
logger: under Serve it lands in the replica's log with Serve's own request context.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from serve_app.metrics import EngineStatsCache, IngressMetrics, render

if TYPE_CHECKING:
    from serve_app.choice_tracker import ChoiceDelta
    from serve_app.context import ServingContext
    from scheduler.outputs import RequestOutput

REQUEST_LOG = logging.getLogger("ray.serve.rayllm.requests")
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
# the generating routes, by the API each speaks (/v1/server_info counts requests per API)
API_OF_ROUTE = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
                "/v1/responses": "responses", "/v1/messages": "messages"}
GENERATION_ROUTES = frozenset(API_OF_ROUTE)
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass
class Observability:
    """What the ingress records and serves; one per replica (ServingContext.observability)."""

    metrics: IngressMetrics = field(default_factory=IngressMetrics)
    engine_stats: EngineStatsCache | None = None  # None: /metrics shows the ingress only
    echo_request_id: bool = True  # False under Serve: its proxy already echoes x-request-id
    clock: Callable[[], float] = time.perf_counter
    requests_by_api: dict[str, int] = field(default_factory=lambda: dict.fromkeys(API_OF_ROUTE.values(), 0))


@dataclass
class RequestRecord:
    """One HTTP request, filled in as it runs (engine deltas, status) and logged at its end."""

    request_id: str
    route: str
    started: float  # Observability.clock()
    first_token_time: float | None = None
    num_prompt_tokens: dict[str, int] = field(default_factory=dict)  # engine request id -> tokens
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # engine request id -> tokens
    num_output_tokens: int = 0  # tokens the engine streamed to this request
    finish_reasons: list[str] = field(default_factory=list)  # per choice, as the client saw them
    workers: set[str] = field(default_factory=set)  # labels of the workers that served it

    def add_output(self, output: RequestOutput, now: float) -> None:
        if output.new_token_ids:
            self.num_output_tokens += len(output.new_token_ids)
            if self.first_token_time is None:
                self.first_token_time = now
        self.num_prompt_tokens[output.request_id] = output.num_prompt_tokens
        self.num_cached_tokens[output.request_id] = output.num_cached_tokens
        if output.worker is not None:
            self.workers.add(output.worker)

    def log_line(self, status_code: int, total_s: float) -> str:
        finish = ",".join(sorted(set(self.finish_reasons))) or "-"
        ttft = "-" if self.first_token_time is None else f"{self.first_token_time - self.started:.3f}s"
        workers = ",".join(sorted(self.workers)) or "-"
        return (
            f"request finished: id={self.request_id} route={self.route} status={status_code} "
            f"finish={finish} prompt_tokens={sum(self.num_prompt_tokens.values())} "
            f"output_tokens={self.num_output_tokens} cached_tokens={sum(self.num_cached_tokens.values())} "
            f"ttft={ttft} total={total_s:.3f}s worker={workers}"
        )


_current: contextvars.ContextVar[tuple[RequestRecord, Observability] | None] = contextvars.ContextVar(
    "rayllm_request", default=None
)


def clean_request_id(raw: str | None) -> str:
    """A log- and id-safe request id: the client's, sanitized, or a new uuid."""
    if not raw:
        return uuid.uuid4().hex
    return _UNSAFE.sub("_", raw[:MAX_REQUEST_ID_CHARS])


def current_request_id() -> str | None:
    entry = _current.get()
    return None if entry is None else entry[0].request_id


def new_request_id(prefix: str) -> str:
    """ServingContext.new_id: "<prefix>-<the HTTP request's id>", or a uuid outside a request."""
    return f"{prefix}-{current_request_id() or uuid.uuid4().hex}"


def observe_output(output: RequestOutput, delta: ChoiceDelta | None) -> None:
    """Called by stream_choices for every engine delta of the current HTTP request."""
    entry = _current.get()
    if entry is None:
        return
    record, observability = entry
    record.add_output(output, observability.clock())
    if delta is not None and delta.finish_reason is not None:
        record.finish_reasons.append(delta.finish_reason)


def observe_finish(delta: ChoiceDelta) -> None:
    """A choice the ingress ended itself (e.g. a timeout), without an engine delta."""
    entry = _current.get()
    if entry is not None and delta.finish_reason is not None:
        entry[0].finish_reasons.append(delta.finish_reason)


class ObservabilityMiddleware:
    """Pure ASGI (streams pass through untouched; BaseHTTPMiddleware would buffer contexts)."""

    def __init__(self, app: Any, observability: Observability, routes: frozenset[str]) -> None:
        self.app = app
        self.observability = observability
        self.routes = routes  # known paths; any other path is counted as "other"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        obs = self.observability
        raw_id = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        path = scope.get("path", "")
        record = RequestRecord(clean_request_id(raw_id), path if path in self.routes else "other", obs.clock())
        status = {"code": 500}

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", ()))
                if obs.echo_request_id:
                    headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
                    headers.append((b"x-request-id", record.request_id.encode("latin-1")))
                # W3C Server-Timing: this app's time to the response headers, so a client can
                # tell a slow app from a slow proxy or network.
                app_ms = (obs.clock() - record.started) * 1000
                headers.append((b"server-timing", f"app;dur={app_ms:.1f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        token = _current.set((record, obs))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            total_s = obs.clock() - record.started
            obs.metrics.observe_http(record.route, status["code"], total_s)
            if record.route in GENERATION_ROUTES:
                obs.requests_by_api[API_OF_ROUTE[record.route]] += 1
                REQUEST_LOG.info(record.log_line(status["code"], total_s))


# --- routes ------------------------------------------------------------------------------------
def install_observability(app: FastAPI, ctx: ServingContext) -> Observability:
    """Adds /metrics, /live, /v1/server_info and the middleware (outermost, so it also
    counts what auth or body limits refuse). Call after every route is defined."""
    obs = ctx.observability if ctx.observability is not None else Observability()
    if ctx.observability is None:
        ctx.observability = obs
    tokenizer = ctx.tokenizer
    if getattr(tokenizer, "on_timing", None) is None:
        tokenizer.on_timing = obs.metrics.observe_tokenization
    obs.metrics.declare(sorted(GENERATION_ROUTES))

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render(obs.metrics, obs.engine_stats)
        return Response(body, media_type=content_type)

    @app.get("/live")
    async def live() -> JSONResponse:
        """Liveness: this replica's event loop answers. The engine's state is /health's."""
        return JSONResponse({"status": "alive"})

    @app.get("/v1/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(server_info_json(ctx, obs))

    routes = frozenset(getattr(route, "path", "") for route in app.routes) - {""}
    app.add_middleware(ObservabilityMiddleware, observability=obs, routes=routes)
    return obs


def worker_json(worker: Any) -> dict[str, Any]:
    state = "dead" if not worker.alive else ("busy" if worker.num_running_seqs or worker.num_waiting_reqs else "idle")
    return {
        "worker": worker.worker,
        "state": state,
        "lifecycle": getattr(worker, "state", "serving"),  # starting | serving | draining (elastic workers)
        "node_id": worker.node_id,
        "node_ip": worker.node_ip,
        "num_running": worker.num_running_seqs,
        "num_waiting": worker.num_waiting_reqs,
        "kv_blocks_used": worker.num_kv_blocks_used,
        "kv_blocks_total": worker.num_kv_blocks_total,
        "kv_usage": round(worker.kv_usage, 4),
        "num_steps": worker.num_steps,
        "seconds_since_last_step": worker.seconds_since_last_step,
        "busy_s": round(worker.busy_s, 3),  # a step in flight
        "gap_s": round(worker.gap_s, 3),  # between a step's return and the next one's submission
        "lora_adapters": list(getattr(worker, "lora_adapters", ())),  # held now, least recently used first
        "lora_loads": getattr(worker, "num_lora_loads", 0),
        "lora_evictions": getattr(worker, "num_lora_evictions", 0),
    }


def server_info_json(ctx: ServingContext, obs: Observability) -> dict[str, Any]:
    """Workers (node, state, KV usage, running requests) per scheduler shard, from the
    engine stats this replica last received (never a call to the engine)."""
    shards = []
    cache = obs.engine_stats
    for shard, stats in enumerate(cache.latest if cache is not None else []):
        if stats is None:
            shards.append({"shard": shard, "status": None, "workers": []})
            continue
        status = dataclasses.asdict(stats.status) if dataclasses.is_dataclass(stats.status) else None
        shards.append({"shard": shard, "status": status, "workers": [worker_json(w) for w in stats.workers]})
    report = ctx.health.readiness() if ctx.health is not None else None
    return {
        "version": ctx.version,
        "model": ctx.card.served_name,
        "max_model_len": ctx.card.max_model_len,
        "ready": None if report is None else report.ready,
        "reason": None if report is None else report.reason,
        "engine_stats_age_s": None if cache is None else cache.age_s(),
        "engine_stats_error": None if cache is None else cache.last_error,
        "fast_data_plane": ctx.fast_data_plane,  # {"enabled", "missing"}: Serve's data plane in this replica
        "prefill_rules": ctx.prefill_rules,  # the prompt-batching knobs in effect, and where each came from
        "requests_by_api": dict(obs.requests_by_api),  # answered by this replica since it started, any status
        "schedulers": shards,
    }
