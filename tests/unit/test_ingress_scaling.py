"""ingress_replicas as a number or a range (serve_app/ingress_scaling.py): parsing, the
autoscaling_config handed to Serve, and resources checked for the most replicas. The built
app's ingress deployment: tests/serve/test_build_app.py."""

from __future__ import annotations

import pydantic
import pytest

from serve_app import config
from serve_app.config import AppArgs, ResourceError, plan_resources


@pytest.mark.parametrize("value, expected", [
    (1, {"num_replicas": 1}),
    ("3", {"num_replicas": 3}),  # `serve run ... ingress_replicas=3`
    ("1-4", {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32.0}}),
    (" 2 - 6 ", {"autoscaling_config": {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 32.0}}),
    ({"max_replicas": 4, "target_ongoing_requests": 8, "downscale_delay_s": 60},
     {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0,
                             "downscale_delay_s": 60.0}}),
])
def test_a_number_is_fixed_and_a_range_is_serves_autoscaling_config(value, expected) -> None:
    args = AppArgs.model_validate({"ingress_replicas": value})
    assert args.ingress_scaling() == expected
    again = AppArgs.model_validate(args.model_dump())  # what build_app hands every deployment
    assert again.ingress_scaling() == expected


@pytest.mark.parametrize("value, words", [
    ("4-1", "min_replicas=4 exceeds max_replicas=1"),
    ("1..4", "neither a number nor a range"),
    ("0-2", "greater than or equal to 1"),
    ({"min": 1, "max": 4}, "min"),  # Serve's key names only
    ({"min_replicas": 1}, "max_replicas"),
    (0, "greater than or equal to 1"),
    (65, "less than or equal to 64"),
])
def test_bad_ranges_fail_validation_naming_the_problem(value, words) -> None:
    with pytest.raises(pydantic.ValidationError) as failure:
        AppArgs.model_validate({"ingress_replicas": value})
    assert "ingress_replicas" in str(failure.value) and words in str(failure.value)


def test_resources_are_checked_for_the_most_replicas() -> None:
    args = AppArgs.model_validate({"ingress_replicas": "1-4", "ingress_num_cpus": 0.5, "worker_num_cpus": 1,
                                   "scheduler_num_cpus": 0.5})
    assert args.max_ingress_replicas == 4
    assert plan_resources(args, {"CPU": 3.5}).total_cpus == pytest.approx(3.5)  # 1 + 0.5 + 4 x 0.5
    with pytest.raises(ResourceError, match="4 ingress replicas x 0.5"):
        plan_resources(args, {"CPU": 3.0})  # fits 2 replicas, not 4
    fixed = AppArgs.model_validate({**args.model_dump(), "ingress_replicas": 2})
    assert plan_resources(fixed, {"CPU": 3.0}).total_cpus == pytest.approx(2.5)


def test_auto_worker_layout_leaves_cpus_for_the_most_ingress_replicas(monkeypatch) -> None:
    monkeypatch.setattr(config, "usable_cpus", lambda: 4)
    fixed = AppArgs.model_validate({"num_workers": "auto", "ingress_replicas": "3", "ingress_num_cpus": 0.5})
    ranged = AppArgs.model_validate({"num_workers": "auto", "ingress_replicas": "1-3", "ingress_num_cpus": 0.5})
    assert ranged.worker_num_cpus == fixed.worker_num_cpus
    single = AppArgs.model_validate({"num_workers": "auto", "ingress_replicas": 1, "ingress_num_cpus": 0.5})
    assert ranged.worker_num_cpus < single.worker_num_cpus

