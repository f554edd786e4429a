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
import math
from pathlib import Path

logger = logging.getLogger(__name__)

# generation_config.json's key -> the bounds a request's field has (serve_app/protocol.py)
SAMPLING_KEYS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),  # (0, 1]: 0 is refused below
    "top_k": (-1, 1 << 20),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0),  # (0, 10]
}
_OPEN_BELOW = ("top_p", "repetition_penalty")  # 0 is out of range for these


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
    defaults: dict[str, float | int] = {}
    for key, (low, high) in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        valid = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        valid = valid and low <= value <= high and not (key in _OPEN_BELOW and value <= 0)
        if key == "top_k":
            valid = valid and float(value).is_integer()
        if not valid:
            logger.warning("%s: %s=%r is out of range [%s, %s]; not used as a default", source, key, value, low, high)
            continue
        defaults[key] = int(value) if key == "top_k" else float(value)
    return defaults
