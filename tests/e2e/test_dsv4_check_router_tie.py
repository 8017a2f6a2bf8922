"""The check's `layers` family (tests/e2e/dsv4_check.py) at a router near-tie, on hand-made
hidden states (fast: no engine, no oracle run). A token whose top-k router choice is a certified
near-tie may route to the other expert in any implementation in vLLM's dtypes; one such flipped
token in an MoE row is set aside, nothing else is.

Reference: per-token relative errors and router margins set by construction (the float32
"oracle" row is the unit vector e0, the floor and the engine add a multiple of e1, so a token's
relative error is that multiple exactly).
"""
from __future__ import annotations

import pytest
import torch

from tests.e2e import dsv4_check as C

T, PLEN, D = 46, 30, 8  # 29 prefill positions compared, 16 decode positions (the suite's window)
CFG = {"compress_ratios": [4]}
FLIP = 0.70  # a flipped expert: O(1) relative error (measured 0.70 at the near-tie that broke CI)


def _hidden(err) -> torch.Tensor:
    h = torch.zeros(T, D, dtype=torch.float64)
    h[:, 0] = 1.0
    h[:, 1] = torch.tensor(err, dtype=torch.float64)
    return h


def _report(name: str, engine_err, margin, margin_v) -> list[dict]:
    floor = [0.02] * T
    oracle = C.OracleRun(hidden=[{name: _hidden([0.0] * T)}], hidden_v=[{name: _hidden(floor)}],
                         router=[{0: torch.tensor(margin)}], router_v=[{0: torch.tensor(margin_v)}])
    return C.layer_report({name: [_hidden(engine_err)]}, oracle, [PLEN], CFG)


def _decode(rows):
    (r,) = [r for r in rows if r["phase"] == "decode"]
    return r


def _flip_at(*ts):
    e = [0.015] * T
    for t in ts:
        e[t] = FLIP
    return e


MARGIN = [0.5] * T  # every token decided by a wide gap ...
TIE_AT = PLEN + 9
MARGIN_TIE = list(MARGIN)
MARGIN_TIE[TIE_AT] = 0.01  # ... but one, whose gap the vLLM-dtype oracle moves by 0.024
MARGIN_TIE_V = list(MARGIN)
MARGIN_TIE_V[TIE_AT] = 0.034


def test_one_flip_at_a_certified_router_near_tie_is_set_aside():
    rows = _report("ffn.0", _flip_at(TIE_AT), MARGIN_TIE, MARGIN_TIE_V)
    r = _decode(rows)
    assert r["router_exception"] == TIE_AT
    assert r["engine"] == pytest.approx(0.015)  # the mean of the other 15 decode positions
    assert r["engine_max"] == pytest.approx(FLIP)  # still reported
    C.check_layers(rows)


def test_the_same_flip_where_the_router_gap_is_wide_fails():
    """A gap the vLLM-dtype oracle does not close: the flip is a bug, not a tie."""
    rows = _report("ffn.0", _flip_at(TIE_AT), MARGIN, MARGIN)
    assert _decode(rows)["router_exception"] is None
    # hand-derived: (15 x 0.015 + 0.70) / 16 = 0.0578 = 2.89x the floor's 0.02 > 2.0
    assert _decode(rows)["ratio"] == pytest.approx((15 * 0.015 + FLIP) / 16 / 0.02)
    with pytest.raises(C.CheckFailed) as e:
        C.check_layers(rows)
    assert e.value.check == "layers" and "ffn.0" in str(e.value)


def test_only_one_token_per_row_is_set_aside():
    """Two flips at two certified near-ties: the worst is set aside, the other still counts."""
    m, mv = list(MARGIN_TIE), list(MARGIN_TIE_V)
    m[PLEN + 2], mv[PLEN + 2] = 0.01, 0.034
    rows = _report("ffn.0", _flip_at(TIE_AT, PLEN + 2), m, mv)
    r = _decode(rows)
    assert r["router_exception"] in (TIE_AT, PLEN + 2)
    assert r["engine"] == pytest.approx((14 * 0.015 + FLIP) / 15)
    with pytest.raises(C.CheckFailed):
        C.check_layers(rows)


def test_attention_rows_set_nothing_aside():
    rows = _report("attn.0", _flip_at(TIE_AT), MARGIN_TIE, MARGIN_TIE_V)
    assert _decode(rows)["router_exception"] is None
    with pytest.raises(C.CheckFailed):
        C.check_layers(rows)
