"""Puts in .whl/ the wheels that a GPU machine with no network access lacks for the served path
(Ray Serve and what it imports), so that `scripts/gpu_check.sh` can run
tests/gpu/test_gpu_served.py there.

    .venv/bin/python scripts/gpu_wheels.py          # then carry .whl to the GPU machine (docs/gpu.md)

At most 64 MiB of files are carried to that machine, and its image (Python 3.12, torch,
transformers, grpcio, no Ray) cannot download anything. Ray's wheel alone is 79 MB, 32 MB of it
Java jars, so this rewrites it without the jars, the dashboard's web client and the libraries the
server never imports (rllib, data, tune, train, llm): 40 MB. With the rest (FastAPI, pydantic,
uvicorn, OpenTelemetry, grpcio and protobuf at the versions of this machine's .venv) and the
llguidance wheel, about 53 MB. It also copies the default model's tokenizer files (4 MB) to
.whl/tokenizer for bench/bench_gpu_served.py (the weights, 517 MB, cannot travel). The list was
found by running the served test with every other package of .venv hidden from imports (what the
GPU image holds: docs/gpu.md).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: bench/ and workers/ from this checkout
WHEELS = REPO / ".whl"
PACKAGES = [
    "ray", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "uvicorn",
    "grpcio", "grpcio-reflection", "protobuf", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions", "opentelemetry-proto",
    "opentelemetry-exporter-prometheus", "llguidance",
]
RAY_DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/tune/", "ray/train/", "ray/llm/")
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def strip_ray(wheel: Path) -> None:
    """Rewrites the ray wheel in place without RAY_DROP (and their RECORD lines)."""
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if info.filename.startswith(RAY_DROP):
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not line.decode().startswith(RAY_DROP))
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    stripped.replace(wheel)


def copy_tokenizer(target: Path) -> None:
    """The default model's tokenizer files (converting the model first if it never was)."""
    from bench.bench_gpu_served import TOKENIZER_FILES
    from workers.loader import resolve_model_path

    source = resolve_model_path(None)
    target.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)


def main() -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    WHEELS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   "3.12", "--implementation", "cp", "-d", scratch, *pins]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        print("downloading", " ".join(pins), flush=True)
        subprocess.run(command, check=True)
        stale = {name.replace("-", "_").lower() for name in PACKAGES}  # another version would break the install
        for old in WHEELS.glob("*.whl"):
            if old.name.split("-")[0].lower() in stale:
                old.unlink()
        for wheel in Path(scratch).glob("*.whl"):
            if wheel.name.startswith("ray-"):
                print(f"stripping {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB)", flush=True)
                strip_ray(wheel)
            wheel.replace(WHEELS / wheel.name)
    copy_tokenizer(WHEELS / "tokenizer")
    total = sum(path.stat().st_size for path in WHEELS.rglob("*") if path.is_file())
    print(f"{WHEELS}: {len(list(WHEELS.glob('*.whl')))} wheels and the tokenizer, {total / 2**20:.0f} MiB (at most 64 MiB, "
          "the working tree included, can be carried to the GPU machine)")


if __name__ == "__main__":
    main()
