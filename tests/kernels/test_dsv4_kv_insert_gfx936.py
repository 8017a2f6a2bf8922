# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused q norm + RoPE + fp8_ds_mla KV insert (patch
dsv4-qnorm-rope-kv-insert-fused-gfx936): the Triton kernel under TRITON_INTERPRET on the CPU.

Two references: the fork's PyTorch twin (``qnorm_rope_kv_insert``, the op's CPU
implementation): the cache bytes must be identical and q_out within one bf16 ulp (its RMS sum
runs in another order); and a float64 computation written here from the layout (RMSNorm and
GPT-J RoPE in float64; the written bytes decoded with torch's own float8_e4m3fn and bfloat16
dtypes): within the quantization of each field. The H200 tier runs the compiled kernel against
the twin (bench/layer_step.py: bitwise, docs/bench/layer-step-h200.md)."""

from __future__ import annotations

import pytest
import torch

from vllm.models.deepseek_v4.amd.gfx936_attention_torch import qnorm_rope_kv_insert
import triton
import triton.language as tl

from vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton import (
    _bf16_bits,
    _encode_e4m3,
    qnorm_rope_kv_insert_triton,
)

ROW, TOKEN, NOPE = 584, 576, 448
EPS = 1e-6


def _cos_sin(n=4096):
    ang = torch.arange(n).double()[:, None] / (10000 ** (torch.arange(0, 64, 2).double() / 64))
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def _case(T, H, bs, nb, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 512, generator=g) * 2).to(torch.bfloat16)
    kv = (torch.randn(T, 512, generator=g) * torch.rand(T, 1, generator=g) * 4).to(torch.bfloat16)
    kv[0, 64:128] *= 1e-6  # one NoPE tile under the 1e-4 scale floor
    stride = bs * ROW + 96  # block-packed with a gap, as the allocator lays it out
    flat = torch.randint(0, 256, ((nb - 1) * stride + bs * ROW,), dtype=torch.uint8, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int64)
    for i in skip:
        slots[i] = -1
    pos = torch.randint(0, 4096, (T,), generator=g)
    return q, kv, flat, stride, slots, pos


def _cache(flat, nb, bs, stride):
    return flat.as_strided((nb, bs, ROW), (stride, ROW, 1))


def _rope64(x, pos, cs):
    """float64 GPT-J RoPE of the last 64 dims of x [T, ..., 512]."""
    c = cs.double()[pos][:, :32]
    s = cs.double()[pos][:, 32:]
    shape = (-1,) + (1,) * (x.dim() - 2) + (32,)
    c, s = c.view(shape), s.view(shape)
    ev, od = x[..., NOPE::2], x[..., NOPE + 1::2]
    out = x.clone()
    out[..., NOPE::2] = ev * c - od * s
    out[..., NOPE + 1::2] = od * c + ev * s
    return out


def _read_token(flat, stride, bs, slot):
    b, p = slot // bs, slot % bs
    data = flat[b * stride + p * TOKEN: b * stride + (p + 1) * TOKEN]
    sc = flat[b * stride + bs * TOKEN + p * 8: b * stride + bs * TOKEN + p * 8 + 8]
    nope = data[:NOPE].view(torch.float8_e4m3fn).double()
    nope = nope * torch.pow(2.0, sc[:7].double() - 127).repeat_interleave(64)
    return torch.cat([nope, data[NOPE:].view(torch.bfloat16).double()]), sc


CASES = [(1, 8, 8, 64, 4, ()), (6, 8, 16, 64, 6, (2,)), (40, 16, 16, 256, 3, (0, 9))]


@pytest.mark.parametrize("T,H,P,bs,nb,skip", CASES)
def test_triton_insert_writes_the_twins_bytes(T, H, P, bs, nb, skip):
    q, kv, flat, stride, slots, pos = _case(T, H, bs, nb, seed=T, skip=skip)
    cs = _cos_sin()
    f_twin, f_tri = flat.clone(), flat.clone()
    q_twin = qnorm_rope_kv_insert(q, kv, _cache(f_twin, nb, bs, stride), slots, pos, cs, P,
                                  EPS, bs)
    q_tri = qnorm_rope_kv_insert_triton(q, kv, _cache(f_tri, nb, bs, stride), slots, pos, cs, P,
                                        EPS, bs)
    assert torch.equal(f_tri, f_twin), "cache bytes differ from the twin's"
    assert q_tri.shape == (T, P, 512) and q_tri.dtype == torch.bfloat16
    d = (q_tri.float() - q_twin.float()).abs()
    # one bf16 ulp (2^-7 relative at most), plus float32 noise where RoPE cancels
    assert bool((d <= q_twin.float().abs() * 2**-7 + 1e-5).all()), float(d.max())


@pytest.mark.parametrize("T,H,P,bs,nb,skip", CASES)
def test_triton_insert_against_float64(T, H, P, bs, nb, skip):
    q, kv, flat, stride, slots, pos = _case(T, H, bs, nb, seed=100 + T, skip=skip)
    cs = _cos_sin()
    before = flat.clone()
    q_out = qnorm_rope_kv_insert_triton(q, kv, _cache(flat, nb, bs, stride), slots, pos, cs, P,
                                        EPS, bs)
    # q: per-head RMSNorm without weight, then RoPE, rounded once to bf16
    x = q.double()
    want_q = _rope64(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS), pos, cs)
    err = (q_out[:, :H].double() - want_q).abs()
    # half a bf16 ulp (2^-8 relative), plus float32 noise where RoPE cancels
    assert bool((err <= want_q.abs() * 2**-8 + 1e-5).all()), float(err.max())
    assert bool((q_out[:, H:] == 0).all()), "padding heads must be zero"
    # kv: RoPE, bf16, per-64 power-of-two scale ceil(log2(max(amax, 1e-4) / 448)), E4M3
    want_k = _rope64(kv.double(), pos, cs)
    touched = torch.zeros_like(flat, dtype=torch.bool)
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        b, p = s // bs, s % bs
        touched[b * stride + p * TOKEN: b * stride + (p + 1) * TOKEN] = True
        touched[b * stride + bs * TOKEN + p * 8: b * stride + bs * TOKEN + p * 8 + 8] = True
        got, sc = _read_token(flat, stride, bs, s)
        amax = kv[t, :NOPE].double().abs().view(7, 64).amax(-1).clamp_min(1e-4)
        want_e = torch.ceil(torch.log2(amax / 448))
        assert torch.equal(sc[:7].double() - 127, want_e) and int(sc[7]) == 0
        tile = torch.pow(2.0, want_e).repeat_interleave(64)
        # E4M3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 of the scale
        assert bool(((got[:NOPE] - want_k[t, :NOPE]).abs()
                     <= want_k[t, :NOPE].abs() * 2**-4 + tile * 2**-10).all()), t
        assert bool(((got[NOPE:] - want_k[t, NOPE:]).abs()
                     <= want_k[t, NOPE:].abs() * 2**-8 + 1e-30).all()), t
    # nothing else written: skipped slots and every other byte keep their old value
    assert torch.equal(flat[~touched], before[~touched])


def test_the_op_runs_the_twin_on_the_cpu_and_has_a_fake():
    from vllm.models.deepseek_v4.common.ops.gfx936_kv_insert import (
        _insert_fake,
        qnorm_rope_kv_insert_gfx936,
    )

    q, kv, flat, stride, slots, pos = _case(5, 8, 64, 4, seed=7, skip=(1,))
    cs = _cos_sin()
    f_op, f_twin = flat.clone(), flat.clone()
    q_op = qnorm_rope_kv_insert_gfx936(q, kv, _cache(f_op, 4, 64, stride), slots, pos, cs, 16,
                                       EPS, 64)
    q_twin = qnorm_rope_kv_insert(q, kv, _cache(f_twin, 4, 64, stride), slots, pos, cs, 16,
                                  EPS, 64)
    assert torch.equal(q_op, q_twin) and torch.equal(f_op, f_twin)
    fake = _insert_fake(q, kv, _cache(flat, 4, 64, stride), slots, pos, cs, 16, EPS, 64)
    assert fake.shape == (5, 16, 512) and fake.dtype == q.dtype


def test_bad_shapes_name_the_tensor():
    q, kv, flat, stride, slots, pos = _case(2, 8, 64, 4, seed=3)
    cs = _cos_sin()
    with pytest.raises(ValueError, match=r"q head dim 256"):
        qnorm_rope_kv_insert_triton(q[..., :256], kv, _cache(flat, 4, 64, stride), slots, pos,
                                    cs, 8, EPS, 64)
    with pytest.raises(ValueError, match=r"cos_sin_cache \(4096, 32\)"):
        qnorm_rope_kv_insert_triton(q, kv, _cache(flat, 4, 64, stride), slots, pos, cs[:, :32],
                                    8, EPS, 64)


@triton.jit
def _probe(x_ptr, bf_ptr, e4_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(bf_ptr + i, _bf16_bits(x), mask=i < n)
    tl.store(e4_ptr + i, _encode_e4m3(x), mask=i < n)


def test_bf16_and_e4m3_rounding_helpers_round_half_to_even():
    """The kernel's integer roundings on crafted ties (random data almost never has one): bf16
    against torch's float32 -> bfloat16 cast, E4M3 against torch's float8_e4m3fn cast (both
    round half to even) with the saturation the writers apply."""
    base = torch.tensor([1.0, 1.0 + 2**-7, 3.0, -1.0, -(1.0 + 2**-7), 2.0**-100, 0.0])
    bits = base.view(torch.int32)
    ties = torch.cat([(bits + 0x8000), (bits - 0x8000), bits + 0x7FFF, bits + 0x8001]).view(
        torch.float32)
    e4 = torch.tensor([1.0625, 1.1875, -1.0625, 0.0009765625 * 1.5, 0.0009765625 * 2.5,
                       447.0, 460.0, 1000.0, -1000.0, 2.0**-12, 240.0, 248.0])
    x = torch.cat([ties, e4])
    bf = torch.empty(x.shape, dtype=torch.int32)
    code = torch.empty(x.shape, dtype=torch.int32)
    _probe[(1,)](x, bf, code, x.numel(), BLOCK=64)
    want_bf = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(bf, want_bf)
    want_e4 = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    assert torch.equal(code & 0xFF, want_e4)
