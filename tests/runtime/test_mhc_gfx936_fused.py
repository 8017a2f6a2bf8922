# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936's fused mHC (mhc/gfx936_fused.py: three ops; mhc/gfx936_triton.py: their Triton kernels)
against the torch chain it replaces (mhc/torch.py, the oracle) and a float64 evaluation.

* The CPU implementation of the ops (the twins) composes to ``mhc_pre_torch`` /
  ``mhc_post_torch`` bit for bit, at every split count: the CPU e2e check keeps its numbers.
* The Triton kernels, run here under Triton's CPU interpreter, match float64 math of the same
  formulas within float32 rounding (mixes, Sinkhorn) and one bf16 rounding (layer input, post),
  at a few shapes including a non-power-of-two hc (masked lanes) and H not a multiple of the
  block (masked tail), and split-K partials that sum to the whole.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from triton_interp import triton  # noqa: F401  (skips without triton; sets the interpreter)

from vllm.model_executor.kernels.mhc import gfx936_fused as fused

importlib.import_module("vllm.model_executor.kernels.mhc.torch")
chain = sys.modules["vllm.model_executor.kernels.mhc.torch"]
kern = importlib.import_module("vllm.model_executor.kernels.mhc.gfx936_triton")

# the float64 oracle (same formulas as the chain, evaluated in float64) is the bench's
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from mhc_fused import EPS, POST_MULT, RMS_EPS, SINKHORN, post_f64, pre_f64  # noqa: E402


def _inputs(t, hc, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = hc * (2 + hc)
    residual = (torch.randn(t, hc, h, generator=g) * 3).to(torch.bfloat16)
    fn = torch.randn(n, hc * h, generator=g) * 0.05
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n, generator=g) * 0.5
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    return residual, fn, scale, base, x


def _chain_pre(residual, fn, scale, base):
    return chain.mhc_pre_torch(residual, fn, scale, base, RMS_EPS, EPS, EPS, POST_MULT, SINKHORN)


@pytest.mark.parametrize("t,hc,h,splits", [(1, 4, 256, 1), (5, 4, 96, 4), (3, 3, 64, 2)])
def test_the_twins_compose_to_the_torch_chain_bit_for_bit(t, hc, h, splits):
    residual, fn, scale, base, x = _inputs(t, hc, h)
    mix, sq = fused.mhc_pre_mix_torch(residual, fn, splits)
    assert mix.shape == (t, splits, fused._mix_rows(hc * (2 + hc))) and sq.shape == (t, splits)
    got = fused.mhc_pre_apply_torch(residual, mix, sq, scale, base, RMS_EPS, EPS, EPS, POST_MULT,
                                   SINKHORN)
    want = _chain_pre(residual, fn, scale, base)
    for g, w, name in zip(got, want, ("post_mix", "comb_mix", "layer_input")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("t,hc,h", [(1, 4, 256), (5, 4, 300), (3, 3, 64), (11, 4, 128)])
def test_the_triton_kernels_match_float64_math(t, hc, h):
    residual, fn, scale, base, x = _inputs(t, hc, h, seed=t + h)
    splits = kern.mhc_pre_splits(t, hc * h)
    mix, sq = kern.mhc_pre_mix_triton(residual, fn, splits)
    # the split-K partials sum to the whole GEMV and sum of squares
    xf = residual.double().reshape(t, -1)
    n = hc * (2 + hc)
    torch.testing.assert_close(mix.double().sum(1)[:, :n], xf @ fn.double().t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sq.double().sum(1), (xf * xf).sum(-1), rtol=1e-6, atol=0)
    assert not mix[:, :, n:].any(), "padded mix rows must be zero"

    post, comb, li = kern.mhc_pre_apply_triton(residual, mix, sq, scale, base, RMS_EPS, EPS, EPS,
                                               POST_MULT, SINKHORN)
    post64, comb64, li64 = pre_f64(residual, fn, scale, base)
    torch.testing.assert_close(post.double(), post64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), comb64, rtol=1e-4, atol=1e-6)
    assert li.dtype == torch.bfloat16
    # one bf16 rounding of a float32 sum whose error is float32 noise on the summed magnitudes
    # (the streams cancel). The torch chain rounds to nearest (half an ulp, 2^-8 relative); the
    # interpreter's fp32 -> bf16 cast truncates (a whole ulp, 2^-7), so the kernel gets 2^-7
    # here (on a GPU the cast rounds to nearest: bench/mhc_fused.py checks it there).
    mag = residual.double().abs().sum(1) * 2
    c_post, c_comb, c_li = _chain_pre(residual, fn, scale, base)
    assert ((c_li.double() - li64).abs() <= li64.abs() * 2**-8 + mag * 1e-6).all()
    err = (li.double() - li64).abs()
    assert (err <= li64.abs() * 2**-7 + mag * 1e-6).all(), err.max()

    out = kern.mhc_post_triton_fused(x, residual, post, comb)
    want64 = post_f64(x, residual, post, comb)
    assert out.dtype == torch.bfloat16 and out.shape == residual.shape
    pmag = residual.double().abs().sum(1, keepdim=True) + x.double().abs().unsqueeze(1) * 2
    assert ((out.double() - want64).abs() <= want64.abs() * 2**-7 + pmag * 1e-6).all()
    twin = chain.mhc_post_torch(x, residual, post, comb)
    assert ((twin.double() - want64).abs() <= want64.abs() * 2**-8 + pmag * 1e-6).all()


def test_a_bad_residual_layout_is_named():
    residual, fn, *_ = _inputs(2, 4, 64)
    with pytest.raises(ValueError, match=r"residual must be \[T, hc, H\].*stride"):
        kern.mhc_pre_mix_triton(residual.transpose(1, 2).contiguous().transpose(1, 2), fn, 1)
    with pytest.raises(ValueError, match=r"fn must be float32 \[24, 256\]"):
        fused.mhc_pre_gfx936(residual, fn[:, :128], torch.ones(3), torch.zeros(24),
                             RMS_EPS, EPS, EPS, POST_MULT, SINKHORN)


def test_the_op_and_the_kernel_choose_the_same_split_count():
    """gfx936_fused.py picks the split count without importing triton; the kernel module's
    choice is the one its blocking was written for."""
    for t in (1, 2, 3, 7, 8, 9, 16, 33, 64, 200, 512):
        for k in (1024, 4 * 4096, 4 * 7168, 96):
            assert fused.mhc_pre_splits(t, k) == kern.mhc_pre_splits(t, k), (t, k)


def test_mhc_ops_decide_their_forward_once_at_construction(monkeypatch):
    """MHCPreOp / MHCPostOp: without FP8 conversion the fused ops replace the forward
    upstream picked for the device (forward_hip on gfx936, forward_cpu on the CPU), asked
    once in dispatch_forward; forward_native (a disabled op) and devices with FP8
    conversion keep upstream's choice."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers import mhc
    from vllm.platforms import gfx936_capability as cap

    lacks = [True]
    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: lacks[0])
    for cls, ours in ((mhc.MHCPreOp, fused.mhc_pre_gfx936),
                      (mhc.MHCPostOp, fused.mhc_post_gfx936)):
        op = object.__new__(cls)
        for pick in ("forward_hip", "forward_cpu", "forward_native"):
            monkeypatch.setattr(CustomOp, "dispatch_forward",
                                lambda self, compile_native, pick=pick: getattr(self, pick))
            for lacks[0] in (True, False):
                got = cls.dispatch_forward(op, False)
                want = ours if lacks[0] and pick != "forward_native" else getattr(op, pick)
                assert got == want, (cls.__name__, pick, lacks[0])


def test_mhc_pre_refuses_a_fused_norm_weight():
    """MHCPreOp's norm_weight (a fused RMSNorm) is not what the fused ops compute: named."""
    residual, fn, scale, base, *_ = _inputs(2, 4, 64)
    with pytest.raises(ValueError, match="norm_weight"):
        fused.mhc_pre_gfx936(residual, fn, scale, base, RMS_EPS, EPS, EPS, POST_MULT,
                             SINKHORN, 1, torch.ones(64), 1e-6)
