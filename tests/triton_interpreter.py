"""What the Triton-in-the-interpreter test files share: importing a kernel module under
TRITON_INTERPRET=1, rerunning a test file in a child process when triton was already imported
compiled, and the bf16 behaviour of a GPU patched into the interpreter for one test."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType

import numpy as np
import torch


def import_interpreted(name: str) -> ModuleType:
    """The module `name` imported under TRITON_INTERPRET=1; sys.modules and the environment are
    left as they were (a later import gets the compiled kernels)."""
    saved_module, saved_env = sys.modules.pop(name, None), os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        sys.modules.pop(name, None)
        if saved_module is not None:
            sys.modules[name] = saved_module


def run_file_in_interpreter(path: str, timeout_s: float = 900) -> None:
    """Runs the test file in a child pytest with TRITON_INTERPRET=1; fails with its output's tail."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join(child.stdout.splitlines()[-25:])
    assert child.returncode == 0, f"interpreter run failed (rc {child.returncode}):\n{tail}\n{child.stderr[-2000:]}"


def patch_bf16_like_a_gpu(monkeypatch) -> None:
    """bf16 tl.dot operands widened to fp32 (exact), and fp32 -> bf16 casts rounded to nearest
    even, as on a GPU (the interpreter multiplies bf16 bit patterns and truncates casts)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original_dot = interpreter.InterpreterBuilder.create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_cast(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).bfloat16()
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
