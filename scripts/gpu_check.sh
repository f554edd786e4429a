#!/usr/bin/env bash
# A GPU machine's checks in one call (docs/gpu.md): the machine, `pytest tests/gpu`, the
# quantized linears against bf16 (bench/bench_quant_gpu.py), the GPU runner benchmark
# (bench/bench_gpu.py) and, when the carried wheels hold Ray Serve, the served
# path against the in-process engine (bench/bench_gpu_served.py). Run from the
# repository root on a machine with CUDA, torch and triton; logs go to $OUT (default /tmp/gpu-check).
#
#     bash scripts/gpu_check.sh
#
# Wheels in .whl/ (packages the GPU image lacks: llguidance, and Ray Serve for the served test;
# `.venv/bin/python scripts/gpu_wheels.py` fills it) are installed to /tmp/site first.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
echo "== pytest tests/gpu"
timeout "${TESTS_TIMEOUT_S:-200}" python3 -m pytest tests/gpu -ra -m gpu -n "${TEST_WORKERS:-8}" --dist loadgroup 2>&1 | tee "$OUT/tests.txt"
echo "== bench.bench_quant_gpu"
timeout "${QUANT_TIMEOUT_S:-180}" python3 -m bench.bench_quant_gpu ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quant.txt"
echo "== bench.bench_gpu"
timeout "${BENCH_TIMEOUT_S:-240}" python3 -m bench.bench_gpu ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
if [ -d .whl/tokenizer ] && python3 -c "import ray.serve" 2>/dev/null; then
    echo "== bench.bench_gpu_served"
    timeout "${SERVED_TIMEOUT_S:-240}" python3 -m bench.bench_gpu_served --tokenizer-dir .whl/tokenizer 2>&1 | tee "$OUT/served.txt"
fi
