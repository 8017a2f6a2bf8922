# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936 Sparse MLA reference decode against a float64 attention written
here over the K the independent writer stored, and its dispatch from
rocm_sparse_attn_decode."""

import math

import pytest
import torch
from fp8_ds_mla_writer import (
    alloc_fp8_ds_mla_cache,
    dequantize_written_k,
    random_fp8_ds_mla_cache,
    swa_only_decode_args,
    write_fp8_ds_mla,
)
from vllm.v1.attention.ops import gfx936_sparse_mla_reference as ref_mod
from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
    rocm_sparse_attn_decode_reference,
    sparse_mla_decode_reference,
)

H = 8
SCALE = 1.0 / math.sqrt(512)
# float32 logits/softmax/sum over <= ~100 keys of |k| <= ~6: relative error
# ~1e-6; 1e-4 leaves margin. bf16 output (drop-in) adds 2^-8 relative.
F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=1e-2)


def _attention_f64(q, keys, sink):
    """out[i,h] = sum_j e^{s_j} k_j / (sum_j e^{s_j} + e^{sink_h}), float64,
    straight from the formula, one query at a time. keys[i]: [n_i, 512]."""
    b, h, d = q.shape
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        k = keys[i]
        if k.shape[0] == 0:
            continue
        s = SCALE * (q[i].double() @ k.T)  # [h, n]
        m = s.max(dim=1, keepdim=True).values
        if sink is not None:
            m = torch.maximum(m, sink.double()[:h, None])
        e = torch.exp(s - m)
        denom = e.sum(dim=1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink.double()[:h, None] - m)
        out[i] = (e / denom) @ k
    return out


def _q(b, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, 512, generator=gen) * 0.5).to(torch.bfloat16)


def _sink(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H + 4, generator=gen)  # longer than H: sliced like upstream


def _dense(rows, width):
    idx = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return idx, torch.tensor([len(r) for r in rows], dtype=torch.int32)


def _ragged(rows):
    flat = torch.tensor([s for r in rows for s in r], dtype=torch.int32)
    indptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
    return flat, indptr


def _written_k_by_slot(k, slots):
    kd = dequantize_written_k(k)
    return {int(s): kd[j] for j, s in enumerate(slots.tolist())}


def _keys(rows, by_slot, extra_rows=None, extra_by_slot=None):
    out = []
    for i, r in enumerate(rows):
        ks = [by_slot[s] for s in r if s >= 0]
        if extra_rows is not None:
            ks += [extra_by_slot[s] for s in extra_rows[i] if s >= 0]
        out.append(torch.stack(ks) if ks else torch.zeros(0, 512, dtype=torch.float64))
    return out


def _call(
    q,
    main_cache,
    main,
    extra_cache=None,
    extra=None,
    *,
    sink=None,
    ragged=False,
    out_dtype=torch.float32,
):
    rows, width = main
    swa_idx, swa_lens = _dense(rows, width)
    kw = dict(
        swa_indices=swa_idx,
        swa_lens=swa_lens,
        swa_ragged_indices=None,
        swa_ragged_indptr=None,
        topk_indices=None,
        topk_lens=None,
        topk_ragged_indices=None,
        topk_ragged_indptr=None,
    )
    if ragged:
        kw["swa_ragged_indices"], kw["swa_ragged_indptr"] = _ragged(rows)
    if extra is not None:
        erows, ewidth = extra
        if ragged:
            kw["topk_ragged_indices"], kw["topk_ragged_indptr"] = _ragged(erows)
        else:
            kw["topk_indices"], kw["topk_lens"] = _dense(erows, ewidth)
    output = torch.empty(q.shape, dtype=out_dtype)
    rocm_sparse_attn_decode_reference(
        q=q,
        kv_cache=extra_cache,
        swa_k_cache=main_cache,
        swa_only=extra is None,
        attn_sink=sink,
        scale=SCALE,
        head_dim=512,
        nope_head_dim=448,
        rope_head_dim=64,
        output=output,
        **kw,
    )
    return output


@pytest.mark.parametrize("ragged", [False, True])
def test_decode_matches_float64_attention_over_written_k(ragged):
    """SWA-only decode on a seed-strided cache equals float64 attention over
    the dequantized written K (tolerance F32_TOL: float32 arithmetic)."""
    cache, k, slots = random_fp8_ds_mla_cache(100, num_blocks=4, seed=2)
    by_slot = _written_k_by_slot(k, slots)
    s = slots.tolist()
    rows = [s[0:11], s[11:40], s[40:41], s[41:100]]
    q = _q(len(rows))
    out = _call(q, cache, (rows, 64), ragged=ragged)
    expect = _attention_f64(q, _keys(rows, by_slot), None)
    torch.testing.assert_close(out.double(), expect, **F32_TOL)


def test_negative_and_out_of_range_indices_are_skipped():
    """-1 entries (anywhere in a row) and slots past the cache contribute
    nothing; the result equals attention over the valid slots only."""
    cache, k, slots = random_fp8_ds_mla_cache(30, num_blocks=2, seed=4)
    by_slot = _written_k_by_slot(k, slots)
    s = slots.tolist()
    num_rows = 2 * 64
    rows = [[s[0], -1, s[1], s[2], -1], [-1, s[3], num_rows + 5, s[4]]]
    q = _q(2, seed=3)
    out = _call(q, cache, (rows, 6))
    expect = _attention_f64(
        q, _keys([[x for x in r if 0 <= x < num_rows] for r in rows], by_slot), None
    )
    torch.testing.assert_close(out.double(), expect, **F32_TOL)
    # Ragged with the same entries (upstream maps bad slots to -1 too).
    out_r = _call(q, cache, (rows, 6), ragged=True)
    torch.testing.assert_close(out_r, out, atol=0, rtol=0)


def test_entries_past_lens_are_ignored():
    """Dense indices are a prefix of length lens (upstream semantics): valid
    slots after it are not attended."""
    cache, k, slots = random_fp8_ds_mla_cache(10, num_blocks=1, seed=8)
    by_slot = _written_k_by_slot(k, slots)
    s = slots.tolist()
    q = _q(1, seed=9)
    idx = torch.tensor([s[:6]], dtype=torch.int32)
    output = torch.empty(q.shape)
    rocm_sparse_attn_decode_reference(
        **swa_only_decode_args(q, cache, idx, torch.tensor([3]), output, scale=SCALE)
    )
    expect = _attention_f64(q, _keys([s[:3]], by_slot), None)
    torch.testing.assert_close(output.double(), expect, **F32_TOL)


def test_sink_adds_exp_sink_to_the_softmax_denominator():
    """With a sink the output is exactly (no-sink output) * Z / (Z + e^sink)
    with Z = sum_j e^{s_j} (float64 formula); and with no attended token the
    output is 0 with or without a sink."""
    cache, k, slots = random_fp8_ds_mla_cache(40, num_blocks=1, seed=5)
    by_slot = _written_k_by_slot(k, slots)
    s = slots.tolist()
    rows = [s[:17], s[17:40], []]
    q = _q(3, seed=6)
    sink = _sink()
    keys = _keys(rows, by_slot)
    out_sink = _call(q, cache, (rows, 32), sink=sink, out_dtype=torch.float32)
    out_nosink = _call(q, cache, (rows, 32), out_dtype=torch.float32)
    torch.testing.assert_close(
        out_sink.double(), _attention_f64(q, keys, sink), **F32_TOL
    )
    for i in range(2):
        logits = SCALE * (q[i].double() @ keys[i].T)
        z = torch.exp(logits).sum(dim=1)
        ratio = (z / (z + torch.exp(sink[:H].double())))[:, None]
        torch.testing.assert_close(
            out_sink[i].double(), out_nosink[i].double() * ratio, **F32_TOL
        )
        assert (ratio < 0.999).any()  # the sink matters in this test
    assert torch.equal(out_sink[2], torch.zeros(H, 512))
    assert torch.equal(out_nosink[2], torch.zeros(H, 512))


@pytest.mark.parametrize("ragged", [False, True])
def test_main_and_extra_caches_are_attended_together(ragged):
    """SWA (main) + compressed top-k (extra, other block size and stride)
    form one softmax: equal to float64 attention over the union."""
    main, km, sm = random_fp8_ds_mla_cache(60, num_blocks=2, seed=10)
    extra, ke, se = random_fp8_ds_mla_cache(
        40, num_blocks=5, block_size=16, block_stride=50000, seed=11
    )
    mb, eb = _written_k_by_slot(km, sm), _written_k_by_slot(ke, se)
    sm, se = sm.tolist(), se.tolist()
    rows = [sm[:20], sm[20:25], sm[25:60]]
    erows = [se[:10] + [-1], [], se[10:40]]
    q = _q(3, seed=12)
    sink = _sink(13)
    out = _call(q, main, (rows, 40), extra, (erows, 32), sink=sink, ragged=ragged)
    expect = _attention_f64(q, _keys(rows, mb, erows, eb), sink)
    torch.testing.assert_close(out.double(), expect, **F32_TOL)
    # Not the same as attending main only.
    main_only = _attention_f64(q, _keys(rows, mb), sink)
    assert (main_only - expect).abs().max() > 1e-2


def test_float64_compute_reproduces_formula_to_rounding():
    """With compute_dtype=float64 the only difference to the formula is
    summation order: the K decode itself is exact."""
    cache, k, slots = random_fp8_ds_mla_cache(50, num_blocks=1, seed=14)
    by_slot = _written_k_by_slot(k, slots)
    s = slots.tolist()
    rows = [s[:50]]
    q = _q(1, seed=15)
    sink = _sink(16)
    sl = torch.tensor([s], dtype=torch.int64)
    out = sparse_mla_decode_reference(
        q, cache, sl, sl >= 0, SCALE, sink, compute_dtype=torch.float64
    )
    expect = _attention_f64(q, _keys(rows, by_slot), sink)
    torch.testing.assert_close(out, expect, atol=1e-12, rtol=1e-12)


def test_bf16_output_drop_in():
    """The drop-in writes into a bf16 output like upstream's decode."""
    cache, k, slots = random_fp8_ds_mla_cache(30, num_blocks=1, seed=17)
    by_slot = _written_k_by_slot(k, slots)
    rows = [slots.tolist()]
    q = _q(1, seed=18)
    out = _call(q, cache, (rows, 30), sink=_sink(), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expect = _attention_f64(q, _keys(rows, by_slot), _sink())
    torch.testing.assert_close(out.double(), expect, **BF16_TOL)


def test_skipped_slots_do_not_leak_nan_from_block_zero():
    """Invalid entries are gathered as slot 0; a NaN-poisoned block 0 must
    not reach the output through them."""
    cache = alloc_fp8_ds_mla_cache(2, 64, 1002240, fill=0x7F)  # NaN e4m3
    gen = torch.Generator().manual_seed(19)
    k = torch.randn(5, 512, generator=gen)
    slots = torch.arange(64, 69)
    write_fp8_ds_mla(cache, k, slots)
    q = _q(1, seed=20)
    rows = [[-1, 64, 65, -1, 66, 67, 68, -1]]
    out = _call(q, cache, (rows, 8))
    assert torch.isfinite(out).all()
    expect = _attention_f64(
        q, _keys([[64, 65, 66, 67, 68]], _written_k_by_slot(k, slots)), None
    )
    torch.testing.assert_close(out.double(), expect, **F32_TOL)


def test_bad_head_dims_raise_clear_error():
    cache = alloc_fp8_ds_mla_cache(1, 64)
    q = _q(1)
    with pytest.raises(ValueError, match="nope_head_dim=512"):
        rocm_sparse_attn_decode_reference(
            **swa_only_decode_args(
                q,
                cache,
                torch.zeros(1, 1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32),
                torch.empty(1, H, 512),
                scale=SCALE,
                head_dim=576,
                nope_head_dim=512,
                rope_head_dim=64,
            )
        )


def test_reference_module_imports_only_torch_and_stdlib():
    """The oracle must run on a bare torch machine: no vllm/triton imports, except the cache
    layout constants, a leaf that itself imports only torch and the stdlib."""
    import ast
    import sys

    from vllm.v1.attention.ops import deepseek_v4_cache_layouts as layouts

    def imports(path):
        names = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
        return {n for n in names if n.split(".")[0] not in set(sys.stdlib_module_names)}

    assert imports(ref_mod.__file__) <= {"torch", layouts.__name__}
    assert imports(layouts.__file__) <= {"torch"}


# --- dispatch from upstream's rocm_sparse_attn_decode -----------------------


def _upstream_args(q, cache, slots, output):
    idx = slots[None, :].to(torch.int32)
    swa_lens = torch.tensor([idx.shape[1]], dtype=torch.int32)
    return swa_only_decode_args(
        q, cache, idx, swa_lens, output, scale=SCALE, attn_sink=_sink()
    )


@pytest.mark.parametrize("mode", ["reference"])
def test_dispatch_picks_reference_on_gfx936(monkeypatch, mode):
    import vllm.platforms.gfx936 as gfx936
    from vllm.platforms import gfx936_kernel_select as sel
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops

    monkeypatch.setattr(gfx936, "on_gfx936", lambda: True)
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", mode)
    sel.reset()
    monkeypatch.setattr(sel, "_CHOSEN", {})  # restored after the test
    logged = []
    monkeypatch.setattr(sel.logger, "info", lambda msg, *a, **k: logged.append(msg % a))

    def no_triton(*a, **k):
        raise AssertionError("Triton decode must not run on gfx936")

    monkeypatch.setattr(ops, "_rocm_sparse_attn_decode_triton", no_triton)
    cache, k, slots = random_fp8_ds_mla_cache(20, num_blocks=1, seed=22)
    q = _q(1, seed=23)
    output = torch.empty(q.shape, dtype=torch.bfloat16)
    ops.rocm_sparse_attn_decode(**_upstream_args(q, cache, slots, output))
    expect = torch.empty_like(output)
    rocm_sparse_attn_decode_reference(**_upstream_args(q, cache, slots, expect))
    assert torch.equal(output, expect)
    assert len(logged) == 1 and "reference" in logged[0] and mode in logged[0]


def test_dispatch_keeps_upstream_path_where_fp8_hardware_exists(monkeypatch):
    """Off the no-FP8 path (gfx942/950: FP8 hardware) upstream's Triton decode runs; gfx936 and
    the CPU take the fork's decode (see test_dispatch_picks_reference_on_gfx936)."""
    import vllm.platforms.gfx936 as gfx936
    import vllm.platforms.gfx936_capability as cap
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops

    monkeypatch.setattr(gfx936, "on_gfx936", lambda: False)
    monkeypatch.setattr(cap, "lacks_fp8_conversion", lambda: False)
    called = []

    def fake_triton(**kw):
        called.append(kw)
        return torch.zeros(kw["q"].shape)

    def no_reference(*a, **k):
        raise AssertionError("reference must not run off gfx936")

    monkeypatch.setattr(ops, "_rocm_sparse_attn_decode_triton", fake_triton)
    from vllm.v1.attention.ops import gfx936_sparse_mla_dispatch as dispatch

    monkeypatch.setattr(dispatch, "run_gfx936_sparse_decode", no_reference)
    cache, k, slots = random_fp8_ds_mla_cache(20, num_blocks=1, seed=24)
    q = _q(1)
    output = torch.empty(q.shape, dtype=torch.bfloat16)
    ops.rocm_sparse_attn_decode(**_upstream_args(q, cache, slots, output))
    assert len(called) == 1 and called[0]["main_cache"] is cache
