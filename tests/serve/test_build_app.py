"""build_app reads a local checkpoint's config.json before anything is deployed: a family we do
not serve fails the build in one line that names it, and a path this node lacks is left to the
workers (the model may live only on the worker nodes)."""

import json

import pytest

from serve_app.app import build_app
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
