"""What a fresh interpreter loads: the engine core is stdlib only (neither ray nor torch), and the
ingress (every serve_app module) never loads torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules_of(package: str, leave_out: tuple[str, ...] = ()) -> list[str]:
    return sorted(p.stem for p in (ROOT / package).glob("*.py") if p.stem not in ("__init__", *leave_out))


def assert_imports_load_none_of(package: str, modules: list[str], banned: tuple[str, ...]) -> None:
    """Importing package.module for every module, in a fresh interpreter, loads no banned package."""
    code = (
        "import sys\n"
        + "".join(f"import {package}.{m}\n" for m in modules)
        + f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {banned!r})\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_scheduler_imports_no_ray_no_torch():
    modules = modules_of("scheduler", leave_out=("actor",))
    assert {"scheduler", "engine", "testing", "kv_cache_manager", "autoscale"} <= set(modules)
    assert_imports_load_none_of("scheduler", modules, ("ray", "torch", "numpy"))


def test_the_ingress_imports_no_torch():
    """Every serve_app module, the app builder and the ingress included, imports without torch: the
    ingress replicas never load it (the workers' types it uses live in torch-free modules)."""
    modules = modules_of("serve_app")
    assert {"app", "api", "tokenizer", "grammar"} <= set(modules)
    assert_imports_load_none_of("serve_app", modules, ("torch",))
