"""Is Ray Serve's fast data plane in effect? Checked once when an ingress replica starts.

We ship Serve's throughput-optimized data plane (deploy/serve.env, docs/serving.md): each
ingress replica's own HTTP port, gRPC between the proxy, the handles and the replicas, and
our code on the replica's own event loop. Ray reads those variables when each of its
processes starts, so a bare `serve run deploy/serve.yaml`, or `serve deploy` on a cluster
whose `ray start` did not source scripts/serve-env.sh, runs without them and says nothing
(measured at c16: 265 vs 311 tok/s). The ingress replica asks Serve's own settings as its
process imported them (`ray.serve._private.constants`, which apply Serve's rules: what
RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, what HAProxy forces), warns once in one line, and
/v1/server_info reports the verdict.

Each check is (Serve's setting, the value the fast path needs); what is off is reported as
the environment assignment that turns it on: RAY_SERVE_THROUGHPUT_OPTIMIZED=1 while that is
off (it defaults the rest), else the setting itself (one a user turned back off). The Python
proxy's gRPC flag is needed only where the Python proxy serves (not with HAProxy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
PROXY_GRPC = "RAY_SERVE_PROXY_USE_GRPC"
# Serve's setting -> the value the fast data plane needs (THROUGHPUT_OPTIMIZED defaults each)
REPLICA_CHECKS: tuple[tuple[str, bool], ...] = (
    ("RAY_SERVE_ENABLE_DIRECT_INGRESS", True),  # each ingress replica's own HTTP port
    ("RAY_SERVE_USE_GRPC_BY_DEFAULT", True),  # handle calls over gRPC, not Ray actor calls
    ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", False),  # our app on the replica's own loop
    ("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", False),  # Serve's router on it too
)
ENV_SCRIPT = "scripts/serve-env.sh"


@dataclass(frozen=True, slots=True)
class DataPlaneReport:
    enabled: bool
    missing: tuple[str, ...]  # KEY=VALUE assignments that would turn the missing parts on

    def as_json(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "missing": list(self.missing)}

    def warning(self) -> str | None:
        """One line for the log when something is off; None when all is on."""
        if self.enabled:
            return None
        return (f"Ray Serve's fast data plane is off ({', '.join(self.missing)} not in effect in this replica; "
                f"~15% fewer tokens/s at 16 streams): start Ray with it: `source {ENV_SCRIPT}` before `serve run` or "
                f"`ray start` (deploy/serve.env; clusters: deploy/serve-cluster.env)")


def check_data_plane(settings: Any) -> DataPlaneReport:
    """The verdict on `settings`, an object with Serve's constants as attributes (its
    constants module, or a stand-in in tests). A setting it lacks (another Serve version)
    counts as off."""
    def value(name: str) -> bool:
        return bool(getattr(settings, name, False))

    throughput_optimized = value(THROUGHPUT_OPTIMIZED)
    missing: list[str] = []
    for name, wanted in REPLICA_CHECKS:
        if value(name) != wanted:
            missing.append(f"{THROUGHPUT_OPTIMIZED}=1" if not throughput_optimized else f"{name}={int(wanted)}")
    if not value(HA_PROXY) and not value(PROXY_GRPC):
        missing.append(f"{PROXY_GRPC}=1")
    unique = tuple(dict.fromkeys(missing))
    return DataPlaneReport(not unique, unique)


def serve_settings() -> Any:
    """Serve's settings as this process imported them (what its proxy and replicas run with,
    where they share the environment of `ray start` / `serve run`)."""
    from ray.serve._private import constants

    return constants


def report_data_plane() -> DataPlaneReport:
    """Checks this process's Serve settings and logs one warning line when something is off."""
    report = check_data_plane(serve_settings())
    line = report.warning()
    if line is not None:
        logger.warning(line)
    return report
