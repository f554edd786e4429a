"""The ingress's check of Ray Serve's fast data plane (serve_app/data_plane.py): the verdict on
Serve's settings, and the whole chain from an environment through Serve's own constants, in a
fresh process per environment (Serve reads them once, at import)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app import data_plane
from serve_app.data_plane import check_data_plane

ROOT = Path(__file__).resolve().parents[2]

# Serve 2.60's values with nothing set, and with deploy/serve.env (the laptop)
BARE = dict(RAY_SERVE_THROUGHPUT_OPTIMIZED=False, RAY_SERVE_ENABLE_DIRECT_INGRESS=False,
            RAY_SERVE_USE_GRPC_BY_DEFAULT=False, RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=True,
            RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=True, RAY_SERVE_PROXY_USE_GRPC=False,
            RAY_SERVE_ENABLE_HA_PROXY=False)
SHIPPED = dict(RAY_SERVE_THROUGHPUT_OPTIMIZED=True, RAY_SERVE_ENABLE_DIRECT_INGRESS=True,
               RAY_SERVE_USE_GRPC_BY_DEFAULT=True, RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=False,
               RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=False, RAY_SERVE_PROXY_USE_GRPC=True,
               RAY_SERVE_ENABLE_HA_PROXY=False)


def test_a_bare_start_misses_throughput_optimized_and_the_proxys_grpc() -> None:
    report = check_data_plane(SimpleNamespace(**BARE))
    assert not report.enabled
    assert report.missing == ("RAY_SERVE_THROUGHPUT_OPTIMIZED=1", "RAY_SERVE_PROXY_USE_GRPC=1")
    assert report.as_json() == {"enabled": False, "missing": list(report.missing)}
    line = report.warning()
    assert line is not None and "\n" not in line
    assert "scripts/serve-env.sh" in line and "RAY_SERVE_PROXY_USE_GRPC=1" in line


def test_the_shipped_settings_are_the_fast_data_plane() -> None:
    report = check_data_plane(SimpleNamespace(**SHIPPED))
    assert report.enabled and report.missing == () and report.warning() is None


def test_haproxy_needs_no_python_proxy_grpc() -> None:
    cluster = {**SHIPPED, "RAY_SERVE_PROXY_USE_GRPC": False, "RAY_SERVE_ENABLE_HA_PROXY": True}
    assert check_data_plane(SimpleNamespace(**cluster)).enabled
    assert check_data_plane(SimpleNamespace(**{**cluster, "RAY_SERVE_ENABLE_HA_PROXY": False})).missing == (
        "RAY_SERVE_PROXY_USE_GRPC=1",)


def test_a_part_turned_back_off_is_named_itself() -> None:
    settings = {**SHIPPED, "RAY_SERVE_ENABLE_DIRECT_INGRESS": False, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": True}
    assert check_data_plane(SimpleNamespace(**settings)).missing == (
        "RAY_SERVE_ENABLE_DIRECT_INGRESS=1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0")


def test_settings_another_serve_lacks_count_as_off() -> None:
    report = check_data_plane(SimpleNamespace())
    assert not report.enabled and "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in report.missing


def test_the_warning_is_logged_when_off_and_not_when_on(monkeypatch, caplog) -> None:
    monkeypatch.setattr(data_plane, "serve_settings", lambda: SimpleNamespace(**BARE))
    with caplog.at_level(logging.WARNING, logger=data_plane.__name__):
        assert not data_plane.report_data_plane().enabled
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "scripts/serve-env.sh" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(data_plane, "serve_settings", lambda: SimpleNamespace(**SHIPPED))
    with caplog.at_level(logging.WARNING, logger=data_plane.__name__):
        assert data_plane.report_data_plane().enabled
    assert caplog.records == []


def verdict_in_fresh_process(env_file: str | None) -> dict:
    """The check in a new Python whose environment has no RAY_SERVE_* but the env file's."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_SERVE_")}
    if env_file is not None:
        from bench.served_app import read_env_file

        env.update(read_env_file(ROOT / "deploy" / env_file))
    code = ("import json\nfrom serve_app.data_plane import check_data_plane, serve_settings\n"
            "print(json.dumps(check_data_plane(serve_settings()).as_json()))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env_file, expected", [
    (None, {"enabled": False, "missing": ["RAY_SERVE_THROUGHPUT_OPTIMIZED=1", "RAY_SERVE_PROXY_USE_GRPC=1"]}),
    ("serve.env", {"enabled": True, "missing": []}),
    ("serve-cluster.env", {"enabled": True, "missing": []}),
])
def test_an_environment_through_serves_own_constants(env_file, expected) -> None:
    assert verdict_in_fresh_process(env_file) == expected
