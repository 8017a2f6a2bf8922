# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Precision compare tools (seed 15.3) on synthetic tensors with a known
cosine: b = cos(t) * a/|a| + sin(t) * u with u a unit vector orthogonal to a,
so cosine(a, b) = cos(t) exactly (up to float rounding, tolerance 1e-6 for
float32 storage, computed in float64)."""

import math
from unittest import mock

import pytest
import torch

from dcu_kit import compare as cmp


def _with_cosine(a: torch.Tensor, cos_t: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = a.reshape(-1).to(torch.float64)
    x = x / x.norm()
    r = torch.randn(x.numel(), generator=g, dtype=torch.float64)
    u = r - torch.dot(r, x) * x
    u = u / u.norm()
    b = cos_t * x + math.sqrt(1 - cos_t**2) * u
    return b.reshape(a.shape).to(torch.float32)


@pytest.mark.parametrize("cos_t", [1.0, 0.999, 0.9, 0.5, 0.0, -0.3])
def test_cosine_matches_constructed_angle(cos_t):
    a = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    b = _with_cosine(a, cos_t, seed=2)
    cos, mx = cmp.cosine_and_max_abs(a, b)
    assert cos == pytest.approx(cos_t, abs=1e-6)
    ref_max = (a.double() - b.double()).abs().max().item()
    assert mx == pytest.approx(ref_max, rel=1e-12)


def test_non_finite_and_zero_edge_cases():
    a = torch.ones(4)
    nan = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    assert math.isnan(cmp.cosine_and_max_abs(a, nan)[0])
    assert cmp.cosine_and_max_abs(torch.zeros(3), torch.zeros(3))[0] == 1.0
    assert cmp.cosine_and_max_abs(torch.zeros(3), torch.ones(3))[0] == 0.0
    with pytest.raises(ValueError, match="shape mismatch"):
        cmp.cosine_and_max_abs(torch.ones(3), torch.ones(4))


def test_dump_roundtrip_and_first_divergent_layer_is_named(tmp_path):
    g = torch.Generator().manual_seed(0)
    ref = {f"layers.{i}.out0": torch.randn(11, 32, generator=g) for i in range(6)}
    run = {k: v.clone() for k, v in ref.items()}
    run["layers.3.out0"] = _with_cosine(ref["layers.3.out0"], 0.95, seed=5)
    run["layers.4.out0"] = _with_cosine(ref["layers.4.out0"], 0.5, seed=6)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    lps = torch.tensor([[-0.1, -1.0, -2.0, -3.0], [-0.2, -1.5, -2.5, -3.5]])
    cmp.save_dump(str(tmp_path / "ref.st"), ref, ids, lps, torch.tensor([5, 9]),
                  {"model": "synthetic"})
    run_ids = torch.tensor([[5, 6, 7, 99], [10, 9, 11, 12]])
    cmp.save_dump(str(tmp_path / "run.st"), run, run_ids, lps, torch.tensor([5, 10]))
    rep = cmp.compare_dumps(cmp.load_dump(str(tmp_path / "run.st")),
                            cmp.load_dump(str(tmp_path / "ref.st")),
                            min_cosine=0.99)
    assert [d.key for d in rep.hidden] == [f"layers.{i}.out0" for i in range(6)]
    cos = {d.key: d.cosine for d in rep.hidden}
    assert cos["layers.0.out0"] == pytest.approx(1.0, abs=1e-9)
    assert cos["layers.3.out0"] == pytest.approx(0.95, abs=1e-6)
    assert cos["layers.4.out0"] == pytest.approx(0.5, abs=1e-6)
    assert rep.first_bad.key == "layers.3.out0" and not rep.ok
    assert rep.topk.overlap == [0.75, 1.0]
    assert rep.topk.argmax_agree == [True, False]
    assert rep.topk.first_token_divergence == 1
    text = rep.format()
    assert "FIRST_DIVERGENT_LAYER: layers.3.out0" in text
    assert "COMPARE_VERDICT: DIVERGED" in text
    assert cmp.main(["diff", str(tmp_path / "ref.st"), str(tmp_path / "ref.st")]) == 0
    assert cmp.main(["diff", str(tmp_path / "run.st"), str(tmp_path / "ref.st")]) == 1


def test_shape_mismatch_is_a_failure_not_a_crash():
    rep = cmp.compare_dumps({"layers.0.out0": torch.ones(3, 4)},
                            {"layers.0.out0": torch.ones(4, 4)})
    assert not rep.ok and "SHAPE MISMATCH" in rep.format()


class _Layer(torch.nn.Module):
    """Returns (hidden, residual) like vLLM decoder layers."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale, x + 1


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(2.0), _Layer(3.0)])


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Inner()

    def forward(self, x):
        for layer in self.model.layers:
            x, _ = layer(x)
        return x


def test_recorder_ignores_warmup_until_armed_and_filters_token_count():
    """Seed J14: a one-shot probe was eaten by warmup. The recorder records
    nothing until armed, and skips calls whose token count differs."""
    m = _Model()
    rec = cmp.HiddenStateRecorder(m, match_num_tokens=5)
    m(torch.ones(8, 4))  # warmup / dummy batch before arming
    assert rec.records == {}
    rec.arm()
    m(torch.ones(8, 4))  # dummy-sized batch after arming: filtered
    assert rec.records == {}
    x = torch.arange(20.0).reshape(5, 4)
    m(x)
    m(x + 100)  # later calls (decode) do not overwrite: max one call
    assert set(rec.records) == {"layers.0.out0", "layers.0.out1",
                                "layers.1.out0", "layers.1.out1"}
    torch.testing.assert_close(rec.records["layers.0.out0"], x * 2)
    torch.testing.assert_close(rec.records["layers.1.out0"], x * 6)
    torch.testing.assert_close(rec.records["layers.1.out1"], x * 2 + 1)
    rec.remove()


def test_topk_from_vllm_logprobs_keeps_k_best():
    class LP:
        def __init__(self, v):
            self.logprob = v

    steps = [{3: LP(-0.1), 4: LP(-2.0), 9: LP(-5.0)}, {7: LP(-0.3)}]
    ids, lps = cmp.topk_from_vllm_logprobs(steps, k=2)
    assert ids.tolist() == [[3, 4], [7, -1]]
    assert lps[0].tolist() == pytest.approx([-0.1, -2.0])


def _run_pair(decode_a, decode_b, tokens_a, tokens_b, steps=3):
    """Two dumps with the same prefill and per-step decode tensors."""
    g = torch.Generator().manual_seed(7)
    ref = {f"layers.{i}.out0": torch.randn(9, 16, generator=g) for i in range(3)}
    a, b = dict(ref), {k: v.clone() for k, v in ref.items()}
    for s in range(1, steps + 1):
        for i in range(3):
            x = torch.randn(1, 16, generator=g)
            a[f"layers.{i}.out0.decode{s}"] = x
            b[f"layers.{i}.out0.decode{s}"] = (
                _with_cosine(x, decode_b, seed=s) if (s, i) == decode_a else x)
    if tokens_a is not None:
        a["tokens"] = torch.tensor(tokens_a)
    if tokens_b is not None:
        b["tokens"] = torch.tensor(tokens_b)
    return a, b


def test_identical_prefill_and_decode_match():
    a, b = _run_pair(None, 1.0, [5, 6, 7, 8], [5, 6, 7, 8])
    rep = cmp.compare_dumps(a, b)
    assert rep.ok, rep.format()
    assert "FIRST_DIVERGENT_TOKEN: none" in rep.format()
    assert "COMPARE_VERDICT: MATCH" in rep.format()


def test_token_divergence_in_decode_fails_even_with_matching_prefill():
    """The false MATCH of issue #11: only prefill was dumped and compared, so
    a decode that went to BOS from step 1 (the seed's J08) still matched."""
    a, b = _run_pair(None, 1.0, [32, 0, 0, 0], [32, 9790, 303, 70037])
    rep = cmp.compare_dumps(a, b)
    assert all(d.cosine == pytest.approx(1.0) for d in rep.hidden)
    assert not rep.ok
    text = rep.format()
    assert "FIRST_DIVERGENT_TOKEN: step 1: A=0 B=9790" in text
    assert "COMPARE_VERDICT: DIVERGED" in text


def test_decode_step_hidden_state_divergence_is_named():
    a, b = _run_pair((2, 1), 0.3, [5, 6, 7, 8], [5, 6, 7, 8])
    rep = cmp.compare_dumps(a, b)
    assert rep.first_bad.key == "layers.1.out0.decode2"
    keys = [d.key for d in rep.hidden]
    # prefill of every layer first, then decode step 1, step 2, ...
    assert keys[:4] == ["layers.0.out0", "layers.1.out0", "layers.2.out0",
                        "layers.0.out0.decode1"]
    assert not rep.ok


@pytest.mark.parametrize("what", ["tokens_a", "tokens_b", "decode_only_in_a",
                                  "nothing_in_common"])
def test_incomplete_dumps_never_match(what):
    a, b = _run_pair(None, 1.0, [5, 6, 7, 8], [5, 6, 7, 8])
    if what == "tokens_a":
        del a["tokens"]
    elif what == "tokens_b":
        del b["tokens"]
    elif what == "decode_only_in_a":
        for k in [k for k in b if ".decode3" in k]:
            del b[k]
    else:
        a = {"tokens": a["tokens"]}
    rep = cmp.compare_dumps(a, b)
    assert not rep.ok and rep.problems
    assert "COMPARE_VERDICT: DIVERGED" in rep.format()


def test_length_difference_is_a_token_divergence():
    a, b = _run_pair(None, 1.0, [5, 6, 7, 8], [5, 6, 7])
    assert cmp.compare_dumps(a, b).token_divergence == (3, 8, None)


def test_recorder_records_decode_steps_after_the_prefill():
    m = _Model()
    rec = cmp.HiddenStateRecorder(m, match_num_tokens=5, decode_steps=2)
    rec.arm()
    m(torch.ones(8, 4))  # dummy batch: ignored
    x = torch.arange(20.0).reshape(5, 4)
    m(x)  # prefill
    d1, d2, d3 = torch.full((1, 4), 1.0), torch.full((1, 4), 2.0), torch.full(
        (1, 4), 3.0)
    m(d1)
    m(d2)
    m(d3)  # beyond decode_steps
    torch.testing.assert_close(rec.records["layers.0.out0"], x * 2)
    torch.testing.assert_close(rec.records["layers.0.out0.decode1"], d1 * 2)
    torch.testing.assert_close(rec.records["layers.1.out0.decode2"], d2 * 6)
    assert not any("decode3" in k for k in rec.records)


def test_dump_runs_eager_by_default_so_decode_hooks_fire():
    """Regression (issue #17 review, item 9): `compare dump` never set enforce_eager, so under
    CUDA/HIP graphs the decode steps replay without Python and the layer hooks record prefill
    only. Eager is the default; --no-enforce-eager turns it off."""
    def kw(*extra):
        with mock.patch.object(cmp, "dump_with_vllm", return_value=0) as f:
            cmp.main(["dump", "--model", "/m", "--out", "/o", *extra])
        return cmp.dump_engine_kwargs(f.call_args.args[0])
    assert kw()["enforce_eager"] is True
    assert kw("--no-enforce-eager")["enforce_eager"] is False
    assert kw("--enforce-eager")["enforce_eager"] is True
