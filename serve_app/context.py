"""Everything a route needs, injected once: tokenizer, engine, model card, clock, ids."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from serve_app.choice_tracker import make_request_tracker
from serve_app.engine_client import EngineClient
from serve_app.generation import GenerationRun
from serve_app.health import HealthMonitor
from serve_app.model_card import ModelCard
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
    new_id: Callable[[str], str] = field(default=lambda prefix: f"{prefix}-{uuid.uuid4().hex}")

    def start_run(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stop_strings: list[str],
    ) -> GenerationRun:
        """One engine request per prompt; choice indexes run prompt by prompt, n each."""
        requests, trackers = [], []
        first_index = 0
        for prompt_index, (token_ids, sampling) in enumerate(zip(prompts, params)):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}"
            hidden = frozenset(self.card.eos_token_ids) | frozenset(sampling.stop_token_ids)
            trackers.append(
                make_request_tracker(
                    request_id, token_ids, sampling.n, first_index,
                    self.tokenizer.decode_on_loop, stop_strings, hidden,
                )
            )
            requests.append(EngineRequest(request_id, token_ids, sampling))
            first_index += sampling.n
        return GenerationRun(base_id, self.engine, requests, trackers)
