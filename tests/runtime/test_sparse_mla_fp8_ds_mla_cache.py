# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The gfx936 reader of the block-packed fp8_ds_mla cache against an
independent writer (tests/runtime/fp8_ds_mla_writer.py, written from the C++
writer's address formulas), the E4M3 bit decoder against torch's dtype, and
the seed's token-interleaved misreading as a regression guard (on the
product's reader, by poisoning the bytes it must not read)."""

import math

import pytest
import torch
from fp8_ds_mla_writer import (
    SEED_BLOCK_STRIDE,
    alloc_fp8_ds_mla_cache,
    dequantize_written_k,
    quantize_fp8_ds_mla_tokens,
    write_fp8_ds_mla,
)
from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
    check_fp8_ds_mla_cache,
    decode_e4m3fn,
    decode_ue8m0,
    gather_fp8_ds_mla_bytes,
    read_fp8_ds_mla_k,
)

BLOCK = 64


def _seed_like_token() -> torch.Tensor:
    """One K row whose 7 NoPE groups have the absmax giving the seed's scale
    bytes, and RoPE values of the seed's magnitude (|x| <= 5.75)."""
    group_absmax = [0.80, 1.50, 1.20, 1.70, 0.60, 1.00, 0.50]
    gen = torch.Generator().manual_seed(7)
    nope = torch.rand(7, 64, generator=gen) * 2 - 1
    nope = nope / nope.abs().amax(dim=1, keepdim=True)
    nope = nope * torch.tensor(group_absmax)[:, None]
    rope = (torch.rand(64, generator=gen) * 2 - 1) * 5.75
    return torch.cat([nope.reshape(-1), rope])[None, :]


def test_all_256_e4m3_bytes_decode_bit_exactly():
    """decode_e4m3fn (bit manipulation, no FP8 dtype) equals
    torch.float8_e4m3fn for all 256 bytes, sign of zero included; 0x7F/0xFF
    are the only NaNs."""
    raw = torch.arange(256, dtype=torch.uint8)
    got = decode_e4m3fn(raw)
    ref = raw.view(torch.float8_e4m3fn).to(torch.float32)
    assert got.dtype == torch.float32
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_ue8m0_decode_is_power_of_two():
    raw = torch.arange(255, dtype=torch.uint8)
    ref = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)])
    assert torch.equal(decode_ue8m0(raw), ref.to(torch.float32))
    assert torch.isnan(decode_ue8m0(torch.tensor([255], dtype=torch.uint8))).all()


def test_writer_scale_bytes_follow_ue8m0_rule_and_seed_pattern():
    """The independent writer gives, per 64-group, ceil(log2(absmax/448))+127
    (float64 here) and a zero pad byte; seed-magnitude K gives the seed's
    [118,119,119,119,118,119,118,0]."""
    k = _seed_like_token()
    _, _, scale_bytes = quantize_fp8_ds_mla_tokens(k)
    x = k.to(torch.bfloat16).to(torch.float64)[0, :448].reshape(7, 64)
    expect = [
        math.ceil(math.log2(max(a, 1e-4) / 448.0)) + 127
        for a in x.abs().amax(dim=1).tolist()
    ]
    assert scale_bytes[0].tolist() == expect + [0]
    assert scale_bytes[0].tolist() == [118, 119, 119, 119, 118, 119, 118, 0]


def test_reader_matches_writer_with_large_block_stride():
    """Bytes and values written at block_base + pos*576 / block_base +
    bs*576 + pos*8 with stride(0)=1002240 (seed) are read back exactly,
    including a nonzero storage offset and random garbage elsewhere."""
    num_blocks = 5
    cache = alloc_fp8_ds_mla_cache(
        num_blocks, BLOCK, SEED_BLOCK_STRIDE, storage_offset=4096, seed=3
    )
    assert cache.stride() == (SEED_BLOCK_STRIDE, 584, 1)
    assert not cache.is_contiguous()
    gen = torch.Generator().manual_seed(11)
    n = 150
    k = torch.randn(n, 512, generator=gen) * 0.7
    k[0] = _seed_like_token()[0]
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:n]
    write_fp8_ds_mla(cache, k, slots)

    data, scales = gather_fp8_ds_mla_bytes(cache, slots)
    nope_b, rope_b, scale_b = quantize_fp8_ds_mla_tokens(k)
    assert torch.equal(data[:, :448], nope_b)
    assert torch.equal(data[:, 448:], rope_b)
    assert torch.equal(scales, scale_b)
    assert scales[0].tolist() == [118, 119, 119, 119, 118, 119, 118, 0]

    k_nope, k_rope = read_fp8_ds_mla_k(cache, slots)
    assert torch.isfinite(k_nope).all() and torch.isfinite(k_rope).all()
    # Dequantization is exact in float32 (e4m3 * 2^k, bf16): tolerance 0.
    ref = dequantize_written_k(k)
    assert torch.equal(k_nope.to(torch.float64), ref[:, :448])
    assert torch.equal(k_rope.to(torch.float64), ref[:, 448:])
    # And the quantization error vs the original K is within E4M3's half-ulp
    # (2^-4 relative to the group scale * 448 range) - i.e. the writer is sane.
    err = (ref[:, :448] - k.to(torch.bfloat16).double()[:, :448]).abs()
    group_scale = torch.pow(2.0, scale_b[:, :7].double() - 127)
    assert (err <= group_scale.repeat_interleave(64, 1) * 16).all()


def test_reader_never_reads_bytes_outside_the_block():
    """Poisoning every byte outside [block_base, block_base + bs*584) with
    NaN-E4M3 (0x7F) and the unwritten slots of the block does not change
    what the reader returns for written slots."""
    cache = alloc_fp8_ds_mla_cache(3, BLOCK, SEED_BLOCK_STRIDE, fill=0x7F)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(20, 512, generator=gen)
    slots = torch.tensor([0, 63, 64, 127, 128, 191] + list(range(1, 15)))
    write_fp8_ds_mla(cache, k, slots)
    k_nope, k_rope = read_fp8_ds_mla_k(cache, slots)
    ref = dequantize_written_k(k)
    assert torch.equal(torch.cat([k_nope, k_rope], 1).double(), ref)


@pytest.mark.parametrize("pos", [0, 17, 40])
def test_scales_come_from_the_block_tail_not_after_each_token(pos):
    """Regression for the seed's fp8_ds_mla bug (J15/J16, section 7): its
    reader took token t's scales from bytes t*584+576.. (token-interleaved);
    the writer keeps them at block_base + bs*576 + t*8. Overwriting the
    interleaved position must leave the product's K unchanged, and raising
    the real scale byte of group 0 by one must double exactly that group."""
    cache = alloc_fp8_ds_mla_cache(2, BLOCK, fill=0x7F)
    k = _seed_like_token()
    slot = torch.tensor([BLOCK + pos])  # block 1: block_base != 0
    write_fp8_ds_mla(cache, k, slot)
    nope0, rope0 = read_fp8_ds_mla_k(cache, slot)
    assert torch.isfinite(nope0).all() and torch.isfinite(rope0).all()
    block = cache[1].view(-1)  # the block's 64*584 bytes, flat
    block[pos * 584 + 576:pos * 584 + 584] = 140  # 2^13 if read as a scale
    nope1, rope1 = read_fp8_ds_mla_k(cache, slot)
    assert torch.equal(nope1, nope0) and torch.equal(rope1, rope0)
    tail = BLOCK * 576 + pos * 8
    assert block[tail:tail + 8].tolist() == [118, 119, 119, 119, 118, 119, 118, 0]
    block[tail] += 1
    nope2, rope2 = read_fp8_ds_mla_k(cache, slot)
    assert torch.equal(nope2[:, :64], nope0[:, :64] * 2)
    assert torch.equal(nope2[:, 64:], nope0[:, 64:])
    assert torch.equal(rope2, rope0)


def test_reader_rejects_non_fp8_ds_mla_views():
    cache = alloc_fp8_ds_mla_cache(2, BLOCK)
    with pytest.raises(TypeError, match="uint8"):
        check_fp8_ds_mla_cache(cache.view(torch.int8), "swa_k_cache")
    with pytest.raises(ValueError, match=r"shape=\(2, 64, 292\)"):
        check_fp8_ds_mla_cache(cache[:, :, :292], "swa_k_cache")
    with pytest.raises(ValueError, match="stride"):
        check_fp8_ds_mla_cache(cache.transpose(0, 1)[:, :2], "swa_k_cache")
