"""Shared fixtures: model directories for worker and integration tests.

Ray defaults for local tests are set before anything imports ray (see shared/DESIGN.md).
"""

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray sockets on 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Sleeping (not spinning) OpenMP workers: on a shared 2-core machine, spinning torch threads
# fight each other and every other process; measured 5x slower steps without this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The shipped serving environment (deploy/serve.env: Ray Serve's data plane and the process
# settings, as scripts/serve.sh exports them), before the session's Ray starts: the tests run
# the path users run. A variable already set wins (e.g. to test the previous data plane).
for _line in (Path(__file__).resolve().parents[1] / "deploy" / "serve.env").read_text().splitlines():
    _key, _sep, _value = _line.strip().partition("=")
    if _sep and not _key.startswith("#"):
        os.environ.setdefault(_key, _value)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM (3 layers, hidden 64, 4 heads / 2 kv heads) with a
    byte-level BPE tokenizer and a ChatML template, saved as safetensors."""
    from tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def gguf_model_dir(tmp_path_factory) -> Path:
    """A tiny llama whose projections' input widths are whole K-type super-blocks (256, 512): the
    GGUF tests quantize its layers (test_gguf_kernels.quantize_layers)."""
    from tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-gguf"), hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model converted to safetensors (once; reuses ~/.cache/rayllm when present)."""
    from workers.loader import resolve_model_path

    return resolve_model_path(None)
