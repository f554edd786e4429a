"""Reliability and security at the HTTP edge, in-process (no Ray): API keys, body and input limits, timeouts,
429 / 503 mapping before any response byte, drain, and resuming after a scheduler restart."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from serve_app.api import create_api
from serve_app.auth import KeyChecker, api_keys_from_env
from serve_app.errors import (
    UNAVAILABLE_RETRY_AFTER_S,
    EngineUnavailableError,
    SchedulerGoneError,
    draining_error,
    queue_full_error,
)
from serve_app.limits import ServerLimits
from serve_app.resume import ResumingEngineClient
from serve_app.testing import ScriptedEngine, make_test_context, text_tokens
from scheduler.outputs import EngineRequest, FinishReason, RequestOutput
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client(ctx, api_keys=()) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_api(ctx, api_keys)), base_url="http://test")


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- auth -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Basic k1"}, 401),
    ({"Authorization": "Bearer"}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "Bearer k1x"}, 401),
    ({"Authorization": "Bearer k2"}, 200),
    ({"Authorization": "bearer  k1 "}, 200),
])
async def test_auth_matrix(headers, status) -> None:
    async with client(make_test_context(), api_keys=["k1", "k2"]) as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert response.status_code == status, response.text
        if status == 401:
            assert error_of(response)["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
            assert "k1" not in response.text and "wrong" not in response.text
        assert (await http.get("/health")).status_code == 200  # exempt
        assert (await http.get("/v1/models", headers=headers)).status_code == status


def test_keys_from_env_and_checker() -> None:
    assert api_keys_from_env({"RAYLLM_API_KEYS": " a, ,b "}) == ["a", "b"]
    assert api_keys_from_env({}) == []
    checker = KeyChecker(["a"])
    assert checker.enabled and checker.is_valid("Bearer a") and not checker.is_valid("Bearer b")
    assert not KeyChecker([]).enabled


# --- body size and input limits ----------------------------------------------------------------------
async def test_body_over_the_limit_is_413_by_header_and_while_streaming() -> None:
    ctx = make_test_context()
    ctx.limits = ServerLimits(max_body_bytes=2048)
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()

    async def chunks():
        for i in range(0, len(big), 512):
            yield big[i:i + 512]

    async with client(ctx) as http:
        response = await http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
        response = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
        assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
        assert (await http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})).status_code == 200


async def test_operator_limits_are_400s_naming_the_field() -> None:
    ctx = make_test_context(ScriptedEngine(responder=lambda r, i: text_tokens("abcdefghijklmnopqrstuvwxyz")))
    ctx.limits = ServerLimits(max_n=2, max_choices=4, max_tokens=5, max_prompt_tokens=10)
    cases = [
        ({"prompt": "x", "n": 3}, "n"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),
        ({"prompt": "x", "max_tokens": 6}, "max_tokens"),
        ({"prompt": "x" * 11}, "prompt"),
        ({"prompt": "x", "top_k": 10**9}, "top_k"),
        ({"prompt": "x", "timeout": 0}, "timeout"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ]
    async with client(ctx) as http:
        for body, param in cases:
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 400, (body, response.text)
            assert (error_of(response)["param"] or "").startswith(param), (body, response.text)
        capped = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": None})
        assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 5


# --- timeouts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_timeout_returns_what_was_generated_with_finish_reason_timeout(stream) -> None:
    engine = ScriptedEngine(responder=lambda r, i: text_tokens("a" * 500), step_delay_s=0.02)
    async with client(make_test_context(engine)) as http:
        body = {"prompt": "x", "max_tokens": 100, "timeout": 0.3, "stream": stream}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200
        if stream:
            events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            choice = response.json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert finish == "timeout" and 0 < len(text) < 100 and set(text) == {"a"}
    assert engine.aborted == [engine.submitted[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_timeout_before_any_token_is_408(stream) -> None:
    engine = ScriptedEngine(first_delay_s=10.0)
    async with client(make_test_context(engine)) as http:
        response = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "timeout": 0.2, "stream": stream})
        assert response.status_code == 408 and error_of(response)["code"] == "timeout"
    assert [request.request_id for request in engine.submitted] == engine.aborted and len(engine.aborted) == 1


# --- 429 and 503 before the response starts ------------------------------------------------------------
class RefusingClient:
    def __init__(self, error) -> None:
        self.error = error

    async def generate(self, request):
        raise self.error
        yield  # pragma: no cover

    def abort(self, request_id):
        pass

    async def status(self):
        raise NotImplementedError


@pytest.mark.parametrize("stream", [False, True])
async def test_queue_full_is_429_with_retry_after_also_for_streams(stream) -> None:
    ctx = make_test_context()
    ctx.engine = RefusingClient(queue_full_error("queue full", 3))
    async with client(ctx) as http:
        response = await http.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
        assert error_of(response)["code"] == "queue_full" and error_of(response)["type"] == "rate_limit_error"


async def test_draining_ingress_refuses_new_requests_and_is_not_ready() -> None:
    ctx = make_test_context()
    ctx.draining = True
    async with client(ctx) as http:
        response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 503 and error_of(response)["code"] == "server_draining"
        assert response.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER_S)
        health = await http.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER_S)


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/completions", {"prompt": "x", "stream": True}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("GET", "/v1/no-such-route", None),  # not a 404 while draining
    ("POST", "/v1/completions", {"prompt": 5}),  # not a 400 either: nothing is read
])
async def test_every_route_but_the_probes_is_503_with_retry_after_while_draining(method, path, body) -> None:
    ctx = make_test_context()
    ctx.draining = True
    async with client(ctx) as http:
        response = await http.request(method, path, json=body)
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER_S)
        assert error_of(response)["code"] == "server_draining"
        assert error_of(response)["type"] == "service_unavailable_error"
        for probe in ("/live", "/metrics", "/v1/server_info"):
            assert (await http.get(probe)).status_code == 200, probe


async def test_the_apps_lifespan_shutdown_starts_draining() -> None:
    """Serve (like any ASGI host) ends the app's lifespan when it stops the replica."""
    ctx = make_test_context()
    app = create_api(ctx)
    incoming: asyncio.Queue = asyncio.Queue()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    for event in ("lifespan.startup", "lifespan.shutdown"):
        incoming.put_nowait({"type": event})
    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, incoming.get, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert ctx.draining
    async with client(ctx) as http:
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 503


@pytest.mark.parametrize("error, code", [(draining_error(), "server_draining"),
                                         (EngineUnavailableError(), "engine_unavailable")])
async def test_an_engine_that_drains_or_is_gone_is_503_with_retry_after(error, code) -> None:
    ctx = make_test_context()
    ctx.engine = RefusingClient(error)
    async with client(ctx) as http:
        response = await http.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and error_of(response)["code"] == code
        assert response.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER_S)


async def test_an_unexpected_error_once_draining_began_is_503_not_500() -> None:
    ctx = make_test_context()

    class FailingAsShutdownBegins(RefusingClient):
        async def generate(self, request):
            ctx.draining = True
            raise RuntimeError("cannot schedule new futures after shutdown")
            yield  # pragma: no cover

    ctx.engine = FailingAsShutdownBegins(None)
    # Starlette re-raises after answering (for the server's log): keep the answer
    transport = httpx.ASGITransport(app=create_api(ctx), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and error_of(response)["code"] == "server_draining"
        assert response.headers["retry-after"] == str(UNAVAILABLE_RETRY_AFTER_S)
        ctx.draining = False
        ctx.engine = RefusingClient(RuntimeError("boom"))  # outside a shutdown: a 500
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 500


# --- resuming after a scheduler restart -----------------------------------------------------------------
class DyingSchedulerClient:
    """Streams token 100 + output position + 1000 * the sequence's seed (seed + index for n>1,
    as a fork child's); 'dies' after die_after tokens of each call."""

    def __init__(self, die_after: list[int]) -> None:
        self.die_after = list(die_after)  # one entry per call; -1: never
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.num_waits = 0

    async def generate(self, request):
        self.requests.append(request)
        die_after = self.die_after.pop(0) if self.die_after else -1
        params = request.sampling_params
        positions = [len(request.output_token_ids)] * params.n
        produced = 0
        while any(p < params.max_tokens for p in positions):
            for index in range(params.n):
                if positions[index] >= params.max_tokens:
                    continue
                if produced == die_after:
                    raise SchedulerGoneError("scheduler died")
                p = positions[index]
                positions[index] += 1
                produced += 1
                finish = FinishReason.LENGTH if p + 1 == params.max_tokens else None
                seed = (params.seed or 0) + (index if params.n > 1 else 0)
                yield RequestOutput(request.request_id, index, [100 + p + 1000 * seed], None, finish, 3, 0)
            await asyncio.sleep(0)

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def wait_ready(self, timeout_s):
        self.num_waits += 1

    async def status(self):
        return None


async def gather_tokens(client_, request) -> dict[int, list[int]]:
    seqs: dict[int, list[int]] = {}
    finished: set[int] = set()
    async for output in client_.generate(request):
        assert output.request_id == request.request_id and output.index not in finished
        seqs.setdefault(output.index, []).extend(output.new_token_ids)
        if output.finished:
            finished.add(output.index)
    assert finished == set(range(request.sampling_params.n))
    return seqs


@pytest.mark.parametrize("n", [1, 3])
async def test_resuming_client_continues_each_sequence_without_gap_or_duplicate(n) -> None:
    inner = DyingSchedulerClient([0, 4 * n, 2, 1])  # dies at submission, then mid-stream
    resuming = ResumingEngineClient(inner, max_resumes=5)
    request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=6, n=n, seed=5))
    seqs = await gather_tokens(resuming, request)
    assert seqs == {i: [100 + p + 1000 * (5 + i) for p in range(6)] for i in range(n)}
    assert inner.num_waits >= 2  # at submission, then mid-stream
    later = inner.requests[1:]
    assert all(q.sampling_params.n == 1 for q in later if n > 1)
    assert [q.request_id for q in later[:1]] == (["r@1"] if n == 1 else ["r@1.0"])
    if n > 1:  # each sequence keeps its fork child's seed
        assert {q.sampling_params.seed for q in later} <= {5, 6, 7}
    assert all(len(q.output_token_ids) < 6 for q in later)


async def test_resuming_client_gives_up_after_max_resumes() -> None:
    resuming = ResumingEngineClient(DyingSchedulerClient([1, 1, 1]), max_resumes=2)
    with pytest.raises(SchedulerGoneError):
        await gather_tokens(resuming, EngineRequest("r", [1], SamplingParams(max_tokens=6)))


async def test_resuming_client_aborts_the_current_engine_request() -> None:
    inner = DyingSchedulerClient([1])
    resuming = ResumingEngineClient(inner)
    stream = resuming.generate(EngineRequest("r", [1], SamplingParams(max_tokens=50)))
    for _ in range(3):
        await anext(stream)
    resuming.abort("r")
    assert inner.aborted == ["r@1"]
    await stream.aclose()


def test_continuation_is_a_plain_dataclass_copy() -> None:
    from serve_app.resume import continuation

    q = EngineRequest("r", [1, 2], SamplingParams(max_tokens=5, n=2, seed=1))
    c = continuation(q, 1, [7, 8], 2)
    assert dataclasses.astuple(c)[:2] == ("r@2.1", [1, 2]) and c.output_token_ids == (7, 8)
    assert c.sampling_params.n == 1 and c.sampling_params.seed == 2
