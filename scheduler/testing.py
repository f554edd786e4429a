"""FakeRunner: the worker side of the step contract, deterministic, without torch.

It keeps per-request state exactly as a real worker must (token ids, block table,
num_computed_tokens) and a simulated KV pool in which slot p of a request holds a digest of
the request's whole prefix [0, p]. The next token is a function of the digest read back
from the pool at the last position, so it depends on the full context AND on the KV the
scheduler pointed at: a wrong prefix hit, a missed copy, a reused block or a lost token
changes the output (or trips an assert), which makes scheduler bugs visible.

Checks on every step:
- finished ids are known; new ids are not; cached progress equals the worker's own;
- nothing is scheduled past the tokens the worker knows, or past the block table;
- a block written this step is referenced by no other live request, and never block 0;
- every position read (all of [0, end)) holds the digest of this request's own prefix.

With `recurrent`, it also keeps what a model with recurrent layers keeps per request (workers/
recurrent.py): a state, here the digest of the prefix it has folded and its length. A step must
continue it exactly; a fork copies the parent's (before the parent is forgotten); a prefix hit
restores a snapshot, which must be of this request's own prefix, of exactly the hit's length.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.block_pool import NULL_BLOCK_ID
from scheduler.outputs import (
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.request import RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

# (prefix digest at the last position, params, output position) -> token id
NextTokenFn = Callable[[int, SamplingParams, int], int]


@dataclass(slots=True)
class FakeSeq:
    """The worker's copy of one request."""

    request_id: str
    token_ids: list[int]  # prompt + generated, as the worker knows them
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_table: list[int]  # block index -> block id
    num_computed_tokens: int  # positions whose KV the worker has written (or was handed)
    digests: list[int] = field(default_factory=list)  # position -> digest of token_ids[: p + 1]

    def digest_at(self, position: int) -> int:
        while len(self.digests) <= position:
            p = len(self.digests)
            prev = self.digests[-1] if self.digests else 0
            self.digests.append(hash((prev, self.token_ids[p], p)))
        return self.digests[position]


class FakeRunner:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int = 1000,
        check_kv: bool = True,
        delay_s: float = 0.0,
        next_token_fn: NextTokenFn | None = None,
        recurrent: bool = False,
    ) -> None:
        self.block_size = block_size  # tokens per block, as the scheduler's
        self.vocab_size = vocab_size  # sampled ids are in [0, vocab_size)
        self.check_kv = check_kv  # verify every read position (O(context) per request per step)
        self.delay_s = delay_s  # sleep per execute, seconds (engine concurrency tests)
        self.next_token_fn = next_token_fn or self.default_next_token
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]  # block -> slot -> digest
        self.requests: dict[str, FakeSeq] = {}  # request_id -> worker state
        self.registered: set[str] = set()  # every request_id ever added
        self.rng = random.Random(0)  # unseeded sampling
        self.num_steps = 0  # execute calls
        self.scheduled_history: list[dict[str, int]] = []  # per step: request_id -> tokens
        self.num_computed_per_request: Counter[str] = Counter()  # request_id -> tokens computed, ever
        self.copies: list[tuple[int, int]] = []  # every (src, dst) applied
        # After a failed step the engine names every id the worker may still hold, and a step
        # that ran after the failure may have named some already (Engine.fail_all): runners
        # that inject failures set this; otherwise an id named twice is a bookkeeping bug.
        self.forgets_may_repeat = False
        self.loras: dict[str, str] = {}  # LoRA adapter name -> path, as the steps loaded them
        self.lora_of: dict[str, str] = {}  # request_id -> its adapter, for requests of one
        self.num_lora_loads = 0  # adapters loaded, ever
        self.loras_per_step: list[set[str]] = []  # per step: the distinct adapters it ran
        self.recurrent = recurrent  # keep and check a state per request (see the module doc)
        self.states: dict[str, tuple[int, int]] = {}  # request_id -> (tokens folded, digest of them)
        self.snapshots: dict[int, tuple[int, int]] = {}  # snapshot slot -> (tokens, digest)
        self.num_restores = 0  # prefix hits that restored a snapshot

    def default_next_token(self, digest: int, params: SamplingParams, position: int) -> int:
        if params.is_greedy:
            return hash((digest, 7)) % self.vocab_size
        salt = params.seed if params.seed is not None else self.rng.getrandbits(32)
        return hash((digest, salt, position)) % self.vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.delay_s:
            time.sleep(self.delay_s)
        so = scheduler_output
        self.num_steps += 1
        self.scheduled_history.append(dict(so.num_scheduled_tokens))
        for parent, child in so.state_forks:
            assert self.recurrent, "state forks for a worker without recurrent layers"
            self.states[child] = self.states[parent]  # KeyError: the parent's state is gone
        for rid in so.finished_request_ids:
            self.states.pop(rid, None)
            # a request whose first step failed may be named without ever being registered
            # (Engine.fail_all); one registered and already forgotten may not, but after a failure
            assert rid in self.requests or rid not in self.registered or self.forgets_may_repeat, (
                f"finished {rid} twice")
            self.requests.pop(rid, None)
        for name in so.lora_unloads:  # unloads first: a name may come back from another path
            assert name in self.loras, f"unloads adapter {name!r} it never loaded"
            del self.loras[name]
        for name, path in so.lora_loads.items():
            assert name not in self.loras, f"loads adapter {name!r} twice"
            self.loras[name] = path
            self.num_lora_loads += 1
        for new in so.new_requests:
            self._add(new)
            if new.lora_name is not None:
                self.lora_of[new.request_id] = new.lora_name
        step_loras = {self.lora_of[rid] for rid in so.num_scheduled_tokens if rid in self.lora_of}
        assert step_loras <= set(self.loras), f"runs adapters {step_loras - set(self.loras)} it has not loaded"
        self.loras_per_step.append(step_loras)
        for cached in so.cached_requests:
            seq = self.requests[cached.request_id]
            assert cached.num_computed_tokens == seq.num_computed_tokens, (cached, seq.num_computed_tokens)
            seq.block_table.extend(cached.new_block_ids)
        for src, dst in so.copy_blocks:
            self.kv[dst] = list(self.kv[src])
            self.copies.append((src, dst))
        listed = {r.request_id for r in so.new_requests} | {r.request_id for r in so.cached_requests}
        assert listed == set(so.num_scheduled_tokens), "scheduled and listed requests differ"
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        self._check_exclusive_writes(so.num_scheduled_tokens)
        assert set(so.state_saves) <= set(so.num_scheduled_tokens), "a snapshot of a request the step does not run"
        self._saves = so.state_saves
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for rid, num_tokens in so.num_scheduled_tokens.items():
            token = self._forward(self.requests[rid], num_tokens)
            if token is not None:
                sampled[rid] = token
                k = self.requests[rid].sampling_params.logprobs
                if k is not None:
                    logprobs[rid] = TokenLogprobs(token, -0.5, [(token, -0.5)][:k] if k else [])
        return ModelRunnerOutput(sampled, logprobs)

    def _add(self, new: NewRequestData) -> None:
        rid = new.request_id
        assert rid not in self.requests, f"new {rid} is already known to the worker"
        self.registered.add(rid)
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        assert 0 <= new.num_computed_tokens < len(tokens), (rid, new.num_computed_tokens)
        assert len(set(new.block_ids)) == len(new.block_ids), f"{rid}: a block twice in one table"
        self.requests[rid] = FakeSeq(
            rid, tokens, len(new.prompt_token_ids), new.sampling_params, list(new.block_ids), new.num_computed_tokens
        )
        if not self.recurrent:
            assert new.state_snapshot is None, f"{rid}: a snapshot for a worker without recurrent layers"
        elif new.state_snapshot is not None:
            self.states[rid] = self.snapshots[new.state_snapshot]
            self.num_restores += 1
        elif new.num_computed_tokens == 0:
            self.states[rid] = (0, 0)
        assert not self.recurrent or self.states.get(rid, (None,))[0] == new.num_computed_tokens, (
            f"{rid} starts at {new.num_computed_tokens} with a state of {self.states.get(rid)}")

    def _check_exclusive_writes(self, num_scheduled: dict[str, int]) -> None:
        owners: dict[int, list[str]] = {}
        for seq in self.requests.values():
            for block_id in seq.block_table:
                owners.setdefault(block_id, []).append(seq.request_id)
        bs = self.block_size
        for rid, num_tokens in num_scheduled.items():
            seq = self.requests[rid]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            assert num_tokens >= 1 and end <= len(seq.token_ids), f"{rid}: scheduled past known tokens"
            assert end <= len(seq.block_table) * bs, f"{rid}: block table too short"
            for b in range(start // bs, (end - 1) // bs + 1):
                block_id = seq.block_table[b]
                assert block_id != NULL_BLOCK_ID, f"{rid} writes the null block"
                assert owners[block_id] == [rid], f"{rid} writes block {block_id} shared with {owners[block_id]}"

    def _forward(self, seq: FakeSeq, num_tokens: int) -> int | None:
        bs = self.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        for p in range(start, end):  # write this step's KV
            self.kv[seq.block_table[p // bs]][p % bs] = seq.digest_at(p)
        if self.check_kv:  # attention reads the whole context
            for p in range(end):
                got = self.kv[seq.block_table[p // bs]][p % bs]
                assert got == seq.digest_at(p), f"{seq.request_id}: wrong KV at position {p}"
        if self.recurrent:
            self._fold(seq, start, end)
        seq.num_computed_tokens = end
        self.num_computed_per_request[seq.request_id] += num_tokens
        if end < len(seq.token_ids):
            return None  # a prefill chunk samples nothing
        last = self.kv[seq.block_table[(end - 1) // bs]][(end - 1) % bs]
        assert last is not None
        token = self.next_token_fn(last, seq.sampling_params, len(seq.token_ids) - seq.num_prompt_tokens)
        seq.token_ids.append(token)
        return token


    def _fold(self, seq: FakeSeq, start: int, end: int) -> None:
        """The recurrent state goes from start to end, taking the step's snapshot on the way."""
        rid = seq.request_id
        assert self.states[rid] == (start, seq.digest_at(start - 1) if start else 0), (
            f"{rid}: computes from {start} over a state of {self.states[rid][0]} tokens, or of another prefix")
        save = self._saves.get(rid)
        if save is not None:
            position, slot = save
            assert start <= position <= end, (rid, save, start, end)
            self.snapshots[slot] = (position, seq.digest_at(position - 1))
        self.states[rid] = (end, seq.digest_at(end - 1))


class InstantRunner:
    """The cheapest worker that keeps the contract: no KV, no checks (benchmarks)."""

    def __init__(self, token_id: int = 1) -> None:
        self.token_id = token_id  # the token every request samples
        self.progress: dict[str, list[int]] = {}  # request_id -> [num_computed_tokens, num_tokens]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        for rid in so.finished_request_ids:
            self.progress.pop(rid, None)  # None: its first step failed (Engine.fail_all)
        for new in so.new_requests:
            num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.progress[new.request_id] = [new.num_computed_tokens, num_tokens]
        sampled = {}
        for rid, num in so.num_scheduled_tokens.items():
            state = self.progress[rid]
            state[0] += num
            if state[0] == state[1]:
                state[1] += 1
                sampled[rid] = self.token_id
        return ModelRunnerOutput(sampled)


# --- driving a scheduler in tests ----------------------------------------------------------
@dataclass(slots=True)
class Transcript:
    """What the clients of one scheduler run saw."""

    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (client id, index) -> tokens
    finish_reasons: dict[tuple[str, int], FinishReason] = field(default_factory=dict)  # (client id, index) -> reason
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # client id -> last reported
    outputs: list[RequestOutput] = field(default_factory=list)  # every delta, in order
    num_steps: int = 0  # steps run

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            key = (out.request_id, out.index)
            assert key not in self.finish_reasons, f"delta after the final one for {key}"
            self.tokens.setdefault(key, []).extend(out.new_token_ids)
            self.num_cached_tokens[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                self.finish_reasons[key] = out.finish_reason
        self.outputs.extend(outputs)


class AheadDriver:
    """Drives a scheduler as the engine does with async scheduling: step N+1 is decided
    (schedule_ahead) before step N's result is applied, and the worker runs N before N+1.

    Between calls to step(), one step may be handed out and not run yet, as when a client
    aborts while the worker computes: tests abort, add or migrate there.
    """

    def __init__(self, scheduler: Scheduler, runner: FakeRunner | InstantRunner,
                 transcript: Transcript | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.transcript = transcript if transcript is not None else Transcript()
        self.next_step: SchedulerOutput | None = None  # handed out, not run yet
        self.num_ahead = 0  # steps decided by schedule_ahead

    @property
    def busy(self) -> bool:
        return self.next_step is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> None:
        """Runs one step (scheduling the next one first, where it can be)."""
        scheduler = self.scheduler
        running = self.next_step
        if running is None:
            running = scheduler.schedule()
            assert not running.is_empty, "no progress while requests are unfinished"
            check_step(scheduler, running)
        ahead = scheduler.schedule_ahead()
        if not ahead.is_empty:
            check_step(scheduler, ahead)
            self.num_ahead += 1
        self.transcript.record(scheduler.update_from_output(running, self.runner.execute(running)))
        self.transcript.num_steps += 1
        self.next_step = None if ahead.is_empty else ahead
        assert_consistent(scheduler)

    def forget_step(self, runner: FakeRunner | InstantRunner) -> None:
        """The worker died (take_requests_for_migration was called): the step it was given is
        gone, and `runner` is its replacement."""
        self.next_step = None
        self.runner = runner


def run_steps(
    scheduler: Scheduler,
    runner: FakeRunner | InstantRunner,
    transcript: Transcript | None = None,
    num_steps: int | None = None,
    until: Callable[[Scheduler], bool] | None = None,
    max_steps: int = 100_000,
) -> Transcript:
    """Steps until no request is left, `num_steps` were run or `until` holds; checks every step."""
    transcript = transcript if transcript is not None else Transcript()
    for i in range(max_steps):
        if not scheduler.has_unfinished_requests() or i == num_steps or (until is not None and until(scheduler)):
            return transcript
        output = scheduler.schedule()
        assert not output.is_empty, "no progress while requests are unfinished"
        check_step(scheduler, output)
        transcript.record(scheduler.update_from_output(output, runner.execute(output)))
        transcript.num_steps += 1
        assert_consistent(scheduler)
    raise AssertionError(f"not done after {max_steps} steps")


def run_to_end(scheduler: Scheduler, runner: FakeRunner | InstantRunner, ahead: bool) -> Transcript:
    """Steps until no request is left: each step scheduled after the last one landed
    (run_steps) or, ahead, decided while the last one runs (AheadDriver)."""
    if not ahead:
        return run_steps(scheduler, runner)
    driver = AheadDriver(scheduler, runner)
    while driver.busy:
        driver.step()
    return driver.transcript


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    cfg = scheduler.config
    assert 0 < output.total_num_scheduled_tokens <= cfg.max_num_batched_tokens, output.total_num_scheduled_tokens
    assert len(output.num_scheduled_tokens) <= cfg.max_num_seqs
    assert scheduler.num_running_seqs <= cfg.max_num_seqs


def assert_consistent(scheduler: Scheduler) -> None:
    """Block accounting matches the requests exactly (ref counts, free list, cache map)."""
    kv = scheduler.kv
    pool = kv.pool
    refs: Counter[int] = Counter()
    for rid, blocks in kv.req_blocks.items():
        request = scheduler.requests[rid]
        assert request.status == RequestStatus.RUNNING, (rid, request.status)
        assert len(blocks) * kv.block_size >= request.num_computed_tokens, rid
        refs.update(b.block_id for b in blocks)
    for request in scheduler.running:
        assert request.request_id in kv.req_blocks, request.request_id
    for request in scheduler.waiting:
        assert request.request_id not in kv.req_blocks and request.status <= RequestStatus.PREEMPTED
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == pool.num_free_blocks == len(set(free_ids))
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
        assert (block.ref_cnt == 0) == (block.prev_free is not None), block
    assert set(free_ids) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert scheduler.num_running_seqs == sum(r.num_seqs for r in scheduler.running)
    assert len(scheduler.requests) == len(scheduler.running) + len(scheduler.waiting)


def assert_pool_full(scheduler: Scheduler) -> None:
    """Every usable block is free again (no leak)."""
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks, (pool.num_free_blocks, pool.num_usable_blocks)
    assert not scheduler.kv.req_blocks
