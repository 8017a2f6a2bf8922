# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fp8_ds_mla KV writer (`deepseek_v4_cache_writer_torch.write_fp8_ds_mla`, the SWA KV insert and the
compressors' store on gfx936 and the CPU) writes the same cache bytes as the writer it replaced
(its boolean-mask filter of `slot_mapping < 0`, kept below as the reference) and as the
independent test writer, with padded -1 slots anywhere (first row, all rows, none), an empty
batch and a non-contiguous block stride, and reaches no host sync (issue 19)."""

import sys
from pathlib import Path

import pytest
import torch
from fp8_ds_mla_writer import alloc_fp8_ds_mla_cache
from fp8_ds_mla_writer import write_fp8_ds_mla as independent_writer

from vllm.v1.attention.ops import deepseek_v4_cache_writer_torch as enc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402

BS = 16


def masked_writer(cache, slot_mapping, block_size, kv):
    """The writer before issue 19 (boolean-mask filter: 3 host syncs), the bytes reference."""
    cache_2d = enc.fp8_ds_mla_blocks(cache, block_size)
    n = slot_mapping.shape[0]
    slots = slot_mapping[:n].to(torch.int64)
    keep = slots >= 0
    nope, rope, scales = enc.quantize_fp8_ds_mla(kv[:n])
    data = torch.cat([nope, rope.contiguous().view(torch.uint8)], dim=-1)
    slots, data, scales = slots[keep], data[keep], scales[keep]
    blocks = (slots // block_size).unsqueeze(-1)
    pos = (slots % block_size).unsqueeze(-1)
    data_cols = pos * enc.FP8_DS_MLA_TOKEN_BYTES + torch.arange(enc.FP8_DS_MLA_TOKEN_BYTES)
    scale_cols = (block_size * enc.FP8_DS_MLA_TOKEN_BYTES + pos * enc.FP8_DS_MLA_SCALE_BYTES
                  + torch.arange(enc.FP8_DS_MLA_SCALE_BYTES))
    cache_2d[blocks, data_cols] = data
    cache_2d[blocks, scale_cols] = scales


def _case(kind, n, g):
    slots = torch.randperm(4 * BS, generator=g)[:n]
    if kind == "first-padded":
        slots[0] = -1
        slots[n // 2] = -1
    elif kind == "all-padded":
        slots[:] = -1
    elif kind == "tail-padded":
        slots[n - 3:] = -1
    return slots


@pytest.mark.parametrize("kind", ["none-padded", "first-padded", "tail-padded", "all-padded"])
@pytest.mark.parametrize("stride_pad", [0, 256])
def test_the_bytes_equal_the_masked_writer_and_the_independent_one(kind, stride_pad):
    g = torch.Generator().manual_seed(hash((kind, stride_pad)) % 1000)
    n = 11
    kv = (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)
    slots = _case(kind, n, g)
    # the caches start with the same random bytes (padding too): a skipped slot keeps them
    stride = BS * (enc.FP8_DS_MLA_TOKEN_BYTES + enc.FP8_DS_MLA_SCALE_BYTES) + stride_pad
    caches = [alloc_fp8_ds_mla_cache(4, BS, block_stride=stride, seed=7) for _ in range(3)]
    assert torch.equal(caches[0], caches[1])
    enc.write_fp8_ds_mla(caches[0], slots, BS, kv)
    masked_writer(caches[1], slots, BS, kv)
    independent_writer(caches[2], kv, slots)  # skips -1 itself
    full = [c.untyped_storage() for c in caches]
    assert bytes(full[0]) == bytes(full[1]), "differs from the masked writer"
    assert bytes(full[0]) == bytes(full[2]), "differs from the independent writer"


def test_an_empty_batch_writes_nothing():
    c = alloc_fp8_ds_mla_cache(2, BS)
    before = c.clone()
    enc.write_fp8_ds_mla(c, torch.empty(0, dtype=torch.int64), BS, torch.empty(0, 512, dtype=torch.bfloat16))
    assert torch.equal(c, before)


def test_the_writer_reaches_no_host_sync_and_the_old_one_three():
    kv = torch.randn(6, 512).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 7, -1, 20, 1])
    counts, sites = {}, {}
    for name, fn in (("new", enc.write_fp8_ds_mla), ("old", masked_writer)):
        c = SC.StepCounter()
        cache = alloc_fp8_ds_mla_cache(2, BS)
        with c:
            fn(cache, slots, BS, kv)
        counts[name] = c.counts["sync"]
        sites[name] = dict(c.ops)
    assert counts == {"new": 0, "old": 3}, (counts, sites)
