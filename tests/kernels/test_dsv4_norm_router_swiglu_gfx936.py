# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decoder layer's RMSNorms, the MoE router and the shared expert's clamped SwiGLU as one
registered op each (issue 19; patches dsv4-rmsnorm-gfx936-one-op,
moe-router-softplus-sqrt-gfx936-one-op, dsv4-shared-expert-swiglu-gfx936-one-op).

For each op, through the product's own entry point (the layer class the model builds, upstream's
router function): the step audit's counter (tests/e2e/step_counter.py) sees exactly one launch and
no host sync; the result is bit-identical to what the CPU computed before (upstream's own PyTorch
form: the IR op's native RMSNorm, ``SiluAndMulWithClamp.forward_native``, the XPU router
twin), checked also against float64 written here; the op has a fake. The new Triton kernel (the
clamped SwiGLU) runs under TRITON_INTERPRET against its twin and float64.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402

BF16_ULP = 2.0**-7  # relative spacing of bf16 near 1 (8 significant bits)


def counted(fn, *args, **kwargs):
    """(result, launches, syncs, ops) of one call under the step audit's counter, with the new
    fused ops' implementations known to it (as in the engine run), so syncs inside count."""
    from vllm.model_executor.layers.fused_moe.router import gfx936_topk_softplus_sqrt as r
    from vllm.models.deepseek_v4.common.ops import gfx936_rmsnorm as n
    from vllm.models.deepseek_v4.common.ops import gfx936_swiglu as s

    return SC.count_call({
        "vllm::gfx936_fused_rms_norm": n._rms_norm,
        "vllm::gfx936_fused_q_kv_rmsnorm": n._q_kv_rmsnorm,
        "vllm::gfx936_fused_topk_softplus_sqrt": r._topk_softplus_sqrt,
        "vllm::gfx936_fused_clamped_swiglu": s._clamped_swiglu,
    }, fn, *args, **kwargs)


@pytest.fixture
def cpu_config():
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


@pytest.fixture
def no_fp8_path(monkeypatch):
    """The no-FP8 path (gfx936, or the CPU engine); this test process has no vLLM platform."""
    import vllm.platforms.gfx936_capability as cap

    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: True)


# ---- RMSNorm: attn_norm / ffn_norm --------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 6])
def test_layer_rmsnorm_is_one_op_and_computes_upstreams_native_rmsnorm(t, cpu_config,
                                                                       no_fp8_path):
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.models.deepseek_v4.common.ops.gfx936_rmsnorm import Gfx936RMSNorm, rms_norm_cls

    h, eps = 256, 1e-6
    assert rms_norm_cls() is Gfx936RMSNorm  # what the decoder layer builds on this path
    g = torch.Generator().manual_seed(t)
    norm, ref = Gfx936RMSNorm(h, eps), RMSNorm(h, eps)
    w = (1 + 0.5 * torch.randn(h, generator=g)).to(torch.bfloat16)
    norm.weight.data = w.clone()
    ref.weight.data = w.clone()
    x = (4 * torch.randn(t, h, generator=g)).to(torch.bfloat16)
    out, launches, syncs, ops = counted(norm, x)
    assert (launches, syncs) == (1, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_rms_norm": 1}
    assert torch.equal(out, ref.forward_native(x))  # what the layer's RMSNorm ran before
    # float64, written here: x / rms rounded to bf16 (as _C.rms_norm does), times w, rounded
    x64 = x.double()
    y = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    want = (y.double() * w.double())
    err = (out.double() - want).abs()
    assert bool((err <= 2 * BF16_ULP * want.abs() + 1e-30).all()), float(err.max())
    fout, _ = SC.fake_call(torch.ops.vllm.gfx936_fused_rms_norm, x, w, eps)
    assert fout.shape == x.shape and fout.dtype == x.dtype


def test_rmsnorm_classes_follow_the_capability(cpu_config, monkeypatch):
    import vllm.platforms.gfx936_capability as cap
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.models.deepseek_v4.common.ops.gfx936_rmsnorm import rms_norm_cls
    from vllm.models.deepseek_v4.common.ops.gfx936_swiglu import swiglu_with_clamp_cls
    from vllm.model_executor.layers.activation import SiluAndMulWithClamp

    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: False)
    assert rms_norm_cls() is RMSNorm
    assert swiglu_with_clamp_cls() is SiluAndMulWithClamp


# ---- RMSNorm: the attention's q / kv pair -------------------------------------------------------
@pytest.mark.parametrize("t", [1, 5])
def test_q_kv_rmsnorm_is_one_op_and_computes_the_twin(t, no_fp8_path):
    from vllm.models.deepseek_v4.amd.gfx936_attention_torch import q_kv_rmsnorm
    from vllm.models.deepseek_v4.common.ops.gfx936_rmsnorm import q_kv_rmsnorm_gfx936

    g = torch.Generator().manual_seed(10 + t)
    qr_kv = (3 * torch.randn(t, 96 + 64, generator=g)).to(torch.bfloat16)
    qr, kv = qr_kv.split([96, 64], dim=-1)  # strided views, as the attention passes them
    qw = (1 + 0.3 * torch.randn(96, generator=g)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    (q_o, kv_o), launches, syncs, ops = counted(q_kv_rmsnorm_gfx936, qr, kv, qw, kw, 1e-6)
    assert (launches, syncs) == (1, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_q_kv_rmsnorm": 1}
    q_t, kv_t = q_kv_rmsnorm(qr, kv, qw, kw, 1e-6)
    assert torch.equal(q_o, q_t) and torch.equal(kv_o, kv_t)
    # float64, written here: float32 throughout in the op, one rounding: within 1 bf16 ulp
    for x, w, o in ((qr, qw, q_o), (kv, kw, kv_o)):
        x64 = x.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        err = (o.double() - want).abs()
        assert bool((err <= BF16_ULP * want.abs() + 1e-30).all()), float(err.max())
    (fq, fkv), _ = SC.fake_call(torch.ops.vllm.gfx936_fused_q_kv_rmsnorm, qr, kv, qw, kw, 1e-6)
    assert fq.shape == qr.shape and fkv.shape == kv.shape and fq.dtype == torch.bfloat16


def test_the_one_rmsnorm_twin_is_the_compressors_norm_bit_for_bit():
    """issue 18: the compressor's window norm now calls the shared twin; it computed
    ``(x * x).sum(-1) / n`` before, which the shared one now writes the same way (and which
    equals the old ``pow(2).mean`` twin on the CPU, bit for bit)."""
    from vllm.models.deepseek_v4.common.ops import gfx936_compressor as comp
    from vllm.models.deepseek_v4.common.ops.gfx936_rmsnorm_torch import rms_norm

    assert comp.rms_norm is rms_norm
    g = torch.Generator().manual_seed(3)
    for d in (128, 512):
        x = 7 * torch.randn(9, d, generator=g)
        w = torch.randn(d, generator=g).to(torch.bfloat16)
        old = x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) / d + 1e-6) * w.float()
        assert torch.equal(rms_norm(x, w, 1e-6), old)
        mean_form = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        assert torch.equal(rms_norm(x, w, 1e-6), mean_form)


# ---- router: sqrt-softplus top-k (biased choice, hash tables) -----------------------------------
def _route_ref64(logits, bias, topk, scale, hash_ids=None):
    """float64, written here: scores = sqrt(softplus(logits)); experts by scores + bias (or the
    hash table), weights = their unbiased scores, renormalized, times the scaling factor."""
    s = torch.sqrt(torch.nn.functional.softplus(logits.double()))
    if hash_ids is None:
        ids = torch.topk(s + bias.double(), topk, dim=-1).indices
    else:
        ids = hash_ids.long()
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scale


@pytest.mark.parametrize("hashed", [False, True])
def test_router_is_one_op_and_computes_the_twin(hashed, monkeypatch):
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as r
    from vllm.model_executor.layers.fused_moe.router import gfx936_topk_softplus_sqrt as g936

    monkeypatch.setattr(g936, "on_no_fp8_path", lambda: True)
    m, e, k, scale = 5, 16, 3, 1.5
    g = torch.Generator().manual_seed(7 + hashed)
    logits = 3 * torch.randn(m, e, generator=g)
    bias = torch.rand(e, generator=g)
    table = torch.randint(0, e, (50, k), generator=g, dtype=torch.int32)
    # distinct experts per token, as a hash table gives
    table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(50)]).int()
    tokens = torch.randint(0, 50, (m,), generator=g, dtype=torch.int32)
    kw = dict(renormalize=True, e_score_correction_bias=bias,
              input_tokens=tokens if hashed else None,
              hash_indices_table=table if hashed else None, routed_scaling_factor=scale)

    def bufs():
        return (torch.empty(m, k), torch.empty(m, k, dtype=torch.int32),
                torch.empty(m, k, dtype=torch.int32))

    (w, ids), launches, syncs, ops = counted(r.vllm_topk_softplus_sqrt, *bufs(), logits, **kw)
    assert (launches, syncs) == (1, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_topk_softplus_sqrt": 1}
    tw, tids = r._topk_softplus_sqrt_torch(*bufs(), logits, **kw)  # the twin, what ran before
    assert torch.equal(w, tw) and torch.equal(ids, tids)
    ids64, w64 = _route_ref64(logits, bias, k, scale, table[tokens] if hashed else None)
    assert torch.equal(ids.long(), ids64)
    assert torch.allclose(w.double(), w64, rtol=1e-6, atol=0)  # float32 math, 3 experts
    out, fargs = SC.fake_call(torch.ops.vllm.gfx936_fused_topk_softplus_sqrt, *bufs(), logits,
                              True, bias, None, None, scale)
    assert out is None and fargs[0].shape == (m, k)  # outputs written in place


# ---- shared expert: clamped SwiGLU ---------------------------------------------------------------
def _swiglu64(x, limit, alpha, beta):
    """float64, written here (no intermediate rounding)."""
    d = x.shape[-1] // 2
    g = x[..., :d].double().clamp(max=limit)
    u = x[..., d:].double().clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (1.702, 1.0)])
def test_shared_expert_swiglu_is_one_op_and_computes_forward_native(alpha, beta, cpu_config,
                                                                    no_fp8_path):
    from vllm.model_executor.layers.activation import SiluAndMulWithClamp
    from vllm.models.deepseek_v4.common.ops.gfx936_swiglu import (
        Gfx936SiluAndMulWithClamp,
        swiglu_with_clamp_cls,
    )

    assert swiglu_with_clamp_cls() is Gfx936SiluAndMulWithClamp  # what the MLP builds here
    act, ref = Gfx936SiluAndMulWithClamp(10.0, alpha, beta), SiluAndMulWithClamp(10.0, alpha, beta)
    g = torch.Generator().manual_seed(int(alpha * 10))
    x = (6 * torch.randn(4, 2 * 96, generator=g)).to(torch.bfloat16)
    out, launches, syncs, ops = counted(act, x)
    assert (launches, syncs) == (1, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_clamped_swiglu": 1}
    assert torch.equal(out, ref.forward_native(x))  # the ROCm/CPU path before, eager
    fout, _ = SC.fake_call(torch.ops.vllm.gfx936_fused_clamped_swiglu, x, 10.0, alpha, beta)
    assert fout.shape == (4, 96) and fout.dtype == torch.bfloat16


@pytest.mark.parametrize("shape,limit,alpha,beta", [
    ((1, 2 * 64), 10.0, 1.0, 0.0),      # decode, DeepSeek V4's limit
    ((7, 2 * 300), 7.0, 1.702, 1.0),    # D not a power of two, gpt-oss-like alpha/beta
    ((3, 5, 2 * 2048), 10.0, 1.0, 0.0),  # leading dims, two column blocks of 1024
])
def test_clamped_swiglu_kernel_matches_the_twin_and_float64(shape, limit, alpha, beta):
    """bf16: the kernel rounds each step as eager PyTorch does (bf16 round to nearest even by
    integer ops, so the interpreter's truncating store does not matter): bitwise equal to the
    twin here; a float32 ``exp`` that differs in its last bits at a rounding boundary could
    move one element by one bf16 ulp on a device, which the 1-ulp bound allows for at most 1 in
    1000 elements. Against float64 (no intermediate rounding): up to seven roundings of 2^-9
    each (relative), so 2^-6 relative, plus 2^-9 of the largest input-scale value for the
    cancellation in ``up + beta`` (absolute)."""
    from vllm.model_executor.layers.fused_moe.clamped_swiglu import clamped_swiglu_stepwise
    from vllm.models.deepseek_v4.common.ops.gfx936_swiglu_triton import clamped_swiglu_triton

    g = torch.Generator().manual_seed(shape[-1])
    x = (8 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    got = clamped_swiglu_triton(x, limit, alpha, beta)
    twin = clamped_swiglu_stepwise(x, limit, alpha, beta)
    assert got.shape == twin.shape and got.dtype == torch.bfloat16
    diff = (got.float() - twin.float()).abs()
    assert bool((diff <= BF16_ULP * twin.float().abs()).all()), float(diff.max())
    assert int((got != twin).sum()) <= got.numel() // 1000
    want = _swiglu64(x, limit, alpha, beta)
    err = (got.double() - want).abs()
    assert bool((err <= 2.0**-6 * want.abs() + 2.0**-9 * limit).all()), float(err.max())
    # float32 input: no rounding between steps; float32 math differs from float64 by ~1e-6
    xf = x.float()
    gotf = clamped_swiglu_triton(xf, limit, alpha, beta)
    assert gotf.dtype == torch.float32
    errf = (gotf.double() - _swiglu64(xf, limit, alpha, beta)).abs()
    assert bool((errf <= 1e-5 * want.abs() + 1e-6).all()), float(errf.max())


def test_clamped_swiglu_kernel_keeps_nan_as_the_twin_does():
    """Review P2 (s8): ``tl.minimum``/``tl.maximum`` return the non-NaN operand, so a NaN gate
    left as +limit and a NaN up as -limit: a finite value where the twin (``torch.clamp``, as
    upstream's ``forward_native``) gives NaN, hiding the failure the port saw at batch >= 8."""
    from vllm.model_executor.layers.fused_moe.clamped_swiglu import clamped_swiglu_stepwise
    from vllm.models.deepseek_v4.common.ops.gfx936_swiglu_triton import clamped_swiglu_triton

    nan = float("nan")
    d = 8
    x = torch.ones(4, 2 * d)
    x[0, 1] = nan           # gate
    x[1, d + 2] = nan       # up
    x[2, 3] = -nan          # gate, sign bit set
    x[3, d + 5] = float("inf")  # up clamps to +limit: finite, as the twin
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        got = clamped_swiglu_triton(xd, 10.0, 1.0, 0.0)
        twin = clamped_swiglu_stepwise(xd, 10.0, 1.0, 0.0)
        assert torch.equal(torch.isnan(got), torch.isnan(twin)), (dtype, got, twin)
        assert int(torch.isnan(twin).sum()) == 3, twin
        fin = ~torch.isnan(twin)
        assert torch.equal(got[fin], twin[fin]), dtype


def test_clamped_swiglu_kernel_names_bad_input():
    from vllm.models.deepseek_v4.common.ops.gfx936_swiglu_triton import clamped_swiglu_triton

    with pytest.raises(ValueError, match="x is torch.float16"):
        clamped_swiglu_triton(torch.zeros(2, 8, dtype=torch.float16), 10.0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"last dim of x \(2, 7\) must be even"):
        clamped_swiglu_triton(torch.zeros(2, 7, dtype=torch.bfloat16), 10.0, 1.0, 0.0)
