# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode step's PyTorch twins without host syncs (issue 19), each against the
implementation it replaced (kept below, verbatim in substance, as the reference) and counted
with the step audit's own counter (tests/e2e/step_counter.py): the same bytes / indices /
values, and 0 host syncs where the old one had some.

- compressor (`gfx936_compressor`): boundary tokens found on the device (no `nonzero`), every
  token's window computed in a fixed shape, the writers without boolean-mask filters; the
  cache bytes (state cache and compressed KV / indexer K cache) equal the old ones byte for
  byte, for decode batches with padding and prefill chunks (the compacted path).
- C4 indexer decode (`gfx936_sparse_attn_indexer`): logits and top-k of the whole batch in one
  pass instead of a per-request loop with `.item()`; with integer-valued E4M3 inputs every
  logit is exact in any summation order, so the selected indices must be identical (ties
  included: the stable sort gives the lower index).
- ragged-index twins (`gfx936_attention_torch`): the packed rows equal the old ones.
- routed-experts MoE (`gfx936_routed_moe_torch`): no sync (numerics: its own test module).
- Sparse MLA reference decode: ragged rows padded to the dense width give the same rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vllm.models.deepseek_v4.amd import gfx936_attention_torch as attn_torch
from vllm.models.deepseek_v4.common.ops import gfx936_compressor as comp
from vllm.v1.attention.ops import gfx936_sparse_attn_indexer as idx
from vllm.v1.attention.ops import gfx936_sparse_mla_reference as mla_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402

ROPE = 64


def counted(fn, *args, **kwargs):
    """(result, host syncs, sync sites) of one call under the step audit's counter."""
    c = SC.StepCounter()
    with c:
        out = fn(*args, **kwargs)
    return out, c.counts["sync"], dict(c.sites)


# ---- the implementations before issue 19 (references) ---------------------------------------
def old_save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size,
                            state_width, compress_ratio):
    n = slot_mapping.shape[0]
    head = kv.shape[-1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    pos = positions[:n].to(torch.int64)[keep]
    sc = score[:n][keep].to(torch.float32) + ape[pos % compress_ratio].to(torch.float32)
    state_cache[blk, off, :head] = kv[:n][keep].to(state_cache.dtype)
    state_cache[blk, off, state_width:state_width + head] = sc.to(state_cache.dtype)


def old_write_indexer_k_fp8(kv_cache, slot_mapping, k):
    head, bs = k.shape[-1], kv_cache.shape[1]
    cache_2d = kv_cache.view(kv_cache.shape[0], -1)
    slots = slot_mapping[: k.shape[0]].to(torch.int64)
    keep = slots >= 0
    codes, scales = comp.quantize_indexer_k(k[: slots.shape[0]][keep])
    slots = slots[keep]
    blk, pos = (slots // bs)[:, None], (slots % bs)[:, None]
    cache_2d[blk, pos * head + torch.arange(head)] = codes
    cache_2d[blk, bs * head + pos * 4 + torch.arange(4)] = scales.contiguous().view(
        torch.uint8).view(-1, 4)


def old_compress_norm_rope_store(state_cache, num_actual, token_to_req_indices, positions,
                                 slot_mapping, block_table, block_size, state_width,
                                 cos_sin_cache, kv_cache, kv_slots, head_dim, compress_ratio,
                                 overlap, rms_norm_weight, rms_norm_eps):
    pos = positions[:num_actual].to(torch.int64)
    ok = (slot_mapping[:num_actual] >= 0) & ((pos + 1) % compress_ratio == 0)
    ok &= kv_slots[:num_actual] >= 0
    i = torch.nonzero(ok, as_tuple=False).flatten()
    if i.numel() == 0:
        return
    x = comp.compress_windows(state_cache, i, token_to_req_indices, positions, block_table,
                              block_size, state_width, head_dim, compress_ratio, overlap)
    normed = comp.rms_norm(x, rms_norm_weight, rms_norm_eps)
    p = positions[i].to(torch.int64)
    roped = comp.gptj_rope_tail(normed, cos_sin_cache[(p // compress_ratio) * compress_ratio],
                                ROPE)
    if head_dim == 512:
        full = torch.cat([normed[:, :-ROPE], roped[:, -ROPE:]], -1)
        comp.write_fp8_ds_mla(kv_cache, kv_slots[i], kv_cache.shape[1], full)
    else:
        old_write_indexer_k_fp8(kv_cache, kv_slots[i], roped)


def old_paged_indexer_logits(q_codes, kv_cache, weights, context_lens, block_table,
                             max_model_len):
    bsz, next_n, h, d = q_codes.shape
    ends = idx.decode_row_ends(context_lens, next_n).view(bsz, next_n)
    logits = torch.full((bsz * next_n, max_model_len), float("-inf"))
    qf = idx.decode_e4m3fn(q_codes, "q")
    w = weights.to(torch.float32).view(bsz, next_n, h)
    bs = kv_cache.shape[1]
    for b in range(bsz):
        n = min(int(ends[b].max().item()), max_model_len)
        if n <= 0:
            continue
        pos = torch.arange(n)
        codes, scales = idx.read_indexer_k(kv_cache, block_table[b, pos // bs], pos % bs, d)
        s = idx._scores(qf[b], w[b], idx.decode_e4m3fn(codes, "k")) * scales[None, :]
        s.masked_fill_(pos[None, :] >= ends[b][:, None], float("-inf"))
        logits[b * next_n:(b + 1) * next_n, :n] = s
    return logits


def old_top_k_per_row(logits, row_starts, row_ends, top_k, out):
    rows = logits.shape[0]
    starts = row_starts.view(-1)[:rows].to(torch.int64)
    ends = row_ends.view(-1)[:rows].to(torch.int64)
    lens = (ends - starts).clamp(min=0)
    cols = torch.arange(logits.shape[1])[None, :]
    valid = (cols >= starts[:, None]) & (cols < ends[:, None])
    masked = logits.masked_fill(~valid, float("-inf"))
    kk = min(top_k, logits.shape[1])
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :kk]
    res = torch.full((rows, top_k), -1, dtype=torch.int64)
    res[:, :kk] = order - starts[:, None]
    short = lens <= top_k
    if bool(short.any()):
        k_idx = torch.arange(top_k)[None, :]
        res[short] = torch.where(k_idx < lens[short][:, None], k_idx, -1)
    out[:rows, :top_k] = res.to(out.dtype)


def old_pack(values, lens, indptr, width):
    flat = torch.full((values.shape[0] * width,), -7, dtype=torch.int32)
    cols = torch.arange(width)[None, :]
    keep = cols < lens[:, None]
    if keep.any():
        dst = (indptr[:-1].to(torch.int64)[:, None] + cols)[keep]
        flat[dst] = values[keep].to(torch.int32)
    return flat


# ---- compressor ------------------------------------------------------------------------------
def _compressor_case(ratio, head, chunks, pad, seed):
    """State cache, compressed cache and one step's tokens: `chunks` [(req, start, end)]."""
    g = torch.Generator().manual_seed(seed)
    overlap = ratio == 4
    w = (1 + overlap) * head
    sbs = 4 if ratio == 4 else 8
    nreq = max(r for r, _, _ in chunks) + 1
    max_pos = max(e for _, _, e in chunks) + 1
    per_req = -(-max_pos // sbs)
    state = torch.randn(nreq * per_req + 2, sbs, 2 * w, generator=g)
    sbt = torch.randperm(state.shape[0], generator=g)[: nreq * per_req].view(nreq, -1).int()
    kvb = 4 if head == 128 else 2
    kv_per_req = -(-(max_pos // ratio + 1) // kvb)
    tb = 132 if head == 128 else 584
    kv_cache = torch.randint(0, 256, (nreq * kv_per_req + 1, kvb, tb), generator=g,
                             dtype=torch.uint8)
    kbt = torch.randperm(kv_cache.shape[0], generator=g)[: nreq * kv_per_req].view(nreq, -1)
    pos = torch.cat([torch.arange(s, e) for _, s, e in chunks] + [torch.zeros(pad, dtype=torch.long)])
    req = torch.cat([torch.full((e - s,), r) for r, s, e in chunks] + [torch.zeros(pad, dtype=torch.long)])
    n = pos.shape[0]
    real = torch.arange(n) < n - pad
    slots = torch.where(real, sbt[req, pos // sbs].long() * sbs + pos % sbs, -1)
    c = pos // ratio
    ks = kbt[req, c // kvb].long() * kvb + c % kvb
    kv_slots = torch.where(real & ((pos + 1) % ratio == 0), ks, -1)
    kv = torch.randn(n, w, generator=g).to(torch.bfloat16)
    sc = (2 * torch.randn(n, w, generator=g)).to(torch.bfloat16)
    ape = torch.randn(ratio, w, generator=g)
    ang = torch.arange(max_pos + 8, dtype=torch.float32)[:, None] / (
        10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    weight = 1 + 0.1 * torch.randn(head, generator=g)
    return dict(state=state, sbt=sbt, sbs=sbs, w=w, kv_cache=kv_cache, pos=pos, req=req.int(),
                slots=slots, kv_slots=kv_slots, kv=kv, sc=sc, ape=ape, cos_sin=cos_sin,
                weight=weight, overlap=overlap)


class _Meta:
    def __init__(self, slot_mapping):
        self.slot_mapping = slot_mapping


def _run_new_compressor(c, ratio, head):
    comp.save_partial_states_torch(c["kv"], c["sc"], c["ape"], c["pos"], c["state"], c["slots"],
                                   c["sbs"], c["w"], ratio)
    comp.compress_norm_rope_store_torch(
        state_cache=c["state"], num_actual=c["pos"].shape[0], token_to_req_indices=c["req"],
        positions=c["pos"], slot_mapping=c["slots"], block_table=c["sbt"],
        block_size=c["sbs"], state_width=c["w"], cos_sin_cache=c["cos_sin"],
        kv_cache=c["kv_cache"], k_cache_metadata=_Meta(c["kv_slots"]), pdl_kwargs={},
        head_dim=head, rope_head_dim=ROPE, compress_ratio=ratio, overlap=c["overlap"],
        use_fp4_cache=False, rms_norm_weight=c["weight"], rms_norm_eps=1e-6,
        quant_block=64, token_stride=576, scale_dim=8)


def _run_old_compressor(c, ratio, head):
    old_save_partial_states(c["kv"], c["sc"], c["ape"], c["pos"], c["state"], c["slots"],
                            c["sbs"], c["w"], ratio)
    old_compress_norm_rope_store(
        c["state"], c["pos"].shape[0], c["req"], c["pos"], c["slots"], c["sbt"], c["sbs"],
        c["w"], c["cos_sin"], c["kv_cache"], c["kv_slots"], head, ratio, c["overlap"],
        c["weight"], 1e-6)


COMPRESSOR_STEPS = {
    # decode: one token per request, boundaries on some (positions 7, 10, 3 for C4), padding
    "decode": ([(0, 7, 8), (1, 10, 11), (2, 3, 4)], 2),
    "decode-no-boundary": ([(0, 5, 6), (1, 9, 10)], 1),
    # prefill chunks: more tokens than windows, so the boundary tokens are compacted
    "prefill": ([(0, 0, 21), (1, 6, 19)], 3),
}


@pytest.mark.parametrize("ratio,head", [(4, 128), (4, 512), (128, 512)])
@pytest.mark.parametrize("step", sorted(COMPRESSOR_STEPS))
def test_compressor_writes_the_old_bytes_without_a_host_sync(ratio, head, step):
    chunks, pad = COMPRESSOR_STEPS[step]
    if ratio == 128:  # same shapes of step, positions around 127
        chunks = [(r, s + 120, e + 120) for r, s, e in chunks] if step != "prefill" else [
            (0, 100, 300), (1, 0, 140)]
    seed = ratio + head + len(step)
    new, old = _compressor_case(ratio, head, chunks, pad, seed), _compressor_case(
        ratio, head, chunks, pad, seed)
    before = new["kv_cache"].clone()
    _, syncs, sites = counted(_run_new_compressor, new, ratio, head)
    _, old_syncs, _ = counted(_run_old_compressor, old, ratio, head)
    assert torch.equal(new["state"], old["state"]), "state cache differs from the old writer"
    assert torch.equal(new["kv_cache"], old["kv_cache"]), "compressed cache differs"
    if step != "decode-no-boundary":
        assert not torch.equal(new["kv_cache"], before), "the step wrote no window"
    assert syncs == 0, sites
    assert old_syncs > 0  # the counter sees the old boolean masks / nonzero


def test_indexer_k_writer_all_padded_and_none_padded_match_the_old_bytes():
    g = torch.Generator().manual_seed(5)
    for slots in (torch.tensor([-1, -1, -1]), torch.tensor([5, 0, 9]), torch.tensor([-1, 4, -1])):
        k = torch.randn(3, 128, generator=g)
        a = torch.randint(0, 256, (3, 4, 132), generator=g, dtype=torch.uint8)
        b = a.clone()
        _, syncs, _ = counted(comp.write_indexer_k_fp8, a, slots, k)
        old_write_indexer_k_fp8(b, slots, k)
        assert torch.equal(a, b) and syncs == 0, slots


# ---- indexer decode --------------------------------------------------------------------------
def _int_e4m3(g, shape, lo, hi):
    """E4M3 bytes of small integers (exact; products and sums stay exact in fp32)."""
    return torch.randint(lo, hi + 1, shape, generator=g).float().to(torch.float8_e4m3fn).view(
        torch.uint8)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("bsz,next_n,top_k", [(1, 1, 8), (5, 1, 8), (3, 2, 4), (4, 1, 64)])
def test_batched_indexer_decode_selects_what_the_per_request_loop_did(bsz, next_n, top_k,
                                                                      chunked, monkeypatch):
    """Same top-k indices (ties included) as the old per-request loop, 0 host syncs; the
    contexts differ per request (some shorter than top-k, one empty). `chunked`: the memory
    bound forces one request per chunk."""
    if chunked:
        monkeypatch.setattr(idx, "_SCORE_BLOCK_ELEMS", 1)
    g = torch.Generator().manual_seed(bsz * 10 + next_n + top_k)
    bs, nblocks, h, d, max_len = 4, 30, 4, 128, 40
    cache = torch.randint(0, 256, (nblocks, bs, d + 4), generator=g, dtype=torch.uint8)
    # K: integers in [-3, 3] (many equal logits), power-of-two scales
    k = torch.randint(-3, 4, (nblocks * bs, d), generator=g).float()
    comp.write_indexer_k_fp8(cache, torch.arange(nblocks * bs), k)
    bt = torch.stack([torch.randperm(nblocks, generator=g)[:8] for _ in range(bsz)]).int()
    ctx = torch.randint(1, 33, (bsz,), generator=g)
    ctx[0] = 0 if bsz > 1 else ctx[0]
    q = _int_e4m3(g, (bsz, next_n, h, d), -2, 2)
    w = torch.randint(-2, 3, (bsz * next_n, h), generator=g).float()
    ends = idx.decode_row_ends(ctx, next_n)
    new_logits, syncs_l, sites = counted(idx._paged_decode_logits, q, cache, w, ends, bt, max_len)
    new = torch.empty(bsz * next_n, top_k, dtype=torch.int32)
    _, syncs_k, sites_k = counted(idx.top_k_per_row, new_logits, None, ends, top_k, new)
    old_logits = old_paged_indexer_logits(q, cache, w, ctx, bt, max_len)
    old = torch.empty_like(new)
    old_top_k_per_row(old_logits, torch.zeros_like(ends), ends, top_k, old)
    width = new_logits.shape[1]
    assert width == min(max_len, bt.shape[1] * bs)
    assert torch.equal(new_logits, old_logits[:, :width])  # exact: integer-valued inputs
    assert torch.isinf(old_logits[:, width:]).all()
    assert torch.equal(new, old)
    assert (syncs_l, syncs_k) == (0, 0), (sites, sites_k)
    # ties really occur, so the tie rule was exercised
    fin = new_logits[torch.isfinite(new_logits)]
    assert fin.unique().numel() < fin.numel()


def test_paged_indexer_logits_keeps_its_max_model_len_contract():
    g = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (6, 4, 132), generator=g, dtype=torch.uint8)
    comp.write_indexer_k_fp8(cache, torch.arange(24), torch.randint(-3, 4, (24, 128),
                                                                    generator=g).float())
    bt = torch.randperm(6, generator=g)[:2].int()[None]
    q = _int_e4m3(g, (1, 1, 2, 128), -2, 2)
    w = torch.ones(1, 2)
    ctx = torch.tensor([6])
    got = idx.paged_indexer_logits(q, cache, w, ctx, bt, 20)
    want = old_paged_indexer_logits(q, cache, w, ctx, bt, 20)
    assert got.shape == (1, 20)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[:, :6], want[:, :6])


def test_top_k_with_row_starts_matches_the_old_one():
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 4, (7, 30), generator=g).float()  # ties
    starts = torch.tensor([0, 10, 4, 0, 2, 0, 1])
    ends = torch.tensor([3, 30, 9, 0, 30, 8, 7])  # the last row: exactly 6 keys
    for top_k in (4, 6, 40):
        a = torch.full((7, top_k), 99, dtype=torch.int32)
        b = a.clone()
        _, syncs, _ = counted(idx.top_k_per_row, logits, starts, ends, top_k, a)
        old_top_k_per_row(logits, starts, ends, top_k, b)
        assert torch.equal(a, b) and syncs == 0, top_k


# ---- ragged-index twins ------------------------------------------------------------------------
def test_ragged_twins_pack_the_old_rows_without_a_host_sync():
    g = torch.Generator().manual_seed(6)
    n, width = 5, 7
    dense = torch.randint(0, 50, (n, width), generator=g).int()
    lens = torch.tensor([0, 7, 3, 9, 1])  # 9 > width: clamped
    (flat, indptr), syncs, sites = counted(attn_torch.build_ragged_indices_from_dense,
                                           dense, lens)
    assert syncs == 0, sites
    want_ptr = torch.cat([torch.zeros(1), lens.clamp(max=width).cumsum(0)]).int()
    assert torch.equal(indptr, want_ptr)
    want = old_pack(dense, lens.clamp(max=width), indptr, width)
    nnz = int(indptr[-1])
    assert torch.equal(flat[:nnz], want[:nnz]) and flat.shape == (n * width,)

    topk = torch.randint(-1, 12, (4, 5), generator=g)
    bt = torch.randperm(20, generator=g)[:12].view(4, 3).int()
    t2r = torch.tensor([0, 1, 2, 3])
    is_valid = torch.tensor([True, True, False, True])
    (rag, ptr, ln), syncs, sites = counted(
        attn_torch.compute_global_topk_ragged_indices_and_indptr, topk, t2r, bt, 4, is_valid)
    assert syncs == 0, sites
    present = topk >= 0
    want_lens = torch.where(is_valid, present.sum(-1), 0).int()
    assert torch.equal(ln, want_lens)
    slots = torch.where(present, bt[t2r[:, None], topk.clamp(min=0) // 4].long() * 4
                        + topk.clamp(min=0) % 4, -1)
    want = old_pack(slots, want_lens, ptr, 5)
    assert torch.equal(rag[: int(ptr[-1])], want[: int(ptr[-1])])


# ---- routed-experts MoE ------------------------------------------------------------------------
def test_routed_moe_reaches_no_host_sync():
    from vllm.model_executor.layers.fused_moe.experts import gfx936_routed_moe_torch as moe

    g = torch.Generator().manual_seed(8)
    w1, w2 = torch.randn(6, 8, 4, generator=g), torch.randn(6, 4, 4, generator=g)
    x = torch.randn(3, 4, generator=g)
    ids = torch.tensor([[1, 4], [4, 0], [-1, 1]])
    out = torch.empty(3, 4)

    def act(o, h):
        o.copy_(torch.nn.functional.silu(h[:, :4]) * h[:, 4:])

    _, syncs, sites = counted(moe.routed_experts_moe_torch, out, x, lambda e: w1[e],
                              lambda e: w2[e], torch.rand(3, 2, generator=g), ids, None,
                              False, act, num_experts=6)
    assert syncs == 0, sites


# ---- Sparse MLA reference: ragged rows -----------------------------------------------------------
def test_ragged_rows_padded_to_the_dense_width_are_the_same_rows():
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6], [5]]
    flat = torch.tensor([s for r in rows for s in r], dtype=torch.int32)
    indptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).int()
    (s0, v0) = mla_ref._rows_from_ragged(flat, indptr, 100)
    (s1, v1), syncs, sites = counted(mla_ref._rows_from_ragged, flat, indptr, 100, 8)
    assert syncs == 0, sites
    assert s1.shape == (4, 8) and s0.shape == (4, 5)
    assert torch.equal(v1[:, :5], v0) and not v1[:, 5:].any()
    assert torch.equal(torch.where(v1[:, :5], s1[:, :5], -1), torch.where(v0, s0, -1))


# ---- compressed slot mapping (metadata, every step) -------------------------------------------
def test_compressed_slot_mapping_reaches_no_host_sync():
    """Its values are checked against the Triton kernel in
    test_dsv4_indexer_metadata_no_triton.py; here: no sync, padding rows untouched."""
    from vllm.v1.attention.backends.mla.gfx936_indexer_metadata import (
        compressed_slot_mapping_torch,
    )

    qsl = torch.tensor([0, 1, 38, 40, 40], dtype=torch.int32)
    seq_lens = torch.tensor([77, 300, 9, 0], dtype=torch.int32)
    bt = torch.arange(80, dtype=torch.int32).view(4, 20)
    sm = torch.full((44,), -5, dtype=torch.int64)
    _, syncs, sites = counted(compressed_slot_mapping_torch, sm, qsl, seq_lens, bt, 16, 4)
    assert syncs == 0, sites
    assert (sm[40:] == -5).all() and (sm[:40] != -5).all()
    # request 0: one token at position 76, no boundary; request 1: positions 263.., token 5
    # at position 267 closes compressed token 66 -> block bt[1, 4] = 24, offset 2
    assert int(sm[0]) == -1 and int(sm[5]) == 24 * 16 + 2


# ---- the compressor's host-side "closes a window" flags (dsv4-compressor-skip-no-window) ------
def test_boundary_flags_say_whether_a_step_closes_a_window():
    """A request with c tokens computed and q new ones closes a window of `ratio` iff one of
    positions c .. c+q-1 is ratio-1 mod ratio (checked here by enumerating positions)."""
    from types import SimpleNamespace

    from vllm.models.deepseek_v4.compressor import _get_c128_boundary

    cases = [([6], [0, 1]), ([7], [0, 1]), ([3, 8], [0, 1, 2]), ([0], [0, 3]), ([120], [0, 8]),
             ([126, 2], [0, 1, 2]), ([5, 9, 200], [0, 1, 2, 3])]
    for starts, qsl in cases:
        meta = SimpleNamespace(_num_computed_tokens_cpu=torch.tensor(starts),
                               query_start_loc_cpu=torch.tensor(qsl))
        for ratio in (4, 128):
            want = any((p + 1) % ratio == 0 for i, c in enumerate(starts)
                       for p in range(c, c + qsl[i + 1] - qsl[i]))
            assert _get_c128_boundary(meta, ratio) is want, (starts, qsl, ratio)
    assert _get_c128_boundary(SimpleNamespace(_num_computed_tokens_cpu=None), 4) is None
