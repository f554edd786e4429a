"""A minimal Hugging Face baseline server: what a user writes without a serving engine.

    python -m bench.hf_server --model PATH [--port 8100] [--threads 2]

One `model.generate` per request, serialized behind one lock (no batching across requests),
streamed token by token through a generate streamer. OpenAI-compatible enough for the
benchmark: /v1/completions and /v1/chat/completions (streaming or not, `usage` with
`stream_options.include_usage`), /v1/models (with `root`), /health. Binds 127.0.0.1 only.

Supported body fields: prompt (text or token ids) / messages, max_tokens
(max_completion_tokens), temperature, top_p, n (the prompt repeated n times in one
generate batch), seed, ignore_eos (EOS is masked until max_tokens), stream, stream_options.
Others (stop, logprobs, penalties, ...) are ignored. One SSE chunk per generated token and
choice, so chunks == usage.completion_tokens; the EOS token is counted, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | None = None  # completions
    messages: list[dict] | None = None  # chat
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None


class TokenQueueStreamer(BaseStreamer):
    """Hands each generated step (one token id per batch row) to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self._loop, self._queue, self._prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)


class CancelOnDisconnect(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


def load_tokenizer(path: str):
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a bare tokenizer.json without tokenizer_config.json
        return PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))


class Generator:
    """The model, its tokenizer and the one lock every request waits on."""

    def __init__(self, path: str, name: str, gguf_file: str | None = None):
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.path, self.name = path, name
        self.tokenizer = load_tokenizer(path) if not gguf_file else AutoTokenizer.from_pretrained(path, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.lock = asyncio.Lock()
        self.num_cut = 0  # generates stopped before their end because the client left (GET /stats)

    def prompt_ids(self, body: CompletionBody) -> list[int]:
        if body.messages is not None:
            if self.tokenizer.chat_template:
                text = self.tokenizer.apply_chat_template(body.messages, tokenize=False, add_generation_prompt=True)
            else:
                text = "".join(f"{m['role']}: {m['content']}\n" for m in body.messages) + "assistant: "
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(body.prompt, list):
            return list(body.prompt)
        if body.prompt is None:
            raise HTTPException(400, "prompt or messages is required")
        return self.tokenizer(body.prompt)["input_ids"]

    def generate_kwargs(self, body: CompletionBody, ids: list[int], max_tokens: int) -> dict:
        input_ids = torch.tensor([ids] * body.n, dtype=torch.long)
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=body.temperature > 0,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
            else next(iter(self.eos_ids), 0),
        )
        if body.temperature > 0:
            kwargs.update(temperature=body.temperature, top_p=body.top_p, top_k=0)
        if body.ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        return kwargs

    async def stream_steps(self, body: CompletionBody, ids: list[int], max_tokens: int):
        """Yields one list of n token ids per step; holds the lock for the whole generate."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        cancel = threading.Event()
        kwargs = self.generate_kwargs(body, ids, max_tokens)
        kwargs["streamer"] = TokenQueueStreamer(loop, queue)
        kwargs["stopping_criteria"] = StoppingCriteriaList([CancelOnDisconnect(cancel)])

        def run() -> None:
            try:
                if body.seed is not None:
                    torch.manual_seed(body.seed)
                with torch.inference_mode():
                    self.model.generate(**kwargs)
            except Exception as e:  # surfaced to the client as a stream error
                loop.call_soon_threadsafe(queue.put_nowait, e)
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async with self.lock:
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            ended = False
            try:
                while (step := await queue.get()) is not None:
                    if isinstance(step, Exception):
                        raise step
                    yield step
                ended = True
            finally:
                cancel.set()  # client gone or done: stop generate at the next step
                self.num_cut += not ended  # before the await: a cancelled task may not come back from it
                await asyncio.to_thread(thread.join)


class Choice:
    """One sequence's incremental detokenization and finish state."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(self, token_id: int, max_tokens: int, ignore_eos: bool) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = ""
        if not full.endswith("\ufffd"):  # hold back a partial UTF-8 character
            delta, self.text = full[len(self.text):], full
        if token_id in self.eos_ids and not ignore_eos:
            self.finish_reason = "stop"
        elif len(self.ids) >= max_tokens:
            self.finish_reason = "length"
        return delta


def build_app(gen: Generator) -> FastAPI:
    app = FastAPI(title="hf-baseline")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        return {"num_cut": gen.num_cut}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": gen.name, "object": "model", "created": int(time.time()),
                "owned_by": "hf-baseline", "root": gen.path, "max_model_len": gen.max_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        return await handle(gen, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: CompletionBody):
        return await handle(gen, body, chat=True)

    return app


async def handle(gen: Generator, body: CompletionBody, *, chat: bool):
    if chat and not body.messages:
        raise HTTPException(400, "messages is required")
    ids = gen.prompt_ids(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or 16
    if not ids or len(ids) + max_tokens > gen.max_len:
        raise HTTPException(400, f"prompt ({len(ids)}) + max_tokens ({max_tokens}) must be in [1, {gen.max_len}]")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    events = _events(gen, body, ids, max_tokens, rid, chat)
    if body.stream:
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(await _collect(events, chat))


def _chunk(rid: str, model: str, chat: bool, choices: list[dict], usage: dict | None = None) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    msg = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        msg["usage"] = usage
    return msg


def _choice_payload(index: int, choice: Choice, delta: str, chat: bool) -> dict:
    if not chat:
        return {"index": index, "text": delta, "logprobs": None, "finish_reason": choice.finish_reason}
    payload = {"index": index, "delta": {"content": delta}, "finish_reason": choice.finish_reason}
    if len(choice.ids) == 1:  # the role rides on the first token's chunk, not before it
        payload["delta"]["role"] = "assistant"
    return payload


async def _events(gen: Generator, body: CompletionBody, ids: list[int], max_tokens: int, rid: str, chat: bool):
    """SSE lines: one chunk per (step, unfinished choice), then usage, then [DONE]."""
    choices = [Choice(gen.tokenizer, gen.eos_ids) for _ in range(body.n)]
    async with contextlib.aclosing(gen.stream_steps(body, ids, max_tokens)) as steps:
        async for step in steps:
            for index, (choice, token_id) in enumerate(zip(choices, step)):
                if choice.finish_reason is not None:
                    continue  # generate pads rows that already finished
                delta = choice.add(token_id, max_tokens, body.ignore_eos)
                payload = _choice_payload(index, choice, delta, chat)
                yield f"data: {json.dumps(_chunk(rid, gen.name, chat, [payload]))}\n\n"
            if all(c.finish_reason is not None for c in choices):
                break
    completion_tokens = sum(len(c.ids) for c in choices)
    usage = {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
             "total_tokens": len(ids) + completion_tokens}
    if (body.stream_options or {}).get("include_usage") or not body.stream:
        yield f"data: {json.dumps(_chunk(rid, gen.name, chat, [], usage))}\n\n"
    yield "data: [DONE]\n\n"


async def _collect(events, chat: bool) -> dict:
    """The non-streaming response, assembled from the same events."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage, first = None, None
    async for line in events:
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        msg = json.loads(data)
        first = first or msg
        usage = msg.get("usage", usage)
        for c in msg["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"]["content"] if chat else c["text"])
            finish[c["index"]] = c["finish_reason"]
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": finish[i]}
                   for i, t in sorted(texts.items())]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": finish[i]}
                   for i, t in sorted(texts.items())]
    return {"id": first["id"], "object": "chat.completion" if chat else "text_completion",
            "created": first["created"], "model": first["model"], "choices": choices, "usage": usage}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF model dir (config.json + safetensors + tokenizer)")
    p.add_argument("--gguf-file", default=None, help="a GGUF file name inside --model to dequantize on load")
    p.add_argument("--served-model-name", default=None, help="id in /v1/models (default: --model)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = Generator(args.model, args.served_model_name or args.model, args.gguf_file)
    uvicorn.run(build_app(gen), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
