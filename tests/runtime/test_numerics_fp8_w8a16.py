# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W8A16 block-scaled FP8 linear for gfx936: software dequant + GEMM.

Covers patch linear-fp8-block-w8a16-gfx936. The reference decodes E4M3
through a 256-entry table built from torch.float8_e4m3fn on CPU (the code
under test uses integer bit manipulation instead) and UE8M0 as 2**(u-127),
then multiplies in float64.
"""

import pytest
import torch

from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16 as w8a16
from vllm.model_executor.kernels.linear.scaled_mm.gfx936 import (
    GFX936_BF16_WEIGHT_ATTR,
    Gfx936W8A16Fp8BlockScaledMMKernel,
)

BLOCK = (128, 128)


def _e4m3_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
        torch.float8_e4m3fn
    ).to(torch.float64)


def _ue8m0_ref(u: torch.Tensor) -> torch.Tensor:
    out = torch.pow(2.0, u.to(torch.float64) - 127.0)
    return out.masked_fill(u == 255, float("nan"))


def _random_case(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wb = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    wb = torch.where((wb & 0x7F) == 0x7F, wb - 1, wb).to(torch.uint8)  # no NaN
    nb, kb = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    su = torch.randint(120, 131, (nb, kb), generator=g, dtype=torch.int32).to(
        torch.uint8
    )
    x = torch.randn(m, k, generator=g, dtype=torch.float32)
    return wb, su, x


def _reference(x: torch.Tensor, wb: torch.Tensor, su: torch.Tensor):
    n, k = wb.shape
    w = _e4m3_table()[wb.long()]
    s = _ue8m0_ref(su)
    s = s.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    w = w * s
    return x.double() @ w.t(), x.double().abs() @ w.abs().t()


def _assert_within(out, ref, mag, out_dtype):
    # Weight values (e4m3 * 2^k) and the scale product are exact in BF16 and
    # FP32, so the only errors are the GEMM's FP32 accumulation (K * 2^-24 of
    # sum|x*w|) and one final rounding to out_dtype (half an ulp of |ref|).
    ulp = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[out_dtype]
    bound = ulp * ref.abs() + 1e-5 * mag + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_e4m3_decode_is_bit_exact_for_all_256_bytes():
    """Integer decode of every E4M3 byte equals torch.float8_e4m3fn's value
    (NaN where it is NaN, signed zeros and subnormals included)."""
    ref = _e4m3_table()
    got = w8a16.decode_e4m3fn(torch.arange(256).to(torch.uint8)).double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(ref[ok]))


def test_ue8m0_scale_decode_matches_powers_of_two_for_all_bytes():
    """Every UE8M0 byte (as uint8 and as float8_e8m0fnu) decodes to
    2**(u-127) exactly, 255 to NaN; float32 scales pass through."""
    u = torch.arange(256).to(torch.uint8)
    ref = _ue8m0_ref(u)
    for scale in (u, u.view(torch.float8_e8m0fnu)):
        got = w8a16.decode_block_scale(scale).double()
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert torch.equal(got[:255], ref[:255])
    f = torch.tensor([0.5, 3.0e-3, 7.0])
    assert torch.equal(w8a16.decode_block_scale(f), f)


@pytest.mark.parametrize("scale_kind", ["uint8", "e8m0fnu", "float32"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_w8a16_matches_float64_dequant_then_matmul(scale_kind, x_dtype):
    """Non-multiple-of-128 N and K, UE8M0 scales in every form upstream can
    hand over; chunked dequant (row_chunk=128 over N=300) gives the same
    answer as the float64 reference."""
    wb, su, x = _random_case(n=300, k=200, m=5)
    x = x.to(x_dtype)
    scale = {
        "uint8": su,
        "e8m0fnu": su.view(torch.float8_e8m0fnu),
        "float32": _ue8m0_ref(su).float(),
    }[scale_kind]
    weight = wb.view(torch.float8_e4m3fn)
    ref, mag = _reference(x, wb, su)
    for chunk in (128, 4096):
        out = w8a16.w8a16_block_mm(x, weight, scale, BLOCK, x_dtype, row_chunk=chunk)
        assert out.dtype == x_dtype and out.shape == (5, 300)
        _assert_within(out, ref, mag, x_dtype)


def test_bad_scale_shape_names_the_tensor():
    wb, su, x = _random_case(n=300, k=200, m=2)
    with pytest.raises(ValueError, match="scale: expected shape"):
        w8a16.w8a16_block_mm(x, wb, su[:, :1], BLOCK)


def _kernel_and_layer(wb, su):
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
    )

    config = FP8ScaledMMLinearLayerConfig(
        weight_quant_key=create_fp8_quant_key(
            static=True, group_shape=GroupShape(*BLOCK)
        ),
        activation_quant_key=create_fp8_quant_key(
            static=False, group_shape=GroupShape(1, BLOCK[1])
        ),
        weight_shape=tuple(wb.shape),
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
    )
    kernel = object.__new__(Gfx936W8A16Fp8BlockScaledMMKernel)
    kernel.config = config
    kernel.weight_group_shape = config.weight_quant_key.scale.group_shape
    kernel.gemv_max_m = 16  # what __init__ decides eagerly (gfx936_kernel_select)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(wb.view(torch.float8_e4m3fn), False)
    layer.weight_scale_inv = torch.nn.Parameter(su.view(torch.float8_e8m0fnu), False)
    return kernel, layer


def test_weight_cache_switch_gives_the_same_result(monkeypatch):
    """VLLM_GFX936_FP8_WEIGHT_CACHE=0 keeps no BF16 copy, =1 keeps one; both
    give the same output (bit-identical: same BF16 weights, same GEMM), and
    both match the float64 reference. Weight and scales stay as loaded."""
    wb, su, x = _random_case(n=300, k=200, m=3, seed=1)
    x = x.to(torch.bfloat16).view(1, 3, 200)
    ref, mag = _reference(x.view(3, 200), wb, su)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("VLLM_GFX936_FP8_WEIGHT_CACHE", flag)
        kernel, layer = _kernel_and_layer(wb, su)
        kernel.process_weights_after_loading(layer)
        cached = getattr(layer, GFX936_BF16_WEIGHT_ATTR)
        assert (cached is not None) == (flag == "1")
        assert torch.equal(layer.weight.view(torch.uint8), wb)
        outs[flag] = kernel.apply_weights(layer, x)
        assert outs[flag].shape == (1, 3, 300)
    assert torch.equal(outs["0"], outs["1"])
    _assert_within(outs["0"].view(3, 300), ref, mag, torch.bfloat16)


def test_kernel_is_supported_only_on_gfx936_and_first_in_rocm_list(monkeypatch):
    """The capability gate: supported on ROCm gfx936 and on the CPU (no FP8
    hardware), not on other ROCm archs or on CUDA; first in ROCm's block-FP8
    list and in the CPU's (so the CPU runs gfx936's path in CI), after only its
    csrc_gfx936 subclass."""
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.scaled_mm.gfx936 import (
        Gfx936W8A16KernelFp8BlockScaledMMKernel,
    )
    from vllm.platforms import PlatformEnum, current_platform, gfx936

    for platform in (PlatformEnum.ROCM, PlatformEnum.CPU):
        assert linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[platform][:2] == [
            Gfx936W8A16KernelFp8BlockScaledMMKernel,
            Gfx936W8A16Fp8BlockScaledMMKernel,
        ]
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False, raising=False)
    monkeypatch.setattr(current_platform, "supports_fp8", lambda: True, raising=False)
    monkeypatch.setattr(gfx936, "on_gfx936", lambda: True)
    ok, _ = Gfx936W8A16Fp8BlockScaledMMKernel.is_supported()
    assert ok
    monkeypatch.setattr(gfx936, "on_gfx936", lambda: False)  # gfx942: FP8 hardware
    ok, why = Gfx936W8A16Fp8BlockScaledMMKernel.is_supported()
    assert not ok and "gfx936" in why
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False, raising=False)
    ok, why = Gfx936W8A16Fp8BlockScaledMMKernel.is_supported()  # CUDA-like
    assert not ok and "requires ROCm" in why
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True, raising=False)
    assert Gfx936W8A16Fp8BlockScaledMMKernel.is_supported()[0]  # the CPU
