# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fast gfx936 Sparse MLA decodes: the Triton twin (TRITON_INTERPRET on the CPU)
against a float64 attention written here over the K the independent writer
stored, the tier selection and its loud fallback, and the AMD compile check of
the HIP kernel (csrc_gfx936) with Debian's hipcc."""

import math
import subprocess
from pathlib import Path

import pytest
import torch
from fp8_ds_mla_writer import alloc_fp8_ds_mla_cache, dequantize_written_k, write_fp8_ds_mla

REPO = Path(__file__).resolve().parents[2]
SCALE = 1.0 / math.sqrt(512)
# Under the interpreter the twin computes in float32 (ieee dot); the only
# rounding that matters is the output store: float32 here, so 1e-4.
TOL = dict(atol=1e-4, rtol=1e-4)


def _f64_attention(q, keys, sink):
    b, h, _ = q.shape
    out = torch.zeros(b, h, 512, dtype=torch.float64)
    for i in range(b):
        k = keys[i]
        s = SCALE * (q[i].double() @ k.T) if k.shape[0] else torch.zeros(h, 0).double()
        m = s.max(dim=1, keepdim=True).values if k.shape[0] else torch.full((h, 1), -1e300, dtype=torch.float64)
        if sink is not None:
            m = torch.maximum(m, sink.double()[:h, None])
        e = torch.exp(s - m)
        den = e.sum(1, keepdim=True) + (torch.exp(sink.double()[:h, None] - m)
                                        if sink is not None else 0)
        out[i] = torch.where(den > 0, e / den, 0.0) @ k if k.shape[0] else 0.0
    return out


def _setup(b, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    # odd block strides and storage offsets: the reader must use stride(0) and the offset
    main = alloc_fp8_ds_mla_cache(6, 16, block_stride=16 * 584 + 40, storage_offset=7, seed=seed)
    extra = alloc_fp8_ds_mla_cache(5, 8, block_stride=8 * 584 + 24, storage_offset=3,
                                   seed=seed + 1)
    km = torch.randn(96, 512, generator=g) * 1.5
    ke = torch.randn(40, 512, generator=g) * 1.5
    # NoPE group 1 = one outlier (64 -> ue8m0 scale 2**-2) + values below 2**-8: the
    # rest are E4M3 subnormals (m * 2**-9), the decoder's special case
    km[:, 64:128] = (torch.rand(96, 64, generator=g) * 2 - 1) * 0.003
    km[:, 64] = 64.0
    write_fp8_ds_mla(main, km, torch.arange(96))
    write_fp8_ds_mla(extra, ke, torch.arange(40))
    q = (torch.randn(b, h, 512, generator=g) * 0.5).to(torch.bfloat16)
    return main, extra, dequantize_written_k(km), dequantize_written_k(ke), q, g


def _keys(rows, kd, n_rows, extra_rows=None, ked=None, e_rows=None):
    out = []
    for i, r in enumerate(rows):
        ks = [kd[s] for s in r if 0 <= s < n_rows]
        if extra_rows is not None:
            ks += [ked[s] for s in extra_rows[i] if 0 <= s < e_rows]
        out.append(torch.stack(ks) if ks else torch.zeros(0, 512, dtype=torch.float64))
    return out


def _args(q, main, extra, swa, tk, sink, out, ragged):
    def dense(rows, width):
        idx = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return idx, torch.tensor([len(r) for r in rows], dtype=torch.int32)

    def rag(rows):
        flat = torch.tensor([s for r in rows for s in r], dtype=torch.int32)
        ptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
        return flat, ptr

    si, sl = dense(swa, 24)
    kw = dict(q=q, kv_cache=extra, swa_k_cache=main, swa_only=extra is None,
              topk_indices=None, topk_lens=None, swa_indices=si, swa_lens=sl,
              swa_ragged_indices=None, swa_ragged_indptr=None, topk_ragged_indices=None,
              topk_ragged_indptr=None, attn_sink=sink, scale=SCALE, head_dim=512,
              nope_head_dim=448, rope_head_dim=64, output=out)
    if ragged:
        kw["swa_ragged_indices"], kw["swa_ragged_indptr"] = rag(swa)
    if extra is not None:
        kw["topk_indices"], kw["topk_lens"] = dense(tk, 40)
        if ragged:
            kw["topk_ragged_indices"], kw["topk_ragged_indptr"] = rag(tk)
    return kw


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("h", [8, 32])
def test_triton_twin_matches_float64_attention_over_written_k(ragged, splits, h):
    """Both sources, -1 and out-of-range slots skipped, an empty query, sink,
    odd block stride and storage offset, dense and ragged indices, split-K."""
    from vllm.v1.attention.ops.gfx936_sparse_mla_triton import sparse_mla_decode_triton

    main, extra, kd, ked, q, g = _setup(3, h)
    swa = [[5, -1, 17, 95, 96, 400, 3] + list(range(30, 45)), [], [0, 1, 2]]
    tk = [[7, 39, -2, 40, 12] + list(range(13, 33)), [1, 2, 3], []]
    sink = torch.randn(h + 3, generator=g)
    out = torch.full((3, h, 512), float("nan"))
    sparse_mla_decode_triton(**_args(q, main, extra, swa, tk, sink, out, ragged),
                             num_splits=splits)
    want = _f64_attention(q, _keys(swa, kd, 96, tk, ked, 40), sink)
    torch.testing.assert_close(out.double(), want, **TOL)


def test_triton_twin_swa_only_without_sink_writes_zero_for_an_empty_query():
    from vllm.v1.attention.ops.gfx936_sparse_mla_triton import sparse_mla_decode_triton

    main, _, kd, _, q, _ = _setup(2, 8, seed=3)
    swa = [[4, 8, 15, 16, 23, 42], [-1, 500]]
    out = torch.full((2, 8, 512), float("nan"))
    sparse_mla_decode_triton(**_args(q, main, None, swa, None, None, out, ragged=True),
                             num_splits=2)
    want = _f64_attention(q, _keys(swa, kd, 96), None)
    torch.testing.assert_close(out.double(), want, **TOL)
    assert torch.equal(out[1], torch.zeros(8, 512))


def test_split_k_only_while_queries_times_head_blocks_leave_sms_idle():
    """The split rule both fast tiers follow (the HIP kernel's decode_plan, the Triton twin's
    split_count; test_sparse_mla_decode_cpu_emu.py checks the kernel's against this): no split
    once queries x head blocks reach the SM/CU count (issue 21: at b=64 H=64 the partials cost
    more than the keys they split); below it as many programs as fit two per SM/CU, rounded
    down (rounding up left a second, part-filled round: 288 programs at b=8 H=64), at least two
    8-key tiles per split, at most 16 splits."""
    from vllm.v1.attention.ops.gfx936_sparse_mla_launch import split_count

    assert split_count(64, 4, 640, 132, 8) == 1    # c4 b=64 H=64: 256 programs >= 132
    assert split_count(64, 2, 640, 132, 8) == 2    # 128 < 132: 264 // 128
    assert split_count(8, 4, 640, 132, 8) == 8     # c4 b=8 H=64: 264 // 32 (256 <= 264)
    assert split_count(64, 1, 640, 132, 8) == 4    # c4 b=64 H=16: 256, not 320
    for b, hb, sms in ((8, 4, 132), (64, 1, 132), (3, 7, 80), (5, 3, 64), (1, 1, 132)):
        s = split_count(b, hb, 4096, sms, 8)
        assert b * hb * s <= 2 * sms < b * hb * (s + 1) or s == 16, (b, hb, sms, s)
    assert split_count(1, 1, 640, 132, 8) == 16    # b=1: capped
    assert split_count(1, 1, 40, 132, 8) == 3      # 40 keys: ceil(40 / 16) tiles of two
    assert split_count(132, 1, 640, 132, 8) == 1


def test_bad_indices_dtype_is_named_in_the_error():
    from vllm.v1.attention.ops.gfx936_sparse_mla_triton import sparse_mla_decode_triton

    main, extra, _, _, q, _ = _setup(1, 8)
    kw = _args(q, main, None, [[1, 2]], None, None, torch.empty(1, 8, 512), ragged=False)
    kw["swa_indices"] = kw["swa_indices"].float()
    with pytest.raises(TypeError, match="swa indices: expected int32/int64.*float32"):
        sparse_mla_decode_triton(**kw)


# --- tier selection (the Sparse MLA row of gfx936_kernel_select's one table) --------------
def test_auto_takes_the_first_available_tier_and_says_why_it_skipped():
    from vllm.platforms.gfx936_kernel_select import resolve

    op = "sparse_mla_decode"
    avail = {"kernel": (False, "no _gfx936_C.so"), "triton": (True, ""),
             "reference": (True, "")}
    path, warns = resolve(op, "auto", avail)
    assert path == "triton" and len(warns) == 1
    assert "kernel path is unavailable (no _gfx936_C.so)" in warns[0]
    assert "VLLM_GFX936_SPARSE_DECODE=kernel makes this an error" in warns[0]
    avail["kernel"] = (True, "loaded")
    assert resolve(op, "auto", avail) == ("kernel", [])
    assert resolve(op, "reference", avail) == ("reference", [])
    avail["triton"] = (False, "no triton")
    with pytest.raises(ValueError, match="VLLM_GFX936_SPARSE_DECODE='fast'"):
        resolve(op, "fast", avail)


def test_a_forced_tier_that_cannot_run_is_an_error_naming_the_switch():
    """A named tier is forced: unavailable, it raises (naming the switch and why) instead of
    running the next tier, so `--kernels force` on the cluster proves the kernel ran (the
    review's P1: a forced kernel used to fall back to Triton with only a warning)."""
    from vllm.platforms.gfx936_kernel_select import resolve

    op = "sparse_mla_decode"
    avail = {"kernel": (False, "no _gfx936_C.so"), "triton": (False, "no triton"),
             "reference": (True, "")}
    with pytest.raises(ValueError, match=r"VLLM_GFX936_SPARSE_DECODE=kernel.*no _gfx936_C.so"):
        resolve(op, "kernel", avail)
    with pytest.raises(ValueError, match=r"VLLM_GFX936_SPARSE_DECODE=triton.*no triton"):
        resolve(op, "triton", avail)
    assert resolve(op, "reference", avail) == ("reference", [])
    assert resolve(op, "auto", avail)[0] == "reference"


def test_extension_absent_on_the_cpu_build_gives_a_reason():
    from vllm.gfx936 import kernels

    ok, why = kernels.load()
    assert not ok and "_gfx936_C" in why


@pytest.fixture
def sel():
    from vllm.platforms import gfx936_kernel_select as sel

    sel.reset()
    yield sel
    sel.reset()


def _dispatch_case(monkeypatch, sel, choice):
    import vllm.platforms.gfx936 as gfx936

    monkeypatch.setattr(gfx936, "on_gfx936", lambda: True)
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", choice)
    sel.reset()
    warned, logged = [], []
    monkeypatch.setattr(sel.logger, "warning", lambda m, *a, **k: warned.append(m % a))
    monkeypatch.setattr(sel.logger, "info", lambda m, *a, **k: logged.append(m % a))
    main, extra, _, _, q, g = _setup(2, 8, seed=5)
    swa = [[1, 2, 3, 50], [60, 61]]
    tk = [[4, 5], [6]]
    sink = torch.randn(8, generator=g)
    out = torch.full((2, 8, 512), float("nan"))
    return _args(q, main, extra, swa, tk, sink, out, ragged=True), warned, logged


def test_dispatch_on_gfx936_under_auto_falls_back_loudly_from_a_missing_kernel(monkeypatch, sel):
    """auto, extension absent (CPU build): the Triton twin runs, a warning names why, and the
    result matches the reference."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
        rocm_sparse_attn_decode_reference)

    kw, warned, logged = _dispatch_case(monkeypatch, sel, "auto")
    ops.rocm_sparse_attn_decode(**kw)
    want = torch.empty_like(kw["output"])
    rocm_sparse_attn_decode_reference(**dict(kw, output=want))
    torch.testing.assert_close(kw["output"], want, **TOL)
    assert any("kernel path is unavailable" in w and "_gfx936_C" in w for w in warned)
    assert len(logged) == 1 and "triton path" in logged[0]


def test_dispatch_on_gfx936_with_the_kernel_forced_and_absent_raises(monkeypatch, sel):
    """VLLM_GFX936_SPARSE_DECODE=kernel and no extension: an error naming the switch and
    the missing library, not a Triton run."""
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops

    kw, warned, logged = _dispatch_case(monkeypatch, sel, "kernel")
    with pytest.raises(ValueError, match=r"VLLM_GFX936_SPARSE_DECODE=kernel.*_gfx936_C"):
        ops.rocm_sparse_attn_decode(**kw)


def test_under_auto_a_fast_path_whose_call_fails_is_dropped_for_the_next_tier(monkeypatch, sel):
    """auto: the kernel's call failing drops it (and every tier above) for the next available
    one, with a warning; here (CPU: no Triton device) that is the reference."""
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "auto")
    sel._CHOSEN["sparse_mla_decode"] = "kernel"
    warned = []
    monkeypatch.setattr(sel.logger, "warning", lambda m, *a, **k: warned.append(m % a))
    assert sel.drop("sparse_mla_decode", "kernel", RuntimeError("boom")) == "reference"
    assert sel.path("sparse_mla_decode") == "reference"
    assert len(warned) == 1 and "kernel path failed" in warned[0] and "boom" in warned[0]


def test_a_fast_call_that_raises_runs_the_next_tier_in_the_same_call(monkeypatch, sel):
    """The hook's loop, not only drop(): under auto a fast tier that raises at run time (a
    kernel fault, not a bad argument) is dropped and the next tier fills the output in the
    same call; later calls go straight to that tier."""
    from vllm.v1.attention.ops import gfx936_sparse_mla_dispatch as dispatch
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    from vllm.v1.attention.ops.gfx936_sparse_mla_reference import (
        rocm_sparse_attn_decode_reference)

    kw, warned, logged = _dispatch_case(monkeypatch, sel, "auto")
    calls = []

    def broken(**_):
        calls.append(1)
        raise RuntimeError("device fault")

    real = dispatch.decode_fn
    monkeypatch.setattr(dispatch, "decode_fn",
                        lambda p: broken if p == "triton" else real(p))
    ops.rocm_sparse_attn_decode(**kw)
    want = torch.empty_like(kw["output"])
    rocm_sparse_attn_decode_reference(**dict(kw, output=want))
    torch.testing.assert_close(kw["output"], want, rtol=0, atol=0)
    assert sel.path("sparse_mla_decode") == "reference" and calls == [1]
    assert any("triton path failed" in w and "device fault" in w for w in warned)
    ops.rocm_sparse_attn_decode(**kw)
    assert calls == [1]


def test_a_forced_fast_path_whose_call_fails_raises_instead_of_falling_back(monkeypatch, sel):
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "triton")
    with pytest.raises(RuntimeError, match=r"VLLM_GFX936_SPARSE_DECODE=triton: the triton path "
                                           r"failed \(RuntimeError: boom\)"):
        sel.drop("sparse_mla_decode", "triton", RuntimeError("boom"))


# --- AMD compile check (CI) --------------------------------------------------------------
def test_hip_kernel_compiles_for_an_amd_wave64_target_without_mfma(gfx90a_kernel_check):
    r, tmp_path = gfx90a_kernel_check
    assert r.returncode == 0, r.stdout + r.stderr
    # part 2's kernels (W8A16 dense, MXFP4 MoE) compile for the same wave64 target
    for src in ("w8a16_fp8", "moe_mxfp4"):
        part2 = [str(REPO / "csrc_gfx936" / "check_offload.py"), "--want", "gfx90a",
                 str(tmp_path / f"{src}.gfx90a.o")]
        done = subprocess.run(["python3"] + part2, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
    obj = tmp_path / "sparse_mla_decode.gfx90a.o"
    check = [str(REPO / "csrc_gfx936" / "check_offload.py"), str(obj)]
    ok = subprocess.run(["python3", check[0], "--want", "gfx90a", check[1]],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    # the wheel's gate must reject an object built for another arch
    bad = subprocess.run(["python3", check[0], "--want", "gfx936", check[1]],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "no gfx936 code" in bad.stdout and "gfx90a" in bad.stdout


def test_kernel_front_end_refuses_a_split_count():
    """The HIP kernel plans split-K itself (decode_plan, from the CU count); a caller that
    still passes num_splits (the old signature) gets an error, not a silently other plan."""
    from vllm.v1.attention.ops.gfx936_sparse_mla_launch import sparse_mla_decode_kernel

    main, _, _, _, q, _ = _setup(2, 8, seed=3)
    out = torch.empty((2, 8, 512))
    with pytest.raises(TypeError, match="num_splits"):
        sparse_mla_decode_kernel(**_args(q, main, None, [[4], [5]], None, None, out,
                                         ragged=True), num_splits=2)
