"""deploy/*.yaml against Ray's own Serve schema and our AppArgs, and the KubeRay RayService
manifest's embedded serveConfigV2. No cluster: schema and resource checks only."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from serve_app.config import AppArgs, check_placement, plan_resources

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_CONFIGS = ["serve.yaml", "serve-cluster.yaml"]


def rayservice() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())


def assert_known_keys(data: dict[str, Any], schema: Any, where: str) -> None:
    """Serve's schemas ignore unknown keys; a typo must not pass silently here."""
    known = set(schema.model_fields) | {f.alias for f in schema.model_fields.values() if f.alias}
    assert set(data) <= known, f"{where}: unknown keys {sorted(set(data) - known)}"


def validate_serve_config(config: dict[str, Any], where: str) -> ServeDeploySchema:
    schema = ServeDeploySchema.model_validate(config)
    assert_known_keys(config, ServeDeploySchema, where)
    assert schema.applications, where
    for app in config["applications"]:
        ServeApplicationSchema.model_validate(app)
        assert_known_keys(app, ServeApplicationSchema, f"{where}: {app['name']}")
        module, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), app["import_path"]
        AppArgs.model_validate(app.get("args") or {})  # unknown or invalid args raise
    return schema


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_yaml_files_match_the_serve_schema_and_app_args(name: str) -> None:
    config = yaml.safe_load((DEPLOY / name).read_text())
    validate_serve_config(config, name)
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.router_policy == "prefix_aware"


def test_the_cluster_yaml_spreads_workers_over_nodes() -> None:
    config = yaml.safe_load((DEPLOY / "serve-cluster.yaml").read_text())
    assert config["proxy_location"] == "EveryNode"
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.worker_placement in ("spread", "strict_spread") and args.num_workers > 1
    # e.g. a CPU head of 4 + two nodes with 2 GPUs each: one worker per GPU
    nodes = [{"CPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    plan = plan_resources(args, {"CPU": 20.0, "GPU": 4.0})
    assert plan.worker_num_gpus == 1
    check_placement(args, plan, nodes)


def test_rayservice_is_a_kuberay_v1_manifest() -> None:
    manifest = rayservice()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    cluster = manifest["spec"]["rayClusterConfig"]
    import ray

    assert cluster["rayVersion"] == ray.__version__  # the image's Ray must match the one we test on
    assert isinstance(manifest["spec"]["serveConfigV2"], str)  # KubeRay wants the YAML as a string
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {6379, 8265, 8000}


def test_rayservice_serve_config_is_valid_and_fits_its_cluster() -> None:
    manifest = rayservice()
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    validate_serve_config(config, "serveConfigV2")
    args = AppArgs.model_validate(config["applications"][0]["args"])
    cluster = manifest["spec"]["rayClusterConfig"]
    nodes = [{"CPU": float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])}]
    for group in cluster["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        node = {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
        nodes += [node] * group["replicas"]
    totals = {key: sum(node.get(key, 0.0) for node in nodes) for key in ("CPU", "GPU")}
    plan = plan_resources(args, totals)  # raises ResourceError if the pods cannot host the app
    assert plan.worker_num_gpus == 1  # one worker per GPU
    check_placement(args, plan, nodes)


def env_file(name: str) -> dict[str, str]:
    from bench.served_app import read_env_file

    return read_env_file(DEPLOY / name)


def test_the_kuberay_pods_run_with_the_cluster_serving_environment() -> None:
    """Head and worker pods: every variable of deploy/serve-cluster.env, the same value."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    expected = env_file("serve-cluster.env")
    assert expected["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and expected["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            env = {item["name"]: item["value"] for item in container["env"]}
            assert {key: env.get(key) for key in expected} == expected, container["name"]


def test_the_laptop_environment_keeps_everything_on_loopback() -> None:
    """deploy/serve.env (scripts/serve.sh, serve.yaml) never turns HAProxy on: it listens on
    every interface (stats :8404, metrics :9101), and the default config binds loopback only."""
    local, cluster = env_file("serve.env"), env_file("serve-cluster.env")
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in local
    assert local["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    shared = set(local) & set(cluster)
    assert {key for key in shared if local[key] != cluster[key]} == set()
    config = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"


def test_scripts_export_the_serving_environment_without_overriding_the_callers(tmp_path) -> None:
    import os
    import subprocess

    root = DEPLOY.parent
    script = f'source "{root}/scripts/serve-env.sh" && env'
    env = {"PATH": os.environ["PATH"], "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    exported = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key, value in env_file("serve.env").items():
        assert exported[key] == (env[key] if key in env else value), key
    cluster = subprocess.run(["bash", "-c", f'source "{root}/scripts/serve-env.sh" "{DEPLOY}/serve-cluster.env" && env'],
                             env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True).stdout
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in cluster.splitlines()
    for launcher in ("scripts/serve.sh", "bench/peers/ours.sh"):
        assert "scripts/serve-env.sh" in (root / launcher).read_text(), launcher


def test_the_grafana_dashboard_is_well_formed_and_has_the_scaling_panels() -> None:
    """Unique panel ids, no two panels on the same cells of the 24-column grid, and the
    scaling row's series under Ray's export names (ray_rayllm_*; that every queried series
    exists on a live server: tests/integration/test_observability.py)."""
    import json

    panels = json.loads((DEPLOY / "grafana-dashboard.json").read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]
    by_title = {panel["title"]: panel for panel in panels}
    workers = " ".join(target["expr"] for target in by_title["Workers"]["targets"])
    assert 'ray_rayllm_workers{state=~"starting|serving|draining"}' in workers and "by (state)" in workers
    assert "ray_rayllm_workers_desired" in workers
    [events] = [target["expr"] for target in by_title["Scale events"]["targets"]]
    assert "rate(ray_rayllm_scale_events_total[5m])" in events and "by (direction, reason)" in events


def test_a_launch_without_the_yaml_gets_what_the_yaml_sets() -> None:
    """`serve run serve_app.app:build_app model=...` and deploy/serve.yaml start the same app: every
    value the shipped file sets is what build_app gives an argument left out."""
    from serve_app.app import build_app

    shipped_args = yaml.safe_load((DEPLOY / "serve.yaml").read_text())["applications"][0]["args"]
    shipped = AppArgs.model_validate(shipped_args)
    launched = AppArgs.model_validate(build_app({})._bound_deployment.init_args[1])
    # every field, the ones num_workers: auto resolves (worker_num_cpus, worker_num_threads) among them
    differing = {name: (getattr(shipped, name), getattr(launched, name)) for name in AppArgs.model_fields
                 if getattr(shipped, name) != getattr(launched, name) and name != "model"}
    assert differing == {}, "deploy/serve.yaml sets values a launch without it does not get (LAUNCH_DEFAULTS)"
