# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SwiGLU of the MXFP4 MoE path: DeepSeek V4 values come from the model.

Covers patch mxfp4-swiglu-from-model-config. References are plain float64
PyTorch written here, independent of the code under test.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.clamped_swiglu import clamped_swiglu
from vllm.model_executor.layers.fused_moe.experts.ocp_mx_emulation_moe import (
    OCP_MXQuantizationEmulationTritonExperts,
)
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
from vllm.model_executor.layers.quantization.mxfp4 import (
    GptOssMxfp4MoEMethod,
    Mxfp4MoEMethod,
)

DSV4_LIMIT = 10.0  # DeepSeek-V4-Flash config.json "swiglu_limit"


def _gate_up_beyond_limit(rows: int = 64, d: int = 96) -> torch.Tensor:
    """gate|up halves spanning [-3*limit, 3*limit], so both clamps bite."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(rows, 2 * d, generator=g, dtype=torch.float64) * 2 - 1) * (
        3 * DSV4_LIMIT
    )
    assert (x[:, :d] > DSV4_LIMIT).any() and (x[:, d:].abs() > DSV4_LIMIT).any()
    return x


def _dsv4_ref(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate = torch.minimum(x[:, :d], torch.tensor(limit, dtype=torch.float64))
    up = torch.clip(x[:, d:], -limit, limit)
    z = alpha * gate
    return z / (1.0 + torch.exp(-z)) * up


def _fake_moe_layer(**attrs) -> SimpleNamespace:
    e, n, k = 2, 64, 64
    return SimpleNamespace(
        w13_weight_scale=torch.zeros(e, 2 * n, k // 32, dtype=torch.uint8),
        w2_weight_scale=torch.zeros(e, k, n // 32, dtype=torch.uint8),
        **attrs,
    )


def test_clamped_swiglu_equals_clamp_formula_beyond_limit():
    """alpha=1, limit=10 on values up to 3x the limit equals the float64
    formula. Tolerance: input is float32 and the op computes in float32, so
    ~1e-6 relative (a few float32 ulps); atol for outputs near zero.

    Regression for seed bug J09 (silu(1.702 * gate) * up, gpt-oss alpha, no
    clamp): on this input that formula is > 1.0 away from the reference, far
    outside the tolerance, so a product computing it fails here."""
    x64 = _gate_up_beyond_limit()
    out = clamped_swiglu(x64.float(), DSV4_LIMIT, 1.0)
    ref = _dsv4_ref(x64.float().double(), DSV4_LIMIT, 1.0)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-5)


def test_dsv4_mxfp4_emulation_config_takes_limit_from_model_without_alpha():
    """The DeepSeek V4 route (Mxfp4MoEMethod, emulation backend) builds its
    quant config from the layer's model values: clamp = config.swiglu_limit,
    no gpt-oss alpha/beta."""
    method = object.__new__(Mxfp4MoEMethod)
    method.mxfp4_backend = Mxfp4MoeBackend.EMULATION
    layer = _fake_moe_layer(swiglu_limit=DSV4_LIMIT, swiglu_alpha=None)
    qc = method.get_fused_moe_quant_config(layer)
    assert qc.gemm1_clamp_limit == DSV4_LIMIT
    assert qc.gemm1_alpha is None and qc.gemm1_beta is None
    # a model that does provide an alpha gets it through (not a constant)
    layer = _fake_moe_layer(swiglu_limit=DSV4_LIMIT, swiglu_alpha=1.25)
    assert method.get_fused_moe_quant_config(layer).gemm1_alpha == 1.25


def test_gpt_oss_mxfp4_config_keeps_its_swiglu_oai_constants():
    """gpt-oss is unchanged: its method still carries the SwiGLU-OAI values
    (alpha 1.702, beta 1.0, limit 7.0) of the gpt-oss reference, whatever
    the layer says, and its formula is not DeepSeek V4's."""
    method = object.__new__(GptOssMxfp4MoEMethod)
    method.mxfp4_backend = Mxfp4MoeBackend.MARLIN
    layer = _fake_moe_layer(swiglu_limit=DSV4_LIMIT)
    qc = method.get_fused_moe_quant_config(layer)
    assert (qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit) == (1.702, 1.0, 7.0)

    # gpt-oss formula (HF modeling_gpt_oss, interleaved gate/up) in float64
    x = _gate_up_beyond_limit()
    gate = x[:, ::2].clamp(max=7.0)
    up = x[:, 1::2].clamp(-7.0, 7.0)
    oai = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    # forward_native reads only alpha/limit; no CustomOp/vllm config needed
    oai_self = SimpleNamespace(alpha=1.702, limit=7.0)
    got = SwigluOAIAndMul.forward_native(oai_self, x)
    torch.testing.assert_close(got, oai, rtol=1e-12, atol=1e-12)
    packed = torch.cat([x[:, ::2], x[:, 1::2]], dim=1)  # same gate/up values
    assert (got - _dsv4_ref(packed, DSV4_LIMIT, 1.0)).abs().max().item() > 1.0


def _emulation_experts(alpha: float | None, limit: float):
    experts = object.__new__(OCP_MXQuantizationEmulationTritonExperts)
    experts.quant_config = SimpleNamespace(gemm1_clamp_limit=limit)
    experts.gemm1_alpha = 1.0 if alpha is None else alpha
    experts.gemm1_beta = 0.0
    return experts


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_emulation_experts_activation_applies_model_alpha_and_limit(
    alpha, monkeypatch
):
    """The emulation experts' activation (what the MoE emulation path runs
    between its two GEMMs) equals the float64 clamp formula for the model's
    limit and alpha. alpha=1 goes through upstream's SiLU+clamp path; alpha
    != 1 used to be dropped there. Tolerance: bf16 in/out, so 1 bf16 ulp
    (2^-8 relative, 2^-7 to be safe on rounding of the float32 SiLU)."""
    import vllm.model_executor.layers.fused_moe.utils as moe_utils

    # upstream wraps its clamp helper in torch.compile; run its eager body so
    # the test stays fast and needs no compiler (same math, same dispatch).
    eager = getattr(moe_utils._swiglu_limit_torch, "_torchdynamo_orig_callable", None)
    if eager is None:
        pytest.skip("cannot reach the eager body of _swiglu_limit_torch")
    monkeypatch.setattr(moe_utils, "_swiglu_limit_torch", eager)

    x = _gate_up_beyond_limit(rows=16, d=64).to(torch.bfloat16)
    out = torch.full((x.shape[0], x.shape[1] // 2), float("nan"), dtype=x.dtype)
    _emulation_experts(alpha, DSV4_LIMIT).activation(MoEActivation.SILU, out, x)
    ref = _dsv4_ref(x.double(), DSV4_LIMIT, alpha)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)
