"""Scale-out on a local 2-node Ray cluster: workers on different nodes with requests
through both, and 2 scheduler shards. The cluster runs in a subprocess (cluster_check.py) so
it never meets tests/integration's session cluster, whatever the test order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def facts(tiny_model_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    result = subprocess.run(
        [sys.executable, str(HERE / "cluster_check.py"), str(tiny_model_dir)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=HERE.parents[1],
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_workers_land_on_different_nodes_and_both_serve_requests(facts: dict[str, Any]) -> None:
    spread = facts["spread"]
    assert len(facts["node_ids"]) == 2
    assert sorted(spread["worker_nodes"]) == facts["node_ids"]  # one worker per node
    assert spread["num_ok"] == 12
    routing = spread["routing"]
    assert routing["policy"] == "prefix_aware"
    assert sum(routing["routed_per_worker"]) == 12
    assert all(n > 0 for n in routing["routed_per_worker"]), routing
    assert all(n > 0 for n in routing["steps_per_worker"]), routing


def test_two_scheduler_shards_each_take_their_hash_share(facts: dict[str, Any]) -> None:
    sharded = facts["sharded"]
    assert sharded["num_ok"] == 16
    assert sharded["workers_per_shard"] == [1, 1]
    assert sharded["routed_per_shard"] == sharded["expected_per_shard"]
    assert all(n > 0 for n in sharded["expected_per_shard"])
