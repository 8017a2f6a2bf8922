"""Run dsv4_vllm_run.py with one deliberate mistake in the product (in process, test-only), to show
that test_dsv4_engine_e2e.py's log-prob thresholds catch it. Not part of the product or of CI.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python dsv4_mutation_run.py MUTATION -- <dsv4_vllm_run args>

MUTATION: kv-scale (fp8_ds_mla reader doubles every UE8M0 scale), rope (KV RoPE at position + 1),
sink (attention sink dropped in prefill and decode), block (the last token of every cache
block read from the next block's first slot).
"""
from __future__ import annotations

import sys
from pathlib import Path


def apply(name: str) -> None:
    import torch

    from vllm.models.deepseek_v4.amd import gfx936_attention_torch as T
    if name == "kv-scale":
        orig = T.decode_ue8m0
        T.decode_ue8m0 = lambda x, *a, **k: orig(x, *a, **k) * 2.0
        import vllm.v1.attention.ops.gfx936_sparse_mla_reference as R
        orig_r = R.decode_ue8m0
        R.decode_ue8m0 = lambda x, *a, **k: orig_r(x, *a, **k) * 2.0
    elif name == "rope":
        orig = T.qnorm_rope_kv_insert
        def shifted(q, kv, cache, slots, positions, *a, **k):
            return orig(q, kv, cache, slots, positions + 1, *a, **k)
        T.qnorm_rope_kv_insert = shifted
    elif name == "sink":
        orig_p = T.sparse_attn_prefill
        def nosink_p(*a, **k):
            k["attn_sink"] = None
            return orig_p(*a, **k)
        T.sparse_attn_prefill = nosink_p
        import vllm.v1.attention.ops.gfx936_sparse_mla_reference as R
        orig_d = R.sparse_mla_decode_reference
        def nosink_d(q, main_cache, main_slots, main_valid, scale, attn_sink, *a, **k):
            return orig_d(q, main_cache, main_slots, main_valid, scale, None, *a, **k)
        R.sparse_mla_decode_reference = nosink_d
    elif name == "block":
        # Off by one at every block boundary: the last token of a block is read from the
        # first slot of the next physical block (prefill gather and every twin reader).
        orig = T.read_fp8_ds_mla
        def boundary(cache, slots, block_size):
            s = torch.where(slots % block_size == block_size - 1, slots + 1, slots)
            return orig(cache, s, block_size)
        T.read_fp8_ds_mla = boundary
    else:
        raise SystemExit(f"unknown mutation {name!r}")


def main() -> int:
    name, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    apply(name)
    sys.path.insert(0, str(Path(__file__).parent))
    import dsv4_vllm_run
    return dsv4_vllm_run.main(rest)


if __name__ == "__main__":
    sys.exit(main())
