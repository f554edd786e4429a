#!/usr/bin/env bash
# Runs the default server (deploy/serve.yaml) on http://127.0.0.1:8000 with a local Ray.
# Extra arguments go to `serve run` (e.g. another YAML file). Ctrl-C stops it.
# The serving environment of deploy/serve.env (Ray Serve's data plane, Ray's process
# settings; docs/serving.md) is exported first; a variable already set in the environment wins.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
source scripts/serve-env.sh deploy/serve.env  # explicit: a bare `source` passes our own args on as its file
exec .venv/bin/serve run "${@:-deploy/serve.yaml}"
