#!/usr/bin/env bash
# Starts the Hugging Face baseline server (bench/hf_server.py: one generate per request,
# behind a lock) with the project's own .venv, and waits until /health answers.
#   PORT=8100 THREADS=2 MODEL=DIR bash bench/peers/hf_baseline.sh
# Stop it with: kill "$(cat ~/.cache/rayllm-peers/hf_baseline.pid)"
source "$(dirname "$0")/common.sh"
PORT=${PORT:-8100}
THREADS=${THREADS:-2}
cd "$REPO_ROOT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
start_bg hf_baseline \
    .venv/bin/python -m bench.hf_server --model "$MODEL" --served-model-name hf-baseline \
    --port "$PORT" --threads "$THREADS"
wait_healthy hf_baseline "$(cat "$PEERS_DIR/hf_baseline.pid")" "http://127.0.0.1:$PORT/health" 300
