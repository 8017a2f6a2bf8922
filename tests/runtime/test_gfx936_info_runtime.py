# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`python -m vllm.gfx936 info --runtime` and the startup wheel/device arch gate (patch
gfx936-info-runtime, issue #17).

On this CPU machine the expected answers are known independently: no device, no kernel
library in a python/cpu wheel, the PyTorch paths (docs: README "Kernel switches"), every
defaults-table row listed. The arch gate is checked against a faked ROCm device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fake_rocm
import pytest

import vllm.gfx936 as gfx936_pkg
from vllm.gfx936 import runtime
from vllm.platforms.gfx936_defaults import GFX936_DEFAULTS

ROCM_BUILD = {"flavour": "rocm", "fork_version": "0.27.1+gfx936.dtk2604.s3",
              "target_arch": "gfx936"}


def _resolved_compilation_config():
    """As VllmConfig hands it to the platform hook (vLLM's defaults resolved)."""
    from types import SimpleNamespace

    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return SimpleNamespace(mode=CompilationMode.VLLM_COMPILE,
                           cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                           max_cudagraph_capture_size=8, cudagraph_capture_sizes=[1, 2, 4, 8])

def test_info_runtime_json_on_the_cpu_names_what_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GFX936_")}
    env["VLLM_GFX936_W8A16_IMPL"] = "torch"
    r = subprocess.run([sys.executable, "-m", "vllm.gfx936", "info", "--runtime", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # vLLM's import-time log lines go to stdout before the JSON document
    rt = json.loads(r.stdout[r.stdout.index("\n{") + 1:])["runtime"]
    import torch

    assert rt["device"]["torch"] == torch.__version__ and rt["device"]["devices"] == []
    assert rt["kernel_library"] == {"loaded": False, "reason": "no GPU visible to torch"}
    assert rt["paths"]["sparse_mla_decode"].startswith("reference")
    assert rt["paths"]["w8a16"].startswith("torch (VLLM_GFX936_W8A16_IMPL=torch)")
    assert rt["paths"]["mxfp4_moe"].startswith("emulation (VLLM_GFX936_MXFP4_MOE_IMPL=auto)")
    assert [d["setting"] for d in rt["defaults"]] == [row.name for row in GFX936_DEFAULTS]
    assert rt["wheel_arch_problem"] is None and rt["on_gfx936"] is False
    assert isinstance(rt["das_triton"], bool)


def test_info_runtime_text_shows_a_forced_kernel_error(monkeypatch):
    env = dict(os.environ, VLLM_GFX936_SPARSE_DECODE="fast")
    r = subprocess.run([sys.executable, "-m", "vllm.gfx936", "info", "--runtime"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if "sparse_mla_decode:" in ln)
    assert "ERROR" in line and "'fast'" in line and "VLLM_GFX936_SPARSE_DECODE" in line
    assert "csrc_gfx936 kernels: not loaded" in r.stdout and "--kv-cache-dtype" in r.stdout


@pytest.mark.parametrize("archs,bad", [(["gfx90a"], "gfx90a"),
                                       (["gfx936", "gfx942"], "gfx942")])
def test_wheel_for_gfx936_on_another_arch_names_both(archs, bad):
    msg = runtime.wheel_arch_problem(ROCM_BUILD, archs)
    assert msg and f"visible GPU is {bad}" in msg and "for gfx936 only" in msg
    assert "invalid device function" in msg


@pytest.mark.parametrize("build,archs", [
    (ROCM_BUILD, ["gfx936"]), (ROCM_BUILD, ["gfx936:sramecc+:xnack-"]), (ROCM_BUILD, []),
    (dict(ROCM_BUILD, flavour="python"), ["gfx90a"]), (dict(ROCM_BUILD, target_arch=None),
                                                      ["gfx90a"])])
def test_no_problem_when_the_arch_matches_or_the_build_has_no_device_code(build, archs):
    assert runtime.wheel_arch_problem(build, archs) is None


@pytest.fixture
def rocm_arch(monkeypatch, tmp_path):
    yield from fake_rocm.rocm_arch(monkeypatch, tmp_path)


def _config():
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=None, kernel_config=SimpleNamespace(moe_backend="auto"),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=_resolved_compilation_config(),
        parallel_config=SimpleNamespace(worker_cls="auto", decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))


def test_startup_stops_a_gfx936_wheel_on_another_gpu(rocm_arch, monkeypatch):
    """Regression (issue #17): such a wheel died in a kernel with 'invalid device function'."""
    rocm = rocm_arch("gfx942")
    monkeypatch.setattr(gfx936_pkg, "build_info", lambda: ROCM_BUILD)
    with pytest.raises(RuntimeError, match="visible GPU is gfx942"):
        rocm.RocmPlatform.check_and_update_config(_config())


def test_startup_accepts_the_gfx936_wheel_on_gfx936(rocm_arch, monkeypatch):
    saved = os.environ.get("VLLM_DISABLE_SHARED_EXPERTS_STREAM")
    rocm = rocm_arch("gfx936")
    monkeypatch.setattr(gfx936_pkg, "build_info", lambda: ROCM_BUILD)
    try:
        rocm.RocmPlatform.check_and_update_config(_config())
    finally:
        os.environ.pop("VLLM_DISABLE_SHARED_EXPERTS_STREAM", None)
        if saved is not None:
            os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = saved
