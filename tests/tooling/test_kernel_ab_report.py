# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench/kernel_ab.py on CPU-only CI: the A/B table's arithmetic (rounds averaged per
build, new / base, the spread of the rounds, upstream's yardstick) against hand-derived
values, and its argument errors. The timing children need a GPU (make bench-ab)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import load_bench

REPO = Path(__file__).resolve().parents[2]


def _row(part, case, path, us):
    return {"part": part, "case": case, "path": path, "us": us}


def test_report_averages_rounds_and_ratios():
    ab = load_bench("kernel_ab")
    runs = [("base", [_row("smla", "c4 b=1", "kernel", 20.0),
                      _row("smla", "c4 b=1", "up-splitk", 15.0),
                      _row("moe", "TP8 M=1", "kernel", 14.0)]),
            ("new", [_row("smla", "c4 b=1", "kernel", 12.0),
                     _row("moe", "TP8 M=1", "kernel", None)]),
            ("base", [_row("smla", "c4 b=1", "kernel", 22.0),
                      _row("moe", "TP8 M=1", "kernel", 14.0)]),
            ("new", [_row("smla", "c4 b=1", "kernel", 12.0),
                     _row("moe", "TP8 M=1", "kernel", 7.0)])]
    table = ab.merge(runs)
    assert table[("smla", "c4 b=1", "kernel")] == {"base": [20.0, 22.0], "new": [12.0, 12.0]}
    text = ab.report(table, {})
    # base mean 21, new 12: 12 / 21 = 0.571; base rounds 20, 22 are 1/21 = 4.8% off the mean;
    # upstream 15 / new 12 = 1.25
    assert "| c4 b=1 | 21.00 | 12.00 | 0.571 | 4.8% | 15.00 | 1.250 |" in text
    # a failed capture (None) is left out of the mean, one new round left: no new spread
    assert "| TP8 M=1 | 14.00 | 7.00 | 0.500 | 0.0% |" in text
    # upstream's rows are the yardstick column, not rows of their own
    assert "| up-splitk |" not in text and "c4 b=1 | 15.00 |" not in text


def test_report_missing_side_is_a_dash():
    ab = load_bench("kernel_ab")
    text = ab.report(ab.merge([("base", [_row("dense", "wq_b M=1", "kernel", 3.0)])]), {})
    assert "| wq_b M=1 | 3.00 | - | - | - |" in text


@pytest.mark.parametrize("argv, msg", [
    (["--lib", "x.so"], "--base-lib is required"),
    (["--lib", "x.so", "--base-lib", "y.so", "--parts", "smla,mla"], "unknown ['mla']"),
    (["--lib", "x.so", "--base-lib", "y.so", "--rounds", "0"], "--rounds 0"),
])
def test_bad_arguments_name_the_fault(argv, msg):
    p = subprocess.run(["python3", str(REPO / "bench" / "kernel_ab.py"), *argv],
                       capture_output=True, text=True)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_missing_library_is_named(tmp_path):
    p = subprocess.run(["python3", str(REPO / "bench" / "kernel_ab.py"), "--lib",
                        str(tmp_path / "new.so"), "--base-lib", str(tmp_path / "base.so")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "base.so missing" in p.stderr, p.stderr
