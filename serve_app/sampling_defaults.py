"""A model's own sampling defaults: what a request that leaves a sampling field out gets.

Model authors write the sampling they recommend in generation_config.json (Llama 3: temperature
0.6, top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20). As vLLM does, a request that
omits one of these fields gets the model's value, and one that sets it gets its own, even where
it equals OpenAI's default:

    defaults = read_sampling_defaults("/models/llama")   # {"temperature": 0.6, "top_p": 0.9}
    value = body.temperature if "temperature" in body.model_fields_set else defaults["temperature"]

`do_sample: false` is not read (vLLM does not either): the values are the author's recommendation
for sampling, and a client asks for greedy decoding with temperature 0. The app argument
`generation_config: "off"` keeps OpenAI's defaults (temperature 1, top_p 1) for every model.
A value out of the range a request could set is dropped with a warning, never served.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import ValidationError

from serve_app.protocol import CompletionRequest

logger = logging.getLogger(__name__)

# generation_config.json's keys that are request fields, checked by the request's own validation
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling fields the model directory's generation_config.json sets, checked; {} without one."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("%s is unreadable (%s); requests keep OpenAI's sampling defaults", path, error)
        return {}
    return checked_sampling_defaults(raw if isinstance(raw, dict) else {}, str(path))


def checked_sampling_defaults(raw: dict, source: str) -> dict[str, float | int]:
    """Each key a request could set to this value, with the request's bounds and types (protocol.py)."""
    defaults: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)  # a whole number written as 20.0
        try:
            defaults[key] = getattr(CompletionRequest.model_validate({"prompt": "x", key: value}), key)
        except ValidationError as error:
            logger.warning("%s: %s=%r is not a value a request could set (%s); not used as a default", source, key,
                           value, error.errors()[0]["msg"])
    return defaults
