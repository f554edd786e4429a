"""Tokenization and chat templating off the event loop.

Each ingress replica owns one TokenizerService with ONE worker thread: fast tokenizers are
not safe to share across threads (truncation/padding state), and a single thread keeps a
300k-word prompt from blocking anything but other tokenizations. The event loop only awaits.

Per-token text (for logprobs) and incremental detokenization are cheap (a few tokens each)
and run on the loop: they must not queue behind a huge prompt on the tokenizer thread.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from serve_app.errors import OpenAIError

T = TypeVar("T")

HEAD_CHARS_PER_TOKEN = 16  # a head of max_length * 16 characters: real text averages ~4 per token
HEAD_MIN_CHARS = 1 << 16
HEAD_MARGIN_TOKENS = 8  # tokens the head may count beyond the whole text's prefix (cut word)


def load_hf_tokenizer(model_dir: str) -> Any:
    """A transformers tokenizer from a local directory (no hub access)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class TokenizerService:
    """Async facade over a Hugging Face tokenizer (or anything with the same methods:
    encode, decode, apply_chat_template, convert_ids_to_tokens)."""

    def __init__(self, tokenizer: Any, executor: ThreadPoolExecutor | None = None) -> None:
        self.tokenizer = tokenizer  # used on the executor thread only
        # A private copy for the event loop's small decodes, so no tokenizer object is ever
        # used by two threads at once.
        self.loop_tokenizer = copy.deepcopy(tokenizer)
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # (op, seconds) of each call on the tokenizer thread: "encode", "encode_chat", "decode"
        self.on_timing: Callable[[str, float], None] | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> TokenizerService:
        return cls(load_hf_tokenizer(model_dir))

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        if self.on_timing is None:
            return await loop.run_in_executor(self._executor, call)
        result, seconds = await loop.run_in_executor(self._executor, _timed, call)
        self.on_timing(fn.__name__.strip("_").removesuffix("_sync"), seconds)
        return result

    async def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        return await self._run(self.encode_sync, text, add_special_tokens, max_length)

    def encode_sync(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Token ids of text. With max_length, at most about that many: a prompt that long is
        refused anyway, so a huge one is judged by its head (see _encode_bounded)."""
        if max_length is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return self._encode_bounded(text, add_special_tokens, max_length)

    def _encode_bounded(self, text: str, add_special_tokens: bool, max_length: int) -> list[int]:
        """A text far longer than max_length tokens could need is tokenized by its head only:
        if the head alone has more than max_length tokens, so has the text. A 300k-word
        prompt then costs one short pass instead of seconds of CPU and a million-token
        encoding whose Python-side conversion and release hold the GIL (stalling the loop).
        Accepted prompts are always encoded whole (the head check fails for them)."""
        head_chars = max(HEAD_MIN_CHARS, max_length * HEAD_CHARS_PER_TOKEN)
        if len(text) > head_chars:
            cut = max(text.rfind(" ", 0, head_chars), head_chars // 2)  # prefer a word boundary
            head = self._encode_truncated(text[:cut], add_special_tokens, max_length + HEAD_MARGIN_TOKENS)
            if len(head) >= max_length + HEAD_MARGIN_TOKENS:  # the margin covers the cut word
                return head
        return self._encode_truncated(text, add_special_tokens, max_length)

    def _encode_truncated(self, text: str, add_special_tokens: bool, max_length: int) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True, max_length=max_length)
        return list(ids)

    @property
    def chat_template(self) -> str | None:
        """The template's source (a name or a dict of named templates is given as text)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return None if template is None else str(template)

    def keeps_text(self, text: str) -> bool:
        """Whether text survives encoding and decoding as output is decoded (special tokens
        skipped): markers a parser looks for in the output must."""
        return self.decode_sync(self.encode_sync(text, add_special_tokens=False)) == text

    @property
    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template renders a `tools` argument itself (else serve_app/tools.py does)."""
        return "tools" in str(getattr(self.tokenizer, "chat_template", None) or "")

    async def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, max_length: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render the model's chat template, then tokenize (the template holds the specials)."""
        return await self._run(self._encode_chat_sync, messages, add_generation_prompt, max_length, tools)

    def _encode_chat_sync(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, max_length: int | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model has no chat template; use /v1/completions", code="no_chat_template")
        extra = {} if tools is None else {"tools": tools}  # templates without tools never see the argument
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as error:  # jinja raises on templates' own checks (role order, ...)
            raise OpenAIError(f"the chat template rejected the messages: {error}", param="messages") from None
        return self.encode_sync(text, add_special_tokens=False, max_length=max_length)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self.decode_sync, token_ids, skip_special_tokens)

    def decode_sync(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_on_loop(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """A short decode on the calling (event loop) thread: incremental detokenization."""
        return self.loop_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs. A token that is not valid UTF-8 on its own (part
        of a multi-byte character) is shown as OpenAI does: "bytes:\\xe2\\x80"."""
        exact = self._exact_token_bytes(token_id)
        if exact is not None:
            try:
                return bytes(exact).decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{byte:02x}" for byte in exact)
        return self.loop_tokenizer.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=1 << 16)
    def token_bytes(self, token_id: int) -> list[int]:
        """The exact bytes of one token for byte-level BPE tokenizers, else its text's UTF-8."""
        exact = self._exact_token_bytes(token_id)
        if exact is not None:
            return exact
        return list(self.token_text(token_id).encode("utf-8"))

    def _exact_token_bytes(self, token_id: int) -> list[int] | None:
        if self._byte_decoder is None:
            return None
        if token_id in self._special_ids:
            return list(self.loop_tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))
        piece = self.loop_tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or not all(char in self._byte_decoder for char in piece):
            return None
        return [self._byte_decoder[char] for char in piece]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's bytes<->unicode table inverted, when the tokenizer decodes byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    offset = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + offset)
            offset += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}
