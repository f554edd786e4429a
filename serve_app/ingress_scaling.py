"""ingress_replicas: a fixed number, or a range Ray Serve autoscales the ingress deployment in.

    ingress_replicas: 2                      # fixed (num_replicas)
    ingress_replicas: "1-4"                  # autoscaling_config {min_replicas: 1, max_replicas: 4}
    ingress_replicas: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 64}

The mapping takes Serve's own autoscaling_config key names (a subset of them). Serve scales
on the requests in flight per replica; each ingress replica streams its requests' text
(detokenization, SSE), so more replicas give that work more cores. The app's resources are
checked for max_replicas (serve_app.config.plan_resources), so a scale-up never waits for a
CPU that is not there.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class IngressAutoscaling(BaseModel):
    """ingress_replicas as a range: Serve's own autoscaling_config of the ingress deployment
    (the same key names), scaling on the requests each replica holds."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, le=64, description="Ingress replicas at least (one answers at all times).")
    max_replicas: int = Field(..., ge=1, le=64, description="Ingress replicas at most; resources are checked for these.")
    target_ongoing_requests: float = Field(
        32.0, gt=0, description="Requests in flight per replica Serve scales toward. A streaming request is long-lived "
        "and cheap for the ingress (its text work is per token), so far more than Serve's default of 2 per replica.",
    )
    upscale_delay_s: float | None = Field(None, ge=0, description="Serve's upscale_delay_s; null: Serve's default.")
    downscale_delay_s: float | None = Field(None, ge=0, description="Serve's downscale_delay_s; null: Serve's default.")

    @model_validator(mode="after")
    def _check_range(self) -> IngressAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        return self

    def serve_config(self) -> dict[str, Any]:
        """The deployment's autoscaling_config (Serve's defaults where we set nothing)."""
        return self.model_dump(exclude_none=True)


def parse_ingress_replicas(value: Any) -> Any:
    """`serve run ... ingress_replicas=2` or `=1-4` (text), as the field takes it: "N" -> N,
    "MIN-MAX" -> {min_replicas, max_replicas}; anything else is left to validation."""
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
        if match is None:
            raise ValueError(f"ingress_replicas: {value!r} is neither a number nor a range MIN-MAX (e.g. 1-4)")
        return {"min_replicas": int(match[1]), "max_replicas": int(match[2])}
    return value


def max_ingress_replicas(value: Any) -> int:
    """The most ingress replicas `value` (any form ingress_replicas takes) may run; 1 for a value
    validation will refuse."""
    try:
        parsed = parse_ingress_replicas(value)
    except ValueError:
        return 1
    if isinstance(parsed, IngressAutoscaling):
        return parsed.max_replicas
    if isinstance(parsed, dict):
        parsed = parsed.get("max_replicas", 1)
    try:
        return max(1, int(parsed))
    except (TypeError, ValueError):
        return 1
