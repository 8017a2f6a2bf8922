# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel selection for block-FP8 linear layers on ROCm (patch
linear-scaled-mm-w8a16-gfx936): upstream's chooser, run over the real ROCm
kernel list, picks the gfx936 W8A16 kernel on gfx936 and never elsewhere.

Replaces a test named "chosen" that only called ``is_supported`` (issue #11):
this one runs ``choose_scaled_mm_linear_kernel`` itself.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm.gfx936 import (
    Gfx936W8A16Fp8BlockScaledMMKernel,
)
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)
from vllm.platforms import PlatformEnum, current_platform, gfx936


def _config(out_dtype=torch.bfloat16):
    return FP8ScaledMMLinearLayerConfig(
        weight_quant_key=kFp8Static128BlockSym,
        activation_quant_key=kFp8Dynamic128Sym,
        input_dtype=torch.bfloat16,
        out_dtype=out_dtype,
        weight_shape=(4096, 7168),
    )


def _choose(monkeypatch, on_gfx936: bool, out_dtype=torch.bfloat16):
    # A ROCm platform: is_rocm, not is_cpu (the CPU takes the W8A16 kernel too), and FP8
    # hardware exactly when the arch is not gfx936 (gfx942/950).
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False, raising=False)
    monkeypatch.setattr(current_platform, "supports_fp8", lambda: not on_gfx936, raising=False)
    monkeypatch.setattr(gfx936, "on_gfx936", lambda: on_gfx936)
    rocm_list = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.ROCM]
    # The chooser reads the list of current_platform._enum (CPU here): hand
    # it ROCm's list under that key, so the selection loop itself runs.
    return linear_kernels.choose_scaled_mm_linear_kernel(
        _config(out_dtype), {current_platform._enum: rocm_list},
        compute_capability=93)


@pytest.mark.parametrize("tier", ["torch", "kernel"])
def test_gfx936_gets_the_w8a16_kernel_from_the_chooser(monkeypatch, tier):
    """The tier table's w8a16 answer decides between the two gfx936 classes (fixed here: which
    one a process gets otherwise depends on whether a _gfx936_C library, real or a test's
    fake, is loaded in it)."""
    from vllm.model_executor.kernels.linear.scaled_mm.gfx936 import (
        Gfx936W8A16KernelFp8BlockScaledMMKernel,
    )
    from vllm.platforms import gfx936_kernel_select as sel

    real_path = sel.path
    monkeypatch.setattr(sel, "path", lambda op: tier if op == "w8a16" else real_path(op))
    want = (Gfx936W8A16KernelFp8BlockScaledMMKernel if tier == "kernel"
            else Gfx936W8A16Fp8BlockScaledMMKernel)
    assert _choose(monkeypatch, True) is want


def test_other_rocm_archs_never_get_the_gfx936_kernel(monkeypatch):
    try:
        chosen = _choose(monkeypatch, False)
    except ValueError as e:  # nothing else usable on this CPU box
        assert "Gfx936W8A16Fp8BlockScaledMMKernel device has FP8 hardware" in str(e)
    else:
        assert chosen is not Gfx936W8A16Fp8BlockScaledMMKernel


def test_unsupported_out_dtype_is_not_chosen_on_gfx936(monkeypatch):
    try:
        chosen = _choose(monkeypatch, True, out_dtype=torch.int8)
    except ValueError as e:
        assert "unsupported out_dtype" in str(e)
    else:
        assert chosen is not Gfx936W8A16Fp8BlockScaledMMKernel
