#!/usr/bin/env bash
# Starts our server (deploy/serve.yaml through `serve run`, with its own local Ray and the
# environment of deploy/serve.env, as scripts/serve.sh starts it) on PORT,
# with any app args overridden by KEY=VALUE arguments (YAML values), and waits for /health.
#   PORT=8000 bash bench/peers/ours.sh                                # the default config
#   PORT=8000 bash bench/peers/ours.sh enable_prefix_caching=false    # one knob off
#   PORT=8000 bash bench/peers/ours.sh num_workers=2 worker_num_threads=1 router_policy=round_robin
# Stop it with: kill -TERM -- -"$(cat ~/.cache/rayllm-peers/ours.pid)" (its process group; started from a
# script, serve run inherits SIGINT as ignored, so kill -INT does nothing), then kill what is left in its
# session (ps -eo pid,sid), as bench/matrix.py's stop() does.
source "$(dirname "$0")/common.sh"
PORT=${PORT:-8000}
cd "$REPO_ROOT"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# explicit file: a bare `source` would pass our KEY=VALUE args on as its file
source scripts/serve-env.sh deploy/serve.env  # the serving environment, as scripts/serve.sh exports it
CONFIG=$PEERS_DIR/ours.yaml
.venv/bin/python - "$CONFIG" "$PORT" "$MODEL" "$@" <<'PYEOF'
import sys

import yaml

out, port, model, *overrides = sys.argv[1:]
with open("deploy/serve.yaml") as f:
    config = yaml.safe_load(f)
config["http_options"]["port"] = int(port)
args = config["applications"][0]["args"]
args["model"] = model
args["served_model_name"] = "rayllm"
for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:  # the keys themselves are checked by serve_app.config.AppArgs at start
        sys.exit(f"ours.sh: expected KEY=VALUE (an app arg of serve_app/config.py), got {item!r}")
    args[key] = yaml.safe_load(value)
with open(out, "w") as f:
    yaml.safe_dump(config, f, sort_keys=False)
print(f"[ours] config {out}: " + (" ".join(overrides) or "defaults of deploy/serve.yaml"))
PYEOF
start_bg ours .venv/bin/serve run "$CONFIG"
wait_healthy ours "$(cat "$PEERS_DIR/ours.pid")" "http://127.0.0.1:$PORT/health" 600
