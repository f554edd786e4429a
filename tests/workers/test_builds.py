"""Every CPU kind's build of our C kernels compiles, whatever CPU this machine has: each runs only
the bodies its own CPU has, so a body no test machine runs is still compiled here."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from workers.kernels.native import CFLAGS, SOURCE_DIR, SOURCES, compiler

# Every body our sources have, built: AVX2 (Zen 2/3, Haswell), AVX-512 without BF16 (Skylake-SP,
# Cascade Lake, Ice Lake), with BF16 and VNNI (Cooper Lake; Zen 4 has these), and AMX (Sapphire
# Rapids on).
MARCHES = ["x86-64", "x86-64-v3", "skylake-avx512", "icelake-server", "cooperlake", "znver4", "sapphirerapids"]


@pytest.mark.parametrize("march", MARCHES)
def test_every_cpu_kinds_build_compiles(march):
    cc = compiler()
    if cc is None or platform.machine() != "x86_64" or shutil.which(cc) is None:
        pytest.skip("no x86 C compiler")
    probe = subprocess.run([cc, f"-march={march}", "-x", "c", "-fsyntax-only", "-"], input="int x;\n",
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"this compiler does not know -march={march}")
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS if flag != "-shared"]
    for name in SOURCES:
        result = subprocess.run([cc, *flags, "-c", "-o", "/dev/null", str(SOURCE_DIR / name)], capture_output=True,
                                text=True, check=False)
        assert result.returncode == 0, f"{name} with -march={march}:\n{result.stderr[-2000:]}"
