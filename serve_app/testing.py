"""Test doubles for the text layer: a byte-level tokenizer and a scripted engine.

ByteTokenizer has the slice of the Hugging Face tokenizer API that TokenizerService uses;
one token per UTF-8 byte, so multi-byte characters split across tokens naturally.
ScriptedEngine has Engine's add_request/abort surface and emits scripted tokens one per
step per sequence, honouring max_tokens, EOS, stop_token_ids, n, logprobs and aborts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from scheduler.outputs import EngineRequest, FinishReason, RequestOutput, TokenLogprobs

EOS_ID = 256
SPECIAL_TOKENS = {256: "<eos>", 257: "<|im_start|>", 258: "<|im_end|>"}
VOCAB_SIZE = 259
# gpt-oss's harmony markers as special tokens, for a ByteTokenizer(special_tokens=HARMONY_SPECIAL_TOKENS)
HARMONY_SPECIAL_TOKENS = {**SPECIAL_TOKENS, 259: "<|start|>", 260: "<|channel|>", 261: "<|message|>", 262: "<|end|>",
                          263: "<|constrain|>"}


class ByteTokenizer:
    eos_token_id = EOS_ID

    def __init__(self, chat_template: str = "chatml", generation_prompt: str = "<|im_start|>assistant\n",
                 special_tokens: dict[int, str] | None = None) -> None:
        self.chat_template = chat_template  # its text is what the server reads (think tags, tools)
        self.generation_prompt = generation_prompt  # e.g. "<|im_start|>assistant\n<think>\n" for a thinking model
        self.special_tokens = special_tokens or SPECIAL_TOKENS  # id -> text, each one token

    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            special = next((i for i, s in self.special_tokens.items() if rest.startswith(s)), None)
            if special is not None:
                ids.append(special)
                rest = rest[len(self.special_tokens[special]):]
            else:
                ids.extend(rest[0].encode())
                rest = rest[1:]
        return ids[:max_length] if truncation else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token_id in token_ids:
            if token_id in self.special_tokens:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                if not skip_special_tokens:
                    parts.append(self.special_tokens[token_id])
            else:
                pending.append(token_id)
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """ChatML; tools (passed only when chat_template mentions them) as a system turn of JSON."""
        assert not tokenize
        if messages[0]["role"] == "assistant":
            raise ValueError("conversation must not start with an assistant message")
        text = "" if tools is None else f"<|im_start|>system\n{json.dumps(tools)}<|im_end|>\n"
        text += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + (self.generation_prompt if add_generation_prompt else "")


def text_tokens(text: str) -> list[int]:
    return list(text.encode())


@dataclass
class ScriptedEngine:
    """Sequence i of a request generates responder(request, i), then EOS."""

    responder: Callable[[EngineRequest, int], list[int]] = lambda request, index: text_tokens("hello world")
    step_delay_s: float = 0.0
    first_delay_s: float = 0.0  # seconds from a request's submission to its first token
    num_cached_tokens: int = 0
    eos_token_ids: tuple[int, ...] = (EOS_ID,)

    def __post_init__(self) -> None:
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.submitted: list[EngineRequest] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_request(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.submitted.append(request)
        self.running.add(request.request_id)
        params = request.sampling_params
        scripts = [self.responder(request, i) + list(self.eos_token_ids[:1]) for i in range(params.n)]
        active = list(range(params.n))
        try:
            await asyncio.sleep(self.first_delay_s)
            for position in range(params.max_tokens):
                if request.request_id in self.aborted or not active:
                    return
                for index in list(active):
                    output = self._output(request, index, scripts[index][position % len(scripts[index])], position)
                    if output.finished:
                        active.remove(index)
                    yield output
                await asyncio.sleep(self.step_delay_s)
        finally:
            self.running.discard(request.request_id)

    def _output(self, request: EngineRequest, index: int, token_id: int, position: int) -> RequestOutput:
        params = request.sampling_params
        finish = None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if token_id in stops:
            finish = FinishReason.STOP
        elif position + 1 == params.max_tokens:
            finish = FinishReason.LENGTH
        logprobs = None
        if params.logprobs is not None:
            top = [(token_id, -0.25), (token_id ^ 1, -1.5), (token_id ^ 2, -2.5)][: params.logprobs]
            logprobs = [TokenLogprobs(token_id, -0.25, top)]
        return RequestOutput(
            request.request_id, index, [token_id], logprobs, finish,
            len(request.prompt_token_ids), self.num_cached_tokens,
        )


def make_test_context(engine: Any = None, max_model_len: int = 128, health: Any = None, stream_interval: int = 1,
                      tokenizer: ByteTokenizer | None = None, reasoning_parser: str | None = None,
                      tool_call_parser: str = "hermes") -> Any:
    """A ServingContext over ByteTokenizer and (by default) a ScriptedEngine."""
    from serve_app.context import ServingContext
    from serve_app.engine_client import InProcessEngineClient
    from serve_app.model_card import ModelCard
    from serve_app.tokenizer import TokenizerService

    card = ModelCard("test-model", "/models/test", max_model_len, VOCAB_SIZE, (EOS_ID,), created=1,
                     reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
    engine = engine if engine is not None else ScriptedEngine()
    return ServingContext(
        TokenizerService(tokenizer or ByteTokenizer()), InProcessEngineClient(engine), card, health=health,
        clock=lambda: 1700000000.0, version="test", stream_interval=stream_interval,
    )
