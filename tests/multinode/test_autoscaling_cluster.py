"""Elastic workers with Ray's own autoscaler (fake multi-node provider): a worker that does not
fit on the head stays pending until Ray adds a node for it, serves there, and after our
scale-down retires it the idle node is removed. The cluster runs in a subprocess
(autoscaling_check.py), so it never meets tests/integration's session cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def facts(tiny_model_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    result = subprocess.run(
        [sys.executable, str(HERE / "autoscaling_check.py"), str(tiny_model_dir)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=HERE.parents[1],
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    facts = json.loads(lines[-1][len("RESULT "):])
    assert facts["error"] is None and result.returncode == 0, f"{facts}\n{result.stderr[-8000:]}"
    return facts


def test_a_node_is_added_for_the_second_worker_and_removed_after_scale_down(facts: dict[str, Any]) -> None:
    assert [count for _, count in facts["node_counts"]] == [1, 2, 1], facts["node_counts"]
    assert [count for _, count in facts["worker_counts"]] == [1, 2, 1], facts["worker_counts"]
    (head,) = facts["head_nodes"]
    assert facts["worker0_node"] == head
    added = set(facts["nodes_with_two_workers"]) - {head}
    assert len(added) == 1 and facts["worker1_node"] in added  # worker 1 ran on the node Ray added
    assert facts["published_worker_nodes"] == {"0": head, "1": facts["worker1_node"]}
    assert facts["remaining_workers"] == {"0": head}  # the retired worker was the one on the added node
    assert facts["nodes_at_end"] == [head]


def test_every_request_succeeds_and_both_workers_served(facts: dict[str, Any]) -> None:
    assert facts["errors"] == []
    assert facts["num_requests"] >= 12 and facts["num_ok"] == facts["num_requests"]
    assert facts["routed_while_two"][1] > 0  # the worker on the added node took requests
    assert sum(facts["routed_per_worker"]) == facts["num_requests"]


def test_the_teardown_leaves_no_process_of_the_cluster(facts: dict[str, Any]) -> None:
    """Only this cluster's processes were ended: each names its temp dir or GCS address, or is
    a Ray worker process (retitled ray::...) found as a descendant of one that does."""
    killed = facts["killed"]
    assert any("gcs_server" in command for command in killed), killed  # the head's GCS among them
    for command in killed:
        assert facts["temp_dir"] in command or facts["gcs_address"] in command or command.startswith("ray::"), command
    assert facts["leftover_processes"] == []
