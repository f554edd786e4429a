"""Every CPU kind's build of our C kernels compiles, whatever CPU this machine has: each runs only
the bodies its own CPU has, so a body no test machine runs is still compiled here."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from workers.kernels.native import (
    CFLAGS,
    SOURCE_DIR,
    SOURCES,
    compiler,
    native_available,
)

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


@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
def test_the_ctypes_mirrors_have_the_c_structs_layouts():
    """native.py's argument structs are checked against csrc's own names, sizeof and offsetof when
    the library loads; a mirror with two same-typed fields swapped (the same offsets) or a field
    short is refused, naming the struct."""
    import ctypes

    from workers.kernels.native import (
        LAYOUT_MIRRORS,
        AttentionArgs,
        NativeBuildError,
        check_layouts,
        native_library,
        struct_layout,
    )

    library = native_library()
    check_layouts(library)
    assert set(LAYOUT_MIRRORS.values()) >= {AttentionArgs}
    fields = list(AttentionArgs._fields_)
    fields[7], fields[8] = fields[8], fields[7]  # num_seqs and num_heads: both int64, so the same offsets

    class Swapped(ctypes.Structure):
        _fields_ = fields

    class Short(ctypes.Structure):
        _fields_ = fields[:-1]

    assert struct_layout(Swapped) == struct_layout(AttentionArgs)
    for wrong in (Swapped, Short):
        with pytest.raises(NativeBuildError, match=wrong.__name__):
            check_layouts(library, {"rayllm_layout_attention_args": wrong})
