# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""STAND-INS for the layer-step bench (bench/layer_step.py): two ops gfx936 runs from vLLM's
compiled extensions, which the H200 stage does not have (no vLLM build there). Each is ONE
Triton launch, as gfx936's op is one launch, so the bench's launch count per layer is the one
gfx936 makes; their TIME is the stand-in's, not gfx936's kernel's. Not product code: nothing in
vllm/ imports this file.

* :func:`rms_norm_standin` stands in for ``_C.rms_norm`` (csrc/libtorch_stable/
  layernorm_kernels.cu, built for HIP), what ``gfx936_fused_rms_norm`` launches for the decoder
  layer's ``attn_norm`` / ``ffn_norm`` (gfx936_rmsnorm.py). Numerics of the IR op's native
  implementation (vllm/ir/ops/layernorm.py, the CPU's implementation of that op): the row in
  float32, ``x * rsqrt(sum(x^2) / H + eps)`` rounded to the weight's dtype, times the weight,
  rounded to ``x``'s dtype.
* :func:`topk_softplus_sqrt_standin` stands in for ``_moe_C.topk_softplus_sqrt``
  (csrc/libtorch_stable/moe/topk_softplus_sqrt_kernels.cu), what
  ``gfx936_fused_topk_softplus_sqrt`` launches (router/gfx936_topk_softplus_sqrt.py), without
  the hash-MoE table (Flash's routed layers): scores ``sqrt(softplus(logits))`` in float32, the
  top-k of ``scores + bias`` (bias for the choice only), weights = the unbiased scores of the
  chosen experts, renormalized, times the routed scaling factor. Numerics of upstream's
  PyTorch twin ``_topk_softplus_sqrt_torch`` (fused_topk_bias_router.py).

Layouts read and written (row strides from the tensors, unit stride within a row):

    rms_norm_standin   x [T, H] bf16/fp32, row t at x_ptr + t * x_s0; w [H] (contiguous);
                       out [T, H] x's dtype, contiguous. Grid (T,): program t owns row t.
    topk_softplus_sqrt logits [T, E] bf16/fp32, row t at g_ptr + t * g_s0; bias [E] fp32;
                       weights [T, K] fp32 and ids [T, K] int32, contiguous (K = top-k, in
                       descending order of the biased score; ties: the lower expert id).
                       Grid (T,): program t owns row t.

Plain tl.load / tl.sum / tl.max / tl.store, no FP8 types, no warp-size assumption. bf16
roundings by integer ops (``_bf16_bits`` of gfx936_kv_insert_triton.py, the same on every
backend: the Triton interpreter truncates a float->bf16 cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton import _bf16_bits


@triton.jit
def _rms_norm_kernel(x_ptr, x_s0, w_ptr, out_ptr, out_s0, eps, H, BLOCK: tl.constexpr,
                     ROUND_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + t * x_s0 + cols, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if ROUND_BF16:  # x.to(weight.dtype) * weight, then .to(x.dtype)
        y = (_bf16_bits(y) << 16).to(tl.float32, bitcast=True)
        y = (_bf16_bits(y * w) << 16).to(tl.float32, bitcast=True)
    else:
        y = y * w
    tl.store(out_ptr + t * out_s0 + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_standin(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """STAND-IN for ``_C.rms_norm`` (one launch): ``[T, H]`` -> ``[T, H]`` in x's dtype."""
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm stand-in: x {tuple(x.shape)} must be [T, H] and weight "
                         f"{tuple(weight.shape)} [H]")
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rms_norm stand-in: x {x.dtype} and weight {weight.dtype} must be "
                         "the same, bf16 or float32 (_C.rms_norm needs them equal)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x.stride(0), weight.contiguous(), out,
                                        out.stride(0), float(eps), x.shape[1],
                                        BLOCK=triton.next_power_of_2(x.shape[1]),
                                        ROUND_BF16=x.dtype == torch.bfloat16)
    return out


@triton.jit
def _topk_softplus_sqrt_kernel(g_ptr, g_s0, bias_ptr, wt_ptr, id_ptr, scale, E,
                               K: tl.constexpr, BLOCK_E: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    x = tl.load(g_ptr + t * g_s0 + e, mask=m, other=0.0).to(tl.float32)
    # softplus (torch: beta 1, threshold 20) with log1p(u) = log(1 + u) * u / ((1 + u) - 1)
    # (exact to float32 for small u, no libdevice call)
    u = tl.exp(tl.minimum(x, 20.0))
    v = 1.0 + u
    lp = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    s = tl.sqrt(tl.where(x > 20.0, x, lp))
    choice = tl.where(m, s + tl.load(bias_ptr + e, mask=m, other=0.0), float("-inf"))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    wts = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(choice, axis=0)
        j = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)
        ids = tl.where(k == i, j, ids)
        wts = tl.where(k == i, tl.sum(tl.where(e == j, s, 0.0), axis=0), wts)
        choice = tl.where(e == j, float("-inf"), choice)
    wts = wts / tl.maximum(tl.sum(wts, axis=0), 1e-20) * scale
    tl.store(wt_ptr + t * K + k, wts, mask=k < K)
    tl.store(id_ptr + t * K + k, ids, mask=k < K)


def topk_softplus_sqrt_standin(logits: torch.Tensor, bias: torch.Tensor, topk: int,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """STAND-IN for ``_moe_C.topk_softplus_sqrt`` (one launch, renormalize=True): logits
    ``[T, E]`` -> (weights ``[T, topk]`` fp32, ids ``[T, topk]`` int32)."""
    if logits.ndim != 2 or bias.shape != (logits.shape[1],) or bias.dtype != torch.float32:
        raise ValueError(f"topk_softplus_sqrt stand-in: logits {tuple(logits.shape)} must be "
                         f"[T, E] and the bias {tuple(bias.shape)} {bias.dtype} [E] float32")
    if not 0 < topk <= logits.shape[1]:
        raise ValueError(f"topk_softplus_sqrt stand-in: top-k {topk} of {logits.shape[1]}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    t = logits.shape[0]
    wts = torch.empty(t, topk, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, topk, dtype=torch.int32, device=logits.device)
    if t:
        _topk_softplus_sqrt_kernel[(t,)](logits, logits.stride(0), bias.contiguous(), wts,
                                         ids, float(scale), logits.shape[1], K=topk,
                                         BLOCK_E=triton.next_power_of_2(logits.shape[1]),
                                         BLOCK_K=triton.next_power_of_2(topk))
    return wts, ids
