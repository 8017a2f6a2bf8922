# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936/w8a16_fp8.cu (the block-FP8 W8A16 GEMV of every dense decode projection, and the
dequant that feeds BLAS at prefill sizes), the kernel source itself, run on the CPU by g++
under the emulation of the HIP/CUDA subset it uses (cpu_emu_compat.h), against a float64
oracle that decodes the E4M3 bytes with torch's own float8_e4m3fn cast (not lowp_decode.h)
and the scales as 2^(u - 127) or float32. The launcher picks its own plan: 1, 2, 4, 8 and 16
tokens per weight load, 20 tokens (two passes on grid.z), R = 4 / 2 / 1 rows per lane (from
the CU count given to it), k split into 512-column tiles summed by the tile's last block, k
not a multiple of 512 or of the 128-column scale block, rows only 8-byte aligned (the
two-8-byte-load path), grouped rows (DeepSeek V4's wo_a: output slice g reads x[:, g k ..]),
bf16 / f16 / f32 activations, UE8M0 and float32 scales. No E4M3 NaN byte (0x7f / 0xff): the
kernels decode it as +-480 (lowp_decode.h), because the weights are refused at load time if
they hold one (scaled_mm/gfx936.py), not checked per element.

Each GEMV runs four times in the emulator's main: once, again (exit 5: the tile counters
reset), with the blocks in reverse grid order (exit 6: the sum does not depend on which block
is last) and with 3 blocks at once, the first to count itself in held at its next barrier
(exit 7: no block is counted before its partials are written); every run must give the first
run's bits. The dequant must equal the fork's torch reference (gfx936_w8a16.
dequantize_fp8_block) bit for bit, in bf16, f16 and float32.

Tolerance (GEMV): float32 output from float32 sums of <= 4096 products (activations staged
as float32 x 2^64, weights decoded exactly); observed rel ~1e-7, asserted rel <= 1e-5 and
cos >= 1 - 1e-9. A lost k tile, a wrong row or a missing barrier gives rel > 1e-2."""

import subprocess
from pathlib import Path

import cpu_emu
import pytest
import torch

XDTYPE = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}  # kBF16, kF16, kF32


@pytest.fixture(scope="module")
def emu_exe(tmp_path_factory):
    return cpu_emu.kernel_exe(tmp_path_factory.mktemp("w8a16_emu"), "w8a16_fp8.cu", "w8a16_emu",
                              "w8a16_cpu_emu_main.cpp", 4)


def run_case(exe, tmp: Path, m, n, k, *, groups=1, bn=128, bk=128, xk=0, f32_scale=False,
             cus=1, pad=0, deq=0, seed=0):
    """(GEMV output float32 [m, n], float64 oracle, dequant output, its torch reference,
    k splits of the plan)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, groups * k, generator=g).to(XDTYPE[xk])
    w = torch.randint(0, 256, (n, k + pad), generator=g, dtype=torch.uint8)
    w[(w & 0x7F) == 0x7F] -= 1  # no NaN code: the load-time check refuses those weights
    sn, sk = -(-n // bn), -(-k // bk)
    if f32_scale:
        scale = torch.rand(sn, sk + 1, generator=g) * 0.03 + 0.001
        sdec = scale[:, :sk].double()
    else:
        scale = torch.randint(118, 126, (sn, sk + 1), generator=g, dtype=torch.uint8)
        sdec = torch.pow(2.0, scale[:, :sk].double() - 127)
    (tmp / "meta.txt").write_text(f"{m} {n} {k} {bn} {bk} {groups} {xk} {int(f32_scale)} {cus} "
                                  f"{k + pad} {sk + 1} {deq}\n")
    x.contiguous().view(torch.uint8).numpy().tofile(tmp / "x.bin")
    w.numpy().tofile(tmp / "w.bin")
    scale.contiguous().view(torch.uint8).numpy().tofile(tmp / "scale.bin")
    done = subprocess.run([str(exe), str(tmp)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = torch.from_file(str(tmp / "out.bin"), size=m * n, dtype=torch.float32).view(m, n)
    # the oracle: torch's own E4M3 decode, float64 block scales, per-group x slices
    wd = w[:, :k].view(torch.float8_e4m3fn).double()
    wd = wd * sdec.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    rows = n // groups
    ref = torch.cat([x[:, gi * k:(gi + 1) * k].double() @ wd[gi * rows:(gi + 1) * rows].T
                     for gi in range(groups)], 1)
    dq = torch.from_file(str(tmp / "deq.bin"), size=n * k, dtype=XDTYPE[deq]).view(n, k)
    from vllm.model_executor.kernels.linear.scaled_mm.gfx936_w8a16 import dequantize_fp8_block
    want = dequantize_fp8_block(w[:, :k].view(torch.float8_e4m3fn),
                                scale[:, :sk].contiguous(), (bn, bk), XDTYPE[deq])
    return out, ref, dq, want, int((tmp / "plan.txt").read_text())


# name: (m, n, k, extra) -- 1 CU: R = 4 where the rows allow; 64 CUs: R = 1
CASES = {
    "m1_r4_three_k_tiles": (1, 96, 1536, {}),
    "m2_f16_8byte_rows": (2, 64, 1024, {"xk": 1, "pad": 8, "deq": 1}),
    "m4_f32_x_f32_scales": (4, 48, 640, {"xk": 2, "f32_scale": True, "deq": 2}),
    "m8_k_not_a_scale_block_multiple": (8, 40, 1000, {"bk": 128, "cus": 64}),
    "m16_r2_grouped_wo_a": (16, 64, 1024, {"groups": 2}),
    "m20_two_passes_64_cus": (20, 32, 2048, {"cus": 64}),
    "m3_small_scale_blocks": (3, 24, 520, {"bn": 8, "bk": 64}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_w8a16_gemv_and_dequant_match_oracles_on_cpu(emu_exe, tmp_path, name):
    m, n, k, extra = CASES[name]
    out, ref, dq, want, splits = run_case(emu_exe, tmp_path, m, n, k, **extra, seed=len(name))
    assert splits == (-(-k // 512) if k > 512 else 0), splits  # every case but k <= 512 splits
    assert out.isfinite().all()
    rel = float((out.double() - ref).norm() / ref.norm())
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), 0))
    assert rel <= 1e-5 and cos >= 1 - 1e-9, (name, rel, cos)
    assert torch.equal(dq, want), name


# the split-K sum's last-block protocol with the count taken before the partials are written:
# in grid order, in reverse and twice in a row the last block still finds every partial
# written (each block runs to its end before the next starts); only blocks running at once,
# one held after counting itself in, catch it (exit 7)
COUNT_BEFORE_PARTIALS = (
    ("  const int64_t plane = static_cast<int64_t>(p.m) * p.n;  // ws [nsplit][m][n]\n",
     "  const int64_t plane = static_cast<int64_t>(p.m) * p.n;  // ws [nsplit][m][n]\n"
     "  if (threadIdx.x == 0) {\n    GFX936_ARRIVE(&g_w8a16_tile_count[blockIdx.z * gridDim.x"
     " + blockIdx.x], nsplit, last_flag);\n  }\n  __syncthreads();\n"),
    ("  if (threadIdx.x == 0) {\n    GFX936_ARRIVE(&g_w8a16_tile_count[tile], nsplit, "
     "last_flag);\n  }\n  __syncthreads();\n  if (!last_flag) return;",
     "  if (!last_flag) return;"),
)


def test_blocks_at_once_catch_a_split_counted_in_before_its_partials(tmp_path):
    exe = cpu_emu.kernel_exe(tmp_path, "w8a16_fp8.cu", "w8a16_emu_mut", "w8a16_cpu_emu_main.cpp",
                             4, COUNT_BEFORE_PARTIALS)
    with pytest.raises(AssertionError, match="blocks running at once differs"):
        run_case(exe, tmp_path, 1, 96, 1536)
