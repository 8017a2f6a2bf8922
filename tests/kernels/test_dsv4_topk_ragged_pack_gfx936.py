# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The C4 layer's top-k -> paged slots -> ragged packing as one op (patch
dsv4-topk-ragged-pack-fused-gfx936, issue 19): the Triton kernel under TRITON_INTERPRET on the CPU.

References, all exact (integer index arithmetic: any difference is a bug): the fork's PyTorch
twin ``compute_global_topk_ragged_indices_and_indptr`` (the op's CPU implementation); upstream's
own two-kernel Triton packer in ``amd/rocm.py`` (interpreted); and a per-row Python loop written
here from the slot formula. Edge cases: requests shorter than top-k (picks then -1), -1
interleaved, a row with nothing, invalid (padded) tokens, picks on both sides of every block
boundary and in the block table's last column, batch 1 and 16, int32 and int64 indices, a
top-k buffer wider than its rows (row stride). The op: one launch and no host sync under the step
audit's counter, its result the twin's, a fake with the twin's shapes. Mutated kernels (the
offset counts the row itself, the slot formula's offset dropped, invalid tokens packed) must
fail the comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vllm.models.deepseek_v4.amd.gfx936_attention_torch import (
    compute_global_topk_ragged_indices_and_indptr as twin,
)
from vllm.models.deepseek_v4.common.ops import gfx936_topk_ragged_triton as ktri

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402


def _case(T: int, topk: int, bs: int, seed: int, dtype=torch.int32, n_req: int | None = None):
    """A decode batch: T tokens of n_req requests, each request's top-k picks local positions
    of its own compressed cache (length ``ctx``): ``ctx <= topk`` -> ``0 .. ctx-1`` then -1 (as
    the indexer writes a short request), else ``topk`` distinct picks; plus an interleaved -1
    row, an empty row, two invalid tokens and picks at every block edge."""
    g = torch.Generator().manual_seed(seed)
    n_req = n_req or max(1, T)
    nb = 5
    bt = (torch.randperm(n_req * nb + 7, generator=g)[: n_req * nb].view(n_req, nb) + 1)
    bt = bt.to(torch.int32)
    t2r = torch.randint(0, n_req, (T,), generator=g, dtype=torch.int32)
    ti = torch.full((T, topk), -1, dtype=dtype)
    for t in range(T):
        ctx = int(torch.randint(0, nb * bs + 1, (1,), generator=g))
        if ctx <= topk:
            ti[t, :ctx] = torch.arange(ctx, dtype=dtype)
        else:
            ti[t] = torch.randperm(ctx, generator=g)[:topk].to(dtype)
    edges = [bs - 1, bs, 2 * bs - 1, 2 * bs, nb * bs - 1, 0]  # block edges, last column
    if T > 1:
        ti[T - 1, : len(edges)] = torch.tensor(edges, dtype=dtype)
    if T > 3:
        ti[1, 3] = -1  # interleaved -1: the packer takes the first `lens` columns
        ti[2] = -1  # a row with nothing
    valid = torch.ones(T, dtype=torch.bool)
    if T > 4:
        valid[[0, 4]] = False  # padded tokens
    return ti, t2r, bt, valid


def _python_pack(ti, t2r, bt, bs, valid):
    """Row by row, from the slot formula ``bt[req, p // bs] * bs + p % bs``."""
    out, indptr, lens = [], [0], []
    for t in range(ti.shape[0]):
        row = [int(v) for v in ti[t]]
        n = sum(v >= 0 for v in row) if bool(valid[t]) else 0
        req = int(t2r[t])
        out += [int(bt[req, p // bs]) * bs + p % bs if p >= 0 else -1 for p in row[:n]]
        lens.append(n)
        indptr.append(indptr[-1] + n)
    return out, indptr, lens


def _same(got, ref):
    nnz = int(ref[1][-1])
    assert got[0].shape == ref[0].shape and got[0].dtype == torch.int32
    assert torch.equal(got[1], ref[1]) and got[1].dtype == torch.int32
    assert torch.equal(got[2], ref[2]) and got[2].dtype == torch.int32
    assert torch.equal(got[0][:nnz], ref[0][:nnz])  # past nnz: scratch


@pytest.mark.parametrize("T,topk,bs,dtype", [
    (1, 16, 4, torch.int32),      # batch 1, a request shorter or longer than top-k
    (16, 16, 4, torch.int32),     # batch 16
    (16, 24, 8, torch.int64),     # top-k not a power of two; int64 indices
    (7, 64, 16, torch.int32),     # a few tokens, wide top-k
])
def test_kernel_matches_the_twin_upstream_and_the_slot_formula(T, topk, bs, dtype):
    from triton_interp import import_with_real_triton

    ti, t2r, bt, valid = _case(T, topk, bs, seed=T * topk + bs, dtype=dtype)
    got = ktri.topk_ragged_pack_triton(ti, t2r, bt, bs, valid)
    ref = twin(ti, t2r, bt, bs, valid)
    _same(got, ref)
    out, indptr, lens = _python_pack(ti, t2r, bt, bs, valid)
    assert got[1].tolist() == indptr and got[2].tolist() == lens
    assert got[0][: indptr[-1]].tolist() == out
    rocm = import_with_real_triton("vllm.models.deepseek_v4.amd.rocm")
    _same(got, rocm.compute_global_topk_ragged_indices_and_indptr(
        ti.to(torch.int32), t2r, bt, bs, valid))
    # the case has what it claims (short and full rows; edges; -1 packed; invalid tokens)
    if T == 16:
        assert (lens.count(topk) > 0) and any(0 < n < topk for n in lens)
        assert -1 in out and not valid.all()


def test_block_edges_by_hand():
    """bs 4, request 1's blocks [9, 3, 7]: p = 3 -> 9*4+3 = 39, 4 -> 3*4 = 12, 7 -> 15, 8 -> 28,
    11 -> 31; token 1 is padding; token 2 (request 0, blocks [5, 6, 2]) picks 0, 1 then -1."""
    bt = torch.tensor([[5, 6, 2], [9, 3, 7]], dtype=torch.int32)
    ti = torch.tensor([[3, 4, 7, 8, 11], [0, 1, 2, 3, 4], [0, 1, -1, -1, -1]], dtype=torch.int32)
    t2r = torch.tensor([1, 0, 0], dtype=torch.int32)
    valid = torch.tensor([True, False, True])
    out, indptr, lens = ktri.topk_ragged_pack_triton(ti, t2r, bt, 4, valid)
    assert lens.tolist() == [5, 0, 2] and indptr.tolist() == [0, 5, 5, 7]
    assert out[:7].tolist() == [39, 12, 15, 28, 31, 20, 21]


def test_a_topk_buffer_slice_with_a_wider_row_stride():
    """The attention passes ``topk_indices_buffer[:T]``; a [T, K] view of a wider buffer is read
    by its row stride."""
    ti, t2r, bt, valid = _case(9, 16, 4, seed=5)
    wide = torch.full((9, 40), 12345, dtype=torch.int32)
    wide[:, :16] = ti
    view = wide[:, :16]
    assert view.stride(0) == 40
    _same(ktri.topk_ragged_pack_triton(view, t2r, bt, 4, valid), twin(ti, t2r, bt, 4, valid))


def test_bad_inputs_name_the_tensor():
    ti, t2r, bt, valid = _case(3, 8, 4, seed=1)
    with pytest.raises(ValueError, match="topk_indices torch.float32"):
        ktri.topk_ragged_pack_triton(ti.float(), t2r, bt, 4, valid)
    with pytest.raises(ValueError, match="block_table"):
        ktri.topk_ragged_pack_triton(ti, t2r, bt.t(), 4, valid)
    with pytest.raises(ValueError, match="is_valid_token"):
        ktri.topk_ragged_pack_triton(ti, t2r, bt, 4, valid[:2])


# ---- the op --------------------------------------------------------------------------------
def _counted(*args):
    from vllm.models.deepseek_v4.common.ops import gfx936_topk_ragged as op

    SC.CUSTOM_IMPLS["vllm::gfx936_fused_topk_ragged_pack"] = op._pack
    c = SC.StepCounter()
    with c:
        res = op.topk_ragged_pack_gfx936(*args)
    return res, c.counts["launch"], c.counts["sync"], dict(c.ops)


@pytest.mark.parametrize("T", [1, 16])
def test_the_op_is_one_launch_and_computes_the_twin_on_the_cpu(T):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ti, t2r, bt, valid = _case(T, 16, 4, seed=T)
    res, launches, syncs, ops = _counted(ti, t2r, bt, 4, valid)
    assert (launches, syncs) == (1, 0), ops
    assert ops == {"launch:vllm::gfx936_fused_topk_ragged_pack": 1}
    ref = twin(ti, t2r, bt, 4, valid)
    _same(res, ref)
    # the twin alone is many launches (what the CPU count saw before)
    c = SC.StepCounter()
    with c:
        twin(ti, t2r, bt, 4, valid)
    assert c.counts["launch"] > 10 and c.counts["sync"] == 0

    mode = FakeTensorMode()
    with mode:
        f = torch.ops.vllm.gfx936_fused_topk_ragged_pack(
            *(mode.from_tensor(a) for a in (ti, t2r, bt)), 4, mode.from_tensor(valid))
    assert [tuple(x.shape) for x in f] == [tuple(x.shape) for x in ref]
    assert all(x.dtype == torch.int32 for x in f)


@pytest.mark.parametrize("chosen,runs", [("triton", "triton"), ("torch", "twin")])
def test_the_op_on_a_device_follows_the_fused_ops_row(monkeypatch, chosen, runs):
    """A meta tensor stands in for a device tensor: the Triton kernel unless
    VLLM_GFX936_FUSED_OPS=torch."""
    import vllm.models.deepseek_v4.amd.gfx936_attention_torch as twins
    from vllm.models.deepseek_v4.common.ops import gfx936_topk_ragged as op
    from vllm.platforms import gfx936_kernel_select as sel

    monkeypatch.setattr(sel, "path", lambda name: chosen if name == "fused_ops" else "kernel")
    seen = []
    monkeypatch.setattr(ktri, "topk_ragged_pack_triton", lambda *a: seen.append("triton"))
    monkeypatch.setattr(twins, "compute_global_topk_ragged_indices_and_indptr",
                        lambda *a: seen.append("twin"))
    meta = torch.empty(2, 8, dtype=torch.int32, device="meta")
    op._pack(meta, meta[:, 0], meta, 4, meta[:, 0].bool())
    assert seen == [runs]


def test_the_c4_attention_decode_packs_through_the_op(monkeypatch):
    """The no-FP8 attention's C4 decode (its own __init__ and _forward_decode; upstream's layer
    constructor and the Sparse MLA call stubbed) packs the top-k with one launch, no sync, and
    hands the decode the twin's ragged slots."""
    from types import SimpleNamespace

    from vllm.models.deepseek_v4.amd import gfx936_attention as ga
    from vllm.models.deepseek_v4.common.ops import gfx936_topk_ragged as op

    monkeypatch.setattr(ga.DeepseekV4ROCMAiterMLAAttention, "__init__",
                        lambda self, *a, **k: torch.nn.Module.__init__(self))
    seen = {}
    monkeypatch.setattr(ga, "rocm_sparse_attn_decode", lambda **kw: seen.update(kw))
    layer = ga.DeepseekV4Gfx936Attention()
    T, bs = 16, 4
    ti, t2r, bt, valid = _case(T, 16, bs, seed=21)
    buf = torch.full((T + 5, 16), 777, dtype=torch.int32)
    buf[:T] = ti
    layer.compress_ratio = 4
    layer.topk_indices_buffer = buf
    layer.swa_cache_layer = SimpleNamespace(kv_cache=None)
    layer.attn_sink, layer.scale, layer.prefix = None, 1.0, "l"
    layer.head_dim, layer.nope_head_dim, layer.rope_head_dim = 512, 448, 64
    swa = SimpleNamespace(num_decodes=bt.shape[0], num_decode_tokens=T, is_valid_token=valid,
                          token_to_req_indices=t2r, decode_swa_indices=None,
                          decode_swa_lens=None, decode_swa_ragged_indices=None,
                          decode_swa_ragged_indptr=None)
    attn = SimpleNamespace(block_size=bs * 4, block_table=bt)
    SC.CUSTOM_IMPLS["vllm::gfx936_fused_topk_ragged_pack"] = op._pack
    q, out = torch.zeros(T, 1, 512), torch.zeros(1)
    c = SC.StepCounter()
    with c:
        layer._forward_decode(q, None, swa, attn, False, out)
    assert (c.counts["launch"], c.counts["sync"]) == (1, 0), dict(c.ops)
    assert dict(c.ops) == {"launch:vllm::gfx936_fused_topk_ragged_pack": 1}
    _same((seen["topk_ragged_indices"], seen["topk_ragged_indptr"], seen["topk_lens"]),
          twin(ti, t2r, bt, bs, valid))


# ---- mutations: the comparisons above must catch a broken kernel ---------------------------
MUTATIONS = [
    ("offset-counts-its-own-row", "rm = r < t", "rm = r <= t"),
    ("slot-offset-dropped", "blk * block_size + p % block_size", "blk * block_size"),
    ("invalid-tokens-packed", "n = tl.where(ok, tl.sum(present.to(tl.int32), axis=0), 0)",
     "n = tl.sum(present.to(tl.int32), axis=0)"),
]


@pytest.mark.parametrize("name,old,new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutated_kernels_fail_the_twin_comparison(tmp_path, name, old, new):
    src = Path(ktri.__file__).read_text()
    assert src.count(old) == 1, f"mutation anchor moved: {old!r}"
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ti, t2r, bt, valid = _case(16, 16, 4, seed=16)
    with pytest.raises(AssertionError):
        _same(mod.topk_ragged_pack_triton(ti, t2r, bt, 4, valid), twin(ti, t2r, bt, 4, valid))
