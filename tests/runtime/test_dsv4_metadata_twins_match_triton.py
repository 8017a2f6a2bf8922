# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PyTorch twins of DeepSeek V4's integer metadata Triton kernels equal
the upstream kernels, run on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest.py; integer kernels are exact in
the interpreter).

All comparisons are EXACT (``torch.equal``): these are integer index
computations, so any difference is a bug, not rounding.

Twins (product) vs upstream kernels (oracle):

* A  ``gfx936_sparse_swa_torch.compute_swa_indices_and_lens`` vs
     ``sparse_swa._compute_swa_indices_and_lens_kernel``;
     ``compute_prefill_gather_lens`` vs ``ComputePrefillMetadataKernel.kernel``.
* B  ``compressor_utils.get_compressed_slot_mapping`` on the CPU (which
     dispatches to ``gfx936_indexer_metadata.compressed_slot_mapping_torch``)
     and ``gfx936_metadata_torch.build_c128a_topk_metadata`` (the C128A
     builder ``c128a_topk_metadata_fn`` picks where Triton has no device) vs
     ``_compressed_slot_mapping_kernel`` / ``_build_c128a_topk_metadata_kernel``.
* C  ``gfx936_attention_torch.combine_topk_swa_indices`` /
     ``compute_global_topk_ragged_indices_and_indptr`` vs the ``amd/rocm.py``
     Triton wrappers; ``build_ragged_indices_from_dense`` vs
     ``rocm_aiter_mla_sparse.build_ragged_indices_from_dense``.

Every scenario uses seeded generators, several requests of different
lengths, decodes (incl. MTP-style query_len > 1), chunked prefill
(prefix_len > 0), windows that cross cache-block boundaries, block sizes 64
and 256, padded / invalid tokens, and positions with (pos+1) % ratio == 0
and != 0.
"""

import pytest
import torch
from triton_interp import import_with_real_triton, triton

from vllm.models.deepseek_v4 import gfx936_metadata_torch as meta_twin
from vllm.models.deepseek_v4.amd import gfx936_attention_torch as attn_twin
from vllm.v1.attention.backends.mla import gfx936_sparse_swa_torch as swa_twin

# Upstream modules, re-imported with the real triton so their kernels launch
# under the interpreter with CPU tensors.
_swa_up = import_with_real_triton("vllm.v1.attention.backends.mla.sparse_swa")
_cu_up = import_with_real_triton("vllm.v1.attention.backends.mla.compressor_utils")
_smla_up = import_with_real_triton("vllm.models.deepseek_v4.sparse_mla")
_rocm_up = import_with_real_triton("vllm.models.deepseek_v4.amd.rocm")
# The product's entry point (on the CPU, has_accelerator() is False, so it
# runs the torch twin, not the kernel).
_twin_slot_mapping = _cu_up.get_compressed_slot_mapping
_aiter_up = import_with_real_triton("vllm.v1.attention.ops.rocm_aiter_mla_sparse")

SENTINEL = 7777  # pre-filled into outputs so unwritten / wrongly kept cells show


def _batch(q_lens, seq_lens, block_size, pad_tokens=0, seed=0, extra_blocks=2):
    """A batch (decodes first): query_start_loc, seq_lens, a block table of
    distinct shuffled physical block ids, token_to_req, is_valid_token.

    ``pad_tokens`` trailing tokens are padding (is_valid False, mapped to
    request 0 as vLLM's padded tail does)."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + extra_blocks
    perm = torch.randperm(n * max_blocks + 7, generator=g)[: n * max_blocks]
    bt = (perm.view(n, max_blocks) + 3).to(torch.int32)
    tot = int(qsl[-1])
    t2r = torch.zeros(tot + pad_tokens, dtype=torch.int32)
    for r in range(n):
        t2r[int(qsl[r]) : int(qsl[r + 1])] = r
    valid = torch.ones(tot + pad_tokens, dtype=torch.bool)
    valid[tot:] = False
    return qsl, sl, bt, t2r, valid


# (q_lens, seq_lens, num_decodes): decode, MTP decode (q_len 2), decode whose
# window crosses a block boundary, short sequences (< window), chunked
# prefill (prefix 200 / 61), fresh prefill (prefix 0).
SWA_BATCHES = [
    ([1, 2, 1, 37, 70, 5], [300, 65, 129, 237, 70, 5], 3),
    ([1, 1, 1, 130, 3], [1, 256, 257, 391, 260], 3),
    ([40, 130], [101, 130], 0),
    ([1, 1, 4], [700, 2, 4], 3),
]


@pytest.mark.parametrize("block_size,window", [(64, 128), (256, 128), (64, 96)])
@pytest.mark.parametrize("case", range(len(SWA_BATCHES)))
def test_swa_indices_and_lens_match_triton(block_size, window, case):
    q_lens, seq_lens, nd_reqs = SWA_BATCHES[case]
    qsl, sl, bt, t2r, valid = _batch(q_lens, seq_lens, block_size, pad_tokens=3,
                                     seed=case)
    # A few invalid tokens inside the batch too (e.g. rejected draft slots).
    g = torch.Generator().manual_seed(100 + case)
    valid[: int(qsl[-1])] &= torch.rand(int(qsl[-1]), generator=g) > 0.15
    num_decode_tokens = int(qsl[nd_reqs])
    num_tokens = valid.numel()
    num_prefill_tokens = num_tokens - num_decode_tokens
    max_tokens = num_tokens + 4

    def run(fn_twin: bool):
        idx_d = torch.full((max_tokens, 1, window), SENTINEL, dtype=torch.int32)
        lens_d = torch.full((max_tokens,), SENTINEL, dtype=torch.int32)
        idx_p = torch.full((max_tokens, 1, window), SENTINEL, dtype=torch.int32)
        lens_p = torch.full((max_tokens,), SENTINEL, dtype=torch.int32)
        parts = [(idx_d, lens_d, 0, num_decode_tokens),
                 (idx_p[:num_prefill_tokens], lens_p[:num_prefill_tokens],
                  num_decode_tokens, num_prefill_tokens)]
        for idx, lens, off, cnt in parts:
            if cnt == 0:
                continue
            # The twin as the CPU's SWA builder launches it: with the kernel's
            # own arguments (METADATA_KERNELS[0] calls compute_swa_indices_and_lens).
            kernel = (swa_twin.METADATA_KERNELS[0] if fn_twin
                      else _swa_up._compute_swa_indices_and_lens_kernel)
            kernel[(cnt,)](
                idx, idx.stride(0), lens, window, qsl, sl, t2r, valid, bt,
                bt.stride(0), block_size, token_offset=off, TRITON_BLOCK_SIZE=1024)
        return idx_d, lens_d, idx_p, lens_p

    got, ref = run(True), run(False)
    for name, a, b in zip(["decode_idx", "decode_lens", "prefill_idx", "prefill_lens"],
                          got, ref):
        assert torch.equal(a, b), f"{name} differs (case {case}, bs {block_size})"
    # The scenario really exercised the edges it claims to.
    lens_all = torch.cat([ref[1][:num_decode_tokens], ref[3][:num_prefill_tokens]])
    assert (lens_all == 0).any() and (lens_all == window).any() or case == 3
    assert ((ref[0] == SENTINEL).any() or (ref[2] == SENTINEL).any())


@pytest.mark.parametrize("window", [128, 64])
def test_prefill_gather_lens_match_triton(window):
    # num_decodes decode requests first; prefills with prefix 0, < W-1, == W-1,
    # > W-1 (chunked prefill).
    q_lens = [1, 2, 50, 10, 7, 300, 1]
    prefix = [99, 40, 0, 5, window - 1, window + 40, 1000]
    seq_lens = torch.tensor([q + p for q, p in zip(q_lens, prefix)], dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    for num_decodes in (0, 2):
        num_prefills = len(q_lens) - num_decodes
        got = torch.full((num_prefills + 2,), SENTINEL, dtype=torch.int32)
        ref = got.clone()
        swa_twin.compute_prefill_gather_lens(
            got, seq_lens, qsl, num_prefills, num_decodes, window)
        _swa_up.ComputePrefillMetadataKernel.kernel[(1,)](
            ref, seq_lens, qsl, num_prefills, num_decodes, window,
            BLOCK_SIZE=triton.next_power_of_2(num_prefills))
        assert torch.equal(got, ref), (num_decodes, got, ref)


# (q_lens, seq_lens): decodes, chunked prefill, fresh prefill, a padded
# request with query_len 0 (CUDA-graph padding).
SLOT_BATCHES = [
    ([1, 1, 3, 200, 0], [128, 1000, 515, 711, 0]),
    ([1, 513, 64, 1], [4, 513, 640, 40000]),
]


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("case", range(len(SLOT_BATCHES)))
def test_compressed_slot_mapping_matches_triton(ratio, block_size, case):
    q_lens, seq_lens = SLOT_BATCHES[case]
    # The compressed cache holds seq_len // ratio entries per request.
    cblocks = [-(-s // ratio) for s in seq_lens]
    qsl, sl, bt, _, _ = _batch(q_lens, seq_lens, block_size, seed=case)
    bt = bt[:, : max(max(-(-c // block_size) for c in cblocks), 1) + 1].contiguous()
    num_tokens = int(qsl[-1])
    got = torch.full((num_tokens + 5,), SENTINEL, dtype=torch.int64)
    ref = torch.full((num_tokens + 5,), -1, dtype=torch.int64)
    # Product entry point: on the CPU it runs the torch twin (fills -1 first).
    _twin_slot_mapping(num_tokens, qsl, sl, bt, block_size, ratio, got)
    _cu_up._compressed_slot_mapping_kernel[(bt.shape[0],)](
        ref[:num_tokens], qsl, sl, bt, bt.stride(0), block_size, ratio,
        PAD_ID=-1, TRITON_BLOCK_SIZE=1024)
    assert torch.equal(got, ref)
    # Both (pos+1) % ratio == 0 (written) and != 0 (-1) occurred.
    assert (ref >= 0).any() and (ref[:num_tokens] == -1).any()


def _negative_position_case(seq_len):
    ratio, block_size = 4, 64
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)  # positions seq_len-4 ..
    bt = torch.tensor([[5, 9]], dtype=torch.int32)
    got = torch.full((4,), SENTINEL, dtype=torch.int64)
    ref = torch.full((4,), -1, dtype=torch.int64)
    _twin_slot_mapping(4, qsl, sl, bt, block_size, ratio, got)
    _cu_up._compressed_slot_mapping_kernel[(1,)](
        ref, qsl, sl, bt, bt.stride(0), block_size, ratio, PAD_ID=-1,
        TRITON_BLOCK_SIZE=1024)
    return got, ref


def test_compressed_slot_mapping_position_minus_one_matches_triton():
    # seq_len < query_len (padded/invalid request): positions -1, 0, 1, 2.
    # pos=-1 has (pos+1) % ratio == 0; upstream truncates -1 // 4 to 0.
    got, ref = _negative_position_case(3)
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())


@pytest.mark.xfail(
    strict=True,
    reason="DISAGREEMENT (degenerate input, seq_len < query_len - 4): for pos=-5 "
    "(ratio 4, bs 64, block_table [[5, 9]]) upstream Triton computes c = -5//4 = -1 "
    "(truncation), block -1//64 = 0, offset -1 % 64 = -1 -> slot 5*64-1 = 319; "
    "the twin clamps floor(-5/4) to 0 -> slot 320",
)
def test_compressed_slot_mapping_position_minus_five_matches_triton():
    got, ref = _negative_position_case(-1)  # positions -5, -4, -3, -2
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())


@pytest.mark.parametrize("block_size", [1, 2, 64])
@pytest.mark.parametrize("width", [128, 256])
def test_c128a_topk_metadata_matches_triton(block_size, width):
    ratio = 128
    g = torch.Generator().manual_seed(block_size * 1000 + width)
    # Decode tokens: counts 0 (pos < 127), exactly at (pos+1) % 128 == 0,
    # just after, above the width (clamped), and a padded one (slot -1).
    dec_pos = [0, 126, 127, 128, 255, 128 * 100 - 1, 128 * 300 + 5, 50, 128 * 7 + 64]
    dec_req = [0, 1, 1, 2, 3, 4, 5, 6, 0]
    dec_slot = [10, 11, 12, 13, -1, 15, 16, -1, 18]
    pf_pos = [0, 127, 128, 200, 128 * 150 - 1, 128 * 400, 5]
    nd = len(dec_pos)
    positions = torch.tensor(dec_pos + pf_pos, dtype=torch.int64)
    t2r = torch.tensor(dec_req + [0] * len(pf_pos), dtype=torch.int32)
    slot_mapping = torch.tensor(dec_slot + [1] * len(pf_pos), dtype=torch.int64)
    nblk = -(-width // block_size) + 1
    bt = torch.randperm(7 * nblk + 11, generator=g)[: 7 * nblk].view(7, nblk)
    bt = bt.to(torch.int32).contiguous()
    max_tokens, max_width = positions.numel() + 3, 2 * width

    def bufs():
        return (torch.full((max_tokens, max_width), SENTINEL, dtype=torch.int32),
                torch.full((max_tokens,), SENTINEL, dtype=torch.int32),
                torch.full((max_tokens, max_width), SENTINEL, dtype=torch.int32))

    got, ref = bufs(), bufs()
    # Product entry point on the CPU: the twin the metadata builder picks once.
    build = meta_twin.c128a_topk_metadata_fn(_smla_up.build_c128a_topk_metadata)
    assert build is meta_twin.build_c128a_topk_metadata
    views = build(
        positions, ratio, nd, t2r, bt, block_size, slot_mapping, got[0], got[1], got[2],
        max_compressed_tokens=width)
    up_views = _smla_up.build_c128a_topk_metadata(
        positions, ratio, nd, t2r, bt, block_size, slot_mapping, *bufs(),
        max_compressed_tokens=width)
    # the same packed views upstream's builder returns, over the twin's buffers
    for v, u, b in zip(views, up_views, got):
        assert v.shape == u.shape and v.data_ptr() == b.data_ptr(), (v.shape, u.shape)
    _smla_up._build_c128a_topk_metadata_kernel[(positions.numel(),)](
        ref[0], width, ref[1], ref[2], width, positions, ratio, width, nd, t2r, bt,
        bt.stride(0), block_size, slot_mapping, BLOCK_SIZE=1024)
    for name, a, b in zip(["global_decode", "decode_lens", "prefill_local"], got, ref):
        assert torch.equal(a, b), name
    # Counts above and below the width both occurred.
    n = (positions + 1) // ratio
    assert (n > width).any() and ((n > 0) & (n < width)).any() and (n == 0).any()


# ---------------------------------------------------------------- C (integer)

def _combine_inputs(topk_width, seed, ratio=4, window=128):
    g = torch.Generator().manual_seed(seed)
    # Prefill chunk: fresh prefill, chunked prefill (prefix > W-1 and < W-1),
    # a long prefix where (pos+1)//ratio exceeds top-k.
    q_lens = [9, 21, 5, 12]
    prefix = [0, 300, 40, 4 * 200]
    seq = torch.tensor([q + p for q, p in zip(q_lens, prefix)], dtype=torch.int32)
    q = torch.tensor(q_lens, dtype=torch.int32)
    base = 17  # decode tokens before the prefills: query_start_loc[0] != 0
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[0] = base
    qsl[1:] = base + torch.cumsum(q, 0)
    gather = q + torch.minimum(seq - q, torch.full_like(q, window - 1))
    max_model_len = 4096
    N = -(-max_model_len // ratio)
    M = N + window + 256
    T = int(q.sum())
    topk = torch.randint(-1, N + 40, (T, topk_width), generator=g, dtype=torch.int32)
    topk[::3, -5:] = -1  # trailing -1 padding in some rows
    return topk, qsl, seq, gather.to(torch.int32), window, ratio, M, N


@pytest.mark.parametrize("topk_width,topk", [(64, 64), (96, 96), (64, 0)])
def test_combine_topk_swa_indices_matches_triton(topk_width, topk):
    ti, qsl, seq, gather, window, ratio, M, N = _combine_inputs(topk_width, topk_width)
    got = attn_twin.combine_topk_swa_indices(ti, qsl, seq, gather, window, ratio,
                                             topk, M, N)
    ref = _rocm_up.combine_topk_swa_indices(ti, qsl, seq, gather, window, ratio,
                                            topk, M, N)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])
    # The batch has tokens whose (pos+1)//ratio is above and below top-k, and
    # top-k entries that are -1 or >= N (dropped).
    q = (qsl[1:] - qsl[:-1]).tolist()
    pos = torch.cat([s - n + torch.arange(n) for s, n in zip(seq.tolist(), q)])
    n_c = (pos + 1) // ratio
    assert (n_c > topk_width).any() and (n_c < topk_width).any()
    assert ((ti < 0) | (ti >= N)).any()


@pytest.mark.parametrize("block_size", [64, 256])
def test_global_topk_ragged_matches_triton(block_size):
    g = torch.Generator().manual_seed(block_size)
    T, topk, n_req = 11, 200, 3
    ti = torch.randint(0, 3 * block_size, (T, topk), generator=g, dtype=torch.int32)
    ti[ti % 7 == 0] = -1  # interleaved -1 (the kernel packs the first `lens` cols)
    ti[0, :3] = 0  # local index 0 is a real entry (block 0, offset 0), not padding
    ti[5, 17] = 0
    ti[2, 50:] = -1
    ti[4] = -1  # a row with nothing
    t2r = torch.randint(0, n_req, (T,), generator=g, dtype=torch.int32)
    bt = (torch.randperm(n_req * 4, generator=g).view(n_req, 4) + 1).to(torch.int32)
    valid = torch.ones(T, dtype=torch.bool)
    valid[[1, T - 1]] = False
    got = attn_twin.compute_global_topk_ragged_indices_and_indptr(
        ti, t2r, bt, block_size, valid)
    ref = _rocm_up.compute_global_topk_ragged_indices_and_indptr(
        ti, t2r, bt, block_size, valid)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    nnz = int(ref[1][-1])
    assert got[0].shape == ref[0].shape
    assert torch.equal(got[0][:nnz], ref[0][:nnz])  # beyond nnz is scratch
    assert (ref[0][:nnz] == -1).any()  # an interleaved -1 was packed


def _dense(seed, rows=9, width=160):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, 500, (rows, width), generator=g, dtype=torch.int32)
    # lengths: negative, zero, partial, == width, > width (clamped)
    lens = torch.tensor([-3, 0, 1, 77, width, width + 40, 128, 129, 5],
                        dtype=torch.int32)[:rows]
    return idx, lens


def test_build_ragged_from_dense_matches_triton():
    idx, lens = _dense(1)
    got = attn_twin.build_ragged_indices_from_dense(idx, lens)
    ref = _aiter_up.build_ragged_indices_from_dense(idx, lens)
    assert torch.equal(got[1], ref[1])
    nnz = int(ref[1][-1])
    assert torch.equal(got[0][:nnz], ref[0][:nnz])
    # 3-d dense input ([T, 1, W], as decode_swa_indices is) flattens the same.
    got3 = attn_twin.build_ragged_indices_from_dense(idx.unsqueeze(1), lens)
    assert torch.equal(got3[1], ref[1]) and torch.equal(got3[0][:nnz], ref[0][:nnz])


@pytest.mark.xfail(
    strict=True,
    reason="DISAGREEMENT: the twin ignores num_rows; upstream "
    "build_ragged_indices_from_dense(indices, lengths, num_rows=K>=0) maps entries "
    "outside [0, K) to -1, the twin keeps them (only the default num_rows=-1, "
    "which rocm.py uses, agrees)",
)
def test_build_ragged_from_dense_num_rows_matches_triton():
    idx, lens = _dense(2)
    got = attn_twin.build_ragged_indices_from_dense(idx, lens, num_rows=300)
    ref = _aiter_up.build_ragged_indices_from_dense(idx, lens, num_rows=300)
    nnz = int(ref[1][-1])
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[0][:nnz], ref[0][:nnz])


def test_c128a_builder_is_upstreams_where_triton_has_a_device(monkeypatch):
    """The choice is made once, by the capability: a device with Triton keeps
    upstream's kernel launcher; the CPU gets the twin."""
    from vllm.platforms import gfx936_capability as cap

    monkeypatch.setattr(cap, "has_accelerator", lambda: True)
    up = _smla_up.build_c128a_topk_metadata
    assert meta_twin.c128a_topk_metadata_fn(up) is up
    monkeypatch.setattr(cap, "has_accelerator", lambda: False)
    assert meta_twin.c128a_topk_metadata_fn(up) is meta_twin.build_c128a_topk_metadata
