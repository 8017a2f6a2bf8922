# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused inverse RoPE of the attention output (patch dsv4-inv-rope-fused-gfx936): the Triton
kernel under TRITON_INTERPRET on the CPU against the fork's twin (``rope_gptj(...,
inverse=True)``, the op's CPU implementation) and against float64 (the rotation written here:
RoPE then its inverse is the identity; the inverse of a known rotation is checked directly)."""

from __future__ import annotations

import pytest
import torch

from vllm.models.deepseek_v4.amd.gfx936_attention_torch import rope_gptj
from vllm.models.deepseek_v4.common.ops.gfx936_inv_rope_triton import inv_rope_triton


def _cs(n=4096):
    ang = torch.arange(n).double()[:, None] / (10000 ** (torch.arange(0, 64, 2).double() / 64))
    return torch.cat([ang.cos(), ang.sin()], -1).float()


@pytest.mark.parametrize("T,H", [(1, 8), (7, 16), (33, 1)])
def test_inverse_rope_matches_the_twin_and_float64(T, H):
    g = torch.Generator().manual_seed(T * H)
    o = (torch.randn(T, H, 512, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), generator=g)
    cs = _cs()
    got = inv_rope_triton(o, pos, cs, 64)
    twin = rope_gptj(o.float(), pos, cs, 64, inverse=True).to(torch.bfloat16)
    assert got.shape == o.shape and got.dtype == torch.bfloat16
    assert torch.equal(got[..., :448], o[..., :448])
    d = (got.float() - twin.float()).abs()
    assert bool((d <= twin.float().abs() * 2**-7 + 1e-5).all()), float(d.max())
    # float64: rotate each interleaved pair by -angle
    c = cs.double()[pos][:, None, :32]
    s = cs.double()[pos][:, None, 32:]
    ev, od = o.double()[..., 448::2], o.double()[..., 449::2]
    want = torch.stack((ev * c + od * s, od * c - ev * s), -1).flatten(-2)
    err = (got[..., 448:].double() - want).abs()
    assert bool((err <= want.abs() * 2**-8 + 1e-5).all()), float(err.max())


def test_the_op_runs_the_twin_on_the_cpu_and_bad_shapes_are_named():
    from vllm.models.deepseek_v4.common.ops.gfx936_inv_rope import inv_rope_gfx936

    g = torch.Generator().manual_seed(1)
    o = torch.randn(4, 8, 512, generator=g).to(torch.bfloat16)
    pos = torch.arange(4)
    cs = _cs()
    assert torch.equal(inv_rope_gfx936(o, pos, cs, 64),
                       rope_gptj(o.float(), pos, cs, 64, inverse=True).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"rope dim 32, cos_sin_cache \(4096, 64\)"):
        inv_rope_triton(o, pos, cs, 32)
