"""The engine core is stdlib only: importing any of it pulls in neither ray nor torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = [p.stem for p in (ROOT / "scheduler").glob("*.py") if p.stem not in ("__init__", "actor")]


def test_scheduler_imports_no_ray_no_torch():
    code = (
        "import sys\n"
        + "".join(f"import scheduler.{m}\n" for m in MODULES)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'numpy'))\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert {"scheduler", "engine", "testing", "kv_cache_manager", "autoscale"} <= set(MODULES)


def test_the_ingress_imports_no_torch():
    """Every serve_app module, the app builder and the ingress included, imports without torch: the
    ingress replicas never load it (the workers' types it uses live in torch-free modules)."""
    modules = sorted(p.stem for p in (ROOT / "serve_app").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        + "".join(f"import serve_app.{m}\n" for m in modules)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert {"app", "api", "tokenizer", "grammar"} <= set(modules)
