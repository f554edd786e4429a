"""Pydantic models of the OpenAI request bodies we accept, plus /tokenize and /detokenize.

Unknown fields are ignored (OpenAI clients send many we do not use), except the ones that
would change what the output means and that we do not implement (REFUSED_FIELDS): those are
declared, and a request that sets one gets a 400 naming it rather than silently ignored.
Types are strict
(a string where a number belongs is a 400, not a silent coercion), numbers must be finite,
and every bound is validated here so that a bad value is a 400 with the field named.
Cross-field rules that need the prompt length (context limits) live in sampling.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 64  # sequences per prompt
MAX_LOGPROBS = 20  # top logprobs per token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 1 << 20  # above any vocabulary: the same as keeping every token
MAX_TIMEOUT_S = 86_400.0  # the server's max_timeout_s clamps further

MAX_TOOLS = 128  # functions in one chat request
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]

# field -> why it is refused; set to anything but null (or its neutral value) it is a 400
REFUSED_FIELDS = {
    "logit_bias": "logit_bias is not supported",
    "min_tokens": "min_tokens is not supported",
    "guided_json": "guided_json is not supported; use response_format json_schema",
    "guided_regex": "guided_regex is not supported",
    "guided_choice": "guided_choice is not supported; use response_format json_schema with an enum",
    "guided_grammar": "guided_grammar is not supported",
    "structured_outputs": "structured_outputs is not supported; use response_format",
    "functions": "functions is not supported; use tools",
    "function_call": "function_call is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of other than n is not supported",
}
_NEUTRAL_VALUES = {"logit_bias": ({},), "min_tokens": (0,), "modalities": (["text"],), "suffix": ("",)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = Field(
        False, description="Send a last chunk with usage (and no choices) before [DONE]."
    )


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=NAME_PATTERN, description="Name of the response format.")
    description: str | None = Field(None, description="What the format is for (not shown to the model).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON Schema; null: any JSON object.")
    strict: bool | None = Field(None, description="True: the schema must follow OpenAI's strict-mode rules.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(description="Output format.")
    json_schema: JsonSchemaFormat | None = Field(None, description="The schema, for type json_schema.")

    @model_validator(mode="after")
    def _check_schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class _SamplingFields(_Body):
    """The sampling and stopping fields that completions and chat share."""

    model: str | None = Field(None, description="Served model id; omitted means the served model.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: probability mass kept.")
    top_k: int | None = Field(
        None, ge=-1, le=MAX_TOP_K, description="Keep the k most likely tokens; None, 0 or -1 keep all."
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Drop tokens below min_p times the top probability."
    )
    seed: int | None = Field(
        None, ge=-(2**63), lt=2**63, description="Reproducible sampling for this request."
    )
    n: int = Field(1, ge=1, le=MAX_N, description="Number of sequences to generate per prompt.")
    stop: str | list[str] | None = Field(
        None, description="Strings that end a sequence; the stop text is not returned."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end a sequence."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Penalty on tokens already generated (OpenAI)."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Penalty per occurrence in the generated text (OpenAI)."
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="Multiplicative penalty over prompt and output (HF)."
    )
    stream: bool = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Options for streaming.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema: output constrained by a grammar."
    )
    logit_bias: Any = Field(None, description="Refused: not supported.")
    min_tokens: Any = Field(None, description="Refused: not supported.")
    guided_json: Any = Field(None, description="Refused: use response_format.")
    guided_regex: Any = Field(None, description="Refused: not supported.")
    guided_choice: Any = Field(None, description="Refused: use response_format.")
    guided_grammar: Any = Field(None, description="Refused: not supported.")
    structured_outputs: Any = Field(None, description="Refused: use response_format.")
    timeout: float | None = Field(
        None, gt=0.0, le=MAX_TIMEOUT_S,
        description="Seconds until the server stops generating: unfinished choices end with "
        "finish_reason 'timeout' (408 if nothing was generated). null: the server's default.",
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for text in strings:
            if not text or len(text) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refused_field(self) -> tuple[str, str] | None:
        """(field, reason) of the first REFUSED_FIELDS entry this body sets, or None."""
        for name, reason in REFUSED_FIELDS.items():
            value = getattr(self, name, None)
            if value is None or value in _NEUTRAL_VALUES.get(name, ()):
                continue
            if name == "best_of" and value == self.n:
                continue
            return name, reason
        return None


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists."
    )
    max_tokens: int | None = Field(
        16, ge=1, description="Tokens to generate at most; null means up to the context length."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Return the sampled token's logprob and this many top alternatives.",
    )
    echo: bool = Field(False, description="Prepend the prompt text to each choice's text.")
    suffix: Any = Field(None, description="Refused: not supported.")
    best_of: Any = Field(None, description="Refused unless equal to n.")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request")
        return prompt


class TextContentPart(_Body):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(BaseModel):
    """One message; fields beyond these (tool_calls, ...) are passed to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Who wrote the message."
    )
    content: str | list[TextContentPart] | None = Field(
        None, description="Text, or a list of text parts (joined with newlines)."
    )
    name: str | None = Field(None, description="Optional author name.")

    def as_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class FunctionDefinition(_Body):
    name: str = Field(pattern=NAME_PATTERN, description="The function's name.")
    description: str | None = Field(None, description="What the function does (shown to the model).")
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments; null: none.")
    strict: bool | None = Field(None, description="True: parameters must follow OpenAI's strict-mode rules.")


class ToolDefinition(_Body):
    type: Literal["function"] = Field(description="Only function tools are supported.")
    function: FunctionDefinition = Field(description="The function.")


class NamedFunction(_Body):
    name: str = Field(description="The function the model must call.")


class NamedToolChoice(_Body):
    type: Literal["function"] = Field(description="Only function tools are supported.")
    function: NamedFunction = Field(description="The function the model must call.")


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Tokens to generate at most; null means up to the context length."
    )
    logprobs: bool = Field(False, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token; needs logprobs=true."
    )
    add_generation_prompt: bool = Field(
        True, description="End the templated prompt with the assistant header."
    )
    tools: list[ToolDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call (rendered into the prompt)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function."
    )
    parallel_tool_calls: bool = Field(True, description="False: at most one tool call per choice.")
    functions: Any = Field(None, description="Refused: use tools.")
    function_call: Any = Field(None, description="Refused: use tool_choice.")
    audio: Any = Field(None, description="Refused: only text output.")
    modalities: Any = Field(None, description="Refused unless ['text'].")

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of top alternatives (0 for none)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizePromptRequest(_Body):
    """Body of POST /tokenize with a prompt."""

    model: str | None = Field(None, description="Served model id; may be omitted.")
    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")


class TokenizeChatRequest(_Body):
    """Body of POST /tokenize with chat messages (templated as /v1/chat/completions does)."""

    model: str | None = Field(None, description="Served model id; may be omitted.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation to template.")
    add_generation_prompt: bool = Field(True, description="End with the assistant header.")


class DetokenizeRequest(_Body):
    """Body of POST /detokenize."""

    model: str | None = Field(None, description="Served model id; may be omitted.")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="Token ids to turn into text.")


def chat_body(fields: dict[str, Any], api: str) -> ChatCompletionRequest:
    """A chat request built from another API's (serve_app/messages.py, responses.py): the fields
    set (None: left out, so the model's sampling defaults apply), checked; a 400 if they do not fit."""
    from serve_app.errors import validation_error

    try:
        return ChatCompletionRequest.model_validate({name: value for name, value in fields.items()
                                                     if value is not None})
    except ValidationError as error:
        raise validation_error(error, f"the {api} request does not map onto a chat request: ") from None
