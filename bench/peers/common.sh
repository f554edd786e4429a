# Shared helpers for the peer launchers (sourced, not run).
#   PEERS_DIR   where peers are installed and logs/PID files go (default ~/.cache/rayllm-peers)
#   MODEL       the local HF model dir (default: the converted SmolLM2 in ~/.cache/rayllm)
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rayllm-peers}
MODEL=${MODEL:-$HOME/.cache/rayllm/SmolLM2-135M-Instruct}
mkdir -p "$PEERS_DIR"

# wait_healthy NAME PID URL TIMEOUT_S: polls URL until it answers 200; fails if PID dies.
wait_healthy() {
    local name=$1 pid=$2 url=$3 timeout=$4 start=$SECONDS
    while (( SECONDS - start < timeout )); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "[$name] exited before becoming healthy; see $PEERS_DIR/$name.log" >&2
            return 1
        fi
        if curl -sf -o /dev/null "$url"; then
            echo "[$name] healthy at $url after $(( SECONDS - start )) s (pid $pid, pid file $PEERS_DIR/$name.pid)"
            return 0
        fi
        sleep 1
    done
    echo "[$name] not healthy after $timeout s; see $PEERS_DIR/$name.log" >&2
    return 1
}

# start_bg NAME CMD...: starts CMD in the background in its own session (so its whole process
# group can be stopped: kill -- -PID), logs to PEERS_DIR/NAME.log, records its PID.
start_bg() {
    local name=$1; shift
    setsid "$@" >"$PEERS_DIR/$name.log" 2>&1 </dev/null &
    echo $! >"$PEERS_DIR/$name.pid"
    echo "[$name] started pid $! : $*"
}
