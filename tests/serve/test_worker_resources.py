"""Worker sizing: torch threads follow reserved CPUs unless the app sets them explicitly."""

from serve_app.config import AppArgs
from workers.actor import WorkerResources


def test_threads_default_to_floor_of_reserved_cpus():
    assert WorkerResources(num_cpus=1.5, num_gpus=0).num_threads == 1
    assert WorkerResources(num_cpus=0.25, num_gpus=0).num_threads == 1
    assert WorkerResources(num_cpus=4, num_gpus=0).num_threads == 4


def test_explicit_threads_override_reserved_cpus():
    assert WorkerResources(num_cpus=1, num_gpus=0, num_threads_override=2).num_threads == 2


def test_app_arg_is_validated():
    assert AppArgs.model_validate({"worker_num_threads": 2}).worker_num_threads == 2
    assert AppArgs.model_validate({}).worker_num_threads is None
    for bad in (0, -1, "many"):
        try:
            AppArgs.model_validate({"worker_num_threads": bad})
        except ValueError:
            continue
        raise AssertionError(f"worker_num_threads={bad!r} was accepted")


def node(node_id: str, cpus: float) -> dict:
    return {"NodeID": node_id, "Alive": True, "Resources": {"CPU": cpus}}


def test_an_elastic_worker_goes_where_the_placement_rule_says() -> None:
    from workers.actor import node_for_new_worker

    nodes = [node("a", 4.0), node("b", 4.0), node("c", 1.0)]
    workers_on = ["a", "a", "b"]  # two workers of 2 CPUs on a (full), one on b
    bundle = {"CPU": 2.0}
    assert node_for_new_worker("spread", nodes, workers_on, bundle) == "b"  # the fewest workers, with room
    assert node_for_new_worker("pack", nodes, workers_on, bundle) == "b"  # a is full
    assert node_for_new_worker("pack", nodes, ["b"], bundle) == "b"  # beside the others while there is room
    assert node_for_new_worker("strict_spread", nodes, workers_on, bundle) is None  # c is too small
    assert node_for_new_worker("strict_spread", nodes, ["a"], bundle) == "b"
    assert node_for_new_worker("none", nodes, workers_on, bundle) is None  # Ray's choice


def test_elastic_workers_of_several_shards_get_names_of_their_own() -> None:
    from scheduler.actor import ElasticWorkers
    from serve_app.config import AppArgs

    args = AppArgs.model_validate({"num_workers": 4, "max_workers": 6, "num_scheduler_shards": 2})
    one, two = (ElasticWorkers(args.autoscale_config(shard), fleet=None, name_prefix=f"{shard}.")
                for shard in range(2))
    fixed = {str(index) for indices in args.shard_worker_indices() for index in indices}
    spawned = {one.name_of(2), two.name_of(2)}  # each shard's next local index
    assert len(spawned) == 2 and not spawned & fixed
