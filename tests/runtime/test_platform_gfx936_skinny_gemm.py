# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Skinny GEMM gate on gfx936 (patch rocm-skinny-gemm-gate-gfx936).

Guards the seed's J06 failure: ``csrc/rocm/skinny_gemms.hip:580
wvSplitK_hf_sml_ Device-side assertion`` followed by a VMFault on the first
generate, which went away with ``VLLM_ROCM_USE_SKINNY_GEMM=0``.

CPU only: the ROCm kernels are replaced by recorders that compute the same
product in float64, and ``torch.cuda`` is mocked to report the arch.
"""

from __future__ import annotations

from types import SimpleNamespace

import fake_rocm
import pytest
import torch

from vllm.platforms import gfx936

ARCHS_WITH_UPSTREAM_SKINNY = ["gfx90a:sramecc+:xnack-", "gfx942", "gfx950"]
GFX936_SPELLINGS = ["gfx936", "gfx936:sramecc+:xnack-"]


@pytest.fixture
def rocm_arch(monkeypatch, tmp_path):
    """Fake a ROCm device of the given arch for vllm.platforms.rocm and gfx936."""
    yield from fake_rocm.rocm_arch(
        monkeypatch,
        tmp_path,
        clear_env=fake_rocm.VISIBILITY_VARS + ("VLLM_ROCM_USE_SKINNY_GEMM",),
    )


@pytest.fixture
def kernels(monkeypatch):
    """Replace the skinny kernels by recorders; returns the list of calls."""
    import vllm.model_executor.layers.utils as layer_utils

    calls: list[str] = []

    def wv_split_k(weight, x, cu_count, bias=None):
        calls.append("wvSplitK")
        return (x.double() @ weight.double().t()).to(x.dtype)

    def llmm1(weight, x, rows_per_block):
        calls.append("LLMM1")
        return (x.double() @ weight.double().t()).to(x.dtype)

    def wv_split_krc(x, weight, cu_count, bias=None):
        calls.append("wvSplitKrc")
        return (x.double() @ weight.double().t()).to(x.dtype)

    monkeypatch.setattr(layer_utils.ops, "wvSplitK", wv_split_k, raising=False)
    monkeypatch.setattr(layer_utils.ops, "LLMM1", llmm1, raising=False)
    monkeypatch.setattr(layer_utils.ops, "wvSplitKrc", wv_split_krc, raising=False)
    monkeypatch.setattr(layer_utils, "num_compute_units", lambda *a: 80)
    return calls


@pytest.fixture
def warnings_seen(monkeypatch):
    """Collect warning_once messages of the gfx936 module."""
    import vllm.logger

    seen: list[str] = []
    real_init_logger = vllm.logger.init_logger

    def init_logger(name):
        logger = real_init_logger(name)
        if name == gfx936.__name__:
            return SimpleNamespace(
                warning_once=lambda msg, *a, **k: seen.append(msg)
            )
        return logger

    monkeypatch.setattr(vllm.logger, "init_logger", init_logger)
    return seen


def run_gemm(n_tokens: int):
    """A decode-shaped BF16 GEMM that upstream routes to a skinny kernel."""
    from vllm.model_executor.layers.utils import rocm_unquantized_gemm_impl

    gen = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, 256, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    out = rocm_unquantized_gemm_impl(x, weight, None)
    # Reference in float64; tolerance covers one BF16 rounding of the output
    # (relative 2^-8) plus BF16 accumulation order in the torch fallback.
    ref = x.double() @ weight.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-1)


def expected_upstream_kernel(n_tokens: int) -> str:
    # upstream: wvSplitK for m > 8 and 0 < n <= 5 (LLMM1 would need n == 1
    # but wvSplitK's branch comes first).
    return "wvSplitK" if 0 < n_tokens <= 5 else "LLMM1"


@pytest.mark.parametrize("arch", GFX936_SPELLINGS)
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_skinny_gemm_is_not_chosen_on_gfx936_by_default(
    rocm_arch, kernels, warnings_seen, arch, n_tokens
):
    """Regression for the seed's wvSplitK_hf_sml_ device assertion (J06)."""
    rocm_arch(arch)
    run_gemm(n_tokens)
    assert kernels == []
    assert warnings_seen == []


def test_skinny_gemm_stays_off_on_gfx936_even_when_classed_as_gfx9(
    rocm_arch, kernels, warnings_seen, monkeypatch
):
    """Regression for the seed's wvSplitK_hf_sml_ device assertion (J06).

    v0.27.1 leaves gfx936 out of on_gfx9(), but the seed's tree classed it as
    gfx9 and crashed. The gate must hold even if gfx936 is ever counted as
    gfx9 again (upstream widening the substring rule, or a later patch).
    """
    rocm = rocm_arch("gfx936:sramecc+:xnack-")
    monkeypatch.setattr(rocm, "on_gfx9", lambda: True)
    run_gemm(1)
    run_gemm(4)
    assert kernels == []
    assert warnings_seen == []


def test_skinny_gemm_explicit_zero_stays_off_on_gfx936(
    rocm_arch, kernels, warnings_seen, monkeypatch
):
    monkeypatch.setenv("VLLM_ROCM_USE_SKINNY_GEMM", "0")
    rocm_arch("gfx936")
    run_gemm(1)
    assert kernels == []


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_explicit_skinny_gemm_is_refused_on_gfx936_with_the_reason(
    rocm_arch, kernels, warnings_seen, monkeypatch, value
):
    """Issue #11: VLLM_ROCM_USE_SKINNY_GEMM=1 on gfx936 used to enable
    kernels that are not built there (with only a warning). It is now an
    error that names the variable and says why, and no kernel runs."""
    monkeypatch.setenv("VLLM_ROCM_USE_SKINNY_GEMM", value)
    rocm_arch("gfx936:sramecc+:xnack-")
    with pytest.raises(ValueError) as e:
        run_gemm(1)
    msg = str(e.value)
    assert "VLLM_ROCM_USE_SKINNY_GEMM=1 is not supported on gfx936" in msg
    assert "not built for gfx936" in msg and "wvSplitK_hf_sml_" in msg
    assert "set it to 0" in msg
    assert kernels == [] and warnings_seen == []


@pytest.mark.parametrize("arch", ARCHS_WITH_UPSTREAM_SKINNY)
@pytest.mark.parametrize("env", [None, "1", "0"])
def test_skinny_gemm_choice_of_other_archs_is_upstreams(
    rocm_arch, kernels, warnings_seen, monkeypatch, arch, env
):
    """gfx90a/gfx942/gfx950: upstream's default-on, env-off rule, no warning."""
    if env is not None:
        monkeypatch.setenv("VLLM_ROCM_USE_SKINNY_GEMM", env)
    rocm_arch(arch)
    run_gemm(3)
    upstream_on = env != "0"
    assert kernels == (["wvSplitK"] if upstream_on else [])
    assert warnings_seen == []


@pytest.mark.parametrize("env", [None, "1"])
def test_fp8_skinny_wvsplitkq_is_never_supported_on_gfx936(
    rocm_arch, monkeypatch, env
):
    """wvSplitKQ needs FP8 hardware; an explicit env var cannot enable it."""
    if env is not None:
        monkeypatch.setenv("VLLM_ROCM_USE_SKINNY_GEMM", env)
    rocm_arch("gfx936")
    import vllm.model_executor.kernels.linear.scaled_mm.rocm as scaled_mm_rocm

    monkeypatch.setattr(
        scaled_mm_rocm, "current_platform", SimpleNamespace(is_rocm=lambda: True)
    )
    supported, reason = scaled_mm_rocm.ROCmFP8ScaledMMLinearKernel.is_supported()
    assert supported is False
    assert reason


def test_skinny_gate_helper_passes_upstream_answer_through_off_gfx936(monkeypatch):
    monkeypatch.setattr(gfx936, "on_gfx936", lambda: False)
    monkeypatch.setenv("VLLM_ROCM_USE_SKINNY_GEMM", "1")
    assert gfx936.skinny_gemm_allowed(True) is True
    assert gfx936.skinny_gemm_allowed(False) is False
