# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek V4's HC head and routed-experts MoE PyTorch twins against
independent float64 references.

* ``mhc.torch.hc_head_torch`` vs float64 math of
  ``mhc.triton.hc_head_reduce_triton_kernel`` (weight-free RMSNorm of the
  flattened [hc_mult * hidden] row rounded to the input dtype, mixes =
  normed @ fn.T, pre = sigmoid(mixes * scale + base) + eps,
  out = sum_i pre_i * x_i), and upstream's Triton implementation run under the
  interpreter as a second implementation.
* ``gfx936_routed_moe_torch.routed_experts_moe_torch`` vs a dense float64
  evaluation of every token with its top-k experts.
"""

import importlib
import importlib.util
import math
import os
import sys

import pytest
import torch
from triton_interp import tl, triton

import vllm.model_executor.kernels.mhc as _mhc_pkg
from vllm.model_executor.layers.fused_moe.experts import (
    gfx936_routed_moe_torch as moe_twin,
)

# (the package's ``torch`` attribute is the torch library, so take the
# submodule from sys.modules)
importlib.import_module("vllm.model_executor.kernels.mhc.torch")
mhc_twin = sys.modules["vllm.model_executor.kernels.mhc.torch"]


def _load_upstream_mhc_triton():
    """Load mhc/triton.py under a private name with the real triton, without
    registering its custom op again (the product import already did)."""
    import vllm.triton_utils as vtu
    import vllm.utils.torch_utils as vtorch

    path = os.path.join(os.path.dirname(_mhc_pkg.__file__), "triton.py")
    spec = importlib.util.spec_from_file_location("_upstream_mhc_triton", path)
    mod = importlib.util.module_from_spec(spec)
    saved = (vtu.triton, vtu.tl, vtorch.direct_register_custom_op)
    vtu.triton, vtu.tl = triton, tl
    vtorch.direct_register_custom_op = lambda *a, **k: None
    try:
        spec.loader.exec_module(mod)
    finally:
        vtu.triton, vtu.tl, vtorch.direct_register_custom_op = saved
    sys.modules.pop("_upstream_mhc_triton", None)
    return mod


_mhc_up = _load_upstream_mhc_triton()


# ------------------------------------------------------------------ HC head

def _hc_inputs(seed, T=5, hc=4, H=96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, hc, H, generator=g) * 2).to(dtype)
    x[1] *= 40  # a large-magnitude token (RMSNorm must rescale it)
    fn = torch.randn(hc, hc * H, generator=g) / math.sqrt(hc * H)
    scale = torch.tensor([0.7])
    base = torch.randn(hc, generator=g)
    return x, fn, scale, base, 1e-6, 1e-2


def _hc_ref(x, fn, scale, base, eps, hc_eps):
    """float64 HC head; the RMSNorm output is rounded to x's dtype as
    upstream's rmsnorm_nw returns the input dtype."""
    T, hc, H = x.shape
    xd = x.to(torch.float64)
    flat = xd.reshape(T, hc * H)
    normed = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.to(x.dtype).to(torch.float64)
    mixes = normed @ fn.to(torch.float64).T
    pre = torch.sigmoid(mixes * scale.double() + base.double()) + hc_eps
    return (pre.unsqueeze(-1) * xd).sum(1), pre


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_head_matches_float64(dtype):
    x, fn, scale, base, eps, hc_eps = _hc_inputs(1, dtype=dtype)
    out = mhc_twin.hc_head_torch(x.view(1, *x.shape), fn, scale, base, eps, hc_eps)
    assert out.shape == (1, x.shape[0], x.shape[2]) and out.dtype == dtype
    ref, pre = _hc_ref(x, fn, scale, base, eps, hc_eps)
    mag = (pre.unsqueeze(-1) * x.double().abs()).sum(1)
    # Tolerance: output rounding (half ulp: 2^-8 relative in bf16, 2^-24 in
    # fp32); the float32 RMSNorm may land one ulp off the float64 one before
    # its rounding to x's dtype, which moves each mix by <= 2^-8 relative in
    # bf16 and so pre by <= 2^-8 * |mix| * scale/4 -> bounded by 2^-8 * mag;
    # float32 accumulation adds ~1e-6 * mag.
    out_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    mix_err = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    err = (out[0].double() - ref).abs()
    assert (err <= out_ulp * ref.abs() + mix_err * mag + 1e-6).all(), float(err.max())


def test_hc_head_matches_upstream_triton_interpreted():
    x, fn, scale, base, eps, hc_eps = _hc_inputs(2)
    out = mhc_twin.hc_head_torch(x, fn, scale, base, eps, hc_eps)
    out_up = torch.empty(x.shape[0], x.shape[2], dtype=torch.bfloat16)
    _mhc_up.hc_head_reduce_triton_kernel(x, fn, scale, base, out_up, eps, hc_eps)
    # Tolerance: the interpreter's fp32->bf16 stores truncate (round toward
    # zero) instead of RNE, both for rmsnorm_nw's bf16 output and for the
    # final store, so upstream-under-interpreter is up to ~1 bf16 ulp
    # (2^-7 relative) off the twin, plus the mixes' shift from the truncated
    # norm (<= 2^-7 * mag, see test_hc_head_matches_float64).
    ref, pre = _hc_ref(x, fn, scale, base, eps, hc_eps)
    mag = (pre.unsqueeze(-1) * x.double().abs()).sum(1)
    err = (out.double() - out_up.double()).abs()
    assert (err <= 2.0**-7 * ref.abs() + 2.0**-7 * mag).all()
    # and upstream itself is near the float64 reference (sanity of the oracle)
    assert ((out_up.double() - ref).abs() <= 2.0**-6 * mag + 1e-6).all()


# ------------------------------------------------------------ routed MoE

LIMIT = 7.0


def _clamped_swiglu(out, h):
    """Clamped SwiGLU callback: gate = h[:, :N] (<= limit), up = h[:, N:]
    (|up| <= limit), out = silu(gate) * up."""
    n = out.shape[1]
    gate = h[:, :n].to(torch.float32).clamp(max=LIMIT)
    up = h[:, n:].to(torch.float32).clamp(-LIMIT, LIMIT)
    out.copy_((gate * torch.sigmoid(gate) * up).to(out.dtype))


def _swiglu64(h):
    n = h.shape[-1] // 2
    gate = h[..., :n].clamp(max=LIMIT)
    up = h[..., n:].clamp(-LIMIT, LIMIT)
    return gate * torch.sigmoid(gate) * up


def _moe_case(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    M, K, N, E_global = 9, 48, 24, 8
    # This rank holds global experts 1, 3, 4, 6 (local 0..3); local 3
    # (global 6) is routed by no token.
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 3, 4, 6])] = torch.arange(4, dtype=torch.int32)
    w1 = torch.randn(4, 2 * N, K, generator=g) * 0.6
    w2 = torch.randn(4, K, N, generator=g) * 0.3
    x = (torch.randn(M, K, generator=g) * 1.5).to(dtype)
    ids = torch.tensor([
        [1, 3, 0],   # 0: another rank's expert (global 0) ignored
        [4, 4, 1],   # repeated expert
        [0, 2, 5],   # nothing on this rank -> zero row
        [3, 1, 4],
        [1, 1, 1],   # one expert three times
        [7, 3, 2],
        [4, 0, 3],
        [1, 4, 3],
        [5, 5, 4],
    ], dtype=torch.int32)
    tw = torch.rand(M, 3, generator=g) + 0.1
    return x, w1, w2, ids, tw, expert_map


def _moe_ref(x, w1, w2, ids, tw, expert_map, on_input):
    """Dense float64: every token, each of its top-k experts."""
    xd = x.to(torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(expert_map[int(ids[m, k])]) if expert_map is not None else int(
                ids[m, k])
            if e < 0:
                continue
            w = float(tw[m, k])
            xi = xd[m] * w if on_input else xd[m]
            h = w1[e].double() @ xi
            y = w2[e].double() @ _swiglu64(h)
            out[m] += y if on_input else w * y
            mag[m] += (w2[e].double().abs() @ _swiglu64(h).abs()) * (1 if on_input else w)
    return out, mag


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_moe_matches_dense_float64(on_input, dtype):
    x, w1, w2, ids, tw, emap = _moe_case(5, dtype)
    calls1, calls2 = [], []

    def dq1(e):
        calls1.append(e)
        return w1[e].to(dtype)

    def dq2(e):
        calls2.append(e)
        return w2[e].to(dtype)

    out = torch.full(x.shape, 99.0, dtype=dtype)
    moe_twin.routed_experts_moe_torch(out, x, dq1, dq2, tw, ids, emap, on_input, _clamped_swiglu,
                                      num_experts=4)
    # Only routed local experts are decoded, each at least once; local 3 never. The loop has
    # min(local experts, routed pairs) = 4 slots (fixed shapes, issue 19): one empty slot
    # decodes a routed expert again and adds nothing.
    for calls in (calls1, calls2):
        got = [int(e) for e in calls]
        assert len(got) == 4 and set(got) == {0, 1, 2}, got
    ref, mag = _moe_ref(x, w1.to(dtype), w2.to(dtype), ids, tw, emap, on_input)
    assert (out[2] == 0).all()  # no expert on this rank
    # Tolerance, relative to the magnitude sum sum_k |w_k| |W2| |a| + |ref|:
    # fp32 -> float32 GEMM rounding, 2e-6 (measured <= 2.2e-7); bf16 -> the
    # two GEMM outputs, the activation and the weighted input each round to
    # bf16 (2^-8 relative each, a few in a row) -> 2^-7 (measured <= 2^-9.6).
    tol = 2e-6 if dtype == torch.float32 else 2.0**-7
    err = (out.double() - ref).abs()
    assert (err <= tol * (mag + ref.abs()) + 1e-6).all(), float(err.max())


def test_routed_moe_without_expert_map():
    x, w1, w2, ids, tw, _ = _moe_case(6, torch.float32)
    ids = ids % 4  # global == local ids
    out = torch.empty(x.shape)
    moe_twin.routed_experts_moe_torch(out, x, lambda e: w1[e], lambda e: w2[e], tw, ids, None,
                             False, _clamped_swiglu)
    ref, mag = _moe_ref(x, w1, w2, ids, tw, None, False)
    assert ((out.double() - ref).abs() <= 2e-6 * (mag + ref.abs()) + 1e-6).all()
    # the clamp was active somewhere (the callback's limit matters)
    h = torch.einsum("mk,enk->men", x.double(), w1.double())
    assert (h.abs() > LIMIT).any()
