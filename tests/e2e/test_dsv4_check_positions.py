"""The check's `positions` family (tests/e2e/dsv4_check.py) on hand-made hidden states (fast: no
engine, no oracle run): a bug confined to one position passes the mean bound of `layers` and fails
the worst-position bound; MoE outputs are not bounded by position.

Reference: per-token relative errors set by construction. The float32 "oracle" row is the unit
vector e0; the floor (vLLM-dtype oracle) and the engine add a multiple of e1 to it, so a token's
relative error is that multiple, exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.e2e import dsv4_check as C

T, PLEN, D = 40, 30, 8  # 30 prompt tokens (29 compared), 10 decode positions
CFG = {"compress_ratios": [4]}


def _hidden(err: list[float]) -> torch.Tensor:
    h = torch.zeros(T, D, dtype=torch.float64)
    h[:, 0] = 1.0
    h[:, 1] = torch.tensor(err, dtype=torch.float64)
    return h


def _report(engine_err: dict, floor_err: list[float]) -> list[dict]:
    oracle = C.OracleRun(hidden=[{n: _hidden([0.0] * T) for n in engine_err}],
                         hidden_v=[{n: _hidden(floor_err) for n in engine_err}])
    return C.layer_report({n: [_hidden(e)] for n, e in engine_err.items()}, oracle, [PLEN], CFG)


def _row(rows, name, phase):
    (r,) = [r for r in rows if r["name"] == name and r["phase"] == phase]
    return r


def test_one_bad_position_passes_the_mean_and_fails_the_worst_position_bound():
    floor = [0.01] * T
    floor[12] = 0.02  # the floor's own worst prefill position
    engine = [0.008] * T
    engine[7] = 0.08  # one position 8x the floor's worst, as the combine's count bug does
    rows = _report({"attn.0": engine}, floor)
    r = _row(rows, "attn.0", "prefill")
    # hand-derived: means over positions 1..29, maxima 0.08 (at 7) and 0.02
    assert r["engine"] == pytest.approx((28 * 0.008 + 0.08) / 29)
    assert r["floor"] == pytest.approx((28 * 0.01 + 0.02) / 29)
    assert r["max_ratio"] == pytest.approx(4.0) and r["worst_pos"] == 7
    assert r["ratio"] < C.LAYER_FACTOR["attn"]
    C.check_layers(rows)  # the mean bound does not see it
    with pytest.raises(C.CheckFailed) as e:
        C.check_positions(rows)
    assert e.value.check == "positions" and "attn.0" in str(e.value) and "position 7" in str(e.value)


def test_decode_positions_are_bounded_by_the_floors_decode_worst():
    floor = [0.01] * T
    floor[5] = 0.5  # a large prefill error of the floor must not excuse decode
    engine = [0.01] * T
    engine[PLEN + 3] = 0.01 * (C.POSITION_FACTOR + 0.5)
    rows = _report({"attn.0": engine}, floor)
    assert _row(rows, "attn.0", "decode")["worst_pos"] == PLEN + 3
    with pytest.raises(C.CheckFailed, match="decode position 33"):
        C.check_positions(rows)
    engine[PLEN + 3] = 0.01 * (C.POSITION_FACTOR - 0.5)
    C.check_positions(_report({"attn.0": engine}, floor))


def test_moe_and_layer_stream_spikes_are_left_to_the_mean_bound():
    floor = [0.01] * T
    engine = [0.008] * T
    engine[9] = 0.1  # a router flip: one token 10x the floor's worst, the mean 1.12x
    rows = _report({"ffn.0": engine, "layer.0": engine}, floor)
    C.check_positions(rows)
    C.check_layers(rows)
