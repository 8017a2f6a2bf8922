# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse-indexer / compressor metadata without a Triton device (the CPU): the torch twins in
``gfx936_indexer_metadata`` equal upstream's integer-only Triton kernels, run here under the
Triton interpreter (integer math only, so the interpreter is a sound reference), bit exact.
"""
from __future__ import annotations

import pytest
import torch


def test_compressed_slot_mapping_matches_triton_kernel():
    triton_interp = pytest.importorskip("triton_interp")
    mod = triton_interp.import_with_real_triton(
        "vllm.v1.attention.backends.mla.compressor_utils")
    from vllm.v1.attention.backends.mla.gfx936_indexer_metadata import (
        compressed_slot_mapping_torch,
    )

    g = torch.Generator().manual_seed(4)
    qsl = torch.tensor([0, 1, 38, 40, 40], dtype=torch.int32)
    seq_lens = torch.tensor([77, 300, 9, 0], dtype=torch.int32)
    bt = torch.randint(0, 50, (4, 20), generator=g, dtype=torch.int32)
    for ratio, bs in ((4, 16), (128, 2)):
        ours = torch.full((44,), -1, dtype=torch.int64)
        theirs = ours.clone()
        compressed_slot_mapping_torch(ours, qsl, seq_lens, bt, bs, ratio)
        mod._compressed_slot_mapping_kernel[(4,)](
            theirs, qsl, seq_lens, bt, bt.stride(0), bs, ratio, PAD_ID=-1,
            TRITON_BLOCK_SIZE=1024)
        assert torch.equal(ours, theirs)


def test_prefill_chunk_and_uniform_decode_metadata_match_triton_kernels():
    """The V4 prefill rows (token_to_seq, cu_seqlen_ks/ke over a query slice) and the
    flattened spec-decode expansion, against upstream's kernels under the interpreter."""
    triton_interp = pytest.importorskip("triton_interp")
    mod = triton_interp.import_with_real_triton("vllm.v1.attention.backends.mla.indexer")
    from vllm.v1.attention.backends.mla import gfx936_indexer_metadata as twin

    qsl = torch.tensor([0, 5, 5, 37], dtype=torch.int32)
    seq_lens = torch.tensor([9, 130, 300], dtype=torch.int32)
    for ratio, (q0, q1) in ((4, (0, 37)), (4, (3, 20)), (128, (0, 37))):
        cseq = seq_lens // ratio
        cu = torch.zeros(4, dtype=torch.int32)
        cu[1:] = torch.cumsum(cseq, 0)
        rows = int(cu[-1])
        outs = []
        for fn in (mod.BuildPrefillChunkMetadataKernel.kernel, None):
            t2s = torch.full((rows,), -7, dtype=torch.int32)
            ks = torch.full((q1 - q0,), -7, dtype=torch.int32)
            ke = torch.full((q1 - q0,), -7, dtype=torch.int32)
            if fn is None:
                twin.prefill_chunk_metadata_torch(qsl, seq_lens, cu, cu, t2s, ks, ke, q0, q1,
                                                  0, 1, 1, num_reqs=3, COMPRESS_RATIO=ratio)
            else:
                fn[(3,)](qsl, seq_lens, cu, cu, t2s, ks, ke, q0, q1, 0, 1, 1,
                         BLOCK_SIZE=1024, COMPRESS_RATIO=ratio)
            outs.append((t2s, ks, ke))
        for a, b in zip(*outs):
            assert torch.equal(a, b), ratio

    g = torch.Generator().manual_seed(5)
    sl = torch.tensor([40, 17, 99], dtype=torch.int32)
    bt = torch.randint(0, 90, (3, 11), generator=g, dtype=torch.int32)
    res = []
    for use_kernel in (True, False):
        dsl = torch.zeros(16, dtype=torch.int32)
        ebt = torch.zeros(16, 11, dtype=torch.int32)
        dl = torch.zeros(16, dtype=torch.int32)
        args = (sl, dsl, bt, bt.stride(0), ebt, ebt.stride(0), dl, 3)
        if use_kernel:
            mod._prepare_uniform_decode_kernel[(9,)](*args, BLOCK_SIZE=1024)
        else:
            twin.prepare_uniform_decode_torch(*args, BLOCK_SIZE=1024)
        res.append((dsl, ebt, dl))
    for a, b in zip(*res):
        assert torch.equal(a, b)
