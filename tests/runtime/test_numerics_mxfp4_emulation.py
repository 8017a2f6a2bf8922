# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MXFP4 MoE emulation on gfx936: torch dequant + clamped SwiGLU experts.

Covers patch moe-mxfp4-emulation-gfx936 (and the SwiGLU of
mxfp4-swiglu-from-model-config inside it). The reference decodes E2M1 from
the OCP MX spec table and E8M0 as 2**(u-127) here, independently, and does
the expert math in float64. The full TritonExperts.apply is not run: its
BF16 tl.dot is not trustworthy under the CPU Triton interpreter.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts import (
    gfx936_mxfp4_emulation as g936,
)
from vllm.model_executor.layers.quantization.utils.mxfp4_torch_dequant import (
    dequant_mxfp4_torch,
)

# OCP MX v1.0, E2M1: code s ee m -> magnitude
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
LIMIT = 10.0  # DeepSeek-V4-Flash swiglu_limit


def _ref_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    lo = table[(w & 0xF).long()]
    hi = table[(w >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # element 2j = low nibble
    sc = torch.pow(2.0, s.to(torch.float64) - 127.0).masked_fill(s == 255, torch.nan)
    return vals * sc.repeat_interleave(32, dim=-1)[..., : vals.shape[-1]]


def test_dequant_is_exact_for_every_nibble_and_scale_byte():
    """All 256 packed bytes (both nibbles) x every E8M0 exponent whose
    products fit float32 (u <= 252: 6 * 2^125 < FLT_MAX) and the NaN
    exponent 255 decode exactly like the spec table (float32 out)."""
    us = torch.tensor(list(range(253)) + [255], dtype=torch.int32)
    w = torch.arange(256).to(torch.uint8).repeat(len(us), 16)  # [254, 4096] bytes
    s = us.to(torch.uint8).view(-1, 1).repeat(1, 256)
    got = dequant_mxfp4_torch(w, s, torch.float32).double()
    ref = _ref_dequant(w, s)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok])
    # e8m0fnu-typed scales are read the same way
    got2 = dequant_mxfp4_torch(w[:3], s[:3].view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(got2, got[:3].float())


def _experts(limit: float, alpha: float = 1.0):
    ex = object.__new__(g936.Gfx936Mxfp4EmulationExperts)
    ex.ocp_mx_scheme = "w_mxfp4"
    ex.quant_config = SimpleNamespace(gemm1_clamp_limit=limit)
    ex.gemm1_alpha = alpha
    ex.gemm1_beta = 0.0
    return ex


def test_expert_gemms_and_activation_match_float64_reference():
    """For 3 experts (N=2*64 gate|up, K=96 hidden, non-multiple of 64), the
    emulation's dequant -> x@w13^T -> clamped SwiGLU (alpha 1, limit 10) ->
    @w2^T in BF16 matches float64 dequantize-then-matmul, with gate/up
    values well beyond the limit. Tolerance: weights are exact in BF16;
    errors come from rounding h, act and y to BF16 (2^-9 relative each,
    SiLU amplifies by <= 1.1), bounded by 2^-6 of sum|terms|."""
    g = torch.Generator().manual_seed(0)
    e, inter, hidden, m = 3, 64, 96, 8
    w13 = torch.randint(0, 256, (e, 2 * inter, hidden // 2), generator=g).to(
        torch.uint8
    )
    w2 = torch.randint(0, 256, (e, hidden, inter // 2), generator=g).to(torch.uint8)
    s13 = torch.randint(124, 129, (e, 2 * inter, hidden // 32), generator=g).to(
        torch.uint8
    )
    s2 = torch.randint(122, 126, (e, hidden, inter // 32), generator=g).to(
        torch.uint8
    )
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)

    ex = _experts(LIMIT)
    w13_dq = ex._dequantize_weights(w13, s13, torch.bfloat16)
    w2_dq = ex._dequantize_weights(w2, s2, torch.bfloat16)
    w13_ref, w2_ref = _ref_dequant(w13, s13), _ref_dequant(w2, s2)
    assert torch.equal(w13_dq.double(), w13_ref)
    assert torch.equal(w2_dq.double(), w2_ref)

    beyond = 0
    for i in range(e):
        h = x @ w13_dq[i].t()
        act = torch.empty(m, inter, dtype=torch.bfloat16)
        ex.activation(MoEActivation.SILU, act, h)
        y = act @ w2_dq[i].t()

        h64 = x.double() @ w13_ref[i].t()
        gate = h64[:, :inter].clamp(max=LIMIT)
        up = h64[:, inter:].clamp(-LIMIT, LIMIT)
        beyond += int((h64[:, :inter] > LIMIT).sum())
        beyond += int((h64[:, inter:].abs() > LIMIT).sum())
        a64 = gate * torch.sigmoid(gate) * up
        y64 = a64 @ w2_ref[i].t()
        mag = a64.abs() @ w2_ref[i].abs().t() + (
            (x.double().abs() @ w13_ref[i].abs().t())[:, :inter].clamp(max=LIMIT)
            @ w2_ref[i].abs().t()
        )
        err = (y.double() - y64).abs()
        assert (err <= 2**-6 * mag + 1e-6).all(), (err - 2**-6 * mag).max()
    assert beyond > 20  # the clamp was exercised


def test_non_weight_only_scheme_is_rejected_with_a_clear_error():
    g936.check_gfx936_mxfp4_scheme("w_mxfp4")
    with pytest.raises(ValueError, match="ocp_mx_scheme.*w_mxfp4_a_fp8"):
        g936.check_gfx936_mxfp4_scheme("w_mxfp4_a_fp8")


def test_kernel_experts_run_the_kernels_first_and_may_fall_back(monkeypatch):
    """Gfx936Mxfp4KernelExperts hands the apply arguments and the MXFP4 scales to the
    csrc_gfx936 MoE; when that takes the call the emulation is skipped, when it declines the
    emulation runs. It is supported exactly when gfx936_kernel_select picks the kernels."""
    from vllm.platforms import current_platform, gfx936_kernel_select

    ex = _experts(LIMIT)
    ex.__class__ = g936.Gfx936Mxfp4KernelExperts
    ex.w1_scale_val, ex.w2_scale_val = "s1", "s2"
    calls = []

    def on_kernels(experts, **kw):
        calls.append((experts, kw["w1_scale"], kw["w2_scale"], kw["w1"]))
        kw["output"].fill_(3.0)
        return True

    out = torch.zeros(2, 2)
    monkeypatch.setattr(g936, "mxfp4_moe_on_kernels", on_kernels)
    ex.apply(output=out, hidden_states=None, w1="w1", w2="w2")
    assert calls == [(ex, "s1", "s2", "w1")]
    assert torch.equal(out, torch.full((2, 2), 3.0))

    fell_back = []
    import vllm.platforms.gfx936_capability as cap

    monkeypatch.setattr(g936, "mxfp4_moe_on_kernels", lambda experts, **kw: False)
    # On a device (gfx936), a declined call falls back to the Triton emulation
    # (hidden_states None: not a decode-sized batch for the routed-only loop).
    monkeypatch.setattr(cap, "has_accelerator", lambda: True)
    monkeypatch.setattr(
        g936.OCP_MXQuantizationEmulationTritonExperts,
        "apply",
        lambda self, **kw: fell_back.append(kw["w1"]),
    )
    ex.apply(output=out, hidden_states=None, w1="w1", w2="w2")
    assert fell_back == ["w1"]

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True, raising=False)
    for chosen, supported in (("kernel", True), ("emulation", False)):
        monkeypatch.setattr(gfx936_kernel_select, "path", lambda op, c=chosen: c)
        assert g936.Gfx936Mxfp4KernelExperts._supports_current_device() is supported
        assert g936.Gfx936Mxfp4EmulationExperts._supports_current_device()


def test_oracle_picks_gfx936_experts_only_on_gfx936(monkeypatch):
    from vllm.model_executor.layers.fused_moe.experts.ocp_mx_emulation_moe import (
        OCP_MXQuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        backend_to_kernel_cls,
    )
    from vllm.platforms import current_platform, gfx936

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False, raising=False)
    monkeypatch.setattr(current_platform, "supports_fp8", lambda: True, raising=False)
    for on, want in (
        (True, [g936.Gfx936Mxfp4KernelExperts, g936.Gfx936Mxfp4EmulationExperts]),
        (False, [OCP_MXQuantizationEmulationTritonExperts]),
    ):
        monkeypatch.setattr(gfx936, "on_gfx936", lambda on=on: on)
        assert backend_to_kernel_cls(Mxfp4MoeBackend.EMULATION) == want
