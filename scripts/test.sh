#!/usr/bin/env bash
# Installs the dev environment and runs the whole test suite (what CI runs).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev || exit 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
.venv/bin/python -m pytest -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing loudly (exit 5 means the suite is empty or mis-selected)" >&2
    exit 1
fi
exit "$rc"
