"""The per-worker LRU of LoRA adapters (scheduler/lora_slots.py) and how the Scheduler uses it:
max_loras per step, loads only on misses, pinned adapters never evicted, waits without
starvation."""

from scheduler.config import SchedulerConfig
from scheduler.lora_slots import LoraSlots
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, run_steps


def load(slots: LoraSlots, name: str, pinned=(), path: str | None = None):
    plan = slots.plan(name, path or f"/adapters/{name}", set(pinned))
    if plan is not None:
        slots.commit(plan)
    return plan


def test_lru_evicts_the_least_recently_used():
    slots = LoraSlots(3)
    for name in "abc":
        assert load(slots, name).load
    slots.touch("a")  # b is now the least recently used
    plan = load(slots, "d")
    assert plan.load and plan.evict == ("b",)
    assert slots.loaded() == ["c", "a", "d"]
    hit = load(slots, "c")
    assert not hit.load and hit.evict == ()
    assert slots.loaded() == ["a", "d", "c"]
    assert (slots.counts.num_loads, slots.counts.num_hits, slots.counts.num_evictions) == (4, 1, 1)


def test_pinned_adapters_are_never_evicted_and_all_pinned_means_wait():
    slots = LoraSlots(2)
    load(slots, "a")
    load(slots, "b")
    assert load(slots, "c", pinned={"a"}).evict == ("b",)  # a is older but pinned
    assert load(slots, "d", pinned={"a", "c"}) is None  # nothing can go: the request waits
    assert slots.loaded() == ["a", "c"]


def test_a_name_from_another_path_is_reloaded_unless_pinned():
    slots = LoraSlots(2)
    load(slots, "a", path="/old")
    assert load(slots, "a", pinned={"a"}, path="/new") is None
    plan = load(slots, "a", path="/new")
    assert plan.load and plan.evict == ("a",) and slots.path_of("a") == "/new"


CFG = SchedulerConfig(block_size=4, num_blocks=256, max_model_len=128, max_num_batched_tokens=256,
                      max_loras=2, max_cpu_loras=3)


def req(rid, lora_name, max_tokens=4, prompt=None):
    return EngineRequest(rid, prompt or [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                         lora_name=lora_name, lora_path=None if lora_name is None else f"/adapters/{lora_name}")


def test_at_most_max_loras_adapters_per_step_and_the_rest_wait():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    for i, name in enumerate(["a", "b", "c", None, "a"]):
        scheduler.add_request(req(f"r{i}", name))
    first = scheduler.schedule()
    # a and b fill max_loras; c waits; the base model and a second a pass it
    assert set(first.num_scheduled_tokens) == {"r0", "r1", "r3", "r4"}
    assert first.lora_loads == {"a": "/adapters/a", "b": "/adapters/b"} and first.lora_unloads == []
    scheduler.update_from_output(first, runner.execute(first))
    transcript = run_steps(scheduler, runner)
    assert {rid for rid, _ in transcript.finish_reasons} == {f"r{i}" for i in range(5)}
    assert max(len(names) for names in runner.loras_per_step) == 2
    assert runner.num_lora_loads == 3  # a, b, c: one load each, no reload
    assert scheduler.lora_requests == {"a": 2, "b": 1, "c": 1}
    assert scheduler.lora_generation_tokens == {"a": 8, "b": 4, "c": 4}


def test_loads_only_on_misses_and_evicts_the_lru_unpinned():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    for i, name in enumerate(["a", "b", "c", "a", "d"]):  # one at a time
        scheduler.add_request(req(f"r{i}", name))
        run_steps(scheduler, runner)
    assert runner.num_lora_loads == 4  # the second a was a hit
    assert scheduler.loras.loaded() == ["c", "a", "d"]  # b was the least recently used
    assert set(runner.loras) == {"c", "a", "d"}
    assert scheduler.loras.counts.num_evictions == 1


def test_a_waiting_adapter_is_not_starved_by_a_running_one():
    config = SchedulerConfig(block_size=4, num_blocks=256, max_model_len=128, max_num_batched_tokens=256,
                             max_loras=1, max_cpu_loras=1, max_lora_wait_steps=3)
    scheduler, runner = Scheduler(config), FakeRunner(config.block_size, config.num_blocks)
    scheduler.add_request(req("a0", "a", max_tokens=5))
    scheduler.add_request(req("b0", "b", max_tokens=2))
    started: dict[str, int] = {}
    for step in range(40):  # a steady stream of a's requests
        scheduler.add_request(req(f"a{step + 1}", "a", max_tokens=5))
        output = scheduler.schedule()
        for new in output.new_requests:
            started.setdefault(new.request_id, step)
        scheduler.update_from_output(output, runner.execute(output))
    assert "b0" in started, "b waited forever behind a's stream"
    # a's younger requests passed b only until b had waited max_lora_wait_steps; then a drained
    assert started["b0"] <= config.max_lora_wait_steps + 5 + 1
    assert all(len(names) <= 1 for names in runner.loras_per_step)


def test_a_new_adapter_never_passes_an_older_waiting_one():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    for i, name in enumerate(["a", "b", "c", "d"]):
        scheduler.add_request(req(f"r{i}", name, max_tokens=3 if name == "a" else 6))
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        order += [new.request_id for new in output.new_requests]
        scheduler.update_from_output(output, runner.execute(output))
    assert order == ["r0", "r1", "r2", "r3"]  # c took a's slot before d could


def test_removed_adapter_is_unloaded_when_unused_and_a_failure_unloads_all():
    scheduler, runner = Scheduler(CFG), FakeRunner(CFG.block_size, CFG.num_blocks)
    scheduler.add_request(req("r0", "a"))
    scheduler.add_request(req("r1", "b", max_tokens=50))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    assert not scheduler.discard_adapter("b")  # running: it stays until unused
    assert not scheduler.discard_adapter("a")  # r0 still runs on it
    run_steps(scheduler, runner, until=lambda s: "r0" not in s.requests)
    assert scheduler.discard_adapter("a")
    output = scheduler.schedule()
    assert output.lora_unloads == ["a"]
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.take_requests_for_migration()  # e.g. a failed step: the worker's state is unknown
    scheduler.add_request(req("r2", None))
    output = scheduler.schedule()
    assert output.lora_unloads == ["b"] and scheduler.loras.loaded() == []
