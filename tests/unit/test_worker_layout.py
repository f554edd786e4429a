"""num_workers: auto (serve_app/worker_layout.py): the layout per kind of CPU, and AppArgs
resolving it before anything else reads the numbers."""

from __future__ import annotations

import pytest

from serve_app import config
from serve_app.config import AppArgs, plan_resources
from serve_app.worker_layout import WorkerLayout, auto_worker_layout


def test_one_worker_with_every_core():
    assert auto_worker_layout(2, reserved_cpus=0.5) == WorkerLayout(1, 1.5, 2)
    assert auto_worker_layout(8, reserved_cpus=1.0) == WorkerLayout(1, 7.0, 8)


def test_nothing_left_for_a_worker_says_what_to_change():
    with pytest.raises(ValueError, match="nothing is left for a worker"):
        auto_worker_layout(1, reserved_cpus=1.0)


def test_app_args_resolve_auto_from_the_cpus_and_fit_the_node(monkeypatch):
    monkeypatch.setattr(config, "usable_cpus", lambda: 2)
    expected = (1, 1.5, 2)
    args = AppArgs.model_validate({"num_workers": "auto"})
    assert (args.num_workers, args.worker_num_cpus, args.worker_num_threads) == expected
    assert plan_resources(args, {"CPU": 2.0}).total_cpus == pytest.approx(2.0)  # the whole node, no more
    again = AppArgs.model_validate(args.model_dump())  # what build_app hands every deployment
    assert (again.num_workers, again.worker_num_cpus, again.worker_num_threads) == expected


def test_auto_counts_the_ingress_and_scheduler_cpus_and_keeps_explicit_settings(monkeypatch):
    monkeypatch.setattr(config, "usable_cpus", lambda: 4)
    args = AppArgs.model_validate({"num_workers": "auto", "ingress_replicas": "2", "ingress_num_cpus": 0.5,
                                   "worker_num_threads": 3})
    assert (args.num_workers, args.worker_num_cpus, args.worker_num_threads) == (1, 2.75, 3)
