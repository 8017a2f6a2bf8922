# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The three big gfx936 kernels as one registered op each (issue 19, item 3): the dense W8A16
linear (`gfx936_fused_w8a16_mm`, patch linear-fp8-w8a16-gfx936-one-op), the routed MXFP4 MoE
experts (`gfx936_fused_mxfp4_moe`, moe-mxfp4-gfx936-one-op) and the Sparse MLA decode
(`gfx936_fused_sparse_mla_decode`, sparse-mla-gfx936-one-op, reached through upstream's
decorated `rocm_sparse_attn_decode`).

For each, through the product's own entry point (the kernel class, the experts class, the
upstream hook): the step audit's counter (tests/e2e/step_counter.py) sees exactly one launch and
no host sync, so a caller that bypasses the op (runs the twin itself) fails here; the result is
bit-identical to the PyTorch twin called directly (the op only wraps it on the CPU); and the op
has a fake that gives the real result's shape and dtype (torch.compile, graph capture).
The Sparse MLA reference's C4 top-k width (patch sparse-mla-reference-topk-no-host-sync) comes
from the packer's row capacity: no sync, the same output, and a row longer than the bound is
never cut short silently.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp8_ds_mla_writer import random_fp8_ds_mla_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402

SCALE = 1.0 / math.sqrt(512)


def counted(fn, *args, **kwargs):
    """(result, launches, syncs, ops) of one call under the step audit's counter, with the
    fused ops' implementations known to it (as in the engine run), so syncs inside them count."""
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16_op as w_op
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_op as m_op
    from vllm.v1.attention.ops import gfx936_sparse_mla_dispatch as d

    return SC.count_call({
        "vllm::gfx936_fused_w8a16_mm": w_op._w8a16_mm,
        "vllm::gfx936_fused_mxfp4_moe": m_op._mxfp4_moe,
        "vllm::gfx936_fused_sparse_mla_decode": d._decode,
    }, fn, *args, **kwargs)


# ---- W8A16 dense linear -------------------------------------------------------------------------
def _fp8_dense(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    return w, s


@pytest.mark.parametrize("m,gemv_max_m,kernels", [
    (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 4, 2),      # under graphs (w8a16_gemv_max_m: 4)
    (5, 16, 1), (16, 16, 1), (17, 16, 2),             # eagerly (16)
])
def test_w8a16_linear_is_one_op_and_computes_the_twin(m, gemv_max_m, kernels):
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936 as g
    from vllm.model_executor.kernels.linear.scaled_mm.gfx936_w8a16 import w8a16_block_mm

    w, s = _fp8_dense(384, 256, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    kernel = object.__new__(g.Gfx936W8A16Fp8BlockScaledMMKernel)
    kernel.weight_group_shape = (128, 128)
    kernel.config = SimpleNamespace(out_dtype=torch.bfloat16)
    kernel.gemv_max_m = gemv_max_m
    out, launches, syncs, ops = counted(kernel._block_mm, x, w, s)
    # one op; gfx936's kernels: the GEMV up to gemv_max_m tokens, dequantize + GEMM above
    assert (launches, syncs) == (kernels, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_w8a16_mm": kernels}
    assert torch.equal(out, w8a16_block_mm(x, w, s, (128, 128), torch.bfloat16))
    # a kept BF16 copy (VLLM_GFX936_FP8_WEIGHT_CACHE=1) is one GEMM at any token count
    wbf = w8a16_block_mm(torch.eye(256, dtype=torch.bfloat16), w, s, (128, 128),
                         torch.bfloat16).t().contiguous()
    _, launches, _, _ = counted(kernel._block_mm, x, w, s, wbf)
    assert launches == 1

    fout, _ = SC.fake_call(torch.ops.vllm.gfx936_fused_w8a16_mm, x, w, s, 128, 128,
                           torch.float32, gemv_max_m, None)
    assert fout.shape == (m, 384) and fout.dtype == torch.float32


# ---- routed MXFP4 MoE experts -------------------------------------------------------------------
def _experts(limit):
    from vllm.model_executor.layers.fused_moe.experts.gfx936_mxfp4_emulation import (
        Gfx936Mxfp4EmulationExperts,
    )

    e, h, i = 6, 64, 32
    g = torch.Generator().manual_seed(3)
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(119, 124, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(113, 117, (e, h, i // 32), generator=g, dtype=torch.uint8)
    ex = object.__new__(Gfx936Mxfp4EmulationExperts)
    ex.quant_config = SimpleNamespace(gemm1_clamp_limit=limit)
    ex.gemm1_alpha = 1.702
    ex.w1_scale_val, ex.w2_scale_val = s13, s2
    ex.direct_max_m = 64  # what __init__ decides by default (moe_direct_max_m)
    return ex, w13, w2


@pytest.mark.parametrize("on_input", [False, True])
def test_routed_mxfp4_moe_is_one_op_and_computes_the_twin(on_input):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.gfx936_routed_moe_torch import (
        routed_experts_moe_torch,
    )
    from vllm.model_executor.layers.quantization.utils.mxfp4_torch_dequant import (
        dequant_mxfp4_torch,
    )

    ex, w13, w2 = _experts(limit=7.0)
    g = torch.Generator().manual_seed(5)
    m, topk = 5, 2
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    tw = torch.rand(m, topk, generator=g)
    ids = torch.tensor([[1, 4], [4, 0], [2, 1], [5, 5], [0, 3]], dtype=torch.int32)
    kw = dict(topk_weights=tw, topk_ids=ids, activation=MoEActivation.SILU, expert_map=None,
              apply_router_weight_on_input=on_input)
    out = torch.empty(m, 64, dtype=torch.bfloat16)
    _, launches, syncs, ops = counted(ex._apply_torch, out, x, w13, w2, **kw)
    # one op, two kernels on gfx936 at these 5 tokens: the direct path's gate/up and down
    # (csrc_gfx936/moe_mxfp4.cu; the grouped path above DIRECT_MAX_TOKENS is route, gate/up,
    # down, reduce)
    assert (launches, syncs) == (2, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_mxfp4_moe": 2}
    # the twin as the experts class ran it before: its own activation method
    ref = torch.empty_like(out)
    routed_experts_moe_torch(
        ref, x,
        lambda e: dequant_mxfp4_torch(w13[e], ex.w1_scale_val[e], x.dtype),
        lambda e: dequant_mxfp4_torch(w2[e], ex.w2_scale_val[e], x.dtype),
        tw, ids, None, on_input, lambda o, h: ex.activation(MoEActivation.SILU, o, h),
        num_experts=w13.shape[0])
    assert torch.equal(out, ref)

    _, fargs = SC.fake_call(torch.ops.vllm.gfx936_fused_mxfp4_moe, out, x, w13, ex.w1_scale_val,
                            w2, ex.w2_scale_val, tw, ids, None, on_input, 1.0, 7.0, False, 64)
    assert fargs[0].shape == out.shape  # writes `output` in place, returns nothing


def test_routed_mxfp4_moe_op_runs_the_kernels_when_the_tier_table_picks_them(monkeypatch):
    """on_kernels (the kernel experts class) + path("mxfp4_moe") == "kernel": the csrc_gfx936
    MoE runs (faked ops on the CPU); the emulation class's calls (on_kernels=False) never do."""
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_kernel as mk
    from vllm.platforms import gfx936_kernel_select as sel

    ex, w13, w2 = _experts(limit=7.0)
    x = torch.randn(2, 64).to(torch.bfloat16)
    args = (x, w13, ex.w1_scale_val, w2, ex.w2_scale_val, torch.rand(2, 2),
            torch.tensor([[0, 1], [2, 1]], dtype=torch.int32), None, False, 1.0, 7.0)
    ran = []
    monkeypatch.setattr(mk, "mxfp4_moe_kernel", lambda *a, **kw: ran.append((a, kw)))
    monkeypatch.setattr(sel, "path", lambda op: "kernel")
    torch.ops.vllm.gfx936_fused_mxfp4_moe(torch.empty(2, 64, dtype=torch.bfloat16), *args, True,
                                          7)
    assert len(ran) == 1 and ran[0][1] == {"direct_max_m": 7}  # the op's limit reaches the kernels
    torch.ops.vllm.gfx936_fused_mxfp4_moe(torch.empty(2, 64, dtype=torch.bfloat16), *args, False,
                                          64)
    monkeypatch.setattr(sel, "path", lambda op: "emulation")
    torch.ops.vllm.gfx936_fused_mxfp4_moe(torch.empty(2, 64, dtype=torch.bfloat16), *args, True,
                                          64)
    assert len(ran) == 1


# ---- Sparse MLA decode ----------------------------------------------------------------------------
def _packed(rows, width):
    """Rows packed back to back in a buffer of len(rows) * width, as the engine's packers
    (compute_global_topk_ragged_indices_and_indptr) write them; the tail is garbage."""
    flat = torch.full((len(rows) * width,), 12345, dtype=torch.int32)
    pos = 0
    for r in rows:
        flat[pos:pos + len(r)] = torch.tensor(r, dtype=torch.int32)
        pos += len(r)
    indptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
    return flat, indptr


def _c4_args(seed=0, topk_rows=None, width=8):
    """A C4-like decode: dense SWA rows, the compressed top-k ragged only (no dense rows)."""
    b, h = 3, 8
    swa, _, swa_slots = random_fp8_ds_mla_cache(40, num_blocks=1, seed=seed)
    comp, _, comp_slots = random_fp8_ds_mla_cache(30, num_blocks=1, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, 512, generator=g) * 0.5).to(torch.bfloat16)
    swa_idx = swa_slots[:24].view(b, 8).to(torch.int32)
    if topk_rows is None:
        cs = comp_slots.tolist()
        topk_rows = [cs[0:5], cs[5:13], cs[13:14]]  # lengths 5, 8, 1 <= width
    tk, tk_ptr = _packed(topk_rows, width)
    return dict(
        q=q, kv_cache=comp, swa_k_cache=swa, swa_only=False, topk_indices=None,
        topk_lens=torch.tensor([len(r) for r in topk_rows], dtype=torch.int32),
        swa_indices=swa_idx, swa_lens=torch.tensor([8, 6, 3], dtype=torch.int32),
        swa_ragged_indices=None, swa_ragged_indptr=None,
        topk_ragged_indices=tk, topk_ragged_indptr=tk_ptr,
        attn_sink=torch.randn(h + 4, generator=g), scale=SCALE, head_dim=512,
        nope_head_dim=448, rope_head_dim=64, output=torch.empty(b, h, 512, dtype=torch.bfloat16))


@pytest.fixture
def no_fp8_path(monkeypatch):
    """The no-FP8 path (gfx936, or the CPU engine) taking the reference decode, as the CPU
    engine does (this test environment has no vLLM platform of its own)."""
    import vllm.platforms.gfx936_capability as cap
    from vllm.platforms import gfx936_kernel_select as sel

    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: True)
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "reference")
    monkeypatch.setattr(sel, "_CHOSEN", {})


def test_sparse_mla_decode_is_one_op_without_a_host_sync_and_computes_the_reference(no_fp8_path):
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
        rocm_sparse_attn_decode_reference,
    )

    kw = _c4_args()
    _, launches, syncs, opcount = counted(ops.rocm_sparse_attn_decode, **kw)
    # one op (the reference's .item() is gone too), one kernel on gfx936 (split-K merged in it)
    assert (launches, syncs) == (1, 0), opcount
    assert opcount == {"launch:vllm::gfx936_fused_sparse_mla_decode": 1}
    # the reference called directly pads to the longest row read from the data (its old way)
    ref = dict(kw, output=torch.empty_like(kw["output"]))
    rocm_sparse_attn_decode_reference(**ref)
    assert torch.equal(kw["output"], ref["output"])
    assert bool(torch.isfinite(kw["output"].float()).all())

    _, fargs = SC.fake_call(torch.ops.vllm.gfx936_fused_sparse_mla_decode,
                            *[kw[k] for k in kw])
    assert fargs[-1].shape == kw["output"].shape


def test_a_ragged_row_longer_than_its_bound_is_never_cut_short_silently(no_fp8_path,
                                                                        monkeypatch):
    """The bound is the packer's contract; a buffer that breaks it (a row of 9 in a buffer of
    3 x 8, width 8) makes that query's output NaN, the others unchanged; with
    VLLM_GFX936_SPARSE_VALIDATE=1 the error names the tensor."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    from vllm.v1.attention.ops.gfx936_sparse_mla_reference import SparseMLAValidationError

    cs = random_fp8_ds_mla_cache(30, num_blocks=1, seed=1)[2].tolist()
    rows = [cs[0:5], cs[5:14], cs[14:15]]  # 5 + 9 + 1 = 15 entries <= 24: fits the buffer
    kw = _c4_args(topk_rows=rows)
    ops.rocm_sparse_attn_decode(**kw)
    bad = torch.isnan(kw["output"].float()).flatten(1).all(-1)
    assert bad.tolist() == [False, True, False]
    monkeypatch.setenv("VLLM_GFX936_SPARSE_VALIDATE", "1")
    with pytest.raises(SparseMLAValidationError, match="topk_ragged_indptr.*bound 8"):
        ops.rocm_sparse_attn_decode(**_c4_args(topk_rows=rows))


@pytest.mark.parametrize("m,inter,limit,kernels", [
    (1, 256, 64, 2), (64, 256, 64, 2),  # the direct path (gate/up, down) up to its limit
    (65, 256, 64, 4),                   # grouped: route, gate/up, down, reduce
    (2, 96, 64, 3), (5, 96, 64, 4),     # I = 96 takes two down steps: grouped, reduce folded <= 4
    (1, 1024, 64, 3),                   # I = 1024 (32 lanes per down row): grouped
    (4, 256, 4, 2), (5, 256, 4, 4),     # VLLM_GFX936_MOE_DIRECT_MAX_M=4
    (1, 256, 0, 3),                     # =0: always grouped
])
def test_step_counter_counts_the_moe_path_the_front_end_takes(m, inter, limit, kernels):
    """The audit's kernel count per MoE op follows the front end's own choice (direct_ok with
    the op's direct_max_m argument)."""
    h, e, topk = 4096, 8, 6
    args = (torch.empty(m, h), torch.empty(m, h), torch.empty(e, 2 * inter, h // 2),
            None, None, None, torch.empty(m, topk), torch.empty(m, topk, dtype=torch.int32),
            None, False, 1.0, 10.0, True, limit)
    assert SC.DEVICE_KERNELS["gfx936_fused_mxfp4_moe"](args) == kernels
