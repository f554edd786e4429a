"""Router: exact hit lengths from real Schedulers, imbalance guard, dead workers, ties, policies."""

import dataclasses
import random
import weakref

import pytest

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.router import (
    Route,
    RouteOutcome,
    Router,
    RouterConfig,
    RoutingPolicy,
    WorkerView,
    route_request,
    worker_views,
)
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

BS = 4
CFG = SchedulerConfig(block_size=BS, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)


def make_schedulers(k):
    return {i: Scheduler(CFG) for i in range(k)}


_RUNNERS: "weakref.WeakKeyDictionary[Scheduler, FakeRunner]" = weakref.WeakKeyDictionary()


def step(scheduler, num_steps=None):
    """Steps a scheduler with its own FakeRunner (the worker's state lives across calls)."""
    runner = _RUNNERS.setdefault(scheduler, FakeRunner(CFG.block_size, CFG.num_blocks))
    return run_steps(scheduler, runner, num_steps=num_steps)


def req(rid, prompt, **params):
    return EngineRequest(rid, list(prompt), SamplingParams(**{"temperature": 0.0, "max_tokens": 3, **params}))


def serve(scheduler, *requests):
    """Runs the requests to completion on this worker: their full blocks stay cached."""
    for r in requests:
        scheduler.add_request(r)
    step(scheduler)
    assert_pool_full(scheduler)


def view(worker_id, matched=0, waiting_tokens=0, free=63, alive=True, in_flight=0, **kw):
    fields = dict(
        worker_id=worker_id, alive=alive, num_matched_tokens=matched, num_running_seqs=0, num_waiting_reqs=0,
        num_waiting_tokens=waiting_tokens, num_running_tokens_to_compute=0, num_free_blocks=free,
        num_usable_blocks=63, num_in_flight_matched_tokens=in_flight,
    )
    return WorkerView(**{**fields, **kw})


def hashes_of(tokens):
    return Scheduler(CFG).block_hasher.hash_tokens(tokens)


P = list(range(100, 140))  # 40 tokens: 10 full blocks
Q = P[:12] + list(range(500, 528))  # shares P's first 3 blocks


# --- exact hit lengths ----------------------------------------------------------------------
def test_exact_hit_lengths_from_real_schedulers():
    schedulers = make_schedulers(3)
    serve(schedulers[0], req("p", P))
    serve(schedulers[1], req("q", Q))
    query = P[:22] + [999] * 10  # 8 full blocks; block 5 (tokens 20..23) already differs from P
    views = worker_views(schedulers, hashes_of(query))
    assert [v.num_matched_tokens for v in views] == [20, 12, 0]
    assert [v.num_in_flight_matched_tokens for v in views] == [0, 0, 0]  # nothing queued or running
    route = route_request(Router(), schedulers, query)
    assert route == Route(worker_id=0, outcome=RouteOutcome.PREFIX_HIT, num_matched_tokens=20, load=0)


def test_hit_length_is_full_blocks_only_and_the_whole_prompt_can_match():
    schedulers = make_schedulers(2)
    serve(schedulers[1], req("p", P))
    assert worker_views(schedulers, hashes_of(P))[1].num_matched_tokens == 40  # every block
    assert worker_views(schedulers, hashes_of(P[:39]))[1].num_matched_tokens == 36  # partial block: no hash
    assert worker_views(schedulers, hashes_of(P[:3]))[1].num_matched_tokens == 0  # no full block
    assert route_request(Router(), schedulers, P + [1, 2]).worker_id == 1
    route = route_request(Router(), schedulers, P[:3])
    assert route.outcome == RouteOutcome.NO_MATCH_MOST_FREE


def test_a_matched_request_really_hits_on_the_chosen_worker():
    schedulers = make_schedulers(2)
    serve(schedulers[1], req("p", P))
    query = P[:30] + [7, 8, 9]
    route = route_request(Router(), schedulers, query)
    assert (route.worker_id, route.num_matched_tokens) == (1, 28)
    transcript = run_steps_on(schedulers[route.worker_id], req("x", query))
    assert transcript.num_cached_tokens["x"] == 28


def run_steps_on(scheduler, request):
    scheduler.add_request(request)
    return step(scheduler)


def test_in_flight_prefixes_count_so_a_burst_follows_its_first_request():
    schedulers = make_schedulers(2)
    schedulers[1].add_request(req("p", P))  # queued, nothing computed or cached yet
    views = worker_views(schedulers, hashes_of(P[:33] + [1]))
    assert [(v.num_matched_tokens, v.num_in_flight_matched_tokens) for v in views] == [(0, 0), (0, 32)]
    route = route_request(Router(), schedulers, P[:33] + [1])
    assert (route.worker_id, route.outcome, route.num_matched_tokens) == (1, RouteOutcome.PREFIX_HIT, 32)
    blind = route_request(Router(RouterConfig(match_in_flight=False)), schedulers, P[:33] + [1])
    assert (blind.worker_id, blind.outcome) == (0, RouteOutcome.NO_MATCH_MOST_FREE)


def test_interleaved_families_burst_stays_together_and_splits_across_workers():
    schedulers = make_schedulers(2)
    router = Router()
    families = [list(range(1000 * f, 1000 * f + 40)) for f in range(4)]
    placed: dict[int, set[int]] = {}
    for member in range(4):
        for f, prefix in enumerate(families):
            prompt = prefix + [member, member + 1]
            route = route_request(router, schedulers, prompt)
            placed.setdefault(f, set()).add(route.worker_id)
            schedulers[route.worker_id].add_request(req(f"f{f}m{member}", prompt))
    assert placed == {0: {0}, 1: {1}, 2: {0}, 3: {1}}


def test_fork_children_keep_the_prefix_in_flight_on_their_worker():
    schedulers = make_schedulers(2)
    schedulers[0].add_request(req("n3", P, n=3, max_tokens=8))
    step(schedulers[0], num_steps=3)  # prompt computed, forked
    assert {r.parent_request_id for r in schedulers[0].requests.values()} == {"n3"}
    route = route_request(Router(), schedulers, P + [5])
    assert (route.worker_id, route.num_matched_tokens) == (0, 40)


# --- load -------------------------------------------------------------------------------------
def test_worker_views_report_the_schedulers_load():
    schedulers = make_schedulers(1)
    s = schedulers[0]
    for i in range(3):
        s.add_request(req(f"r{i}", range(i * 100, i * 100 + 20)))
    step(s, num_steps=1)  # budget 32: r0 whole, r1 12 of 20
    v = worker_views(schedulers, [])[0]
    assert (v.num_running_seqs, v.num_waiting_reqs, v.num_waiting_tokens) == (2, 1, 20)
    assert v.num_running_tokens_to_compute == 1 + 8  # r0 decodes, r1 lacks 8 prompt tokens
    assert v.num_usable_blocks == 63 and v.num_free_blocks == 63 - 5 - 3
    assert Router().load_of(v) == 20 + 9 + 16 * 3
    assert Router(RouterConfig(seq_load_tokens=0)).load_of(v) == 29


# --- imbalance guard --------------------------------------------------------------------------
def test_imbalance_guard_needs_both_thresholds():
    cfg = RouterConfig(balance_abs_threshold=1000, balance_rel_threshold=2.0, seq_load_tokens=0)
    router = Router(cfg)
    hot = lambda load: view(0, matched=32, waiting_tokens=load)  # noqa: E731
    cold = lambda load: view(1, waiting_tokens=load)  # noqa: E731
    # both exceeded: 5000 - 100 > 1000 and 5000 > 2 * 100
    route = router.route(40, [hot(5000), cold(100)])
    assert (route.worker_id, route.outcome, route.load) == (1, RouteOutcome.IMBALANCE_FALLBACK, 100)
    # only the absolute gap exceeded: 5000 - 3000 > 1000 but 5000 <= 2 * 3000
    assert router.route(40, [hot(5000), cold(3000)]).outcome == RouteOutcome.PREFIX_HIT
    # only the ratio exceeded: 900 > 2 * 0 but 900 - 0 <= 1000
    assert router.route(40, [hot(900), cold(0)]).outcome == RouteOutcome.PREFIX_HIT
    # each exactly at its threshold, the other exceeded: not imbalanced (both comparisons strict)
    assert router.route(40, [hot(1000), cold(0)]).outcome == RouteOutcome.PREFIX_HIT
    assert router.route(40, [hot(3000), cold(1500)]).outcome == RouteOutcome.PREFIX_HIT
    assert router.route(40, [hot(1001), cold(0)]).outcome == RouteOutcome.IMBALANCE_FALLBACK
    assert router.route(40, [hot(2001), cold(1000)]).outcome == RouteOutcome.IMBALANCE_FALLBACK


def test_imbalance_among_live_workers_only():
    router = Router(RouterConfig(balance_abs_threshold=10, seq_load_tokens=0))
    workers = [view(0, matched=32, waiting_tokens=500), view(1, alive=False), view(2, waiting_tokens=490)]
    assert router.route(40, workers).outcome == RouteOutcome.PREFIX_HIT


def test_imbalance_guard_with_real_schedulers():
    schedulers = make_schedulers(2)
    serve(schedulers[0], req("p", P))
    for i in range(4):
        schedulers[0].add_request(req(f"busy{i}", range(2000 + 50 * i, 2000 + 50 * i + 30)))
    router = Router(RouterConfig(balance_abs_threshold=64))
    route = route_request(router, schedulers, P + [1])
    assert (route.worker_id, route.outcome) == (1, RouteOutcome.IMBALANCE_FALLBACK)
    assert route_request(Router(), schedulers, P + [1]).outcome == RouteOutcome.PREFIX_HIT  # 184 tokens: balanced


# --- dead workers, no worker --------------------------------------------------------------------
def test_dead_workers_are_never_chosen():
    workers = [view(0, matched=40, alive=False), view(1, matched=8), view(2, alive=False, free=63), view(3, free=10)]
    for policy in RoutingPolicy:
        router = Router(RouterConfig(policy=policy))
        chosen = {router.route(40, workers).worker_id for _ in range(6)}
        assert chosen <= {1, 3}, policy
    assert Router().route(40, workers).worker_id == 1


def test_adapter_marks_dead_workers_and_skips_their_matching():
    schedulers = make_schedulers(3)
    serve(schedulers[0], req("p", P))
    views = worker_views(schedulers, hashes_of(P), alive={1, 2})
    assert [(v.alive, v.num_matched_tokens) for v in views] == [(False, 0), (True, 0), (True, 0)]
    route = route_request(Router(), schedulers, P, alive={1, 2})
    assert (route.worker_id, route.outcome) == (1, RouteOutcome.NO_MATCH_MOST_FREE)


@pytest.mark.parametrize("policy", list(RoutingPolicy))
def test_no_live_worker_routes_nowhere(policy):
    router = Router(RouterConfig(policy=policy))
    assert router.route(10, []) is None
    assert router.route(10, [view(0, alive=False), view(1, alive=False)]) is None
    assert route_request(router, {}, [1, 2, 3]) is None
    assert route_request(router, make_schedulers(2), [1, 2, 3], alive=set()) is None


# --- ties ---------------------------------------------------------------------------------------
def test_ties_are_deterministic_whatever_the_view_order():
    rng = random.Random(0)
    cases = [
        ([view(i) for i in range(4)], 0),  # all equal: lowest id
        ([view(0, matched=16, waiting_tokens=300), view(1, matched=16, waiting_tokens=200),
          view(2, matched=16, waiting_tokens=200)], 1),  # equal match: lower load, then lower id
        ([view(0, free=10), view(1, free=50, waiting_tokens=9), view(2, free=50, waiting_tokens=3),
          view(3, free=50, waiting_tokens=3)], 2),  # no match: most free, then lower load, then lower id
    ]
    for workers, expected in cases:
        for _ in range(5):
            rng.shuffle(workers)
            assert Router().route(40, workers).worker_id == expected
            assert Router(RouterConfig(policy="least_loaded")).route(40, workers).worker_id == min(
                workers, key=lambda w: (Router().load_of(w), w.worker_id)).worker_id


def test_longest_match_beats_lower_load_when_balanced():
    workers = [view(0, matched=8), view(1, matched=24, waiting_tokens=100), view(2, in_flight=16)]
    assert Router().route(40, workers) == Route(1, RouteOutcome.PREFIX_HIT, 24, 100)
    workers[2] = view(2, in_flight=32)
    assert Router().route(40, workers).worker_id == 2
    assert Router(RouterConfig(match_in_flight=False)).route(40, workers).worker_id == 1


def test_duplicate_worker_ids_are_a_bug():
    with pytest.raises(AssertionError):
        Router().route(4, [view(0), view(0)])


# --- min_match_fraction -------------------------------------------------------------------------
def test_min_match_fraction_falls_back_to_most_free_cache():
    workers = [view(0, matched=8, free=20), view(1, free=40), view(2, free=40, waiting_tokens=5)]
    router = Router(RouterConfig(min_match_fraction=0.25))
    route = router.route(40, workers)  # 8 < 0.25 * 40
    assert (route.worker_id, route.outcome, route.num_matched_tokens) == (1, RouteOutcome.NO_MATCH_MOST_FREE, 0)
    route = router.route(32, workers)  # 8 >= 0.25 * 32
    assert (route.worker_id, route.outcome) == (0, RouteOutcome.PREFIX_HIT)
    assert Router(RouterConfig(min_match_fraction=0.0)).route(40, [view(0, free=1), view(1, free=2)]).outcome == (
        RouteOutcome.NO_MATCH_MOST_FREE)  # a zero match never counts as a hit


def test_a_burst_of_new_prompts_spreads_before_any_of_them_is_admitted():
    """Requests routed in one go hold no blocks until admitted: free blocks alone sent every one
    of them to the worker that happened to hold one block less (the served c16 runs)."""
    schedulers = make_schedulers(2)
    schedulers[0].add_request(req("holder", range(4000, 4012)))
    step(schedulers[0], num_steps=1)  # worker 0 holds 3 blocks, decoding
    owners = []
    for i in range(8):  # 8 new 20-token prompts (5 blocks each), nothing in common
        prompt = list(range(10_000 + 100 * i, 10_000 + 100 * i + 20))
        route = route_request(Router(), schedulers, prompt)
        assert route.outcome == RouteOutcome.NO_MATCH_MOST_FREE
        schedulers[route.worker_id].add_request(req(f"b{i}", prompt))  # queued, no blocks yet
        owners.append(route.worker_id)
    assert sorted(owners.count(w) for w in (0, 1)) == [4, 4], owners


def test_min_match_fraction_with_real_schedulers():
    schedulers = make_schedulers(2)
    serve(schedulers[0], req("p", P))
    schedulers[0].add_request(req("holder", range(4000, 4040)))
    step(schedulers[0], num_steps=1)  # holds 8 blocks: 55 free vs 63
    query = P[:8] + list(range(7000, 7072))  # 80 tokens, 8 matched on worker 0 (10%)
    assert route_request(Router(RouterConfig(min_match_fraction=0.05)), schedulers, query).worker_id == 0
    route = route_request(Router(RouterConfig(min_match_fraction=0.2)), schedulers, query)
    assert (route.worker_id, route.outcome) == (1, RouteOutcome.NO_MATCH_MOST_FREE)


# --- round robin, least loaded --------------------------------------------------------------------
def test_round_robin_cycles_over_live_workers_only():
    router = Router(RouterConfig(policy=RoutingPolicy.ROUND_ROBIN))
    workers = [view(0, matched=40), view(1, alive=False), view(2), view(3, alive=False)]
    picks = [router.route(40, workers) for _ in range(5)]
    assert [r.worker_id for r in picks] == [0, 2, 0, 2, 0]
    assert {r.outcome for r in picks} == {RouteOutcome.ROUND_ROBIN}
    assert picks[0].num_matched_tokens == 40
    workers[1] = view(1)  # back alive: rejoins the cycle after 0
    assert [router.route(40, workers).worker_id for _ in range(4)] == [1, 2, 0, 1]
    workers[2] = view(2, alive=False)  # the next one dies: skipped
    assert router.route(40, workers).worker_id == 0


def test_least_loaded_ignores_matches():
    router = Router(RouterConfig(policy="least_loaded", seq_load_tokens=10))
    workers = [view(0, matched=40, num_waiting_reqs=1), view(1, waiting_tokens=5), view(2, num_running_seqs=1),
               view(3, num_running_tokens_to_compute=3)]  # loads 10, 5, 10, 3
    route = router.route(40, workers)
    assert (route.worker_id, route.outcome, route.load) == (3, RouteOutcome.LEAST_LOADED, 3)


def test_least_loaded_spreads_a_burst_over_real_schedulers():
    schedulers = make_schedulers(3)
    router = Router(RouterConfig(policy=RoutingPolicy.LEAST_LOADED))
    counts = [0, 0, 0]
    for i in range(9):
        route = route_request(router, schedulers, P + [i])
        schedulers[route.worker_id].add_request(req(f"r{i}", P + [i]))
        counts[route.worker_id] += 1
    assert counts == [3, 3, 3]


# --- config -------------------------------------------------------------------------------------
def test_config_is_frozen_validated_and_takes_policy_names():
    cfg = RouterConfig(policy="round_robin")
    assert cfg.policy is RoutingPolicy.ROUND_ROBIN
    assert RouterConfig().policy is RoutingPolicy.PREFIX_AWARE
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = RoutingPolicy.LEAST_LOADED  # type: ignore[misc]
    with pytest.raises(ValueError):
        RouterConfig(policy="random")
    for bad in (dict(balance_abs_threshold=-1), dict(balance_rel_threshold=0.9), dict(min_match_fraction=1.5),
                dict(seq_load_tokens=-1)):
        with pytest.raises(AssertionError):
            RouterConfig(**bad)
