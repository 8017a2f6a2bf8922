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

DTK_TORCH = ("__version__ = '2.13.0+das.opt1.dtk2604'\n"
             "class version:\n    hip = '6.3.25'\n"
             "class cuda:\n    @staticmethod\n    def is_available(): return False\n"
             "    @staticmethod\n    def get_arch_list(): return ['gfx936']\n")


def run_check(tmp_path: Path, torch_src: str, dtk_version: str = "26.04.0",
              *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
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
    tk = tmp_path / "triton_kernels"   # a local triton_kernels: no GitHub clone needed
    tk.mkdir(exist_ok=True)
    (tk / "__init__.py").write_text("")
    env.update(ROCM_PATH=str(dtk), PYTHONPATH=str(fake), TRITON_KERNELS_SRC_DIR=str(tk),
               PATH=f"{Path(sys.executable).parent}:{dtk / 'bin'}:{env['PATH']}")
    for k, v in (env_extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
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


def test_torch_older_than_vllms_rocm_minimum_is_refused_unless_asked_for(tmp_path):
    """Regression (issue #17 review, item 4): vLLM 0.27.1 is built against ROCm torch >= 2.13
    (vllm/CMakeLists.txt), but --check accepted any ROCm torch."""
    old = DTK_TORCH.replace("2.13.0+das", "2.5.1+das")
    r = run_check(tmp_path, old)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "torch 2.5.1+das.opt1.dtk2604" in r.stderr and "2.13.0" in r.stderr
    assert "--any-torch" in r.stderr
    r = run_check(tmp_path, old, "26.04.0", "--any-torch")
    assert r.returncode == 0 and "building anyway" in r.stdout, r.stdout + r.stderr
    assert run_check(tmp_path, DTK_TORCH.replace("2.13.0+das", "2.14.1+das")).returncode == 0


def _github_to(url: str) -> dict:
    """git config from the environment: https://github.com/ URLs go to `url` instead."""
    return {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": f"url.{url}.insteadOf",
            "GIT_CONFIG_VALUE_0": "https://github.com/"}


def test_unreachable_github_names_triton_kernels_src_dir(tmp_path):
    """Regression (issue #17 review, item 1): even with UPSTREAM_SDIST the ROCm CMake configure
    git-clones ROCm/triton (triton_kernels.cmake), so an offline node failed an hour in. --check
    now fails at once naming what to copy and TRITON_KERNELS_SRC_DIR (upstream's local-source
    switch); with it set, no clone is needed."""
    r = run_check(tmp_path, DTK_TORCH, env_extra={"TRITON_KERNELS_SRC_DIR": None,
                                                  **_github_to(f"file://{tmp_path}/nowhere/")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ROCm/triton.git is unreachable" in r.stderr
    assert "TRITON_KERNELS_SRC_DIR=" in r.stderr and "python/triton_kernels/triton_kernels" in r.stderr
    ok = run_check(tmp_path, DTK_TORCH, env_extra=_github_to(f"file://{tmp_path}/nowhere/"))
    assert ok.returncode == 0 and "no GitHub clone" in ok.stdout, ok.stdout + ok.stderr
    bad = run_check(tmp_path, DTK_TORCH, env_extra={"TRITON_KERNELS_SRC_DIR": str(tmp_path)})
    assert bad.returncode == 1 and "has no __init__.py" in bad.stderr


def test_reachable_github_needs_no_local_triton_kernels(tmp_path):
    mirror = tmp_path / "gh" / "ROCm" / "triton.git"
    subprocess.run(["git", "init", "-q", "--bare", str(mirror)], check=True)
    seed = tmp_path / "seed"
    subprocess.run(["git", "init", "-q", str(seed)], check=True)
    subprocess.run(["git", "-C", str(seed), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    subprocess.run(["git", "-C", str(seed), "push", "-q", str(mirror), "HEAD:refs/heads/main"],
                   check=True)
    subprocess.run(["git", "-C", str(mirror), "symbolic-ref", "HEAD", "refs/heads/main"], check=True)
    r = run_check(tmp_path, DTK_TORCH, env_extra={"TRITON_KERNELS_SRC_DIR": None,
                                                  **_github_to(f"file://{tmp_path}/gh/")})
    assert r.returncode == 0 and "reachable" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("env_arch,want", [
    ("gfx906;gfx926;gfx936", "gfx936"),           # a DTK module's list
    ("gfx926,gfx936:xnack-", "gfx936:xnack-"),
    ("gfx936", "gfx936"),
])
def test_pytorch_rocm_arch_list_with_gfx936_builds_for_gfx936(tmp_path, env_arch, want):
    """The user never passed --arch: a DTK module's PYTORCH_ROCM_ARCH list that holds gfx936
    builds for its gfx936 entry instead of stopping with '--arch ...: targets gfx936 only'."""
    r = run_check(tmp_path, DTK_TORCH, env_extra={"PYTORCH_ROCM_ARCH": env_arch})
    assert r.returncode == 0, r.stdout + r.stderr
    if env_arch != want:
        assert f"PYTORCH_ROCM_ARCH={env_arch} lists several archs; building for {want} only" \
            in r.stdout


@pytest.mark.parametrize("env_arch", ["gfx90a", "gfx906;gfx926"])
def test_pytorch_rocm_arch_without_gfx936_is_named_in_the_error(tmp_path, env_arch):
    r = run_check(tmp_path, DTK_TORCH, env_extra={"PYTORCH_ROCM_ARCH": env_arch})
    assert r.returncode == 1
    assert f"PYTORCH_ROCM_ARCH={env_arch} (from the environment" in r.stderr
    # The error names the variable, not an --arch the user never passed.
    assert f"build.sh: PYTORCH_ROCM_ARCH={env_arch} (from the environment; unset it or pass " \
        "--arch gfx936): this fork's ROCm build targets gfx936 only" in r.stderr


@pytest.mark.parametrize("arch", ["gfx90a", "gfx936;gfx926"])
def test_explicit_arch_other_than_gfx936_is_refused(tmp_path, arch):
    # --arch wins over the environment and is the one named.
    r = run_check(tmp_path, DTK_TORCH, "26.04.0", "--arch", arch,
                  env_extra={"PYTORCH_ROCM_ARCH": "gfx936"})
    assert r.returncode == 1 and f"--arch {arch}: this fork's ROCm build targets gfx936 only" \
        in r.stderr
