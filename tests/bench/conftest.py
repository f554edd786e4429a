"""Fixtures for the benchmark tests: a live HF baseline server on the shared tiny model.

The model is the session fixture `tiny_model_dir` from tests/conftest.py (a tiny random
Llama with a byte-level BPE tokenizer.json and a ChatML template).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.served_app import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT_S = 60.0


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hf_server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"hf_server not healthy after {timeout_s} s")


@pytest.fixture(scope="module")
def hf_server(tiny_model_dir, tmp_path_factory):
    """(base_url, model_dir) of a live HF baseline server; killed by PID afterwards."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("hf_server") / "server.log", "w+")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.hf_server", "--model", str(tiny_model_dir), "--port", str(port),
         "--threads", "1"],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc, SERVER_START_TIMEOUT_S)
        yield base_url, tiny_model_dir
    except Exception:
        log.seek(0)
        print(log.read()[-4000:])
        raise
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
