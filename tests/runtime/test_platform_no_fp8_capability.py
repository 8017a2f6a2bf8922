# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one capability question (no FP8 hardware, no AITER) answers the same on gfx936 and CPU.

gfx936 is faked at torch's device properties (fake_rocm); the answers come from the product's
platform classes, not from a table in the test.
"""
from __future__ import annotations

import pytest

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
