"""The router's LoRA residency scoring (scheduler/router.py, steps 3a-3c): a request goes where
its adapter is loaded, unless those workers are busy beyond the imbalance guard; hits and
loads are counted."""

from scheduler.router import RouteOutcome, Router, RouterConfig, WorkerView


def view(worker_id, has_adapter, waiting_tokens=0, matched=0, free_blocks=100, free_slot=True):
    return WorkerView(worker_id=worker_id, alive=True, num_matched_tokens=matched, num_running_seqs=0,
                      num_waiting_reqs=0, num_waiting_tokens=waiting_tokens, num_running_tokens_to_compute=0,
                      num_free_blocks=free_blocks, num_usable_blocks=100, has_adapter=has_adapter,
                      has_free_adapter_slot=free_slot)


ROUTER = RouterConfig(balance_abs_threshold=100, balance_rel_threshold=1.5)


def test_the_worker_holding_the_adapter_wins_over_more_free_room():
    route = Router(ROUTER).route(32, [view(0, False, free_blocks=100), view(1, True, free_blocks=10)], needs_adapter=True)
    assert route.worker_id == 1 and route.adapter_hit is True and route.outcome == RouteOutcome.NO_MATCH_MOST_FREE


def test_a_prefix_on_a_non_holder_does_not_pull_the_request_away_from_the_holder():
    route = Router(ROUTER).route(32, [view(0, False, matched=32), view(1, True)], needs_adapter=True)
    assert route.worker_id == 1 and route.adapter_hit


def test_busy_holders_spread_the_adapter_to_the_least_loaded_worker():
    # the holder's load is within the guard of the idle worker: it still wins
    assert Router(ROUTER).route(32, [view(0, False), view(1, True, waiting_tokens=90)], needs_adapter=True).worker_id == 1
    route = Router(ROUTER).route(32, [view(0, False, waiting_tokens=10), view(1, True, waiting_tokens=500),
                                      view(2, False, waiting_tokens=400)], needs_adapter=True)
    assert route.worker_id == 0 and route.outcome == RouteOutcome.ADAPTER_SPREAD and route.adapter_hit is False


def test_no_holder_routes_as_without_adapters_and_base_requests_have_no_adapter_outcome():
    route = Router(ROUTER).route(32, [view(0, False, matched=16), view(1, False)], needs_adapter=True)
    assert route.worker_id == 0 and route.adapter_hit is False and route.outcome == RouteOutcome.PREFIX_HIT
    assert Router(ROUTER).route(32, [view(0, True), view(1, True)]).adapter_hit is None


def test_round_robin_ignores_residency_but_reports_it():
    router = Router(RouterConfig(policy="round_robin"))
    views = [view(0, True), view(1, False)]
    assert [(r.worker_id, r.adapter_hit) for r in (router.route(8, views, True), router.route(8, views, True))] == [
        (0, True), (1, False)]


def test_a_new_adapter_goes_where_a_slot_is_free_before_any_other_rule():
    # worker 0 has more KV room and the prefix, but its adapter slots are full: loading there would evict
    route = Router(ROUTER).route(32, [view(0, False, matched=16, free_slot=False), view(1, False, free_blocks=10)],
                                 needs_adapter=True)
    assert route.worker_id == 1 and route.adapter_hit is False
    # every worker full: the usual rules among all of them
    route = Router(ROUTER).route(32, [view(0, False, matched=16, free_slot=False), view(1, False, free_slot=False)],
                                 needs_adapter=True)
    assert route.worker_id == 0
