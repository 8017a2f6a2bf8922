# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builds a csrc_gfx936 kernel source for the CPU under cpu_emu_compat.h (the tests
test_moe_mxfp4_cpu_emu.py, test_sparse_mla_decode_cpu_emu.py, test_w8a16_cpu_emu.py): its
kernel launches rewritten into emu_launch calls, g++ with cpu_emu_runtime.cpp and the test's
main; as written, or with source mutations (a test that the checks catch a broken kernel)."""

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc_gfx936"
HERE = Path(__file__).resolve().parent
HEADERS = ("last_block.h", "lowp_decode.h", "moe_mxfp4.h", "sparse_mla_decode.h", "w8a16_fp8.h")


def emulated_source(src: str, min_launches: int) -> str:
    """`k<<<grid, block, shmem, stream>>>(args);` -> `emu_launch([&] { k(args); }, grid, ...)`."""
    src, n = re.subn(r"([\w:]+(?:<[^;{}]*?>)?)<<<(.*?)>>>\((.*?)\);",
                     r"emu_launch([&] { \1(\3); }, \2);", src)
    assert n >= min_launches, f"expected {min_launches} kernel launches, rewrote {n}"
    return src


def build(tmp: Path, name: str, source: str, main: str) -> Path:
    """The executable of `source` (already rewritten, named `name`) linked with `main`."""
    compat = (CSRC / "gfx936_compat.h").read_text()
    tail = compat[compat.index("namespace gfx936 {"):]  # bit casts and conversions, as is
    (tmp / "gfx936_compat.h").write_text((HERE / "cpu_emu_compat.h").read_text() + "\n" + tail)
    for h in HEADERS:
        shutil.copy(CSRC / h, tmp / h)
    (tmp / f"{name}.cpp").write_text(source)
    exe = tmp / name
    done = subprocess.run(
        ["g++", "-O2", "-std=c++17", "-pthread", "-fno-extern-tls-init", f"-I{tmp}", f"-I{HERE}",
         str(tmp / f"{name}.cpp"),
         str(HERE / "cpu_emu_runtime.cpp"), str(HERE / main), "-o", str(exe)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe


def kernel_exe(tmp: Path, kernel: str, name: str, main: str, min_launches: int,
               mutations: tuple[tuple[str, str], ...] = (),
               prepare: Callable[[str], str] = lambda src: src) -> Path:
    """The emulator executable of csrc_gfx936/`kernel` (after `prepare`, e.g. dynamic LDS as
    g_dyn_shmem), each (old, new) of `mutations` replaced first (old must occur once: a moved
    anchor fails rather than testing nothing). Skips without g++."""
    if shutil.which("g++") is None:
        pytest.skip(f"no g++ on PATH; the CPU emulation of {kernel} is skipped")
    src = (CSRC / kernel).read_text()
    for old, new in mutations:
        assert src.count(old) == 1, f"mutation anchor moved: {old!r}"
        src = src.replace(old, new)
    return build(tmp, name, emulated_source(prepare(src), min_launches), main)
