# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek V4 Lightning indexer on the no-FP8 path (gfx936, CPU).

References, each independent of the product's code:
- q RoPE + per-(token, head) quant: a float64 model of the kernel's math; bytes decoded by
  torch's own float8_e4m3fn cast (not the fork's decoder).
- logits: upstream's ``fp8_paged_mqa_logits_torch`` / ``fp8_mqa_logits_torch`` fed with
  torch-cast FP8 tensors, and a float64 model.
- top-k and the whole op: float64 logits from independently dequantized q/K, causal masking
  written from DeepSeek V4's definition (token at position p sees compressed keys
  n < (p + 1) // ratio), selection by sorting.
- metadata twins: upstream's integer-only Triton kernels under the interpreter, bit exact.
"""
from __future__ import annotations

import pytest
import torch

from vllm.models.deepseek_v4.common.ops import gfx936_compressor as comp
from vllm.models.deepseek_v4.common.ops import gfx936_indexer_q as iq
from vllm.v1.attention.ops import gfx936_sparse_attn_indexer as idx

H, D, ROPE, RATIO = 4, 128, 64, 4


def _cos_sin(max_pos: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(torch.float32)


def _torch_dequant(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


# ---- q side -------------------------------------------------------------------------------
def test_q_rope_quant_matches_float64_model_and_folds_scale_into_weights():
    g = torch.Generator().manual_seed(0)
    t = 9
    q = (torch.randn(t, H, D, generator=g) * torch.logspace(-3, 2, t)[:, None, None]).to(
        torch.bfloat16)
    pos = torch.randint(0, 500, (t,), generator=g)
    cs = _cos_sin(512)
    w = torch.randn(t, H, generator=g).to(torch.bfloat16)
    codes, w_out = iq.indexer_q_rope_quant_torch(pos, q, cs, w, D**-0.5, H**-0.5)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (t, H, D)
    # float64 model
    x = q.double()
    c, s = cs[pos, :32].double()[:, None], cs[pos, 32:].double()[:, None]
    e, o = x[..., 64::2], x[..., 65::2]
    rot = torch.stack((e * c - o * s, o * c + e * s), -1).flatten(-2)
    ref = torch.cat([x[..., :64], rot], -1)
    amax = torch.cat([x[..., :64], rot.float().to(torch.bfloat16).double()], -1).abs().amax(-1)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax.clamp(min=1e-4) / 448)))
    got = _torch_dequant(codes) * scale[..., None]
    tol = ref.abs() * (2.0**-4 + 2.0**-8) + scale[..., None] * 2.0**-10
    assert ((got - ref).abs() <= tol).all()
    want_w = w.double() * scale * D**-0.5 * H**-0.5
    torch.testing.assert_close(w_out.double(), want_w, rtol=1e-6, atol=0)


def test_fp4_indexer_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="use_fp4_indexer_cache"):
        iq.indexer_q_rope_quant_torch(torch.zeros(1, dtype=torch.long), torch.zeros(1, H, D),
                                      _cos_sin(4), torch.zeros(1, H), 1.0, 1.0, use_fp4=True)


def test_short_context_fill_selects_every_compressed_candidate_then_minus_one():
    top_k = 8
    buf = torch.full((6, top_k), 77, dtype=torch.int32)
    pos = torch.tensor([0, 3, 4, 7, 35, 2])
    iq.fill_short_context_topk_indices_torch(buf, pos, top_k, RATIO, 5)
    for i, p in enumerate(pos[:5].tolist()):
        n = (p + 1) // RATIO
        assert buf[i].tolist() == [j if j < n else -1 for j in range(top_k)]
    assert buf[5].tolist() == [77] * top_k  # rows past num_tokens untouched


# ---- logits and top-k against upstream's torch references -----------------------------------
def _random_cache(g, nblocks, bs, n_tokens):
    k = torch.randn(n_tokens, D, generator=g)
    cache = torch.randint(0, 256, (nblocks, bs, D + 4), generator=g, dtype=torch.uint8)
    slots = torch.randperm(nblocks * bs, generator=g)[:n_tokens]
    comp.write_indexer_k_fp8(cache, slots, k)
    return cache, slots


def test_paged_logits_match_upstream_fp8_paged_mqa_logits_torch():
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch

    g = torch.Generator().manual_seed(1)
    bs, nblocks, b, max_len = 4, 12, 3, 24
    cache, _ = _random_cache(g, nblocks, bs, nblocks * bs)
    bt = torch.stack([torch.randperm(nblocks, generator=g)[:6] for _ in range(b)]).to(torch.int32)
    ctx = torch.tensor([[5], [24], [13]], dtype=torch.int32)
    qf = torch.randn(b, 1, H, D, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(b, H, generator=g)
    ours = idx.paged_indexer_logits(qf.view(torch.uint8), cache, w, ctx, bt, max_len)
    theirs = fp8_paged_mqa_logits_torch(qf, cache, w, ctx, bt, max_len)
    fin = torch.isfinite(theirs)
    assert torch.equal(fin, torch.isfinite(ours))
    torch.testing.assert_close(ours[fin], theirs[fin], rtol=1e-5, atol=1e-4)


def test_prefill_logits_match_upstream_fp8_mqa_logits_torch():
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    g = torch.Generator().manual_seed(2)
    m, n = 7, 19
    qf = torch.randn(m, H, D, generator=g).to(torch.float8_e4m3fn)
    kf = torch.randn(n, D, generator=g).to(torch.float8_e4m3fn)
    ks_scale = torch.rand(n, generator=g) + 0.5
    w = torch.randn(m, H, generator=g)
    starts = torch.tensor([0, 0, 0, 5, 5, 5, 5], dtype=torch.int32)
    ends = torch.tensor([1, 3, 5, 6, 9, 19, 5], dtype=torch.int32)
    ours = idx.indexer_logits(qf.view(torch.uint8), w, kf.view(torch.uint8), ks_scale,
                              starts, ends)
    theirs = fp8_mqa_logits_torch(qf, (kf, ks_scale), w, starts, ends)
    fin = torch.isfinite(theirs)
    assert torch.equal(fin, torch.isfinite(ours))
    # Upstream's reference multiplies in bf16 (8 bits): compare at that precision.
    torch.testing.assert_close(ours[fin], theirs[fin], rtol=2**-6, atol=0.05)
    ref = torch.einsum("mhd,nd->mhn", qf.double(), kf.double()).relu()
    ref = (ref * w.double()[:, :, None]).sum(1) * ks_scale.double()[None]
    torch.testing.assert_close(ours[fin].double(), ref[fin], rtol=1e-5, atol=1e-4)


def test_top_k_convention_relative_indices_minus_one_padding_and_selection():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g)
    starts = torch.tensor([0, 10, 4, 0])
    ends = torch.tensor([3, 30, 9, 0])
    out = torch.full((4, 6), 99, dtype=torch.int32)
    idx.top_k_per_row(logits, starts, ends, 6, out)
    assert out[0].tolist() == [0, 1, 2, -1, -1, -1]
    assert out[2].tolist() == [0, 1, 2, 3, 4, -1]
    assert out[3].tolist() == [-1] * 6
    want = torch.argsort(logits[1, 10:30].double(), descending=True)[:6]
    assert out[1].tolist() == want.tolist()  # relative to the row start, best first


# ---- the whole op ---------------------------------------------------------------------------
@pytest.fixture
def workspace():
    from vllm.v1.worker import workspace as ws

    ws.init_workspace_manager(torch.device("cpu"))
    yield
    ws.reset_workspace_manager()


class _Layer:
    prefix = "layers.0.indexer.k_cache"


def _run_op(meta, cache, q_codes, w, topk, max_len, total, n_tokens, buf):
    from vllm.forward_context import ForwardContext, override_forward_context

    fc = ForwardContext(no_compile_layers={}, attn_metadata={_Layer.prefix: meta},
                        slot_mapping={})
    with override_forward_context(fc):
        return idx.gfx936_sparse_attn_indexer(
            torch.zeros(n_tokens, 8), _Layer.prefix, cache, q_codes, None, w, 128, "ue8m0",
            topk, D, max_len, total, buf, True)


def _expected_k(k: torch.Tensor) -> torch.Tensor:
    """Dequantized K as the compressor's writer rule defines it (bf16, one UE8M0-style
    power-of-two scale per token, E4M3 by torch's own cast)."""
    v = k.to(torch.bfloat16).float()
    scale = torch.pow(2.0, torch.ceil(torch.log2(v.abs().amax(-1).clamp(min=1e-4) / 448)))
    return _torch_dequant((v / scale[:, None]).to(torch.float8_e4m3fn)) * scale.double()[:, None]


class Request:
    def __init__(self, g, length, nblocks_free, bs):
        self.len = length
        self.k = torch.randn(length // RATIO, D, generator=g)
        self.blocks = nblocks_free[: -(-max(length // RATIO, 1) // bs) + 1]


def _ref_topk(q_codes, w, k_deq, n_keys, topk):
    """float64 logits from torch-dequantized q / K; returns the selected set (or the
    short-row list) and the margin around the k-th logit."""
    if n_keys <= topk:
        return [j if j < n_keys else -1 for j in range(topk)], None
    s = torch.einsum("hd,nd->hn", _torch_dequant(q_codes), k_deq[:n_keys]).relu()
    logit = (s * w.double()[:, None]).sum(0)
    order = torch.argsort(logit, descending=True)
    return sorted(order[:topk].tolist()), (logit[order[topk - 1]] - logit[order[topk]]).item()


@pytest.mark.parametrize("topk,device_workspace", [(8, False), (64, False), (8, True)])
def test_indexer_op_prefill_chunk_then_decode_matches_float64_selection(
        workspace, monkeypatch, topk, device_workspace):
    """Two requests; request 0 is a second prefill chunk (start_pos > 0, K from the first
    chunk already cached), request 1 a first chunk; then both decode. With top-k 8 rows have
    more compressed keys than top-k (the op must select), with 64 fewer (0..n-1, then -1).
    K-cache pages of 4 compressed tokens are scattered by the block table."""
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
        DeepseekV32IndexerPrefillMetadata,
        build_prefill_chunk_metadata,
    )

    if device_workspace:  # gfx936's branch: K gathered into the shared workspace
        monkeypatch.setattr(idx, "_use_workspace_manager", lambda dev: True)
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    g = torch.Generator().manual_seed(10 + topk)
    bs, nblocks = 4, 40
    cache = torch.randint(0, 256, (nblocks, bs, D + 4), generator=g, dtype=torch.uint8)
    free = torch.randperm(nblocks, generator=g).tolist()
    lens_after_prefill = [71, 47]
    chunk_starts = [30, 0]  # request 0: positions 30..69 this step
    reqs = []
    for L in lens_after_prefill:
        r = Request(g, L + 4, free, bs)
        free = free[len(r.blocks):]
        reqs.append(r)
    bt = torch.tensor([r.blocks + [0] * (8 - len(r.blocks)) for r in reqs], dtype=torch.int32)

    def write_keys(r_i, upto_pos):
        r = reqs[r_i]
        n = (upto_pos + 1) // RATIO
        c = torch.arange(n)
        slots = bt[r_i, c // bs].long() * bs + c % bs
        slots = torch.cat([slots, torch.tensor([-1])])  # a padded token: nothing written
        comp.write_indexer_k_fp8(cache, slots, torch.cat([r.k[:n], torch.randn(1, D)]))

    for r_i, r in enumerate(reqs):
        write_keys(r_i, lens_after_prefill[r_i] - 1)
    k_deq = [_expected_k(r.k) for r in reqs]
    # The cache bytes at the layout's addresses (token-major block, read here by hand).
    for r_i, r in enumerate(reqs):
        for c in range(lens_after_prefill[r_i] // RATIO):
            blk = cache[bt[r_i, c // bs]].reshape(-1)
            t = c % bs
            scale = blk[bs * D + 4 * t: bs * D + 4 * t + 4].view(torch.float32)
            deq = _torch_dequant(blk[t * D:(t + 1) * D]) * scale.double()
            assert torch.equal(deq, k_deq[r_i][c])

    # ---- prefill step ----
    qlens = [lens_after_prefill[0] - chunk_starts[0], lens_after_prefill[1] - chunk_starts[1]]
    qsl = torch.tensor([0, qlens[0], qlens[0] + qlens[1]], dtype=torch.int32)
    seq_lens = torch.tensor(lens_after_prefill, dtype=torch.int32)
    cseq = seq_lens // RATIO
    chunk = build_prefill_chunk_metadata(0, 2, qsl, qsl.clone(), seq_lens, cseq, cseq.clone(),
                                         bt, RATIO)
    n_tok = int(qsl[-1])
    positions = torch.cat([torch.arange(chunk_starts[i], lens_after_prefill[i])
                           for i in range(2)])
    token_req = torch.cat([torch.full((qlens[i],), i) for i in range(2)])
    qraw = torch.randn(n_tok, H, D, generator=g).to(torch.bfloat16)
    wraw = torch.randn(n_tok, H, generator=g)
    q_codes, w = iq.indexer_q_rope_quant_torch(positions, qraw, _cos_sin(200), wraw,
                                               D**-0.5, H**-0.5)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), slot_mapping=torch.zeros(n_tok),
        num_decodes=0, num_decode_tokens=0, num_prefills=2, num_prefill_tokens=n_tok,
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))
    buf = torch.full((n_tok + 3, topk), 55, dtype=torch.int32)
    max_len = 200 // RATIO
    _run_op(meta, cache, q_codes, w, topk, max_len, 4096, n_tok, buf)
    selected_any = False
    for t in range(n_tok):
        r_i, p = int(token_req[t]), int(positions[t])
        want, margin = _ref_topk(q_codes[t], w[t], k_deq[r_i], (p + 1) // RATIO, topk)
        got = buf[t].tolist()
        if margin is None:
            assert got == want, (t, p, got, want)
        else:
            selected_any = True
            if margin > 1e-3:
                assert sorted(got) == want, (t, p)
    assert selected_any == (topk == 8)
    assert buf[n_tok:].eq(55).all()

    # ---- decode step: each request decodes the token at position len, which closes a
    # compress window for both (72 and 48 are multiples of 4): one new key each ----
    for r_i in range(2):
        write_keys(r_i, lens_after_prefill[r_i])
    dpos = torch.tensor(lens_after_prefill)
    dlen = dpos + 1
    qd, wd = iq.indexer_q_rope_quant_torch(dpos, torch.randn(2, H, D, generator=g).to(
        torch.bfloat16), _cos_sin(200), torch.randn(2, H, generator=g), D**-0.5, H**-0.5)
    dmeta = DeepseekV32IndexerMetadata(
        seq_lens=dlen.to(torch.int32), max_seq_len=int(dlen.max()), slot_mapping=torch.zeros(2),
        num_decodes=2, num_decode_tokens=2, num_prefills=0, num_prefill_tokens=0,
        decode=DeepSeekV32IndexerDecodeMetadata(
            block_table=bt, seq_lens=(dlen // RATIO).to(torch.int32).unsqueeze(-1),
            decode_lens=torch.ones(2, dtype=torch.int32), requires_padding=False,
            schedule_metadata=torch.zeros(1)))
    buf = torch.full((4, topk), 55, dtype=torch.int32)
    _run_op(dmeta, cache, qd, wd, topk, max_len, 4096, 2, buf)
    for r_i in range(2):
        n = int(dlen[r_i]) // RATIO
        want, margin = _ref_topk(qd[r_i], wd[r_i], k_deq[r_i], n, topk)
        got = buf[r_i].tolist()
        if margin is None:
            assert got == want
        elif margin > 1e-3:
            assert sorted(got) == want


def test_profile_run_reserves_workspaces_and_leaves_buffer(workspace, monkeypatch):
    """On a device (gfx936) the profile run reserves the K-gather and decode-logits
    workspaces, as the AITER op does; the CPU path allocates per call instead (the
    workspace manager's growth path needs an accelerator), so the device branch is forced."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker.workspace import current_workspace_manager

    monkeypatch.setattr(idx, "_use_workspace_manager", lambda dev: True)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)

    buf = torch.full((5, 8), 3, dtype=torch.int32)
    fc = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})
    with override_forward_context(fc):
        out = idx.gfx936_sparse_attn_indexer(
            torch.zeros(5, 8), "x", torch.zeros(1, 4, 132, dtype=torch.uint8),
            torch.zeros(5, H, D, dtype=torch.uint8), None, torch.zeros(5, H), 128, "ue8m0",
            8, D, 64, 1000, buf, True)
    assert out is buf and buf.eq(3).all()
    got = current_workspace_manager()._current_workspaces[0].numel()
    assert got >= 1000 * (D + 4) and got >= 5 * 64 * 4


def test_sparse_attn_indexer_decides_its_forward_once_at_construction(monkeypatch):
    """Without FP8 conversion SparseAttnIndexer's forward is the no-FP8 op, chosen by
    dispatch_forward at construction: the capability is asked once, not per call. With FP8
    conversion the forward is upstream's choice."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.platforms import gfx936_capability as cap

    asked = []
    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: asked.append(1) or True)
    monkeypatch.setattr(CustomOp, "dispatch_forward", lambda self, compile_native: "upstream")
    calls = []
    monkeypatch.setattr(idx, "sparse_attn_indexer_no_fp8_forward",
                        lambda *a: calls.append(a) or "ours")
    layer = object.__new__(sai.SparseAttnIndexer)
    forward = sai.SparseAttnIndexer.dispatch_forward(layer, False)
    assert forward(1, 2, 3, 4) == "ours" and forward(5, 6, 7, 8) == "ours"
    assert calls == [(layer, 1, 2, 3, 4), (layer, 5, 6, 7, 8)]
    assert len(asked) == 1
    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: False)
    assert sai.SparseAttnIndexer.dispatch_forward(layer, False) == "upstream"


def test_deepseek_v4_indexer_forward_takes_the_no_fp8_twins_on_cpu(monkeypatch):
    """The twins DeepseekV4Indexer picks at build on the CPU: short context -> the fill twin;
    long context -> the q twin's bytes and folded weights reach the indexer op."""
    from types import SimpleNamespace

    from torch import nn

    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.models.deepseek_v4 import attention
    from vllm.models.deepseek_v4.amd import gfx936_attention_ops as gfx936_ops
    from vllm.models.deepseek_v4.attention import DeepseekV4Indexer
    from vllm.platforms import gfx936_capability as cap
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(cap, "current_platform", CpuPlatform())
    g = torch.Generator().manual_seed(9)
    t, topk = 5, 8
    ind = object.__new__(DeepseekV4Indexer)
    nn.Module.__init__(ind)
    buf = torch.full((t + 2, topk), 77, dtype=torch.int32)
    wq = torch.randn(16, H * D, generator=g)
    seen = {}
    for k, v in dict(compress_ratio=RATIO, topk_tokens=topk, n_head=H, head_dim=D,
                     topk_indices_buffer=buf, use_fp4_kv=False, eager_scratch_pool=None,
                     softmax_scale=D**-0.5, aux_stream=None, ln_events=[None, None],
                     k_cache=SimpleNamespace(prefix="kc")).items():
        setattr(ind, k, v)
    # what __init__ decides (its one line), on the CPU platform
    ind.fill_short_context_torch, ind.q_quant_fn = gfx936_ops.indexer_ops(
        attention.fused_indexer_q_rope_quant)
    ind.compressor = lambda *a: seen.setdefault("compressor", True)
    ind.wq_b = lambda qr: (qr @ wq, None)
    ind.indexer_op = lambda hs, q, k, w: (seen.update(q=q, w=w), "op")[1]
    pos = torch.tensor([0, 3, 7, 20, 31])
    qr = torch.randn(t, 16, generator=g)
    w = torch.randn(t, H, generator=g)
    cs = _cos_sin(64)
    for max_seq_len, short in ((32, True), (400, False)):
        meta = SimpleNamespace(max_seq_len=max_seq_len, num_decode_tokens=0, num_prefill_tokens=t)
        fc = ForwardContext(no_compile_layers={}, attn_metadata={"kc": meta}, slot_mapping={})
        with override_forward_context(fc):
            out = ind.forward(None, qr, None, w, pos, SimpleNamespace(cos_sin_cache=cs))
        if short:
            assert out is buf
            for i, p in enumerate(pos.tolist()):
                n = (p + 1) // RATIO
                assert buf[i].tolist() == [j if j < n else -1 for j in range(topk)]
            assert buf[t:].eq(77).all()
        else:
            assert out == "op"
            q_want, w_want = iq.indexer_q_rope_quant_torch(
                pos, (qr @ wq).view(t, H, D), cs, w, D**-0.5, H**-0.5)
            assert torch.equal(seen["q"].view(torch.uint8), q_want.view(torch.uint8))
            assert torch.equal(seen["w"], w_want)
    assert seen["compressor"]
