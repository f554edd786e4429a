"""LoRA adapters in the pure scheduler: the prefix cache keys blocks by adapter (the same
tokens under two adapters share no KV), the router matches under the request's adapter, and
the adapter travels to the worker with the request, to fork children and through migration."""

from scheduler.block_hash import BlockHasher, adapter_root
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.router import RouteOutcome, Router, route_request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=64)
SHARED = list(range(1000, 1030))  # 30 tokens: 7 full blocks of 4


def req(rid, prompt, lora_name=None, **params):
    return EngineRequest(rid, list(prompt), SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **params}),
                         lora_name=lora_name)


def test_an_adapter_roots_its_own_hash_chain():
    hasher = BlockHasher(4)
    base, first, second = (hasher.hash_tokens(SHARED, adapter_root(name)) for name in (None, "a", "b"))
    assert len(base) == len(first) == len(second) == 7
    assert not set(base) & set(first) and not set(first) & set(second)  # no block key in common
    assert hasher.hash_tokens(SHARED, adapter_root("a")) == first  # and stable
    assert adapter_root(None) is None and hasher.hash_tokens(SHARED) == base


def test_two_adapters_never_share_cached_blocks_and_one_adapter_does():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    scheduler.add_request(req("a1", SHARED + [1, 2], "a"))
    transcript = run_steps(scheduler, runner)
    for rid, lora_name in (("b1", "b"), ("base", None), ("a2", "a")):
        scheduler.add_request(req(rid, SHARED + [3, 4, 5], lora_name))
        run_steps(scheduler, runner, transcript)
    assert transcript.num_cached_tokens == {"a1": 0, "b1": 0, "base": 0, "a2": 28}
    assert_pool_full(scheduler)


def test_the_worker_is_told_each_new_requests_adapter():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    scheduler.add_request(req("x", [1, 2, 3], "a"))
    scheduler.add_request(req("y", [4, 5, 6]))
    scheduler.add_request(req("z", [7, 8, 9], "b", n=2, temperature=1.0, seed=1))
    output = scheduler.schedule()
    sent = {new.request_id: new.lora_name for new in output.new_requests}
    assert sent["x"] == "a" and sent["y"] is None
    assert {rid: name for rid, name in sent.items() if rid.startswith("z")} and all(
        name == "b" for rid, name in sent.items() if rid.startswith("z"))  # fork children keep it


def test_the_router_matches_a_prompt_under_its_adapter():
    schedulers = {i: Scheduler(CFG) for i in range(2)}
    for worker, lora_name in ((0, None), (1, "a")):
        scheduler, runner = schedulers[worker], FakeRunner(CFG.block_size, CFG.num_blocks)
        scheduler.add_request(req(f"warm{worker}", SHARED, lora_name))
        run_steps(scheduler, runner)
    query = SHARED + [9, 9]
    assert route_request(Router(), schedulers, query).worker_id == 0
    route = route_request(Router(), schedulers, query, lora_name="a")
    assert (route.worker_id, route.outcome, route.num_matched_tokens) == (1, RouteOutcome.PREFIX_HIT, 28)
    assert route_request(Router(), schedulers, query, lora_name="b").outcome == RouteOutcome.NO_MATCH_MOST_FREE


def test_a_migrated_request_keeps_its_adapter():
    source, target = Scheduler(CFG), Scheduler(CFG)
    source.add_request(req("m", SHARED, "a", max_tokens=8))
    run_steps(source, FakeRunner(CFG.block_size, CFG.num_blocks), num_steps=2)
    [moved] = source.take_requests_for_migration()
    target.add_migrated_request(moved)
    output = target.schedule()
    assert [(new.request_id, new.lora_name) for new in output.new_requests] == [("m", "a")]
    assert moved.block_hashes[0] == BlockHasher(4).hash_tokens(SHARED, adapter_root("a"))[0]
