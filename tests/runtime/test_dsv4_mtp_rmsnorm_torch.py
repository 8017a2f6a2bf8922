# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MTP draft's RMSNorm twins (patch dsv4-mtp-rmsnorm-torch) against a float64 reference and
against upstream's Triton kernels run under the interpreter (a second implementation).

enorm: the embedding row is zeroed at position 0, then RMSNorm; hnorm: RMSNorm of each of the
hc_mult streams; shared head: RMSNorm of [T, H]. All in float32, rounded once to the input dtype.
"""
import pytest
import torch
from triton_interp import import_with_real_triton

from vllm.models.deepseek_v4.common.ops import gfx936_rmsnorm_torch as twin

EPS = 1e-6


def _inputs(seed, T=6, hc=4, H=96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    emb = (torch.randn(T, H, generator=g) * 3).to(dtype)
    prev = (torch.randn(T, hc, H, generator=g) * 2).to(dtype)
    prev[2] *= 50  # a large-magnitude token: the norm must rescale it
    pos = torch.tensor([0, 1, 2, 0, 7, 300][:T])  # two requests start at position 0
    we = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    wh = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return emb, pos, prev, we, wh


def _ref(x, w):
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _close(out, ref, dtype):
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-22
    return bool(((out.double() - ref).abs() <= ulp * ref.abs() + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mtp_input_and_head_norms_match_float64(dtype):
    emb, pos, prev, we, wh = _inputs(1, dtype=dtype)
    e, h = twin.fused_mtp_input_rmsnorm_torch(emb, pos, prev, we, wh, EPS)
    assert e.dtype == h.dtype == dtype and e.shape == emb.shape and h.shape == prev.shape
    ref_e = _ref(emb, we)
    ref_e[pos == 0] = 0.0  # position 0 has no previous token: masked to zero
    assert _close(e, ref_e, dtype) and bool((e[pos == 0] == 0).all())
    assert _close(h, _ref(prev, wh), dtype)
    s = twin.mtp_shared_head_rmsnorm_torch(emb, we, EPS)
    assert _close(s, _ref(emb, we), dtype)


def test_twins_match_upstream_triton_interpreted():
    up = import_with_real_triton("vllm.models.deepseek_v4.common.ops.fused_mtp_input_rmsnorm")
    emb, pos, prev, we, wh = _inputs(2, dtype=torch.float32)
    e_up = torch.empty_like(emb)
    h_up = torch.empty_like(prev)
    T, H = emb.shape
    up._fused_mtp_input_rmsnorm_kernel[(T, prev.shape[1] + 1)](
        emb, pos, prev, we, wh, e_up, h_up, EPS, HIDDEN=H, HC_MULT=prev.shape[1], BLOCK_SIZE=128)
    e, h = twin.fused_mtp_input_rmsnorm_torch(emb, pos, prev, we, wh, EPS)
    torch.testing.assert_close(e, e_up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h, h_up, rtol=1e-6, atol=1e-6)
    s_up = torch.empty_like(emb)
    up._mtp_shared_head_rmsnorm_kernel[(T,)](emb, we, s_up, EPS, HIDDEN=H, BLOCK_SIZE=128)
    torch.testing.assert_close(twin.mtp_shared_head_rmsnorm_torch(emb, we, EPS), s_up,
                               rtol=1e-6, atol=1e-6)


def test_the_op_takes_the_twin_without_a_triton_device():
    """On the CPU (no Triton device) the product entry points return the twins' results."""
    import importlib

    # (the package re-exports the function under the module's name)
    op = importlib.import_module("vllm.models.deepseek_v4.common.ops.fused_mtp_input_rmsnorm")
    from vllm.platforms.gfx936_capability import has_accelerator

    if has_accelerator():
        pytest.skip("a Triton device is present: the kernel runs, not the twin")
    emb, pos, prev, we, wh = _inputs(3)
    e, h = op.fused_mtp_input_rmsnorm(emb, pos, prev, we, wh, EPS, prev.shape[1])
    e2, h2 = twin.fused_mtp_input_rmsnorm_torch(emb, pos, prev, we, wh, EPS)
    assert torch.equal(e, e2) and torch.equal(h, h2)
    assert torch.equal(op.mtp_shared_head_rmsnorm(emb, we, EPS),
                       twin.mtp_shared_head_rmsnorm_torch(emb, we, EPS))
