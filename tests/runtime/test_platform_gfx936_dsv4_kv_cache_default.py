# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A bare `vllm serve <DeepSeek V4>` on gfx936 gets the fp8_ds_mla KV cache (patch
dsv4-kv-cache-default-gfx936).

Regression (issue #17): with no --kv-cache-dtype the DeepSeek V4 attention layer refused the
default `auto`, so the cluster command needed `--kv-cache-dtype fp8`. The default is applied
in RocmPlatform.check_and_update_config on gfx936 only; the layer's own resolver (the code that
refused `auto`) is the judge of what the config then holds. Explicit values are not touched.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import fake_rocm
import pytest
import torch

import vllm.models.deepseek_v4.attention as attention
from vllm.platforms import gfx936_defaults

MANAGED_ENV = ("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "ROCR_VISIBLE_DEVICES",
               "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def _resolved_compilation_config():
    """As VllmConfig hands it to the platform hook (vLLM's defaults resolved)."""
    from types import SimpleNamespace

    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return SimpleNamespace(mode=CompilationMode.VLLM_COMPILE,
                           cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                           max_cudagraph_capture_size=8, cudagraph_capture_sizes=[1, 2, 4, 8])


@pytest.fixture
def env(monkeypatch):
    saved = {name: os.environ.pop(name, None) for name in MANAGED_ENV}
    yield monkeypatch
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def config(cache_dtype="auto", model_type="deepseek_v4"):
    hf_config = SimpleNamespace(model_type=model_type, expert_dtype="fp4")
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization="deepseek_v4_fp8", hf_config=hf_config,
                                     hf_text_config=hf_config, enforce_eager=False),
        kernel_config=SimpleNamespace(moe_backend="auto"),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=_resolved_compilation_config(),
        parallel_config=SimpleNamespace(worker_cls="auto", decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
    )


def layer_resolves(cfg):
    """What the DeepSeek V4 attention layer makes of the config's cache dtype."""
    return attention._resolve_dsv4_kv_cache_dtype(True, cfg.cache_config.cache_dtype,
                                                  cfg.cache_config)


def test_auto_on_deepseek_v4_becomes_the_fp8_ds_mla_cache(env):
    cfg = config()
    with pytest.raises(ValueError, match="--kv-cache-dtype='auto'"):
        layer_resolves(config())  # what the bare command hit before
    applied = gfx936_defaults.apply_gfx936_defaults(cfg)
    assert "kv_cache_dtype=fp8 (fp8_ds_mla)" in applied
    assert layer_resolves(cfg) == ("fp8_ds_mla", torch.uint8)
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"


@pytest.mark.parametrize("explicit", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_explicit_fp8_values_are_kept_and_work(env, explicit):
    cfg = config(explicit)
    applied = gfx936_defaults.apply_gfx936_defaults(cfg)
    assert cfg.cache_config.cache_dtype == explicit
    assert not any(a.startswith("kv_cache_dtype") for a in applied)
    assert layer_resolves(cfg) == ("fp8_ds_mla", torch.uint8)


@pytest.mark.parametrize("explicit", ["bfloat16", "fp8_e5m2"])
def test_explicit_unsupported_values_still_get_the_named_error(env, explicit):
    cfg = config(explicit)
    gfx936_defaults.apply_gfx936_defaults(cfg)
    assert cfg.cache_config.cache_dtype == explicit
    with pytest.raises(ValueError, match=f"--kv-cache-dtype='{explicit}'"):
        layer_resolves(cfg)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama", None])
def test_other_models_keep_auto(env, model_type):
    cfg = config(model_type=model_type)
    gfx936_defaults.apply_gfx936_defaults(cfg)
    assert cfg.cache_config.cache_dtype == "auto"


def test_the_defaults_table_lists_it():
    rows = {row.name: row for row in gfx936_defaults.GFX936_DEFAULTS}
    assert "fp8_ds_mla" in rows["--kv-cache-dtype"].default


@pytest.fixture
def rocm_arch(env, tmp_path):
    yield from fake_rocm.rocm_arch(env, tmp_path)


@pytest.mark.parametrize("arch,want", [("gfx936", "fp8"), ("gfx936:sramecc+:xnack-", "fp8"),
                                       ("gfx942", "auto"), ("gfx90a", "auto")])
def test_rocm_platform_applies_it_on_gfx936_only(rocm_arch, arch, want):
    rocm = rocm_arch(arch)
    cfg = config()
    rocm.RocmPlatform.check_and_update_config(cfg)
    assert cfg.cache_config.cache_dtype == want
