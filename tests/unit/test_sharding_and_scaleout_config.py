"""Scale-out pieces without Ray: shard choice, the sharded client, the router/shard/placement
app args (deploy YAMLs: tests/serve/test_deploy_configs.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pydantic
import pytest

from serve_app.config import AppArgs, ResourceError, check_placement, plan_resources, worker_bundle
from serve_app.sharding import ShardedEngineClient, merge_statuses
from scheduler.engine_group import SchedulerStatus
from scheduler.outputs import EngineRequest, RequestOutput
from scheduler.router import RoutingPolicy
from scheduler.sampling_params import SamplingParams
from scheduler.sharding import shard_of

def test_shard_depends_only_on_the_first_block_and_is_stable() -> None:
    prompt = list(range(100, 140))
    shard = shard_of(prompt, block_size=16, num_shards=4)
    assert shard == shard_of(prompt[:16] + [7, 7, 7], 16, 4)  # same first block, same shard
    assert shard_of(prompt, 16, 1) == 0
    assert shard == 0  # sha256-based: the same in every process and replica (not hash())
    shards = {shard_of([i] * 16, 16, 4) for i in range(64)}
    assert shards == {0, 1, 2, 3}  # different first blocks spread
    assert shard_of([5, 6], 16, 4) == shard_of([5, 6], 16, 4)  # shorter than a block: hashed whole


def test_more_hash_blocks_separate_prompts_with_a_common_first_block() -> None:
    common = list(range(16))
    prompts = [common + [i] * 16 for i in range(32)]
    assert len({shard_of(p, 16, 4) for p in prompts}) == 1
    assert len({shard_of(p, 16, 4, num_hash_blocks=2) for p in prompts}) == 4


@dataclass
class FakeShard:
    name: int
    num_running: int = 1

    def __post_init__(self) -> None:
        self.requests: list[str] = []
        self.aborts: list[str] = []

    async def generate(self, request: EngineRequest):
        self.requests.append(request.request_id)
        yield RequestOutput(request.request_id, 0, [self.name], None, None, 5, 0)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    async def status(self) -> SchedulerStatus:
        return SchedulerStatus(1, 1, self.num_running, 0, 0, 1.0 * self.name if self.name else None, 5, 10, 3)


def test_sharded_client_routes_by_first_block_and_aborts_on_the_owner() -> None:
    shards = [FakeShard(0), FakeShard(1)]
    client = ShardedEngineClient(shards, block_size=4)
    params = SamplingParams(max_tokens=1)

    async def main():
        outputs = {}
        for i in range(8):
            request = EngineRequest(f"r{i}", [i] * 4 + [99], params)
            outputs[f"r{i}"] = [o.new_token_ids async for o in client.generate(request)]
        return outputs

    outputs = asyncio.run(main())
    for i in range(8):
        expected = shard_of([i] * 4, 4, 2)
        assert outputs[f"r{i}"] == [[expected]] and f"r{i}" in shards[expected].requests
    assert shards[0].requests and shards[1].requests
    owner = shard_of([3] * 4, 4, 2)
    client.abort("r3")
    assert shards[owner].aborts == ["r3"] and shards[1 - owner].aborts == []
    client.abort("never-seen")  # unknown: every shard is told
    assert all(shard.aborts[-1] == "never-seen" for shard in shards)
    status = asyncio.run(client.status())
    assert (status.num_workers, status.num_running, status.num_kv_blocks_total, status.num_steps) == (2, 2, 20, 6)
    assert status.seconds_since_last_step == 1.0


def test_merge_statuses_keeps_none_when_every_shard_is_idle() -> None:
    idle = SchedulerStatus(1, 1, 0, 0, 0, None, 5, 5, 0)
    assert merge_statuses([idle, idle]).seconds_since_last_step is None


def test_router_args_become_the_router_config() -> None:
    args = AppArgs(router_policy="round_robin", router_balance_abs_threshold=8, router_balance_rel_threshold=2.0,
                   router_min_match_fraction=0.5, router_seq_load_tokens=0, router_match_in_flight=False)
    config = args.router_config()
    assert config.policy == RoutingPolicy.ROUND_ROBIN
    assert (config.balance_abs_threshold, config.balance_rel_threshold) == (8, 2.0)
    assert (config.min_match_fraction, config.seq_load_tokens, config.match_in_flight) == (0.5, 0, False)
    assert AppArgs().router_config().policy == RoutingPolicy.PREFIX_AWARE
    with pytest.raises(pydantic.ValidationError):
        AppArgs(router_policy="random")
    with pytest.raises(pydantic.ValidationError):
        AppArgs(router_balance_rel_threshold=0.5)


def test_shards_split_the_workers_and_need_one_each() -> None:
    assert AppArgs(num_workers=4, num_scheduler_shards=2).shard_worker_indices() == [[0, 1], [2, 3]]
    assert AppArgs(num_workers=3, num_scheduler_shards=2).shard_worker_indices() == [[0, 1], [2]]
    assert AppArgs().shard_worker_indices() == [[0]]
    with pytest.raises(pydantic.ValidationError, match="every shard needs at least one worker"):
        AppArgs(num_workers=1, num_scheduler_shards=2)
    plan = plan_resources(AppArgs(num_workers=2, num_scheduler_shards=2, scheduler_num_cpus=0.5), {"CPU": 4})
    assert plan.total_cpus == 2 + 2 * 0.5 + 0.25
    with pytest.raises(ResourceError, match="2 schedulers x 1"):
        plan_resources(AppArgs(num_workers=2, num_scheduler_shards=2, scheduler_num_cpus=1), {"CPU": 4})


def test_placement_checks_nodes_one_by_one() -> None:
    args = AppArgs(num_workers=2, worker_num_cpus=2, worker_placement="strict_spread")
    plan = plan_resources(args, {"CPU": 6})
    assert worker_bundle(plan) == {"CPU": 2.0}
    check_placement(args, plan, [{"CPU": 2}, {"CPU": 4}])
    with pytest.raises(ResourceError, match="strict_spread"):
        check_placement(args, plan, [{"CPU": 4}, {"CPU": 1}])
    spread = args.model_copy(update={"worker_placement": "spread"})
    check_placement(spread, plan, [{"CPU": 4}, {"CPU": 1}])  # both fit on the first node
    with pytest.raises(ResourceError, match="hold only 1 workers"):
        check_placement(spread, plan, [{"CPU": 3}, {"CPU": 1.5}])  # 4.5 CPUs in all, but one node fits a worker
    with pytest.raises(ResourceError, match="no node"):
        check_placement(spread, plan, [{"CPU": 1}, {"CPU": 1}])
    gpu_args = AppArgs(num_workers=2, worker_device="cuda")
    gpu_plan = plan_resources(gpu_args, {"CPU": 8, "GPU": 2})
    assert worker_bundle(gpu_plan) == {"CPU": 1.0, "GPU": 1.0}  # one worker per GPU
    check_placement(gpu_args, gpu_plan, [{"CPU": 4, "GPU": 2}])
    with pytest.raises(ResourceError):
        check_placement(gpu_args, gpu_plan, [{"CPU": 4, "GPU": 1}, {"CPU": 4}])


def test_autoscaling_with_shards_splits_the_bounds_as_the_starting_workers_are_split() -> None:
    args = AppArgs.model_validate({"num_workers": 3, "min_workers": 1, "max_workers": 5, "num_scheduler_shards": 2})
    bounds = [args.autoscale_config(shard) for shard in range(2)]
    starts = [len(indices) for indices in args.shard_worker_indices()]
    assert [(b.min_workers, b.max_workers) for b in bounds] == [(1, 3), (0, 2)] and starts == [2, 1]
    assert all(b.min_workers <= start <= b.max_workers for b, start in zip(bounds, starts))
    assert sum(b.max_workers for b in bounds) == 5 and sum(b.min_workers for b in bounds) == 1
    with pytest.raises(pydantic.ValidationError, match="below num_scheduler_shards"):
        AppArgs.model_validate({"num_workers": 2, "max_workers": 1, "num_scheduler_shards": 2})
