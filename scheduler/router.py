"""Routes a new request to one of the scheduler actor's workers. Pure: stdlib only, no Ray.

The scheduler actor owns every worker's `Scheduler` and so every worker's block table: the
prefix each worker holds is known EXACTLY, not guessed from an approximate per-worker tree
(sgl-router) or a prefix tree fed by lagging KV events. The router itself sees only plain
`WorkerView`s; `worker_views` builds them from the schedulers in one call.

Algorithm (policy `prefix_aware`, the default), for one request of `num_prompt_tokens`:

1. Candidates are the live workers (`WorkerView.alive`). None live: `route` returns None.
2. Load of a worker, in tokens of work it has not done yet:

       load = num_waiting_tokens                  (queued requests, prompt + generated)
            + num_running_tokens_to_compute       (what running sequences still lack)
            + seq_load_tokens * (num_running_seqs + num_waiting_reqs)   (their decodes ahead)

3. Imbalance guard, as sgl-router's: over the live workers, the load is imbalanced when
   BOTH  max_load - min_load > balance_abs_threshold
   AND   max_load > balance_rel_threshold * min_load.
   Then the request goes to the least loaded worker (ties: lowest worker id), whatever it
   matches: outcome IMBALANCE_FALLBACK.
4. Otherwise the worker with the longest matched prefix wins (ties: lower load, then lowest
   worker id). A worker's match is the number of prompt tokens, in full blocks, whose KV
   it holds in its prefix cache (`Scheduler.num_matched_tokens`) or, with
   `match_in_flight`, will hold once requests queued or running there have computed them
   (a burst of requests sharing a system prompt then follows the first one instead of
   spreading before any block is cached). Outcome PREFIX_HIT.
5. If that best match is 0 or below `min_match_fraction * num_prompt_tokens`, nothing
   matches well: the request goes to the worker with the most KV room left once the work it
   already has is placed (free tokens = free blocks * block_size - the load's queued and
   running tokens; cached-but-free blocks count as free; ties: lower load, then lowest
   worker id), so a new prefix lands where it evicts the least: outcome NO_MATCH_MOST_FREE.
   Counting the queued work matters for bursts: requests routed before any of them is
   admitted hold no blocks yet, and comparing free blocks alone sent a whole burst of new
   prompts to one worker while the other idled.

LoRA residency (a request of adapter L; each worker's Scheduler knows exactly which adapters
its worker holds, scheduler/lora_slots.py), before step 3:

3a. The holders are the live workers that hold L (loaded, pinned or not). If there are
    holders and the least loaded of them is not imbalanced against the least loaded live
    worker (the guard of step 3 over those two loads), steps 3 to 5 run over the holders
    only: the request goes where its adapter is (and, among those, its prefix), so no load.
3b. If every holder is that busy, the request goes to the least loaded live worker, which loads
    L there (ties: lowest worker id): outcome ADAPTER_SPREAD. A popular adapter so spreads to
    a second worker once its first one is loaded beyond the guard, not before.
3c. With no holder, steps 3 to 5 run over the live workers with a free adapter slot (loading
    L there evicts nothing), or over all live workers when none has one (a prefix match under
    L's root means L ran there recently). Without this, a run of new adapters would all go to
    the worker with the most KV room, thrashing its LRU while the other's slots stayed empty.

Each decision is an adapter hit (the chosen worker holds L) or an adapter load (it will load
L), counted by the EngineGroup (`lora_route_counts`) whatever the policy, for metrics and
bench/bench_lora_routing.py.

The other policies, for comparison (bench/bench_routing.py):
- `round_robin`: the live worker with the next id after the last one chosen (wrapping);
  dead workers are skipped and a worker that comes back rejoins the cycle. ROUND_ROBIN.
- `least_loaded`: the live worker with the least load as in 2 (ties: lowest id). LEAST_LOADED.

Every decision is deterministic: same views, same config, same result (round robin also
depends on the last worker it chose).

n>1: the client request is routed ONCE, as its fork parent; the worker's Scheduler forks
the children there, on the parent's blocks, so children never leave the parent's worker
and the router never sees them. A request migrated off a dead worker is routed like a new
one, with the hashes of its prompt + generated tokens.

Knobs (`RouterConfig`, defaults in brackets):
- policy [prefix_aware]: prefix_aware | round_robin | least_loaded.
- balance_abs_threshold [4096 tokens]: the imbalance guard's absolute load gap.
- balance_rel_threshold [1.5]: the imbalance guard's max/min load ratio.
- min_match_fraction [0.1]: the least matched share of the prompt that counts as a hit.
- seq_load_tokens [16 tokens]: decode work charged per queued or running sequence.
- match_in_flight [True]: count prefixes that queued/running requests will compute.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.block_hash import BlockHash, adapter_root

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class RoutingPolicy(str, enum.Enum):
    PREFIX_AWARE = "prefix_aware"  # longest exact match, with the imbalance guard
    ROUND_ROBIN = "round_robin"  # the next live worker by id
    LEAST_LOADED = "least_loaded"  # the live worker with the least pending tokens


class RouteOutcome(str, enum.Enum):
    """Why a worker was chosen (a metrics label)."""

    PREFIX_HIT = "prefix_hit"  # prefix_aware: the longest match, load balanced enough
    IMBALANCE_FALLBACK = "imbalance_fallback"  # prefix_aware: load imbalanced, least loaded
    NO_MATCH_MOST_FREE = "no_match_most_free"  # prefix_aware: no good match, most free blocks
    ADAPTER_SPREAD = "adapter_spread"  # prefix_aware: the adapter's holders are busy, least loaded loads it
    ROUND_ROBIN = "round_robin"  # round_robin policy
    LEAST_LOADED = "least_loaded"  # least_loaded policy


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: RoutingPolicy = RoutingPolicy.PREFIX_AWARE  # how to pick a worker; a str is accepted
    balance_abs_threshold: int = 4096  # tokens: imbalanced only if max_load - min_load exceeds this
    balance_rel_threshold: float = 1.5  # and only if max_load exceeds this times min_load
    min_match_fraction: float = 0.1  # a match below this share of the prompt is "no match"
    seq_load_tokens: int = 16  # tokens of load per queued or running sequence (its decodes ahead)
    match_in_flight: bool = True  # prefixes of queued/running requests count as matched

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        assert self.balance_abs_threshold >= 0, self.balance_abs_threshold
        assert self.balance_rel_threshold >= 1.0, self.balance_rel_threshold
        assert 0.0 <= self.min_match_fraction <= 1.0, self.min_match_fraction
        assert self.seq_load_tokens >= 0, self.seq_load_tokens


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the router knows of one worker for one request."""

    worker_id: int  # the worker's index in the scheduler actor
    alive: bool  # False: never chosen
    num_matched_tokens: int  # prompt tokens (full blocks) in this worker's prefix cache now
    num_running_seqs: int  # sequences in the running batch
    num_waiting_reqs: int  # requests queued
    num_waiting_tokens: int  # tokens the queued requests still have to compute
    num_running_tokens_to_compute: int  # tokens the running sequences still lack
    num_free_blocks: int  # allocatable KV blocks (cached-but-free included)
    num_usable_blocks: int  # the pool's blocks but the null block
    num_in_flight_matched_tokens: int = 0  # prompt tokens (full blocks) queued/running requests share
    has_adapter: bool = True  # the worker holds the request's LoRA adapter (True for a base-model request)
    has_free_adapter_slot: bool = True  # loading one more adapter there would evict none
    block_size: int = 16  # tokens per KV block

    @property
    def num_free_tokens_after_queue(self) -> int:
        """KV room left once the queued and running work is allocated (may be negative)."""
        return (self.num_free_blocks * self.block_size - self.num_waiting_tokens
                - self.num_running_tokens_to_compute)


@dataclass(frozen=True, slots=True)
class Route:
    """The router's decision for one request."""

    worker_id: int  # the chosen worker
    outcome: RouteOutcome  # why
    num_matched_tokens: int  # prompt tokens the chosen worker matches (cached, or in flight if counted)
    load: int  # the chosen worker's load (tokens) before this request
    adapter_hit: bool | None = None  # the chosen worker holds the request's adapter; None: a base-model request


class Router:
    """Picks a worker per request. Stateless but for round robin's last choice."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._last_worker_id: int | None = None  # round robin: the worker chosen last

    def load_of(self, worker: WorkerView) -> int:
        """Pending work on the worker, in tokens (see the module docstring, step 2)."""
        num_seqs = worker.num_running_seqs + worker.num_waiting_reqs
        return worker.num_waiting_tokens + worker.num_running_tokens_to_compute + self.config.seq_load_tokens * num_seqs

    def matched_tokens_of(self, worker: WorkerView) -> int:
        if self.config.match_in_flight:
            return max(worker.num_matched_tokens, worker.num_in_flight_matched_tokens)
        return worker.num_matched_tokens

    def route(self, num_prompt_tokens: int, workers: Sequence[WorkerView], needs_adapter: bool = False) -> Route | None:
        """The worker for a request of `num_prompt_tokens`, or None if no worker is alive.
        needs_adapter: the request names a LoRA adapter (WorkerView.has_adapter says where it is)."""
        assert num_prompt_tokens >= 1, num_prompt_tokens
        live = sorted((w for w in workers if w.alive), key=lambda w: w.worker_id)
        if not live:
            return None
        assert len({w.worker_id for w in live}) == len(live), "duplicate worker ids"
        policy = self.config.policy
        if policy == RoutingPolicy.ROUND_ROBIN:
            route = self._route_round_robin(live)
        else:
            loads = {w.worker_id: self.load_of(w) for w in live}
            if policy == RoutingPolicy.LEAST_LOADED:
                route = self._least_loaded(live, loads, RouteOutcome.LEAST_LOADED)
            else:
                route = self._route_prefix_aware(num_prompt_tokens, live, loads, needs_adapter)
        if not needs_adapter:
            return route
        chosen = next(w for w in live if w.worker_id == route.worker_id)
        return Route(route.worker_id, route.outcome, route.num_matched_tokens, route.load, chosen.has_adapter)

    def is_imbalanced(self, loads: Collection[int]) -> bool:
        """sgl-router's guard: both the absolute gap and the ratio exceed their thresholds."""
        max_load, min_load = max(loads), min(loads)
        return (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > self.config.balance_rel_threshold * min_load
        )

    # --- policies ----------------------------------------------------------------------
    def _route_prefix_aware(self, num_prompt_tokens: int, live: list[WorkerView], loads: dict[int, int],
                            needs_adapter: bool = False) -> Route:
        holders = [w for w in live if w.has_adapter] if needs_adapter else []
        if holders:
            if self.is_imbalanced([min(loads[w.worker_id] for w in holders), min(loads.values())]):
                return self._least_loaded(live, loads, RouteOutcome.ADAPTER_SPREAD)  # 3b
            live = holders  # 3a
        elif needs_adapter:  # 3c
            live = [w for w in live if w.has_free_adapter_slot] or live
        if self.is_imbalanced([loads[w.worker_id] for w in live]):
            return self._least_loaded(live, loads, RouteOutcome.IMBALANCE_FALLBACK)
        matched = {w.worker_id: self.matched_tokens_of(w) for w in live}
        best = min(live, key=lambda w: (-matched[w.worker_id], loads[w.worker_id], w.worker_id))
        num_matched = matched[best.worker_id]
        if num_matched == 0 or num_matched < self.config.min_match_fraction * num_prompt_tokens:
            most_free = min(live, key=lambda w: (-w.num_free_tokens_after_queue, loads[w.worker_id], w.worker_id))
            return self._route(most_free, RouteOutcome.NO_MATCH_MOST_FREE, matched, loads)
        return self._route(best, RouteOutcome.PREFIX_HIT, matched, loads)

    def _least_loaded(self, live: list[WorkerView], loads: dict[int, int], outcome: RouteOutcome) -> Route:
        chosen = min(live, key=lambda w: (loads[w.worker_id], w.worker_id))
        return self._route(chosen, outcome, None, loads)

    def _route_round_robin(self, live: list[WorkerView]) -> Route:
        last = self._last_worker_id
        later = [w for w in live if last is not None and w.worker_id > last]
        chosen = later[0] if later else live[0]  # `live` is sorted by worker id
        return self._route(chosen, RouteOutcome.ROUND_ROBIN, None, {chosen.worker_id: self.load_of(chosen)})

    def _route(
        self, chosen: WorkerView, outcome: RouteOutcome, matched: dict[int, int] | None, loads: dict[int, int]
    ) -> Route:
        self._last_worker_id = chosen.worker_id
        num_matched = matched[chosen.worker_id] if matched is not None else self.matched_tokens_of(chosen)
        return Route(chosen.worker_id, outcome, num_matched, loads[chosen.worker_id])


# --- the adapter the scheduler actor calls ------------------------------------------------
def worker_views(
    schedulers: Mapping[int, Scheduler],
    block_hashes: Sequence[BlockHash],
    alive: Collection[int] | None = None,
    match_in_flight: bool = True,
    lora_name: str | None = None,
    lora_path: str | None = None,
) -> list[WorkerView]:
    """One view per worker for a request whose full-block hashes are `block_hashes`.

    `schedulers`: worker id -> that worker's Scheduler (all with the same block size and
    hash); `alive`: the live worker ids (None: all). A dead worker's view is not matched.
    """
    views = []
    for worker_id, scheduler in schedulers.items():
        is_alive = alive is None or worker_id in alive
        load = scheduler.load()
        num_matched = num_in_flight = 0
        if is_alive:
            num_matched = scheduler.num_matched_tokens(block_hashes)
            if match_in_flight and scheduler.config.enable_prefix_caching:
                num_in_flight = _num_in_flight_matched_blocks(scheduler, block_hashes) * scheduler.config.block_size
        views.append(
            WorkerView(
                worker_id=worker_id,
                alive=is_alive,
                num_matched_tokens=num_matched,
                num_running_seqs=load.num_running_seqs,
                num_waiting_reqs=load.num_waiting_reqs,
                num_waiting_tokens=load.num_waiting_tokens,
                num_running_tokens_to_compute=sum(
                    r.num_tokens_to_compute - r.num_computed_tokens for r in scheduler.running
                ),
                num_free_blocks=load.num_free_blocks,
                num_usable_blocks=load.num_usable_blocks,
                num_in_flight_matched_tokens=num_in_flight,
                block_size=scheduler.config.block_size,
                has_adapter=lora_name is None or scheduler.loras.path_of(lora_name) == (lora_path or ""),
                has_free_adapter_slot=scheduler.loras.has_free_slot(),
            )
        )
    return views


def route_request(
    router: Router,
    schedulers: Mapping[int, Scheduler],
    prompt_token_ids: Sequence[int],
    alive: Collection[int] | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
) -> Route | None:
    """Hashes the prompt once (under its LoRA adapter's root) and routes it: the scheduler
    actor's one-line call."""
    if not schedulers:
        return None
    hashers = {s.block_hasher for s in schedulers.values()}
    assert len(hashers) == 1, "every worker's scheduler must share block size and hash"
    block_hashes = next(iter(hashers)).hash_tokens(prompt_token_ids, adapter_root(lora_name, lora_path))
    views = worker_views(schedulers, block_hashes, alive, router.config.match_in_flight, lora_name, lora_path)
    return router.route(len(prompt_token_ids), views, needs_adapter=lora_name is not None)


def _num_in_flight_matched_blocks(scheduler: Scheduler, block_hashes: Sequence[BlockHash]) -> int:
    """Leading blocks of `block_hashes` that some unfinished request on `scheduler` shares.

    Hashes are chained, so block i equal means blocks 0..i equal: a request can only beat
    the best so far if it agrees at index `best`. O(requests + matched blocks).
    """
    best = 0
    for request in scheduler.requests.values():
        hashes = request.block_hashes
        limit = min(len(hashes), len(block_hashes))
        if best >= limit or hashes[best] != block_hashes[best]:
            continue
        best += 1
        while best < limit and hashes[best] == block_hashes[best]:
            best += 1
        if best == len(block_hashes):
            break
    return best
