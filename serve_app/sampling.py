"""The one place where an HTTP body becomes scheduler.SamplingParams.

Context rules (need the prompt length, so they cannot live in the pydantic models):

    |<------------------- max_model_len ------------------->|
    | prompt (num_prompt_tokens) | output (max_tokens) | ... |

- a prompt of max_model_len tokens or more is a 400 (no room for one output token); the
  ingress tokenizes prompts with max_length=max_model_len, so it never counts further;
- an explicit max_tokens over max_model_len - num_prompt_tokens is a 400;
- an omitted max_tokens (null) means "up to the context length".
Stop strings are not in SamplingParams: the ingress matches them on text. A sampling field the
body leaves out takes the model's default (card.sampling_defaults, serve_app/sampling_defaults.py).
"""

from __future__ import annotations

from serve_app.errors import OpenAIError
from serve_app.limits import ServerLimits
from serve_app.model_card import ModelCard
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from scheduler.sampling_params import SamplingParams


def check_prompt_length(num_prompt_tokens: int, card: ModelCard) -> None:
    if num_prompt_tokens == 0:
        raise OpenAIError("the prompt is empty", param="prompt", code="empty_prompt")
    if num_prompt_tokens >= card.max_model_len:
        # Prompts are tokenized with max_length=max_model_len, so this count may be a floor.
        raise OpenAIError(
            f"the prompt has at least {num_prompt_tokens} tokens; this model's context is "
            f"{card.max_model_len} tokens, which leaves no room for output",
            param="prompt",
            code="context_length_exceeded",
        )


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, card: ModelCard) -> int:
    check_prompt_length(num_prompt_tokens, card)
    remaining = card.max_model_len - num_prompt_tokens
    if requested is None:
        return remaining
    if requested > remaining:
        raise OpenAIError(
            f"max_tokens is {requested}, but the prompt has {num_prompt_tokens} tokens and the "
            f"context is {card.max_model_len}: at most {remaining} tokens can be generated",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def resolve_limited_max_tokens(
    requested: int | None, num_prompt_tokens: int, card: ModelCard, limits: ServerLimits
) -> int:
    """resolve_max_tokens under the operator's limits: max_prompt_tokens and max_tokens
    (an explicit max_tokens above it is a 400; an omitted one is capped by it)."""
    if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
        raise OpenAIError(
            f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {limits.max_prompt_tokens}",
            param="prompt", code="context_length_exceeded")
    if limits.max_tokens is not None and requested is not None and requested > limits.max_tokens:
        raise OpenAIError(
            f"max_tokens is {requested}; this server generates at most {limits.max_tokens} per choice",
            param="max_tokens", code="invalid_value")
    max_tokens = resolve_max_tokens(requested, num_prompt_tokens, card)
    return max_tokens if limits.max_tokens is None else min(max_tokens, limits.max_tokens)


def _sampling_field(body: CompletionRequest | ChatCompletionRequest, key: str, card: ModelCard):
    """The body's value where the client set it, else the model's default, else the body's default."""
    if key in body.model_fields_set or key not in card.sampling_defaults:
        return getattr(body, key)
    return card.sampling_defaults[key]


def to_sampling_params(
    body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int, card: ModelCard,
    limits: ServerLimits | None = None,
) -> SamplingParams:
    """Validated body + prompt length -> SamplingParams; raises OpenAIError (400)."""
    if isinstance(body, ChatCompletionRequest):
        requested_max_tokens = body.max_output_tokens
        num_logprobs = body.num_logprobs
    else:
        requested_max_tokens = body.max_tokens
        num_logprobs = body.logprobs
    limits = limits or ServerLimits()
    stop_token_ids = tuple(body.stop_token_ids or ())
    card.check_token_ids(list(stop_token_ids), "stop_token_ids")
    top_k = _sampling_field(body, "top_k", card)
    return SamplingParams(
        max_tokens=resolve_limited_max_tokens(requested_max_tokens, num_prompt_tokens, card, limits),
        temperature=_sampling_field(body, "temperature", card),
        top_p=_sampling_field(body, "top_p", card),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        min_p=_sampling_field(body, "min_p", card),
        seed=body.seed,
        n=body.n,
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=_sampling_field(body, "repetition_penalty", card),
        logprobs=num_logprobs,
    )
