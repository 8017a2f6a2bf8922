# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936::mul_rn (csrc_gfx936/gfx936_compat.h) stays a multiply rounded on its own under
hipcc's default FP contraction: the MoE direct path's per-token sum (moe_mxfp4.cu) adds
dot * weight products that the grouped path rounds when it stores them, so a fused
multiply-add there changes the output's bits (HIP's __fmul_rn is a plain multiply, and
hipcc fuses it). Compiled for gfx90a with the compile check's flags; the same loop with a
plain `*` is the control that shows hipcc does contract (without it this test could pass
on a compiler that never fuses)."""

import re
import shutil
import subprocess

import pytest

from conftest import REPO

KERNELS = """
#include "gfx936_compat.h"
__global__ void sum_mul_rn(const float* a, const float* b, float* o, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += gfx936::mul_rn(a[i], b[i]);
  o[threadIdx.x] = s;
}
__global__ void sum_plain(const float* a, const float* b, float* o, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  o[threadIdx.x] = s;
}
"""
FUSED = r"\bv_(fmac?|mac|mad|fma_mix)\w*_f32"


def _body(asm: str, name: str) -> str:
    m = re.search(rf"^(_Z\d+{name}\w*):[^\n]*\n(.*?)\.Lfunc_end", asm, re.S | re.M)
    assert m, f"{name} not in the device assembly"
    return m.group(2)


def test_mul_rn_is_not_fused_into_the_following_add(tmp_path):
    if shutil.which("hipcc") is None:
        pytest.skip("no hipcc on PATH (Debian: apt-get install hipcc); AMD compile check skipped")
    (tmp_path / "k.hip").write_text(KERNELS)
    done = subprocess.run(
        ["hipcc", "--offload-arch=gfx90a", "-O3", "-std=c++17",
         "-fno-gpu-flush-denormals-to-zero", f"-I{REPO / 'csrc_gfx936'}", "--cuda-device-only",
         "-S", str(tmp_path / "k.hip"), "-o", str(tmp_path / "k.s")],
        capture_output=True, text=True, timeout=600, env={"HIP_PLATFORM": "amd", "PATH":
                                                          "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    asm = (tmp_path / "k.s").read_text()
    plain, rn = _body(asm, "sum_plain"), _body(asm, "sum_mul_rn")
    assert re.search(FUSED, plain), "control: hipcc no longer contracts a * b + s"
    assert not re.search(FUSED, rn), "mul_rn's product was fused into the add"
    assert re.search(r"\bv_mul_f32", rn) and re.search(r"\bv_add_f32", rn)
