# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU's PyTorch twins against the upstream Triton kernels gfx936 runs in their place,
run here on the same inputs under Triton's CPU interpreter (issue 16, item 7; the table of all
twins is in docs/dsv4-no-fp8-path.md).

Interpreter caveats that shape what is compared: its fp32 -> e4m3 cast is wrong for some
inputs, so no FP8 code a kernel *writes* is taken from it (the indexer q bytes, the compressor's
e4m3 data bytes); its e4m3 -> fp32 decode is exact for every finite code (checked below), so a
kernel that *reads* FP8 is compared in full. Small shapes: the whole file runs in seconds.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from test_dsv4_compressor_no_fp8 import Scenario
from triton_interp import import_with_real_triton, tl, triton

from vllm.models.deepseek_v4.amd import gfx936_attention_torch as attn
from vllm.models.deepseek_v4.common.ops import gfx936_compressor as comp
from vllm.models.deepseek_v4.common.ops import gfx936_indexer_q as idx_q
from vllm.model_executor.layers.quantization.utils.lowp_codecs_torch import decode_e4m3fn

_rms_up = import_with_real_triton("vllm.models.common.ops.fused_qk_rmsnorm")


def _private_copy_with_real_triton(name: str):
    """A second copy of a module, under another name, with real Triton: attention.py holds the
    model's classes, so it is not reloaded in place (other tests keep using the original)."""
    import vllm.triton_utils as vllm_triton_utils

    spec = importlib.util.find_spec(name)
    copy = importlib.util.spec_from_file_location(f"_interp_{name.replace('.', '_')}",
                                                  spec.origin)
    mod = importlib.util.module_from_spec(copy)
    saved = (vllm_triton_utils.triton, vllm_triton_utils.tl)
    vllm_triton_utils.triton, vllm_triton_utils.tl = triton, tl
    try:
        copy.loader.exec_module(mod)
    finally:
        vllm_triton_utils.triton, vllm_triton_utils.tl = saved
    return mod


_attn_up = _private_copy_with_real_triton("vllm.models.deepseek_v4.attention")
_iq_up = import_with_real_triton("vllm.models.deepseek_v4.common.ops.fused_indexer_q")
_cache_up = import_with_real_triton("vllm.models.deepseek_v4.common.ops.cache_utils")
import_with_real_triton("vllm.triton_utils.softmax")  # the compressor kernel's tl helper
_comp_up = import_with_real_triton("vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache")


@triton.jit
def _decode_e4m3_kernel(x_ptr, y_ptr):
    o = tl.arange(0, 256)
    tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.float8e4nv, bitcast=True).to(tl.float32))


def test_interpreter_decodes_every_finite_e4m3_code_like_the_fork_decoder():
    """Precondition of the gather-dequant comparison: the interpreter's e4m3 -> fp32 equals
    the fork's integer decoder on all 254 finite codes (0x7f / 0xff are NaN; the fork's
    saturating encoder never writes them)."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256)
    _decode_e4m3_kernel[(1,)](codes, got)
    finite = (codes & 0x7F) != 0x7F
    assert torch.equal(got[finite], decode_e4m3fn(codes)[finite].to(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q_kv_rmsnorm_matches_fused_q_kv_rmsnorm_triton(dtype):
    """Float work: both keep x, rrms and w in fp32 and cast once at the store. The sum of
    squares is reduced in another order (tl.sum tree vs torch), so rrms may differ by a few
    fp32 ulps: fp32 out, 4 fp32 ulps (2**-21 relative; measured ~64% bit-equal). bf16
    out: 1 bf16 ulp (2**-7 relative), because the interpreter's fp32 -> bf16 store truncates
    where the hardware (and the twin) round to nearest even (measured: ~50% of elements)."""
    g = torch.Generator().manual_seed(0)
    qr = (3 * torch.randn(5, 96, generator=g)).to(dtype)
    kv = (0.2 * torch.randn(5, 64, generator=g)).to(dtype)
    qw = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    q_t, kv_t = attn.q_kv_rmsnorm(qr, kv, qw, kw, 1e-6)
    q_u, kv_u = _rms_up.fused_q_kv_rmsnorm(qr, kv, qw, kw, 1e-6)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-21
    for t, u in ((q_t, q_u), (kv_t, kv_u)):
        assert t.dtype == u.dtype == dtype
        err = (t.double() - u.double()).abs()
        assert (err <= ulp * u.double().abs()).all(), float(err.max())


@pytest.mark.parametrize("ratio,top_k", [(4, 8), (128, 16), (4, 20)])
def test_fill_short_context_topk_matches_triton_kernel(ratio, top_k):
    """Integer work, bit exact, including rows whose candidates exceed top_k, position 0 and
    padded rows (position -1). The kernel writes rows [0, num_tokens) at stride top_k."""
    g = torch.Generator().manual_seed(ratio + top_k)
    pos = torch.cat([torch.tensor([-1, 0, ratio - 2, ratio - 1, ratio * top_k + 5]),
                     torch.randint(0, ratio * (top_k + 2), (6,), generator=g)])
    n = pos.numel()
    ours = torch.full((n + 2, top_k), 7, dtype=torch.int32)  # 2 extra rows must stay
    theirs = ours.clone()
    idx_q.fill_short_context_topk_indices_torch(ours, pos, top_k, ratio, n)
    _attn_up._fill_short_context_topk_indices[(n,)](
        theirs, pos, TOP_K=top_k, COMPRESS_RATIO=ratio,
        PADDED_TOP_K=triton.next_power_of_2(top_k))
    assert torch.equal(ours, theirs), (ours.tolist(), theirs.tolist())


def test_indexer_q_weights_and_scale_match_fused_indexer_q_triton():
    """The FP8 path's non-FP8 output, bit exact: weights_out = weights * q_scale * softmax *
    head, where q_scale = 2**ceil(log2(max(amax, 1e-4) / 448)) over the NoPE values and the
    bf16-rounded RoPE values (the kernel takes float log2, the twin an integer exponent).
    Rows are built with amax exactly 448 * 2**k (a power-of-two boundary) and just above it.
    The e4m3 q codes are not compared: the interpreter's fp32 -> e4m3 cast is wrong for some
    inputs (the twin's codes are checked against float64 in test_dsv4_indexer_no_fp8.py)."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 6, 4, 128
    q = torch.randn(T, H, D, generator=g) * torch.logspace(-3, 2, T)[:, None, None]
    q[0, 0, 3] = 448.0 * 4          # amax on a power-of-two boundary (NoPE)
    q[0, 1, 3] = 448.0 * 4 * (1 + 2**-7)
    q[1, 2, :] = 1e-6               # amax under the 1e-4 floor
    q = q.to(torch.bfloat16)
    pos = torch.tensor([0, 3, 17, 100, 5, 63])
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = torch.arange(128, dtype=torch.float64)[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], -1).to(torch.float32)
    w = torch.randn(T, H, generator=g)
    _, w_t = idx_q.indexer_q_rope_quant_torch(pos, q, cs, w, 0.125, 0.5)
    _, w_u = _iq_up.fused_indexer_q_rope_quant(pos, q, cs, w, 0.125, 0.5)
    assert torch.equal(w_t, w_u), (w_t / w_u)


def _gather_inputs(block_size, g):
    """Random fp8_ds_mla bytes: finite e4m3 codes, UE8M0 scales around 2**0, bf16 RoPE."""
    n_blocks = 5
    blk = torch.empty(n_blocks, block_size * (576 + 8), dtype=torch.uint8)
    tok = blk[:, : block_size * 576].view(n_blocks, block_size, 576)
    codes = torch.randint(0, 256, (n_blocks, block_size, 448), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    tok[..., :448] = codes
    rope = torch.randn(n_blocks, block_size, 64, generator=g).to(torch.bfloat16)
    tok[..., 448:] = rope.view(torch.uint8).view(n_blocks, block_size, 128)
    sc = blk[:, block_size * 576:].view(n_blocks, block_size, 8)
    sc[..., :7] = torch.randint(110, 140, (n_blocks, block_size, 7), generator=g,
                                dtype=torch.uint8)
    sc[..., 7] = 0
    return blk.view(n_blocks, block_size, 576 + 8)


@pytest.mark.parametrize("block_size,with_lens", [(16, True), (64, False)])
def test_dequantize_and_gather_matches_triton_kernel(block_size, with_lens):
    """Reads FP8 (decode is exact in the interpreter, checked above): bit exact. Two requests
    over a shuffled block table, gather of the last tokens or all of them, an offset."""
    g = torch.Generator().manual_seed(block_size)
    cache = _gather_inputs(block_size, g)
    seq = torch.tensor([block_size + 5, 2 * block_size], dtype=torch.int32)
    lens = torch.tensor([7, block_size + 3], dtype=torch.int32) if with_lens else None
    bt = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32)
    width = int(seq.max()) + 2
    ours = torch.full((2, width, 512), -3.0, dtype=torch.bfloat16)
    theirs = ours.clone()
    attn.dequantize_and_gather_k_cache(ours, cache, seq, lens, bt, block_size, 2)
    _cache_up.dequantize_and_gather_k_cache_triton(theirs, cache, seq, lens, bt, block_size, 2)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("ratio,head", [(4, 512), (128, 512), (4, 128)])
def test_compress_norm_rope_store_matches_triton_kernel_outside_the_e4m3_codes(ratio, head):
    """The twin and the fused compress+RMSNorm+RoPE+FP8-insert kernel write the same cache
    bytes except the e4m3 codes (the interpreter's fp32 -> e4m3 cast is wrong for some
    inputs): the bf16 RoPE tail and the UE8M0 scale bytes of head 512 (fp8_ds_mla), the fp32
    power-of-two scale of head 128 (indexer K), every byte of unwritten slots, and the
    state cache. Float work: softmax/RMSNorm reduce in another order and the interpreter's
    fp32 -> bf16 cast truncates (hardware and twin round to nearest even), so a RoPE value
    may be the neighbouring bf16 (tolerance 1 bf16 ulp, 2**-7 relative) and a scale may
    move one power of two only when the amax sits on a boundary (allowed on <= 1% of tokens;
    the twin's values are checked against float64 in test_dsv4_compressor_no_fp8.py)."""
    kw = dict(ratio=ratio, head=head, kv_block=4, lens=[2 * ratio + 3, ratio + 1], seed=5)
    a, b = Scenario(**kw), Scenario(**kw)
    steps = [[(0, 0, ratio + 1), (1, 0, ratio + 1)], [(0, ratio + 1, 2 * ratio + 3)]]
    for chunks in steps:
        a.step(chunks, pad=1)
    real = comp.compress_norm_rope_store_torch
    try:
        comp.compress_norm_rope_store_torch = _comp_up.compress_norm_rope_store_triton
        for chunks in steps:
            b.step(chunks, pad=1)
    finally:
        comp.compress_norm_rope_store_torch = real
    assert torch.equal(a.state, b.state)
    assert a.written, "the scenario wrote no compressed token"
    bs = a.kv_cache.shape[1]
    flat_a, flat_b = a.kv_cache.view(a.kv_cache.shape[0], -1), b.kv_cache.view(
        b.kv_cache.shape[0], -1)
    codes = torch.zeros_like(flat_a, dtype=torch.bool)
    scale_moves = 0
    for slot in a.written:
        blk, t = divmod(slot, bs)
        if head == 512:
            codes[blk, t * 576: t * 576 + 448] = True
            ra = flat_a[blk, t * 576 + 448: (t + 1) * 576].clone().view(torch.bfloat16)
            rb = flat_b[blk, t * 576 + 448: (t + 1) * 576].clone().view(torch.bfloat16)
            err = (ra.double() - rb.double()).abs()
            assert (err <= 2.0**-7 * rb.double().abs()).all(), (slot, float(err.max()))
            codes[blk, t * 576 + 448: (t + 1) * 576] = True
            s = slice(bs * 576 + t * 8, bs * 576 + (t + 1) * 8)
        else:
            codes[blk, t * 128: (t + 1) * 128] = True
            s = slice(bs * 128 + t * 4, bs * 128 + (t + 1) * 4)
        sa, sb = flat_a[blk, s].to(torch.int32), flat_b[blk, s].to(torch.int32)
        if not torch.equal(sa, sb):
            scale_moves += 1
            if head == 512:
                assert ((sa - sb).abs() <= 1).all(), (slot, sa.tolist(), sb.tolist())
            else:
                ea = flat_a[blk, s].clone().view(torch.float32)
                eb = flat_b[blk, s].clone().view(torch.float32)
                assert float(ea / eb) in (0.5, 2.0), (slot, float(ea), float(eb))
            codes[blk, s] = True
    assert scale_moves <= max(len(a.written) // 100, 0), scale_moves
    assert torch.equal(flat_a[~codes], flat_b[~codes])
