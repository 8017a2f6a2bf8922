"""Kernel tests: Triton under its CPU interpreter (set before triton is imported); the AMD
compile check of csrc_gfx936, run once per session and shared by the tests that read it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # fp8_ds_mla_writer


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gfx90a_kernel_check(tmp_path_factory):
    """(CompletedProcess, out dir) of csrc_gfx936/compile_check.sh --arch gfx90a on the kernels,
    with the checked-in allow-list (what CI and `make kernel-check` run)."""
    if shutil.which("hipcc") is None:
        pytest.skip("no hipcc on PATH (Debian: apt-get install hipcc); AMD compile check skipped")
    out = tmp_path_factory.mktemp("kernel-check")
    done = subprocess.run([str(REPO / "csrc_gfx936" / "compile_check.sh"), "--arch", "gfx90a",
                           "--out", str(out)], capture_output=True, text=True, timeout=1800)
    return done, out
