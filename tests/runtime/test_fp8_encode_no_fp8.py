# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The integer-op E4M3 encoder and the fp8_ds_mla writer of the no-FP8 path.

References: torch's own float32 -> float8_e4m3fn cast (a second implementation, RNE) and the test
writer ``fp8_ds_mla_writer`` (written from the C++ kernel's address formulas).
"""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.utils import lowp_codecs_torch as codecs
from vllm.model_executor.layers.quantization.utils.lowp_codecs_torch import decode_e4m3fn
from vllm.v1.attention.ops import deepseek_v4_cache_writer_torch as writer

import fp8_ds_mla_writer as ref_writer


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def test_every_e4m3_value_and_every_midpoint_round_to_nearest_even():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = decode_e4m3fn(codes)
    finite = ~torch.isnan(vals)
    # Every representable value encodes to itself (incl. subnormals and -0).
    assert torch.equal(codecs.encode_e4m3fn(vals[finite]), codes[finite])
    # Midpoints between neighbours: ties go to the even code, like torch's cast.
    pos = torch.sort(vals[finite & (vals >= 0)]).values.to(torch.float64)
    mids = ((pos[1:] + pos[:-1]) / 2).to(torch.float32)
    for m in (mids, -mids):
        assert torch.equal(codecs.encode_e4m3fn(m), _torch_e4m3(m))


def test_random_floats_over_all_magnitudes_match_torch_cast():
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(200_000, generator=g) * 2 - 1
    expo = torch.randint(-14, 11, (200_000,), generator=g).to(torch.float32)
    x = mant * torch.pow(2.0, expo)
    assert torch.equal(codecs.encode_e4m3fn(x), _torch_e4m3(x))


def test_saturates_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, 449.0, 464.0, 479.9, float("inf"), float("nan")])
    got = codecs.encode_e4m3fn(x)
    assert got[:6].tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7E]
    assert int(got[6]) & 0x7F == 0x7F


@pytest.mark.parametrize("block_size,block_stride,offset", [
    (64, None, 0), (64, ref_writer.SEED_BLOCK_STRIDE, 0), (256, None, 584 * 3)])
def test_fp8_ds_mla_writer_matches_the_kernel_formulas_byte_for_byte(
        block_size, block_stride, offset):
    g = torch.Generator().manual_seed(1)
    n = 40
    k = torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, 512)
    slots = torch.randperm(3 * block_size, generator=g)[:n]
    slots[5] = -1  # a padded token: nothing written
    ours = ref_writer.alloc_fp8_ds_mla_cache(3, block_size, block_stride, offset, seed=3)
    theirs = ref_writer.alloc_fp8_ds_mla_cache(3, block_size, block_stride, offset, seed=3)
    writer.write_fp8_ds_mla(ours, slots, block_size, k)
    ref_writer.write_fp8_ds_mla(theirs, k, slots)
    assert torch.equal(ours, theirs)
    # The bytes between blocks (stride > block bytes) and before block 0 are untouched too.
    assert torch.equal(torch.frombuffer(bytearray(ours.untyped_storage()), dtype=torch.uint8),
                       torch.frombuffer(bytearray(theirs.untyped_storage()), dtype=torch.uint8))


def test_writer_rejects_a_cache_too_small_for_the_block_size():
    cache = torch.zeros(2, 64 * 584, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block of 256 tokens needs"):
        writer.write_fp8_ds_mla(cache, torch.tensor([0]), 256, torch.zeros(1, 512))
