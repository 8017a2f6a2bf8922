# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regression: merging DeepSeek V4's SWA cache specs dropped kv_quant_mode, so the merged group's
fp8_ds_mla cache was shaped as "auto" ([nb, 64, 512]) and gfx936's reference decode refused every
decode step (found running the no-FP8 path through the real engine on the CPU)."""
from __future__ import annotations

import torch

from vllm.v1.kv_cache_interface import KVQuantMode, SlidingWindowMLASpec, get_kv_quant_mode


def _spec() -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, sliding_window=128,
        cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"))


def test_merged_swa_mla_spec_keeps_the_fp8_quant_mode_and_alignment():
    a, b = _spec(), _spec()
    assert a.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
    merged = SlidingWindowMLASpec.merge([a, b])
    # The model runner shapes the cache "auto" when the mode is NONE.
    assert merged.kv_quant_mode == a.kv_quant_mode
    assert merged.alignment == a.alignment
    assert merged.page_size_bytes == a.page_size_bytes
    assert merged.real_page_size_bytes == 64 * 584
