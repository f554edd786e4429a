"""Admission control: a bounded queue in front of the workers, and drain. Pure, stdlib only.

    new request --> Admission.check(loads, request) --> route to a worker --> Scheduler.waiting
                      |  draining           -> DrainingError   (HTTP 503, code server_draining)
                      |  queue full (reqs)  -> QueueFullError  (HTTP 429 + Retry-After)
                      |  queue full (tokens)-> QueueFullError  (HTTP 429 + Retry-After)

What counts as queued: a worker holds max_num_seqs sequences in its running batch; every
sequence beyond that, running or waiting, is queued behind them:

    queued_w        = max(0, running_seqs_w + waiting_reqs_w - max_num_seqs)   (per worker)
    queued_requests = sum of queued_w over live workers
    queued_tokens   = sum of waiting_tokens_w (tokens the waiting requests still compute)

A request is refused when queued_requests >= max_queued_requests, or when some request is
waiting and queued_tokens + its prompt tokens > max_queued_tokens (a lone huge prompt is
always let in when nothing waits, so no valid request is refused forever). A burst that fits
the running seats never counts as queued, although it sits in `waiting` until the next step.

Migrated and preempted requests never pass through here: a request once accepted is never
refused later. Rejections are counted by reason in `num_rejected` (the metrics module
exports it) and carry a Retry-After hint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.scheduler import SchedulerLoad


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_queued_requests: int | None = 1024  # queued client requests, all workers; None: unbounded
    max_queued_tokens: int | None = 1 << 20  # tokens waiting requests still compute; None: unbounded
    max_num_seqs: int = 256  # each worker's running seats (SchedulerConfig.max_num_seqs)
    retry_after_s: int = 1  # the Retry-After hint on a refusal, seconds

    def __post_init__(self) -> None:
        assert self.max_queued_requests is None or self.max_queued_requests >= 0, self.max_queued_requests
        assert self.max_queued_tokens is None or self.max_queued_tokens >= 1, self.max_queued_tokens
        assert self.max_num_seqs >= 1 and self.retry_after_s >= 0


class QueueFullError(RuntimeError):
    """The waiting queue is full: retry after `retry_after_s` (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # type: ignore[no-untyped-def]  (crosses Ray as a task error's cause)
        return (QueueFullError, (str(self), self.retry_after_s))


class DrainingError(RuntimeError):
    """The engine is draining for shutdown: it finishes what it has and takes nothing new (503)."""


class Admission:
    def __init__(self, config: AdmissionConfig = AdmissionConfig()) -> None:
        self.config = config
        self.draining = False  # set once by drain(); never cleared (a drained engine goes away)
        self.num_rejected: Counter[str] = Counter()  # reason -> requests refused: queue_requests, queue_tokens, draining

    def check(self, loads: Sequence[SchedulerLoad], num_prompt_tokens: int) -> None:
        """Raises DrainingError or QueueFullError, or returns: the request may be routed."""
        if self.draining:
            self.num_rejected["draining"] += 1
            raise DrainingError("the server is draining for shutdown and takes no new requests")
        cfg = self.config
        queued = sum(max(0, load.num_running_seqs + load.num_waiting_reqs - cfg.max_num_seqs) for load in loads)
        if cfg.max_queued_requests is not None and queued >= cfg.max_queued_requests:
            self.num_rejected["queue_requests"] += 1
            raise QueueFullError(
                f"the server is at capacity: {queued} requests are queued (max_queued_requests="
                f"{cfg.max_queued_requests}); retry later", cfg.retry_after_s)
        waiting_tokens = sum(load.num_waiting_tokens for load in loads)
        num_waiting = sum(load.num_waiting_reqs for load in loads)
        if (cfg.max_queued_tokens is not None and num_waiting > 0
                and waiting_tokens + num_prompt_tokens > cfg.max_queued_tokens):
            self.num_rejected["queue_tokens"] += 1
            raise QueueFullError(
                f"the server is at capacity: {waiting_tokens} tokens are queued and this request adds "
                f"{num_prompt_tokens} (max_queued_tokens={cfg.max_queued_tokens}); retry later",
                cfg.retry_after_s)

    @property
    def num_rejected_total(self) -> int:
        return sum(self.num_rejected.values())
