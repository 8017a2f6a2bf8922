# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer top-k op fills the top-k buffer's padded tail with -1 in its own launch (patch
dsv4-indexer-topk-fill-fused-gfx936, issue 19): a pure decode step no longer spends a launch of
its own on ``topk_indices_buffer[:num_tokens] = -1``.

Reference: what the step did before, written here (the whole tail filled with -1, then the
twin's top-k into the decode rows). The kernel under TRITON_INTERPRET and the op's CPU twin must
give that buffer exactly, and leave rows past ``fill_rows`` alone; the whole no-FP8 indexer op on a
pure decode batch must give it with no ``fill_`` launch (2 launches: logits, top-k) and no sync,
batch 1 and 16. A mutated kernel (the tail filled with 0) must fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_dsv4_indexer_fused_gfx936 import D, _case, _q

from vllm.v1.attention.ops import gfx936_indexer_topk as kop
from vllm.v1.attention.ops import gfx936_indexer_topk_triton as ktri
from vllm.v1.attention.ops import gfx936_sparse_attn_indexer as idx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import step_counter as SC  # noqa: E402

TOPK = 8
SENTINEL = 55


def _before(logits, seq, next_n, n_rows, buf_rows):
    """The buffer as the step left it before: rows [:n_rows] = -1, then the decode top-k."""
    out = torch.full((buf_rows, TOPK), SENTINEL, dtype=torch.int32)
    out[:n_rows] = -1
    ends = idx.decode_row_ends(seq, next_n).clamp(max=logits.shape[1])
    idx.top_k_per_row(logits, None, ends, TOPK, out)
    return out


@pytest.mark.parametrize("lens,pad", [([37], 3), ([0, 3, 8, 9, 37, 130, 5, 1, 64, 2, 19, 8, 7,
                                                      90, 12, 33], 4), ([9, 40], 0)])
def test_kernel_and_twin_fill_the_tail_in_the_same_launch(lens, pad):
    cache, bt, seq, q, w = _case(lens, 16, 1, False, 4, seed=len(lens))
    logits = idx._paged_decode_logits(q, cache, w, idx.decode_row_ends(seq, 1), bt, 4096)
    rows = logits.shape[0]
    want = _before(logits, seq, 1, rows + pad, rows + pad + 2)
    for run in ("kernel", "twin"):
        out = torch.full((rows + pad + 2, TOPK), SENTINEL, dtype=torch.int32)
        if run == "kernel":
            ktri.indexer_topk_triton(logits, seq, 1, TOPK, out, block=64, fill_rows=rows + pad)
        else:
            kop._topk(logits, seq, 1, TOPK, out, rows + pad)
        assert torch.equal(out, want), run
        assert bool((out[rows + pad:] == SENTINEL).all())  # past fill_rows: untouched


def test_fill_rows_past_the_buffer_is_named():
    cache, bt, seq, q, w = _case([5], 16, 1, False, 4, seed=1)
    logits = idx._paged_decode_logits(q, cache, w, idx.decode_row_ends(seq, 1), bt, 64)
    with pytest.raises(ValueError, match="fill_rows 9 past out"):
        ktri.indexer_topk_triton(logits, seq, 1, TOPK, torch.empty(4, TOPK, dtype=torch.int32),
                                 fill_rows=9)


@pytest.mark.parametrize("bsz", [1, 16])
def test_a_pure_decode_step_fills_no_more_in_a_launch_of_its_own(bsz):
    """The no-FP8 indexer op on a pure decode batch, under the step audit's counter: the two
    fused ops and nothing else; the buffer as before (padded tokens' rows -1)."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
    )

    lens = [3, 60, 129, 7, 1, 40, 8, 9, 16, 17, 90, 2, 33, 64, 65, 11][:bsz]
    cache, bt, seq, _, _ = _case(lens, 16, 1, False, 4, seed=bsz)
    g = torch.Generator().manual_seed(bsz)
    q, w = _q(bsz, 4, g)
    pad = 3
    meta = DeepseekV32IndexerMetadata(
        seq_lens=seq, max_seq_len=int(seq.max()) * 4, slot_mapping=torch.zeros(bsz),
        num_decodes=bsz, num_decode_tokens=bsz, num_prefills=0, num_prefill_tokens=0,
        decode=DeepSeekV32IndexerDecodeMetadata(
            block_table=bt, seq_lens=seq, decode_lens=torch.ones(bsz, dtype=torch.int32),
            requires_padding=False, schedule_metadata=torch.zeros(1)))
    SC.CUSTOM_IMPLS.update({"vllm::gfx936_fused_indexer_logits": kop._logits,
                            "vllm::gfx936_fused_indexer_topk": kop._topk})
    buf = torch.full((bsz + pad + 2, TOPK), SENTINEL, dtype=torch.int32)
    hs = torch.zeros(bsz + pad, 8)
    qf = q.view(torch.float8_e4m3fn)
    fc = ForwardContext(no_compile_layers={}, attn_metadata={"kc": meta}, slot_mapping={})
    c = SC.StepCounter()
    with override_forward_context(fc), c:
        idx.gfx936_sparse_attn_indexer(hs, "kc", cache, qf, None, w, 128, "ue8m0", TOPK, D,
                                       4096, 1000, buf, True)
    assert (c.counts["launch"], c.counts["sync"]) == (2, 0), dict(c.ops)
    assert "launch:aten::fill_" not in c.ops
    logits = kop._logits(q.view(bsz, 1, 4, D), w, cache, bt, seq, 4096)
    assert torch.equal(buf, _before(logits, seq, 1, bsz + pad, bsz + pad + 2))


def test_mutated_kernel_fails(tmp_path):
    old, new = "tl.full([KP], -1, tl.int32)", "tl.full([KP], 0, tl.int32)"
    src = Path(ktri.__file__).read_text()
    assert src.count(old) == 1, f"mutation anchor moved: {old!r}"
    path = tmp_path / "tail_zero.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cache, bt, seq, q, w = _case([9, 40], 16, 1, False, 4, seed=3)
    logits = idx._paged_decode_logits(q, cache, w, idx.decode_row_ends(seq, 1), bt, 4096)
    out = torch.full((5, TOPK), SENTINEL, dtype=torch.int32)
    mod.indexer_topk_triton(logits, seq, 1, TOPK, out, block=64, fill_rows=4)
    assert not torch.equal(out, _before(logits, seq, 1, 4, 5))
