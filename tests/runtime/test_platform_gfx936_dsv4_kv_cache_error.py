# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek V4 kv-cache dtype error (patch dsv4-clear-error-kv-cache-dtype-gfx936).

Guards the seed's J12 failure: ``--kv-cache-dtype auto`` on ROCm died with
``AssertionError: DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache,
got auto``, which names neither the option nor what to use instead.
"""

from __future__ import annotations

import typing
from types import SimpleNamespace

import pytest
import torch

import vllm.models.deepseek_v4.attention as attention
from vllm.config.cache import CacheDType

# The values the fp8_ds_mla layout stores (E4M3 NoPE + UE8M0 scales), written
# here and not read from the product: every other CacheDType must be refused.
SUPPORTED = ("fp8", "fp8_e4m3", "fp8_ds_mla")
UNSUPPORTED = [d for d in typing.get_args(CacheDType) if d not in SUPPORTED]


def test_other_fp8_formats_are_among_the_refused_values():
    """Issue #11: fp8_e5m2 / fp8_inc / fp8_per_token_head start with 'fp8'
    and used to be stored as E4M3 fp8_ds_mla without a word."""
    assert {"fp8_e5m2", "fp8_inc", "fp8_per_token_head", "auto"} <= set(
        UNSUPPORTED)
    assert tuple(attention.DSV4_FP8_DS_MLA_KV_CACHE_DTYPES) == SUPPORTED


@pytest.mark.parametrize("kv_cache_dtype", UNSUPPORTED)
def test_non_fp8_kv_cache_on_fp8_ds_mla_layout_names_option_and_values(
    kv_cache_dtype,
):
    """Regression for the seed's bare AssertionError with kv_cache_dtype=auto."""
    with pytest.raises(ValueError) as excinfo:
        attention._resolve_dsv4_kv_cache_dtype(True, kv_cache_dtype, None)
    message = str(excinfo.value)
    assert "--kv-cache-dtype" in message
    assert repr(kv_cache_dtype) in message
    for value in SUPPORTED:
        assert value in message
    assert "use --kv-cache-dtype fp8" in message
    # It says why: the layout is the only Sparse MLA cache on this path.
    assert "fp8_ds_mla" in message and "Sparse MLA" in message
    if kv_cache_dtype.startswith("fp8"):
        assert "stored as E4M3 fp8_ds_mla instead of what was asked" in message


@pytest.mark.parametrize("kv_cache_dtype", SUPPORTED)
def test_supported_values_become_fp8_ds_mla_and_update_cache_config(kv_cache_dtype):
    cache_config = SimpleNamespace(cache_dtype=kv_cache_dtype)
    resolved = attention._resolve_dsv4_kv_cache_dtype(
        True, kv_cache_dtype, cache_config
    )
    assert resolved == ("fp8_ds_mla", torch.uint8)
    assert cache_config.cache_dtype == "fp8_ds_mla"


@pytest.mark.parametrize(
    "kv_cache_dtype,expected",
    [
        ("auto", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp8", torch.float8_e4m3fn),
    ],
)
def test_plain_row_layout_is_unchanged(kv_cache_dtype, expected):
    """Backends without the fp8_ds_mla layout keep upstream's mapping."""
    resolved = attention._resolve_dsv4_kv_cache_dtype(False, kv_cache_dtype, None)
    assert resolved == (kv_cache_dtype, expected)
