# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one capability question (no FP8 hardware, no AITER) answers the same on gfx936 and CPU.

gfx936 is faked at torch's device properties (fake_rocm); the answers come from the product's
platform classes, not from a table in the test.
"""
from __future__ import annotations

import pytest
import torch

from vllm.platforms import gfx936_capability as cap
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import Platform, PlatformEnum

import fake_rocm


@pytest.fixture
def rocm_arch(monkeypatch, tmp_path):
    yield from fake_rocm.rocm_arch(monkeypatch, tmp_path, clear_env=fake_rocm.VISIBILITY_VARS)


def _use(monkeypatch, platform_cls):
    monkeypatch.setattr(cap, "current_platform", platform_cls())


def test_cpu_takes_the_no_fp8_path_like_gfx936(monkeypatch):
    _use(monkeypatch, CpuPlatform)
    assert not cap.converts_fp8_in_hardware()
    assert not cap.aiter_usable()
    assert cap.lacks_fp8_conversion()
    assert not cap.has_accelerator()


@pytest.mark.parametrize("arch", ["gfx936", "gfx936:sramecc+:xnack-"])
def test_gfx936_has_no_fp8_no_aiter_no_mfma(monkeypatch, rocm_arch, arch):
    rocm = rocm_arch(arch)
    _use(monkeypatch, rocm.RocmPlatform)
    # The substring "gfx9" made upstream's supports_fp8() say True on gfx936.
    assert rocm.RocmPlatform.supports_fp8() is False
    assert not cap.converts_fp8_in_hardware()
    assert not cap.aiter_usable()
    assert cap.lacks_fp8_conversion()
    assert cap.has_accelerator()
    assert not cap.rocm_matrix_kernels_usable()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_mi300_family_keeps_upstream_fp8_paths(monkeypatch, rocm_arch, arch):
    rocm = rocm_arch(arch)
    _use(monkeypatch, rocm.RocmPlatform)
    assert rocm.RocmPlatform.supports_fp8() is True
    assert cap.converts_fp8_in_hardware()
    assert not cap.lacks_fp8_conversion()
    assert cap.rocm_matrix_kernels_usable()


class _Cuda(Platform):
    """The CUDA platform's enum on the base class (cuda.py needs CUDA's compiled ops to import)."""

    _enum = PlatformEnum.CUDA


def test_cuda_is_untouched(monkeypatch):
    _use(monkeypatch, _Cuda)
    assert cap.converts_fp8_in_hardware()
    assert not cap.lacks_fp8_conversion()


def test_tilelang_mhc_is_never_chosen_on_gfx936(monkeypatch, rocm_arch):
    """mhc.py excluded only gfx942 from TileLang; on gfx936 it emits v_mfma, which faults."""
    import vllm.model_executor.layers.mhc as mhc
    import vllm.platforms as platforms

    rocm = rocm_arch("gfx936")
    monkeypatch.setattr(mhc, "has_tilelang", lambda: True)
    monkeypatch.setattr(mhc, "current_platform", rocm.RocmPlatform())
    monkeypatch.setattr(cap, "current_platform", rocm.RocmPlatform())
    monkeypatch.setattr(platforms, "_current_platform", rocm.RocmPlatform(), raising=False)
    assert mhc._has_tilelang_mhc() is False
    rocm = rocm_arch("gfx90a")
    monkeypatch.setattr(mhc, "current_platform", rocm.RocmPlatform())
    monkeypatch.setattr(cap, "current_platform", rocm.RocmPlatform())
    assert mhc._has_tilelang_mhc() is True


class _Xpu(Platform):
    _enum = PlatformEnum.XPU


def _platform(monkeypatch, rocm_arch, name):
    if name == "cuda":
        return _Cuda()
    if name == "xpu":
        return _Xpu()
    if name == "cpu":
        return CpuPlatform()
    return rocm_arch(name).RocmPlatform()


@pytest.mark.parametrize("name", ["cuda", "xpu", "gfx942", "gfx936", "cpu"])
def test_deepseek_v4_hooks_give_other_platforms_upstreams_ops(monkeypatch, rocm_arch, name):
    """attention.py's hooks (amd/gfx936_attention_ops) and the router's hook hand CUDA, XPU and
    ROCm with FP8 (MI300) exactly upstream's ops; only the no-FP8 path (gfx936, and the CPU that
    runs it) takes the fork's ops. Asked of the product's own functions on faked platforms."""
    import vllm.platforms as platforms
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as r
    from vllm.model_executor.layers.fused_moe.router import gfx936_topk_softplus_sqrt as g
    from vllm.models.deepseek_v4.amd import gfx936_attention_ops as ops

    plat = _platform(monkeypatch, rocm_arch, name)
    monkeypatch.setattr(cap, "current_platform", plat)
    monkeypatch.setattr(platforms, "_current_platform", plat, raising=False)
    no_fp8 = name in ("gfx936", "cpu")

    def upstream_norm(*a):
        return "upstream norm"

    def upstream_q(*a):
        return "upstream q"

    assert ops.no_fp8_path() is no_fp8
    assert (ops.q_kv_rmsnorm(upstream_norm) is upstream_norm) is not no_fp8
    fill, q_quant = ops.indexer_ops(upstream_q)
    assert (q_quant is upstream_q) is not no_fp8
    assert (fill is None) is (name != "cpu")  # upstream's Triton fill wherever a device is

    calls = []
    monkeypatch.setattr(r, "_topk_softplus_sqrt_torch", lambda *a: calls.append("xpu twin"))
    monkeypatch.setattr(r.ops, "topk_hash_softplus_sqrt",
                        lambda *a, **k: calls.append("upstream kernel"))
    monkeypatch.setattr(r, "_get_padding_mask", lambda n: None)
    monkeypatch.setattr(g, "topk_softplus_sqrt_gfx936", lambda *a: calls.append("gfx936 op"))
    g.on_no_fp8_path.cache_clear()
    try:
        r.vllm_topk_softplus_sqrt(None, torch.zeros(1, 6, dtype=torch.int32), None, None)
    finally:
        g.on_no_fp8_path.cache_clear()
    want = {"xpu": "xpu twin", "cuda": "upstream kernel", "gfx942": "upstream kernel"}
    assert calls == [want.get(name, "gfx936 op")]
