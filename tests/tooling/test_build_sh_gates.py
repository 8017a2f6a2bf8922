# SPDX-License-Identifier: Apache-2.0
"""build.sh --check on a fake DTK machine: each prerequisite gate names the fix (issue #17).

The DTK install is a folder with `.info/version` and a `bin/hipcc` that is never run; torch is a
tiny package on PYTHONPATH that says what a DTK torch, a CUDA torch or a torch missing DTK's
libraries says. Only `--check` runs: nothing is built.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DTK_TORCH = ("__version__ = '2.5.1+das.opt1.dtk2604'\n"
             "class version:\n    hip = '6.3.25'\n"
             "class cuda:\n    @staticmethod\n    def is_available(): return False\n"
             "    @staticmethod\n    def get_arch_list(): return ['gfx936']\n")


def run_check(tmp_path: Path, torch_src: str, dtk_version: str = "26.04.0",
              *args: str) -> subprocess.CompletedProcess:
    dtk = tmp_path / "dtk"
    (dtk / "bin").mkdir(parents=True, exist_ok=True)
    (dtk / ".info").mkdir(exist_ok=True)
    (dtk / ".info" / "version").write_text(dtk_version + "\n")
    hipcc = dtk / "bin" / "hipcc"
    hipcc.write_text("#!/bin/sh\nexit 0\n")
    hipcc.chmod(0o755)
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True, exist_ok=True)
    (fake / "torch" / "__init__.py").write_text(torch_src)
    env = {k: v for k, v in os.environ.items() if k not in ("DTK_VERSION", "PYTORCH_ROCM_ARCH")}
    env.update(ROCM_PATH=str(dtk), PYTHONPATH=str(fake),
               PATH=f"{Path(sys.executable).parent}:{dtk / 'bin'}:{env['PATH']}")
    return subprocess.run(["bash", str(REPO / "build.sh"), "--check", "--python", sys.executable,
                           *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_dtk_torch_on_dtk_2604_passes_every_gate(tmp_path):
    r = run_check(tmp_path, DTK_TORCH)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: DTK 2604" in r.stdout and "HIP 6.3.25" in r.stdout and "MAX_JOBS=" in r.stdout


def test_other_dtk_is_refused_unless_asked_for(tmp_path):
    r = run_check(tmp_path, DTK_TORCH, "25.10.1")
    assert r.returncode == 1 and "DTK 2510" in r.stderr and "--any-dtk" in r.stderr
    assert run_check(tmp_path, DTK_TORCH, "25.10.1", "--any-dtk").returncode == 0


def test_torch_missing_dtk_libraries_is_not_called_a_missing_torch(tmp_path):
    r = run_check(tmp_path, "raise ImportError('libgalaxyhip.so.5: cannot open shared object file')\n")
    assert r.returncode == 1
    assert "cannot load a library" in r.stderr and "libgalaxyhip.so.5" in r.stderr
    assert "module load" in r.stderr


def test_cuda_torch_is_refused(tmp_path):
    r = run_check(tmp_path, DTK_TORCH.replace("hip = '6.3.25'", "hip = None"))
    assert r.returncode == 1 and "not a ROCm build" in r.stderr


def test_torch_without_gfx936_kernels_is_warned(tmp_path):
    r = run_check(tmp_path, DTK_TORCH.replace("['gfx936']", "['gfx90a', 'gfx942']"))
    assert r.returncode == 0 and "lists no gfx936 kernels" in r.stdout


@pytest.mark.parametrize("flag", ["--bogus"])
def test_unknown_argument_is_named(tmp_path, flag):
    r = run_check(tmp_path, DTK_TORCH, "26.04.0", flag)
    assert r.returncode == 2 and f"unknown argument '{flag}'" in r.stderr


def _logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def test_every_step_piped_into_tee_fails_loudly():
    """Regression (issue #17 review, item 16): `tools.stack apply 2>&1 | tee -a "$log"` had no
    error handler, so under `set -eo pipefail` a failed apply ended build.sh with no message.
    Every step piped into tee names its failure with `|| die`; the apply step is gone (the wheel
    is exported from the series, not from vllm/'s work tree)."""
    text = (REPO / "build.sh").read_text()
    teed = [ln for ln in _logical_lines(text) if "| tee" in ln and not ln.lstrip().startswith("#")]
    assert teed
    silent = [ln.strip() for ln in teed if "|| die" not in ln]
    assert not silent, silent
    assert "tools.stack apply" not in "\n".join(ln for ln in _logical_lines(text)
                                                if not ln.lstrip().startswith("#"))
