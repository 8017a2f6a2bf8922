# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936/torch_bindings.cpp, the ops' torch glue, compiles on the CPU tier.

Only the device tiers build the extension (nvcc on the H200, hipcc on gfx936), so an edit to
the glue (a check, a helper, an op's signature against the kernels' headers) was first compiled
on a leased GPU. Here g++ checks it against this venv's torch headers with the CUDA runtime
API it touches (stream, guard, device properties) shimmed to host stubs: everything else
(ATen, the op schemas' C++ signatures, the kernel headers) is the real thing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc_gfx936"

# the CUDA spellings torch_bindings.cpp uses (torch's cpp_extension hipifies them for ROCm)
SHIM = {
    "ATen/cuda/CUDAContext.h": """#pragma once
#include <c10/core/Device.h>
namespace at { namespace cuda {
struct ShimStream { void* stream() const { return nullptr; } };
inline ShimStream getCurrentCUDAStream() { return {}; }
struct ShimProps { int multiProcessorCount; };
inline const ShimProps* getCurrentDeviceProperties() { static ShimProps p{1}; return &p; }
}}  // namespace at::cuda
""",
    "c10/cuda/CUDAGuard.h": """#pragma once
#include <c10/core/Device.h>
namespace at { namespace cuda {
struct OptionalCUDAGuard { explicit OptionalCUDAGuard(c10::Device) {} };
}}  // namespace at::cuda
""",
}


def _compile(src: Path, tmp: Path) -> subprocess.CompletedProcess:
    shim = tmp / "shim"
    for rel, text in SHIM.items():
        (shim / rel).parent.mkdir(parents=True, exist_ok=True)
        (shim / rel).write_text(text)
    inc = Path(torch.__file__).parent / "include"
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Werror=return-type", f"-I{shim}",
           "-isystem", str(inc), "-isystem", str(inc / "torch/csrc/api/include"),
           f"-I{CSRC}", str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def gxx():
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed: the CPU compile check of torch_bindings.cpp needs it")
    return "g++"


def test_torch_bindings_compile_against_the_cpu_torch_headers(gxx, tmp_path):
    done = _compile(CSRC / "torch_bindings.cpp", tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_broken_binding_fails_the_compile_check(gxx, tmp_path):
    """The check can fail: an op calling its launcher with a wrong argument type."""
    text = (CSRC / "torch_bindings.cpp").read_text()
    good = "gfx936::moe_mxfp4_direct_launch(\n      p, "
    assert good in text, "torch_bindings.cpp no longer calls moe_mxfp4_direct_launch(p, ...)"
    bad = tmp_path / "torch_bindings.cpp"
    bad.write_text(text.replace(good, "gfx936::moe_mxfp4_direct_launch(\n      &p, "))
    done = _compile(bad, tmp_path)
    assert done.returncode != 0 and "moe_mxfp4_direct_launch" in done.stderr
