"""Everything a route needs, injected once: tokenizer, engine, model card, clock, ids."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from serve_app.choice_tracker import make_request_tracker
from serve_app.engine_client import EngineClient
from serve_app.generation import GenerationRun
from serve_app.health import HealthMonitor
from serve_app.limits import ServerLimits
from serve_app.model_card import ModelCard
from serve_app.observability import Observability, new_request_id
from serve_app.tokenizer import TokenizerService
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams


@dataclass
class ServingContext:
    tokenizer: TokenizerService
    engine: EngineClient
    card: ModelCard
    health: HealthMonitor | None = None  # None: /health reports only that the ingress is up
    clock: Callable[[], float] = time.time  # unix seconds, for "created"
    version: str = "0.0.0"
    new_id: Callable[[str], str] = new_request_id  # "<prefix>-<x-request-id or a uuid>"
    limits: ServerLimits = field(default_factory=ServerLimits)  # body size, n, tokens, timeouts
    draining: bool = False  # set on shutdown: new generation requests get 503, /health 503
    observability: Observability | None = None  # metrics, request ids, logs; None: made by create_api
    grammars: Any = None  # serve_app.grammar.GrammarValidator, made on the first structured-output request
    stream_interval: int = 1  # tokens per streamed chunk at least (AppArgs.stream_interval)
    fast_data_plane: dict[str, Any] | None = None  # serve_app.data_plane's verdict; None: not checked
    # the scheduler's prompt-batching knobs in effect: name -> {"value", "from": config | step costs | default}
    prefill_rules: dict[str, Any] | None = None
    allow_runtime_lora_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter exist
    lora_version: int = 0  # the newest adapter list the card has (serve_app/lora_api.py)

    def start_run(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stop_strings: list[str],
        timeout_s: float | None = None,
        client_timeout: bool = False,
        skip_special_tokens: bool = True,
        lora_name: str | None = None,
    ) -> GenerationRun:
        """One engine request per prompt; choice indexes run prompt by prompt, n each. The text
        is decoded without special tokens, or with them (skip_special_tokens False: a harmony
        reply, whose markers the chat route parses away)."""
        decode = self.tokenizer.decode_on_loop
        if not skip_special_tokens:
            decode = functools.partial(self.tokenizer.decode_on_loop, skip_special_tokens=False)
        requests, trackers = [], []
        first_index = 0
        for prompt_index, (token_ids, sampling) in enumerate(zip(prompts, params)):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}"
            hidden = frozenset(self.card.eos_token_ids) | frozenset(sampling.stop_token_ids)
            trackers.append(
                make_request_tracker(
                    request_id, token_ids, sampling.n, first_index,
                    decode, stop_strings, hidden,
                )
            )
            requests.append(EngineRequest(request_id, token_ids, sampling, lora_name=lora_name))
            first_index += sampling.n
        run = GenerationRun(base_id, self.engine, requests, trackers, timeout_s, client_timeout, self.stream_interval)
        run.model = lora_name or self.card.served_name
        return run
