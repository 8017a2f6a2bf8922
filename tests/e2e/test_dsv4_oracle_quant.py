"""The oracle's run-time FP8 steps (tests/e2e/dsv4_oracle.py) against plain references written here.

The E4M3 reference is torch's own float32 -> float8_e4m3fn cast (round to nearest even), checked on
every code's midpoint, where rounding direction is decided by the tie rule.
"""
import torch

from tests.e2e.dsv4_oracle import E4M3_POS, e4m3_rne, fp8_ds_mla_nope, fp8_indexer_k


def test_e4m3_rne_matches_torch_cast_on_midpoints_and_random_values():
    mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([mids, -mids, E4M3_POS, (torch.rand(100000, generator=g, dtype=torch.float64) - 0.5) * 896])
    x = x.float().double()  # values representable in float32, like the activations vLLM casts
    ref = x.float().to(torch.float8_e4m3fn).double()
    assert torch.equal(e4m3_rne(x), ref)


def test_fp8_ds_mla_nope_scales_are_pow2_per_64_and_rope_dims_untouched():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 512, generator=g) * torch.logspace(-3, 2, 7).view(1, 7, 1)
    y = fp8_ds_mla_nope(x)
    assert torch.equal(y[..., 448:], x[..., 448:])
    tiles = x[..., :448].bfloat16().double().unflatten(-1, (7, 64))
    s = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    ref = ((tiles / s).float().to(torch.float8_e4m3fn).double() * s).flatten(-2).float()
    assert torch.equal(y[..., :448], ref)


def test_fp8_indexer_k_uses_one_scale_per_128():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=g)
    x[:, 0] = 1000.0  # one large value sets the scale of the whole vector
    y = fp8_indexer_k(x)
    s = torch.exp2(torch.ceil(torch.log2(torch.tensor(1000.0 / 448))))
    assert torch.equal(y.double(), (x.bfloat16().double() / s).float().to(torch.float8_e4m3fn).double() * s)
