"""Continuous batching over ONE worker's KV pool.

One currency, `num_computed_tokens`, and one token budget per step. Each step:

1. fork: n>1 parents whose prompt is computed up to its last token become n children
   (shared full blocks, a private copy of the partial block, copy_blocks for the worker);
2. running, oldest first: each gets min(tokens it lacks, budget left) tokens; when the pool
   is short, the NEWEST running sequence is preempted by recompute (blocks freed, progress
   reset to 0, put at the FRONT of waiting) until the allocation fits;
3. waiting, first come first served (skipped in a step that preempted): admitted while
   budget, seats (max_num_seqs) and blocks last; a prefix hit starts it at
   num_computed_tokens > 0. With waiting_served_ratio > 0 and sequences running, new
   requests are held until enough of them wait or the oldest has waited max_waiting_steps
   (`_holds_new_prompts`), so that prompts arriving close together share one prefill step;
   with hold_while_finishing_steps, also while most running sequences are about to end, and
   never while most of them have just started (an arrival joins their batch). A request
   whose next min_shared_prefix_to_wait prompt tokens a running request is computing (one
   system prompt in a burst) is passed over, its place kept, until they are cached.

LoRA adapters (scheduler/lora_slots.py): the scheduler keeps the worker's loaded adapters as an
exact LRU (`self.loras`, at most max_cpu_loras). Admitting a request of an adapter that is not
loaded puts it in that step's `lora_loads` (and the adapters evicted for it in `lora_unloads`);
the adapters of running requests are pinned. At most max_loras distinct adapters run at once,
hence in any step. A request whose adapter cannot be admitted (max_loras reached, or every
loaded adapter pinned) keeps its place; younger requests of the base model pass it (they take
no adapter slot), those of adapters already running only until it has waited
max_lora_wait_steps steps, and those of another new adapter never. So adapters start in arrival order, and the running ones drain
(each request ends by max_tokens) until the oldest waiting one gets its slot.

Decodes (1 token each) and prefill chunks share the same batch, so a long prompt never stops
the decodes beside it. Preempted and migrated requests keep their generated tokens, and the
worker recomputes prompt + those tokens, so their output streams go on without a duplicate or
a gap. Requests the worker must forget (finished, aborted, preempted, forked-away parents)
ride in finished_request_ids of the next non-empty step.

Async scheduling (`schedule_ahead`): while step N runs, step N+1 is decided from what N was
given, not from what it returns. A request that samples in N gets its next position in N+1
before the scheduler knows the token: the worker computes N+1 after N and reads the token it
sampled itself (it keeps every request's token ids; scheduler.outputs). So the worker goes
from N to N+1 without waiting for a round trip through the scheduler. What needs N's tokens
is not done ahead: a ready fork, a preemption (the pool too short for every running request),
and a request that N finishes by length. Then schedule_ahead returns an empty step and the
caller lands N and calls schedule(). A request that N finishes by a stop token has computed
one wasted position in N+1, whose output is dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from scheduler.batch import StepBatch, check_stop
from scheduler.block_hash import BlockHash, BlockHasher, HashFn, sha256_block_hash
from scheduler.block_pool import KVBlock
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager
from scheduler.lora_slots import LoraSlots, SlotPlan
from scheduler.state_snapshots import StateSnapshots
from scheduler.outputs import EngineRequest, ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.stats import CumulativeStats, StepStats


@dataclass(slots=True)
class SchedulerLoad:
    """What a router weighs, for one worker."""

    num_running_seqs: int  # sequences in the running batch
    num_waiting_reqs: int  # requests queued
    num_waiting_tokens: int  # tokens the queued requests still have to compute
    num_free_blocks: int  # allocatable blocks (cached-but-free included)
    num_usable_blocks: int  # the pool's blocks but the null block


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int] = (),
        hash_fn: HashFn = sha256_block_hash,
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)  # token ids that finish with "stop"
        self.block_hasher = BlockHasher(config.block_size, hash_fn)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # recurrent layers' prefix caching: which prefixes' states the worker keeps (None: no recurrent layers, or
        # no prefix caching)
        self.snapshots = (StateSnapshots(config.num_state_snapshots)
                          if config.recurrent_state and config.enable_prefix_caching else None)
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.seqs_of_client: dict[str, list[str]] = {}  # client request id -> its live request_ids
        self.waiting: deque[Request] = deque()  # admission order; preempted ones at the front
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.num_running_seqs = 0  # sum of num_seqs over running (an unforked n>1 counts n)
        self.finished_for_worker: set[str] = set()  # request_ids the worker must drop, not sent yet
        self.totals = CumulativeStats()
        self.last_step_stats: StepStats | None = None  # the last step update_from_output closed
        # Steps handed out and not updated yet, oldest first: one, or two with schedule_ahead.
        self._in_flight: deque[tuple[SchedulerOutput, dict[str, Request], StepStats]] = deque()
        self._num_steps_handed_out = 0
        # Requests queued while _num_steps_handed_out was at most this were left waiting by a step
        # whose prompt budget ran out: they missed a prefill only for lack of room, never held.
        self._left_over_through = -1
        self._prefill_left = config.max_num_batched_tokens  # prompt tokens the step being decided may still compute
        self._long_left: int | None = None  # tokens long prompts may still compute in it (None: no such cap)
        self.loras = LoraSlots(config.max_cpu_loras)  # the worker's loaded adapters, exactly
        self._lora_unloads: list[str] = []  # adapters the worker must drop, not sent yet
        self.lora_requests: dict[str, int] = {}  # adapter name -> client requests added
        self.lora_generation_tokens: dict[str, int] = {}  # adapter name -> tokens sampled

    # --- queries -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_matched_tokens(self, block_hashes: Sequence[BlockHash]) -> int:
        """Prompt tokens this worker's prefix cache holds for these hashes (routing)."""
        return self.kv.num_matched_tokens(block_hashes)

    def load(self) -> SchedulerLoad:
        return SchedulerLoad(
            num_running_seqs=self.num_running_seqs,
            num_waiting_reqs=len(self.waiting),
            num_waiting_tokens=sum(r.num_tokens_to_compute for r in self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_usable_blocks=self.kv.pool.num_usable_blocks,
        )

    # --- requests in and out ------------------------------------------------------------
    def add_request(self, engine_request: EngineRequest) -> None:
        """Queues a client request. Raises ValueError if it can never run here."""
        prompt = list(engine_request.prompt_token_ids)
        params = engine_request.sampling_params
        self._validate(engine_request.request_id, prompt, params.n)
        resumed = engine_request.output_token_ids
        if resumed:
            self._validate_resumed(engine_request)
        request = Request(
            request_id=engine_request.request_id,
            client_request_id=engine_request.request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            block_hasher=self.block_hasher,
            arrival_time=engine_request.arrival_time,
            lora_name=engine_request.lora_name,
            lora_path=engine_request.lora_path,
        )
        if request.lora_name is not None:
            self.lora_requests[request.lora_name] = self.lora_requests.get(request.lora_name, 0) + 1
        if resumed:
            request.append_output_token_ids(list(resumed))
        if params.n > 1 and len(prompt) == 1:
            # Nothing to compute before the fork point: the children start from scratch.
            for i in range(params.n):
                self._enqueue(request.make_fork_child(i))
        else:
            self._enqueue(request)

    def add_migrated_request(self, request: Request) -> None:
        """Queues a request taken from another scheduler; it keeps its generated tokens."""
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert not request.sent_to_worker, request.request_id
        assert request.block_hasher == self.block_hasher, "block size or hash differs"
        assert request.num_tokens < self.config.max_model_len, request.request_id
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already queued here")
        self._enqueue(request)

    def abort_request(self, client_request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finishes every sequence of these client requests now, in any state; frees blocks.

        Returns one final (abort) delta per sequence; unknown ids are ignored.
        """
        if isinstance(client_request_ids, str):
            client_request_ids = (client_request_ids,)
        outputs = []
        for client_id in client_request_ids:
            for rid in list(self.seqs_of_client.get(client_id, ())):
                request = self.requests[rid]
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                    self.num_running_seqs -= request.num_seqs
                else:
                    self.waiting.remove(request)
                indices = range(request.num_seqs) if request.is_fork_parent else (request.index,)
                self._retire(request, RequestStatus.FINISHED_ABORTED)
                outputs.extend(_final_output(request, i) for i in indices)
        self.totals.num_aborted_seqs += len(outputs)
        return outputs

    def ids_the_worker_may_hold(self) -> set[str]:
        """Every request id the worker may keep state for: requests it was sent, those retired
        and not yet named in a step's finished ids, and those named in the steps in flight
        (a step that fails may never have told the worker)."""
        ids = {request.request_id for request in self.requests.values() if request.sent_to_worker}
        ids.update(self.finished_for_worker)
        for output, _, _ in self._in_flight:
            ids.update(output.finished_request_ids)
        return ids

    def take_requests_for_migration(self) -> list[Request]:
        """The worker is gone: returns every unfinished request, reset, oldest first.

        Each keeps its prompt, generated tokens, ids and index; re-add it on a live worker's
        scheduler with add_migrated_request and its stream goes on where it stopped. This
        scheduler's KV accounting (blocks and prefix cache) starts empty again.
        """
        requests = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        for request in requests:
            request.reset_for_recompute()
        self.kv.reset()
        if self.snapshots is not None:
            self.snapshots.clear()
        self._lora_unloads.extend(self.loras.reset())  # a live worker (fail_all) drops them with the next step
        self.requests.clear()
        self.seqs_of_client.clear()
        self.waiting.clear()
        self.running.clear()
        self.num_running_seqs = 0
        self.finished_for_worker.clear()
        self._in_flight.clear()
        self.totals.num_migrated_reqs += len(requests)
        return requests

    # --- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decides this step's batch. Call update_from_output with its result before the next."""
        assert not self._in_flight, "update_from_output was not called for the last step"
        stats = StepStats(step=self.totals.num_steps + 1)
        batch = StepBatch()
        self._fork_ready_parents(batch, stats)
        self._set_prefill_limits()
        budget = self._schedule_running(self.config.max_num_batched_tokens, batch, stats)
        if stats.num_preemptions == 0:
            self._schedule_waiting(budget, batch, stats)
        return self._hand_out(batch, stats)

    def schedule_ahead(self) -> SchedulerOutput:
        """Decides the next step while the last one is still running (async scheduling).

        Call with exactly one step handed out and not updated; update_from_output takes the
        two in the order they were handed out. The worker must run steps in that order.
        Returns an empty step when the next one needs the running step's tokens (see the
        module doc): land that step, then call schedule().
        """
        assert len(self._in_flight) == 1, "schedule_ahead needs exactly one step in flight"
        running_step = self._in_flight[0][0].num_scheduled_tokens
        plan = []  # (request, computed by then, tokens now)
        budget = self.config.max_num_batched_tokens
        self._set_prefill_limits(running_step)
        for request in self.running:
            if request.is_fork_parent and request.num_computed_tokens == request.num_tokens_to_compute:
                return _empty_step()  # a fork is due: it happens in a synchronous schedule()
            if budget == 0:
                break
            num_running = running_step.get(request.request_id, 0)
            computed = request.num_computed_tokens + num_running
            target = request.num_tokens_to_compute
            if num_running and computed == target and not request.is_fork_parent:
                if self._finishes_by_length_after_one_more(request):
                    continue  # done once the running step lands: nothing to compute ahead
                target += 1  # the token the running step samples: the worker will hold it
            num_new = self._cap_new_tokens(target - computed, budget, request)
            if num_new > 0:
                plan.append((request, computed, num_new))
                budget -= num_new
                self._charge_prefill(target - computed, num_new, request)
        num_new_blocks = sum(self.kv.num_blocks_to_grow(request.request_id, computed + num_new)
                             for request, computed, num_new in plan)
        if num_new_blocks > self.kv.num_free_blocks:
            return _empty_step()  # someone must be preempted: that is schedule()'s decision
        stats = StepStats(step=self.totals.num_steps + 2)
        batch = StepBatch()
        for request, computed, num_new in plan:
            allocation = self.kv.allocate_slots(request, computed - request.num_computed_tokens + num_new)
            assert allocation is not None, "blocks were counted"
            batch.add(request, num_new, allocation.new_block_ids, partial(self.kv.block_ids, request.request_id),
                      start=computed)
        self._schedule_waiting(budget, batch, stats, running_step)
        return self._hand_out(batch, stats)

    def _blocks_landing(self, running_step: dict[str, int]) -> dict[BlockHash, KVBlock]:
        """Blocks that running requests hold and the step in flight fills: a waiting request
        admitted in the step after it takes them as a prefix hit, as if they were cached
        already (a burst's followers start right after the step that computes their shared
        prefix, not one step later). Only running owners' blocks: an owner aborted meanwhile
        has freed them, and another request may write them again in the step being decided."""
        landing: dict[BlockHash, KVBlock] = {}
        for rid, num_tokens in running_step.items():
            if num_tokens == 1:
                continue  # a decode: the blocks it fills hold generated tokens, no one's prompt
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                landing.update(self.kv.blocks_filled_by(request, request.num_computed_tokens + num_tokens))
        return landing

    def _finishes_by_length_after_one_more(self, request: Request) -> bool:
        return self._tokens_before_length_stop(request) <= 1

    def _tokens_before_length_stop(self, request: Request) -> int:
        """Tokens the request may still sample before max_tokens or max_model_len stops it."""
        return min(request.sampling_params.max_tokens - request.num_output_tokens,
                   self.config.max_model_len - request.num_tokens)

    def _hand_out(self, batch: StepBatch, stats: StepStats) -> SchedulerOutput:
        assert batch.total_num_scheduled_tokens > 0 or not batch.copies, "copies without a step"
        finished: set[str] = set()
        if batch.total_num_scheduled_tokens > 0:
            finished, self.finished_for_worker = self.finished_for_worker, set()
            self._hand_out_loras(batch)
            if self.snapshots is not None:
                self._plan_state_saves(batch)
        output = batch.build(finished)
        self._fill_schedule_stats(stats, batch)
        if not output.is_empty:
            self._in_flight.append((output, batch.scheduled, stats))
            self._num_steps_handed_out += 1
        return output

    def _hand_out_loras(self, batch: StepBatch) -> None:
        """The step's adapter unloads (evictions decided now or earlier) and recency."""
        if self._lora_unloads:
            batch.lora_unloads[:0] = self._lora_unloads
            self._lora_unloads = []
        names = {r.lora_name for r in batch.scheduled.values() if r.lora_name is not None}
        assert len(names) <= self.config.max_loras, names
        for name in names:
            self.loras.touch(name)

    def discard_adapter(self, name: str) -> bool:
        """The adapter was removed from the server: unloaded with the next step if no running
        request uses it (else it stays until the LRU evicts it). True if it is unloaded."""
        if any(request.lora_name == name for request in self.running) or not self.loras.discard(name):
            return False
        self._lora_unloads.append(name)
        return True

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Advances progress, appends sampled tokens, applies stop rules; returns the deltas."""
        if scheduler_output.is_empty:
            return []
        assert self._in_flight and self._in_flight[0][0] is scheduler_output, "steps land in the order handed out"
        _, scheduled, stats = self._in_flight.popleft()
        outputs = []
        num_finished = 0
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = scheduled[rid]
            if request.status != RequestStatus.RUNNING:
                continue  # aborted or migrated while the step ran, or finished by the step before it
            request.num_computed_tokens += num_tokens
            self.kv.cache_computed_blocks(request)
            token_id = runner_output.sampled_token_ids.get(rid)
            if request.num_computed_tokens < request.num_tokens:
                assert token_id is None, f"{rid} sampled in the middle of its prompt"
                continue
            assert token_id is not None, f"{rid} computed every token but sampled none"
            request.append_output_token_ids(token_id)
            if request.lora_name is not None:
                tokens = self.lora_generation_tokens
                tokens[request.lora_name] = tokens.get(request.lora_name, 0) + 1
            status = check_stop(request, token_id, self.eos_token_ids, self.config.max_model_len)
            outputs.append(self._token_output(request, token_id, runner_output, status))
            if status is not None:
                self._retire(request, status)
                num_finished += 1
        if num_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            self.num_running_seqs -= num_finished
        stats.num_generation_tokens = len(outputs)
        stats.num_finished_seqs = num_finished
        self.totals.add(stats)
        self.last_step_stats = stats
        return outputs

    # --- schedule() helpers ------------------------------------------------------------
    def _fork_ready_parents(self, batch: StepBatch, stats: StepStats) -> None:
        ready = [
            r for r in self.running
            if r.is_fork_parent and r.num_computed_tokens == r.num_tokens_to_compute
        ]
        forked = []
        for parent in ready:
            if parent.status != RequestStatus.RUNNING:
                continue  # preempted to make room for an earlier fork
            bs = self.config.block_size
            num_copies = parent.num_seqs if parent.num_computed_tokens % bs else 0
            while self.kv.num_free_blocks < num_copies and parent.status == RequestStatus.RUNNING:
                self._preempt_newest(batch, stats)
            if parent.status == RequestStatus.RUNNING:
                self._fork(parent, batch)
                forked.append(parent)
        # Free parents only now, so that no parent's partial block is another fork's copy target.
        for parent in forked:
            self._retire(parent, RequestStatus.FINISHED_STOPPED)  # no output: its children go on

    def _fork(self, parent: Request, batch: StepBatch) -> None:
        children = [parent.make_fork_child(i) for i in range(parent.num_seqs)]
        for child in children:
            result = self.kv.fork(parent, child)
            assert result is not None, "fork blocks were checked"
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            if result.copy is not None:
                batch.copies[child.request_id] = result.copy
            if self.config.recurrent_state:  # the child's recurrent states start as the parent's
                batch.state_forks.append((parent.request_id, child.request_id))
                child.fork_state_on_worker = True
            self._register(child)
        i = self.running.index(parent)
        self.running[i : i + 1] = children  # the children take the parent's age

    def _schedule_running(self, budget: int, batch: StepBatch, stats: StepStats) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_left = request.num_tokens_to_compute - request.num_computed_tokens
            assert num_left > 0, f"{request.request_id} is running with nothing to compute"
            num_new = self._cap_new_tokens(num_left, budget, request)
            if num_new == 0:  # a prompt chunk, and this step's prompt tokens are spent
                i += 1
                continue
            while (allocation := self.kv.allocate_slots(request, num_new)) is None:
                if self._preempt_newest(batch, stats) is request:
                    return budget
            batch.add(request, num_new, allocation.new_block_ids, partial(self.kv.block_ids, request.request_id))
            budget -= num_new
            self._charge_prefill(num_left, num_new, request)
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, batch: StepBatch, stats: StepStats,
                          running_step: dict[str, int] | None = None) -> int:
        """Admits waiting requests into the step being decided; running_step: the step in
        flight, when deciding ahead (its filled blocks count as cached: _blocks_landing)."""
        if self._holds_new_prompts() or not self.waiting:
            return budget
        landing = None
        if running_step is not None and self.config.enable_prefix_caching:
            landing = self._blocks_landing(running_step)
        out_of_budget = False
        being_computed: set[BlockHash] | None = None  # built on first need
        deferred: list[Request] = []
        active = {r.lora_name for r in self.running if r.lora_name is not None}  # pinned adapters
        lora_blocked: Request | None = None  # the oldest request left waiting for an adapter slot
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_running_seqs + request.num_seqs > self.config.max_num_seqs:
                break
            plan = None
            if request.lora_name is not None:
                plan = self._adapter_plan(request, active, lora_blocked)
                if plan is None:
                    lora_blocked = lora_blocked or request
                    deferred.append(self.waiting.popleft())
                    continue
            computed = self.kv.get_computed_blocks(request, landing)
            if self.config.recurrent_state:
                computed = self._with_state_snapshot(request, computed, batch)
            if self._may_wait_for_prefix(request, computed):
                if being_computed is None:
                    being_computed = self._hashes_being_computed()
                if self._waits_for_prefix(request, computed, being_computed):
                    deferred.append(self.waiting.popleft())
                    continue
            num_new = request.num_tokens_to_compute - computed.num_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                out_of_budget = True
                break
            num_left, num_new = num_new, self._cap_new_tokens(num_new, budget, request)
            if num_new == 0:  # this step's prompt tokens are spent
                out_of_budget = True
                break
            allocation = self.kv.allocate_slots(request, num_new, computed)
            if allocation is None:
                break
            self._charge_prefill(num_left, num_new, request)
            self.waiting.popleft()
            if plan is not None:
                self._commit_adapter(plan, batch)
                active.add(plan.name)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            self.running.append(request)
            self.num_running_seqs += request.num_seqs
            stats.num_prefix_query_tokens += request.num_tokens
            stats.num_prefix_hit_tokens += computed.num_tokens
            batch.add(request, num_new, allocation.new_block_ids, partial(self.kv.block_ids, request.request_id))
            budget -= num_new
            if being_computed is not None:
                being_computed.update(self.kv.uncached_hashes(request))
        self.waiting.extendleft(reversed(deferred))
        if self.waiting and (out_of_budget or budget == 0):
            self._left_over_through = self._num_steps_handed_out
        return budget

    def _adapter_plan(self, request: Request, active: set[str], blocked: Request | None) -> SlotPlan | None:
        """How the request's adapter gets onto the worker now, or None if the request waits
        (the module doc: max_loras, pinned slots, and the order among new adapters)."""
        name = request.lora_name
        assert name is not None
        if blocked is not None and (name not in active or self._lora_wait_is_over(blocked)):
            return None
        if name not in active and len(active) >= self.config.max_loras:
            return None
        return self.loras.plan(name, request.lora_path or "", active)

    def _lora_wait_is_over(self, blocked: Request) -> bool:
        """Whether the request waiting for an adapter slot has waited long enough that no
        younger adapter request passes it any more."""
        return self._num_steps_handed_out - blocked.queued_at_step >= self.config.max_lora_wait_steps

    def _commit_adapter(self, plan: SlotPlan, batch: StepBatch) -> None:
        self.loras.commit(plan)
        batch.lora_unloads.extend(plan.evict)  # never one loaded in this step: those are pinned
        if plan.load:
            batch.lora_loads[plan.name] = plan.path

    def _with_state_snapshot(self, request: Request, computed: ComputedBlocks, batch: StepBatch) -> ComputedBlocks:
        """A recurrent model's prefix hit: cut back to the longest prefix whose states the worker kept
        (scheduler/state_snapshots.py), and that snapshot noted for the worker; no hit without one."""
        num_blocks = len(computed.blocks)
        while num_blocks > 0:
            slot = self.snapshots.lookup(request.block_hashes[num_blocks - 1]) if self.snapshots else None
            if slot is not None:
                batch.state_restores[request.request_id] = slot
                break
            num_blocks -= 1
        return ComputedBlocks(computed.blocks[:num_blocks], num_blocks * self.config.block_size)

    def _plan_state_saves(self, batch: StepBatch) -> None:
        """Each scheduled request whose step reaches the last block boundary before its last prompt
        token keeps its state there as a snapshot (scheduler/state_snapshots.py)."""
        size = self.config.block_size
        for rid, num_tokens in batch.num_scheduled_tokens.items():
            request = batch.scheduled[rid]
            boundary = (request.num_prompt_tokens - 1) // size * size
            start = batch.starts[rid]
            if boundary == 0 or not start < boundary <= start + num_tokens:
                continue
            if len(request.block_hashes) < boundary // size:
                continue  # no hashes (prefix caching off for it)
            slot = self.snapshots.reserve(request.block_hashes[boundary // size - 1])
            if slot is not None:
                batch.state_saves[rid] = (boundary, slot)

    def _may_wait_for_prefix(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether waiting could give the request a prefix hit of min_shared_prefix_to_wait more tokens."""
        min_tokens = self.config.min_shared_prefix_to_wait
        if min_tokens is None or not self.config.enable_prefix_caching or self.config.recurrent_state:
            return False  # recurrent layers: the blocks alone are no hit (they need a state snapshot)
        max_hit = (request.num_tokens_to_compute - 1) // self.config.block_size * self.config.block_size
        return max_hit - computed.num_tokens >= min_tokens

    def _waits_for_prefix(self, request: Request, computed: ComputedBlocks, being_computed: set[BlockHash]) -> bool:
        """Whether the request's next min_shared_prefix_to_wait tokens (whole blocks) are all in
        blocks that running requests are computing (_hashes_being_computed): then it waits for
        them to be cached, as it would compute the same tokens beside their owner otherwise."""
        first = len(computed.blocks)
        num_blocks = -(-self.config.min_shared_prefix_to_wait // self.config.block_size)
        return all(h in being_computed for h in request.block_hashes[first:first + num_blocks])

    def _hashes_being_computed(self) -> set[BlockHash]:
        """The hashes of blocks that running requests hold and that are not cached yet: their
        tokens are scheduled, in a step in flight or in the one being decided. Each lands in
        the prefix cache after the step that computes its last token."""
        hashes: set[BlockHash] = set()
        for request in self.running:
            if request.num_computed_tokens + 1 < request.num_tokens_to_compute:  # not a decode
                hashes.update(self.kv.uncached_hashes(request))
        return hashes

    def _holds_new_prompts(self) -> bool:
        """Whether the waiting queue sits this step out so that running streams keep decoding.

        A step that computes prompts costs every running stream a longer token gap; holding
        arrivals until several can be computed together (or the oldest has waited long
        enough) turns many such gaps into one. Preempted and migrated requests at the head
        were running already: they are never held. Nor are requests that were waiting when a
        step's prompt budget ran out: they belong to the batch of prompts just computed, and
        holding them would leave them behind it, to stall its streams later; nor, for the same
        reason, while most running sequences have just started (_running_mostly_starting).
        """
        ratio = self.config.waiting_served_ratio
        if ratio == 0 or self.num_running_seqs == 0 or not self.waiting:
            return False
        head = self.waiting[0]
        if head.status != RequestStatus.WAITING or head.queued_at_step <= self._left_over_through:
            return False
        if self._num_steps_handed_out - head.queued_at_step >= self.config.max_waiting_steps:
            return False
        if self._running_mostly_finishing():
            return True
        if self._running_mostly_starting():
            return False
        return len(self.waiting) < ratio * self.num_running_seqs

    def _running_mostly_starting(self) -> bool:
        """Whether at least half of the running sequences have sampled fewer than
        hold_while_finishing_steps tokens: a batch of prompts is still being computed or has
        just been, and an arrival now joins it instead of waiting. Held, a few late members of
        a burst (their clients' requests took longer to reach us) would start max_waiting_steps
        behind the rest, end that far behind them, and their clients' next requests would then
        arrive alone beside the next batch, to be held and stall it, wave after wave. Admitted
        now, they end within hold_while_finishing_steps of the batch, and the finishing hold
        keeps the next requests together (bench/sim.py replays that loop)."""
        return self._half_of_running(lambda request, steps: request.num_output_tokens < steps)

    def _running_mostly_finishing(self) -> bool:
        """Whether at least half of the running sequences reach their length limit within
        hold_while_finishing_steps steps. Requests of one length that arrived together finish
        together, and their clients' next requests arrive together; when half a batch ends a step
        before the other half (its prompts were computed a step earlier), computing the new
        prompts at once would stall the other half's last tokens by a whole prefill step."""
        return self._half_of_running(
            lambda request, steps: request.num_output_tokens > 0  # else its prompt is still being computed
            and self._tokens_before_length_stop(request) <= steps)

    def _half_of_running(self, counts: Callable[[Request, int], bool]) -> bool:
        """Whether hold_while_finishing_steps is on and at least half of the running sequences
        belong to requests for which counts(request, hold_while_finishing_steps) holds."""
        steps = self.config.hold_while_finishing_steps
        if steps == 0:
            return False
        num_counted = sum(request.num_seqs for request in self.running if counts(request, steps))
        return 2 * num_counted >= self.num_running_seqs

    def _set_prefill_limits(self, running_step: dict[str, int] | None = None) -> None:
        """The prompt limits of the step about to be decided (running_step: the step in flight
        when deciding ahead). While more sequences decode in it than there are prompts to
        compute, a long step would delay many streams to serve few prompts, so:
        max_prefill_tokens_while_decoding caps its prompt tokens (summed over requests), and
        long_prefill_tokens_while_decoding caps the tokens of long prompts (longer than
        long_prefill_token_threshold), summed over them. Otherwise the whole budget."""
        config = self.config
        self._prefill_left = config.max_num_batched_tokens
        self._long_left = None
        cap, long_cap = config.max_prefill_tokens_while_decoding, config.long_prefill_tokens_while_decoding
        if (cap is None and long_cap is None) or not self._decoding_outnumbers_prompts(running_step or {}):
            return
        if cap is not None:
            self._prefill_left = cap
        if long_cap is not None and config.long_prefill_token_threshold is not None:
            self._long_left = long_cap

    def _decoding_outnumbers_prompts(self, running_step: dict[str, int]) -> bool:
        """Whether more sequences decode in the next step than there are prompts to compute. A
        sequence decodes once it has sampled, or samples in running_step."""
        num_decoding = 0
        for request in self.running:
            in_flight = running_step.get(request.request_id, 0)
            if request.num_output_tokens or (
                    in_flight and request.num_computed_tokens + in_flight >= request.num_tokens_to_compute):
                num_decoding += 1
        num_prompts = len(self.running) - num_decoding + len(self.waiting)
        return num_decoding > num_prompts

    def _cap_new_tokens(self, num_new: int, budget: int, request: Request) -> int:
        """Tokens the request, lacking num_new, may compute now. More than one lacking means
        prompt tokens (or a recompute): those also draw on the step's prompt tokens left, and
        a long prompt's on the long prompts' tokens left."""
        is_prefill = num_new > 1
        num_new = min(num_new, budget)
        threshold = self.config.long_prefill_token_threshold
        if self.config.enable_chunked_prefill and threshold is not None:
            num_new = min(num_new, threshold)
        if is_prefill and self.config.enable_chunked_prefill:
            num_new = min(num_new, self._prefill_left)
            if self._draws_on_long_left(request):
                num_new = min(num_new, self._long_left)
        return num_new

    def _charge_prefill(self, num_left: int, num_new: int, request: Request) -> None:
        if num_left > 1:
            self._prefill_left -= num_new
            if self._draws_on_long_left(request):
                self._long_left -= num_new

    def _draws_on_long_left(self, request: Request) -> bool:
        """Whether the request's prompt tokens count against this step's long-prompt cap: the
        cap is on (long_prefill_tokens_while_decoding, streams decoding) and its prompt (or
        recompute) is longer than long_prefill_token_threshold."""
        return self._long_left is not None and request.num_tokens_to_compute > self.config.long_prefill_token_threshold

    def _preempt_newest(self, batch: StepBatch, stats: StepStats) -> Request:
        """Preempts the newest running sequence by recompute; returns it."""
        request = self.running.pop()
        assert request.request_id not in batch.scheduled, "preempted a scheduled request"
        self.num_running_seqs -= request.num_seqs
        self.kv.free(request)
        batch.copies.pop(request.request_id, None)  # a child forked this step: no copy needed
        if request.sent_to_worker or request.fork_state_on_worker:
            self.finished_for_worker.add(request.request_id)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        stats.num_preemptions += 1
        return request

    def _fill_schedule_stats(self, stats: StepStats, batch: StepBatch) -> None:
        stats.num_running_seqs = self.num_running_seqs
        stats.num_waiting_reqs = len(self.waiting)
        usage = self.kv.usage()
        stats.num_kv_blocks_used = usage.num_used_blocks
        stats.num_kv_blocks_total = usage.num_usable_blocks
        stats.num_scheduled_tokens = batch.total_num_scheduled_tokens
        stats.num_scheduled_seqs = len(batch.num_scheduled_tokens)
        stats.num_prompt_tokens_computed = batch.num_prompt_tokens
        stats.num_new_reqs = len(batch.new_requests)

    # --- bookkeeping ------------------------------------------------------------------------
    def _validate(self, request_id: str, prompt: list[int], n: int) -> None:
        cfg = self.config
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_model_len={cfg.max_model_len}")
        if n > cfg.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs={cfg.max_num_seqs}")
        fork_blocks = -(-(len(prompt) - 1) // cfg.block_size) + n
        if n > 1 and fork_blocks > cfg.num_blocks - 1:
            raise ValueError(f"n={n} over {len(prompt)} prompt tokens needs {fork_blocks} blocks at the fork")
        ids = [request_id] + ([f"{request_id}-{i}" for i in range(n)] if n > 1 else [])
        if request_id in self.seqs_of_client or any(i in self.requests for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        base, _, index = request_id.rpartition("-")
        parent = self.requests.get(base)
        if parent is not None and parent.is_fork_parent and index.isdigit() and int(index) < parent.num_seqs:
            raise ValueError(f"request id {request_id!r} is reserved for a child of {base!r}")

    def _validate_resumed(self, engine_request: EngineRequest) -> None:
        params, resumed = engine_request.sampling_params, engine_request.output_token_ids
        if params.n != 1:
            raise ValueError("only an n=1 request can resume with output tokens")
        if len(resumed) >= params.max_tokens:
            raise ValueError(f"{len(resumed)} resumed output tokens leave none of max_tokens={params.max_tokens}")
        num_tokens = len(engine_request.prompt_token_ids) + len(resumed)
        if num_tokens >= self.config.max_model_len:
            raise ValueError(f"{num_tokens} tokens leave no room in max_model_len={self.config.max_model_len}")

    def _enqueue(self, request: Request) -> None:
        self._register(request)
        request.queued_at_step = self._num_steps_handed_out
        self.waiting.append(request)

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.seqs_of_client.setdefault(request.client_request_id, []).append(request.request_id)

    def _retire(self, request: Request, status: RequestStatus) -> None:
        """Finishes a request that is already off the waiting queue (running list: caller's)."""
        request.status = status
        self.kv.free(request)
        if request.sent_to_worker or request.fork_state_on_worker:
            self.finished_for_worker.add(request.request_id)
        del self.requests[request.request_id]
        seqs = self.seqs_of_client[request.client_request_id]
        seqs.remove(request.request_id)
        if not seqs:
            del self.seqs_of_client[request.client_request_id]

    def _token_output(
        self, request: Request, token_id: int, runner_output: ModelRunnerOutput, status: RequestStatus | None
    ) -> RequestOutput:
        logprobs = None
        if request.sampling_params.logprobs is not None:
            entry = runner_output.logprobs.get(request.request_id)
            logprobs = [entry] if entry is not None else None
        return RequestOutput(
            request_id=request.client_request_id,
            index=request.index,
            new_token_ids=[token_id],
            new_logprobs=logprobs,
            finish_reason=status.finish_reason if status is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )


def _empty_step() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0)


def _final_output(request: Request, index: int) -> RequestOutput:
    return RequestOutput(
        request_id=request.client_request_id,
        index=index,
        new_token_ids=[],
        new_logprobs=None,
        finish_reason=request.status.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
    )
