# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench/sparse_mla_decode.py's roofline arithmetic (FLOPs, FP32 peak, floor)
and its PASS/MISS against the issue's decode targets, checked on hand-derived
values for the DSV4 Flash shapes (no GPU, no staged modules needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "sparse_mla_decode", REPO / "bench" / "sparse_mla_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flops_and_floor_of_c4_b64_h64(bench):
    case = bench.C.Case("c4", 64, 64)  # window 128 + top-k 512 = 640 keys
    assert case.n_main + case.n_extra == 640
    # 64 * 64 * 640 * 2 * (512 + 512) = 5,368,709,120 (QK^T + PV over 512 dims each)
    assert bench.case_flops(case) == 5_368_709_120
    # H200: 132 SMs * 128 lanes * 2 * 1980 MHz = 66.908 TFLOP/s
    peak = bench.fp32_peak_flops(132, 1980)
    assert peak == pytest.approx(66.90816e12)
    # useful bytes: 64 * 640 rows * (584 + 4) + q and out 2 * 64*64*512 * 2 + sink 64*4
    nbytes = case.useful_bytes()
    assert nbytes == 24_084_480 + 8_388_608 + 256
    # at 4 TB/s the bytes take 8.12 us, the FMAs 5.3687e9 / 66.908e12 = 80.24 us
    floor = bench.floor_us(nbytes, bench.case_flops(case), 4e12, peak)
    assert floor == pytest.approx(80.240, abs=1e-3)
    # peak unknown: the bytes alone
    assert bench.floor_us(nbytes, 1e12, 4e12, None) == pytest.approx(8.1183, abs=1e-4)


def test_swa_b64_h64_floor_is_compute_bound_too(bench):
    case = bench.C.Case("swa", 64, 64)
    assert bench.case_flops(case) == 64 * 64 * 128 * 2048 == 1_073_741_824
    fl = bench.floor_us(case.useful_bytes(), bench.case_flops(case), 4e12,
                        bench.fp32_peak_flops(132, 1980))
    assert fl == pytest.approx(16.048, abs=1e-3)


def test_verdict_names_each_missed_target(bench):
    Case = bench.C.Case
    # named target 150 us, 1.6 x 80.24 = 128.4 us, and faster than up-splitk
    assert bench.verdict(Case("c4", 64, 64), 120.0, 80.24, 300.0) == "PASS"
    assert bench.verdict(Case("c4", 64, 64), 140.0, 80.24, 300.0) == "MISS: <= 1.6x floor"
    assert bench.verdict(Case("c4", 64, 64), 160.0, 80.24, 150.0) == (
        "MISS: <= 150 us, <= 1.6x floor, < up-splitk")
    assert bench.verdict(Case("c4", 64, 8), 41.0, 10.0, 50.0) == "MISS: <= 40 us"
    # swa b=64 H=64: 1.6 x 16.05 = 25.7 us is stricter than the named 40 us
    assert bench.verdict(Case("swa", 64, 64), 25.0, 16.05, 60.0) == "PASS"
    assert bench.verdict(Case("swa", 64, 64), 39.0, 16.05, 60.0) == "MISS: <= 1.6x floor"
    # b=1: <= 10 us; H=8 has no floor target
    assert bench.verdict(Case("c128", 1, 8), 11.0, 1.0, 20.0) == "MISS: b=1 <= 10 us"
    # non-DSV4 keys: the named target does not apply
    assert bench.verdict(Case("c4", 64, 64, topk=256), 200.0, None, None) == "-"
    assert bench.verdict(Case("c4", 64, 64), None, 80.0, 1.0) == "n/a"
