# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936's low-precision decoders (lowp_decode.h), the functions every HIP/CUDA kernel
calls, run on the CPU (hipcc builds them for the host: they are __host__ __device__) over every
E4M3, UE8M0 and E2M1 code and compared bit for bit with PyTorch's own decoders
(``torch.float8_e4m3fn`` / ``torch.float8_e8m0fnu`` -> float32); E2M1 against the OCP MX table.
Also: no kernel source decodes bits on its own (issue 18: sparse_mla_decode.cu had its own
E4M3/UE8M0 decoder beside lowp_decode.h's)."""

import array
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc_gfx936"
HARNESS = Path(__file__).with_name("lowp_decode_host.hip")
NAN_CODES = {0x7F, 0xFF}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX: s ee m, e == 0 -> m / 2


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits(x: float) -> int:
    """float32 bits of x (rounded once to float32; overflow -> inf)."""
    return int(torch.tensor([x], dtype=torch.float64).float().view(torch.int32).item()) & 0xFFFFFFFF


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    if shutil.which("hipcc") is None:
        pytest.skip("no hipcc on PATH (Debian: apt-get install hipcc); lowp_decode.h host test skipped")
    exe = tmp_path_factory.mktemp("lowp") / "lowp_decode_host"
    build = subprocess.run(
        ["hipcc", "--offload-arch=gfx90a", "-O2", "-std=c++17", f"-I{CSRC}", str(HARNESS),
         "-o", str(exe)], capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"},
        timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=120).stdout
    table: dict[str, dict[tuple[int, int], int]] = {}
    for line in out.splitlines():
        kind, a, b, bits = line.split()
        table.setdefault(kind, {})[(int(a), int(b))] = int(bits, 16)
    return table


def _torch_e4m3() -> list[float]:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()


def _torch_ue8m0() -> list[float]:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).double().tolist()


def test_e4m3_decoder_gives_torchs_value_times_2_pow_minus_120_for_all_256_codes(decoded):
    """decode_e4m3x4 (W8A16): value * 2^-120 exactly, normals and subnormals alike (the latter
    as float32 denormals), in every byte position; the NaN codes give +-480 * 2^-120 (weights
    are checked for NaN at load time, not per element: lowp_decode.h says so)."""
    ref = _torch_e4m3()
    assert len(decoded["e4m3"]) == 256 * 4
    for (code, pos), bits in decoded["e4m3"].items():
        want = (-480.0 if code & 0x80 else 480.0) if code in NAN_CODES else ref[code]
        assert bits == _bits(want * 2.0**-120), (code, pos, hex(bits))


def test_e4m3_nan_decoder_matches_torch_for_all_256_codes(decoded):
    ref = _torch_e4m3()
    for (code, pos), bits in decoded["e4m3nan"].items():
        if code in NAN_CODES:
            assert _f32(bits) != _f32(bits), (code, pos, hex(bits))  # NaN, as torch
        else:
            assert bits == _bits(ref[code] * 2.0**-120), (code, pos, hex(bits))


def test_sparse_mla_decode_path_equals_torch_e4m3_times_ue8m0_for_every_code_pair(decoded):
    """What sparse_mla_decode.cu stages in LDS for a NoPE byte and its group's UE8M0 scale:
    float32(e4m3 * 2^(ue8m0 - 127)) bit for bit as PyTorch computes it (float32 product of the
    two decoded dtypes), NaN wherever torch gives NaN, for all 256 x 256 pairs. This covers
    scales >= 2^8 (ue8m0 > 134), where the kernel's former folded scale overflowed to inf."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ue8m0 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    want = e4m3[:, None] * ue8m0[None, :]  # float32 products, rounded once
    assert len(decoded["mla"]) == 256 * 256
    words = array.array("I", (decoded["mla"][(c, u)] for c in range(256) for u in range(256)))
    got = torch.frombuffer(bytearray(words.tobytes()), dtype=torch.float32).view(256, 256)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    same = torch.isnan(want) | (got.view(torch.int32) == want.view(torch.int32))
    bad = (~same).nonzero().tolist()
    assert not bad, [(c, u, got[c, u].item(), want[c, u].item()) for c, u in bad[:8]]


@pytest.mark.parametrize("extra", [0, 56, 62, 120])
def test_ue8m0_decoder_gives_torchs_power_of_two_times_2_pow_extra(decoded, extra):
    """ue8m0_pow2(u, extra) = 2^(u - 127 + extra) rounded to float32 (inf past float32's range),
    NaN at 255, for the extras the kernels use (dequant 0, W8A16 56, MoE 62, Sparse MLA 120)."""
    ref = _torch_ue8m0()
    for u in range(256):
        bits = decoded["ue8m0"][(u, extra)]
        if u == 255:
            assert _f32(bits) != _f32(bits)
        else:
            assert bits == _bits(ref[u] * 2.0**extra), (u, extra, hex(bits))


def test_e2m1_decoder_gives_the_mx_table_times_2_pow_minus_126(decoded):
    for (code, pos), bits in decoded["e2m1"].items():
        v = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
        assert bits == _bits(v * 2.0**-126), (code, pos, hex(bits))


def test_e2m1_device_path_folds_to_the_mx_table_times_2_pow_minus_126(tmp_path):
    """The HIP device branch of decode_e2m1x8 (one v_perm_b32 per element): hipcc folds it
    with constant inputs, and the folded floats are the OCP table's values times 2^-126 for
    every code at every nibble position (the selectors and operand order as the compiler
    models the instruction; the host test above covers the C fallback)."""
    if shutil.which("hipcc") is None:
        pytest.skip("no hipcc on PATH (Debian: apt-get install hipcc); device-path fold test skipped")
    ll = tmp_path / "fold.ll"
    build = subprocess.run(
        ["hipcc", "--offload-arch=gfx90a", "-O3", "-std=c++17", f"-I{CSRC}", "--cuda-device-only",
         "-emit-llvm", "-S", str(Path(__file__).with_name("lowp_decode_device_fold.hip")),
         "-o", str(ll)], capture_output=True, text=True,
        env={**os.environ, "HIP_PLATFORM": "amd"}, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    ir = ll.read_text()
    assert "llvm.amdgcn.perm" not in ir, "the permutes were not folded: nothing to compare"
    words = [int(v) & 0xFFFFFFFF for v in re.findall(r"store volatile i32 (-?\d+),", ir)]
    assert len(words) == 16 * 8, len(words)
    for i, bits in enumerate(words):
        code = i // 8
        v = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
        assert bits == _bits(v * 2.0**-126), (code, i % 8, hex(bits))


# bit casts turn bits into a float: only the portability and decode headers may do it
_BITCAST = re.compile(r"\b(bits_to_float|__uint_as_float|__int_as_float|__float_as_uint|ldexpf|"
                      r"__builtin_bit_cast|e4m3_top|e2m1_top)\s*\(")


def test_no_kernel_source_decodes_bits_outside_lowp_decode_h():
    """Every kernel (*.cu) decodes E4M3/UE8M0/E2M1 through lowp_decode.h only (issue 18)."""
    sources = sorted(CSRC.glob("*.cu"))
    assert {p.name for p in sources} >= {"sparse_mla_decode.cu", "w8a16_fp8.cu", "moe_mxfp4.cu"}
    for src in sources:
        text = src.read_text()
        hits = [m.group(0) for m in _BITCAST.finditer(text)]
        assert not hits, f"{src.name} decodes bits itself ({hits}); use lowp_decode.h"
        if re.search(r"e4m3|ue8m0|e2m1", text):
            assert '#include "lowp_decode.h"' in text, src.name
