"""build_app reads a local checkpoint's config.json before anything is deployed: a family we do
not serve fails the build in one line that names it, and a path this node lacks is left to the
workers (the model may live only on the worker nodes). The ingress deployment carries
ingress_replicas: a number as num_replicas, a range as Serve's autoscaling_config."""

import json

import pytest

from serve_app.app import build_app
from serve_app.ingress_scaling import IngressAutoscaling
from workers.config import ModelConfigError


def test_an_unknown_model_type_fails_the_build_in_one_line(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelConfigError) as failure:
        build_app({"model": str(tmp_path)})
    message = str(failure.value)
    assert "\n" not in message and "model_type 'gpt2' is not supported" in message
    assert str(tmp_path / "config.json") in message


def test_a_path_this_node_lacks_is_left_to_the_workers(tmp_path) -> None:
    assert build_app({"model": str(tmp_path / "only-on-the-worker-nodes")}) is not None


def test_a_range_of_ingress_replicas_is_the_ingress_deployments_autoscaling_config(tmp_path) -> None:
    app = build_app({"model": str(tmp_path / "elsewhere"), "ingress_replicas": {
        "min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 16, "downscale_delay_s": 120}})
    ingress = app._bound_deployment
    assert ingress.name == "rayllm-ingress"
    scaling = ingress._deployment_config.autoscaling_config
    assert scaling is not None
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 16)
    assert scaling.downscale_delay_s == 120 and scaling.upscale_delay_s == 30.0  # Serve's default where unset
    text = build_app({"model": str(tmp_path / "elsewhere"), "ingress_replicas": "1-3"})._bound_deployment
    assert (text._deployment_config.autoscaling_config.min_replicas,
            text._deployment_config.autoscaling_config.max_replicas) == (1, 3)


def test_a_number_of_ingress_replicas_is_fixed(tmp_path) -> None:
    ingress = build_app({"model": str(tmp_path / "elsewhere"), "ingress_replicas": "3"})._bound_deployment
    assert ingress.num_replicas == 3 and ingress._deployment_config.autoscaling_config is None


def test_the_range_model_uses_serves_own_key_names() -> None:
    from ray.serve.config import AutoscalingConfig

    full = IngressAutoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=16, upscale_delay_s=5,
                              downscale_delay_s=120)
    serve_config = AutoscalingConfig(**full.serve_config())  # Serve takes every key we pass
    assert (serve_config.min_replicas, serve_config.max_replicas, serve_config.upscale_delay_s) == (1, 4, 5)
    assert set(full.serve_config()) <= set(AutoscalingConfig.model_fields)
