# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The gfx936 reader of the block-packed fp8_ds_mla cache against an
independent writer (tests/runtime/fp8_ds_mla_writer.py, written from the C++
writer's address formulas), the E4M3 bit decoder against torch's dtype, and
the seed's old token-interleaved reader as a regression guard."""

import math

import pytest
import torch
from fp8_ds_mla_writer import (
    SEED_BLOCK_STRIDE,
    alloc_fp8_ds_mla_cache,
    dequantize_written_k,
    quantize_fp8_ds_mla_tokens,
    random_fp8_ds_mla_cache,
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


def _old_token_interleaved_read(cache, slots):
    """The seed's first gfx936 reader (section 7.3): contiguous bytes,
    token = raw[block, pos], scales = token[576:584]."""
    block_size = cache.shape[1]
    cache_u8 = cache.view(torch.uint8).contiguous()
    raw = cache_u8.reshape(cache.shape[0], block_size, -1)
    token = raw[slots // block_size, slots % block_size]
    data = token[:, :576]
    scale_bytes = token[:, 576:584]
    scales = torch.exp2(scale_bytes[:, :7].float() - 127.0)
    k_nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float()
    k_nope = k_nope * scales.repeat_interleave(64, dim=1)
    k_rope = data[:, 448:576].contiguous().view(torch.bfloat16).float()
    return scale_bytes, k_nope, k_rope


@pytest.mark.parametrize("fill_blocks", [True, False])
def test_old_token_interleaved_reader_is_wrong_on_block_packed_cache(fill_blocks):
    """Regression guard for the seed's fp8_ds_mla bug (J15/J16, section 7):
    reading token[:, 576:584] as scales on the block-packed cache gives
    wrong scale bytes and wrong, non-finite or ~1e37 K, while the fixed
    reader on the same cache is exact."""
    num_blocks = 4
    n = num_blocks * BLOCK if fill_blocks else 40
    cache, k, slots = random_fp8_ds_mla_cache(n, num_blocks=num_blocks, seed=21)
    ref = dequantize_written_k(k)

    k_nope, k_rope = read_fp8_ds_mla_k(cache, slots)
    assert torch.equal(torch.cat([k_nope, k_rope], 1).double(), ref)

    old_scales, old_nope, old_rope = _old_token_interleaved_read(cache, slots)
    _, _, true_scales = quantize_fp8_ds_mla_tokens(k)
    assert (old_scales != true_scales).any(dim=1).float().mean() > 0.9
    old = torch.cat([old_nope, old_rope], 1).double()
    bad = ~torch.isfinite(old) | (old.abs() > 1e30)
    assert bad.any(), "old reader should produce non-finite / huge K"
    finite = torch.isfinite(old)
    assert (old[finite] - ref[finite]).abs().max() > 1.0


def test_reader_rejects_non_fp8_ds_mla_views():
    cache = alloc_fp8_ds_mla_cache(2, BLOCK)
    with pytest.raises(TypeError, match="uint8"):
        check_fp8_ds_mla_cache(cache.view(torch.int8), "swa_k_cache")
    with pytest.raises(ValueError, match=r"shape=\(2, 64, 292\)"):
        check_fp8_ds_mla_cache(cache[:, :, :292], "swa_k_cache")
    with pytest.raises(ValueError, match="stride"):
        check_fp8_ds_mla_cache(cache.transpose(0, 1)[:, :2], "swa_k_cache")
