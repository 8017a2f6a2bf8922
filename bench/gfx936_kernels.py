# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936 part 2: block-FP8 W8A16 dense and MXFP4 MoE kernels, numerics
against float64 and speed, on the GPU torch sees, with the kernel library of
``make kernels`` (``--kernel-lib build/kernels/_gfx936_C.so``).

What runs is the fork's dispatch, staged byte for byte by ``make bench-stage``
into ``.device/dense_moe``: ``gfx936_w8a16_kernel.py`` (GEMV for M <= 32,
dequantize once + BLAS above) and ``gfx936_mxfp4_moe_kernel.py`` (device
routing, GEMV kernels for decode sizes, routed-experts dequant + grouped GEMM
for prefill), next to today's paths (``gfx936_w8a16.w8a16_block_mm``: torch
dequant per call; the MXFP4 emulation: every local expert dequantized per
forward) and BF16 GEMMs on pre-dequantized weights.

Numerics (``--no-speed`` runs only these; exit 1 on a mismatch): the oracle
decodes the bytes independently in float64 (torch's float8_e4m3fn cast, an
E2M1 lookup table, ``2.0 ** (u - 127)``), as bench/dense_moe.py does:

* dequant kernels in float32 == the float64 decode, bitwise; in BF16 ==
  the fork's torch dequant (the reference), bitwise;
* dense at DeepSeek V4 Flash TP8/TP4 per-rank shapes, M = 1..512 (both sides
  of the GEMV/BLAS switch; grouped wo_a; float32 scales): rel <= 1e-2,
  cos >= 0.9999 (one BF16 rounding of the output; see dense_moe.py);
* MoE at TP8/TP4 shapes (256 experts, H 4096, I 256/512, top-6): random
  routing, a token routing twice to one expert, every token on one expert,
  an expert_map with experts on other ranks, weight on input; decode sizes
  (GEMV) and prefill sizes (dequant + BLAS, and the GEMV forced on the same
  batch): rel <= 2e-2, cos >= 0.9999, clamp active;
* NaN-free, and bitwise identical outputs over 50 repeats.

Speed: median of isolated calls, L2 flushed and the device idle before each
(sparse_mla_common.Timer), eager and CUDA-graph replay, as ratios in one run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dense_moe as DM  # noqa: E402
import sparse_mla_common as C  # noqa: E402

BLOCK = DM.BLOCK
# DeepSeek V4 Flash per-rank dense FP8 projections: name -> (N, K, groups)
DENSE_TP8 = {
    "wqa+wkv 1536x4096": (1536, 4096, 1),
    "wq_b 4096x1024": (4096, 1024, 1),
    "idx wq_b 8192x1024": (8192, 1024, 1),
    "wo_a 1024x4096": (1024, 4096, 1),
    "wo_b 4096x1024": (4096, 1024, 1),
    "shared w13 512x4096": (512, 4096, 1),
    "shared w2 4096x256": (4096, 256, 1),
}
DENSE_TP4 = {
    "wq_b 8192x1024": (8192, 1024, 1),
    "wo_a 2x1024x4096": (2048, 4096, 2),
    "wo_b 4096x2048": (4096, 2048, 1),
    "shared w13 1024x4096": (1024, 4096, 1),
    "shared w2 4096x512": (4096, 512, 1),
}
MOE_TP8 = DM.MoECfg(hidden=4096, inter=256, experts=256, topk=6)
MOE_TP4 = DM.MoECfg(hidden=4096, inter=512, experts=256, topk=6)


def load(stage_dir, kernel_lib):
    w8, mx, sw = DM.load_staged(stage_dir)
    wk = importlib.import_module("gfx936_w8a16_kernel")
    mk = importlib.import_module("gfx936_mxfp4_moe_kernel")
    torch.ops.load_library(str(kernel_lib))
    return w8, mx, sw, wk, mk


# ---- numerics ------------------------------------------------------------------------
def dense_ref(x, w64, groups):
    n, k = w64.shape
    g = n // groups
    return torch.cat([x[:, i * k:(i + 1) * k].double() @ w64[i * g:(i + 1) * g].t()
                      for i in range(groups)], dim=1)


def dense_check(w8, wk, shapes, tokens, device, sdtype, log):
    ok = True
    ops = torch.ops._gfx936_C
    for si, (name, (n, k, groups)) in enumerate(shapes.items()):
        d = DM.Dense(n, k, device, sdtype, seed=21 + si)
        w64 = d.w64()
        wu8 = d.weight.view(torch.uint8)
        f32 = torch.empty(n, k, device=device)
        ops.fp8_block_dequant(wu8, d.u8, *BLOCK, f32)
        bf = torch.empty(n, k, device=device, dtype=torch.bfloat16)
        ops.fp8_block_dequant(wu8, d.u8, *BLOCK, bf)
        e1 = bool(torch.equal(f32.double(), w64))
        e2 = bool(torch.equal(bf, w8.dequantize_fp8_block(d.weight, d.scale, BLOCK)))
        ok &= e1 and e2
        log(f"dense {name}: fp8_block_dequant fp32 == f64 decode bitwise {e1}, "
            f"bf16 == torch reference bitwise {e2}")
        del f32, bf
        for m in tokens:
            gen = torch.Generator(device=device).manual_seed(7000 + 97 * si + m)
            x = torch.randn(m, groups * k, generator=gen, device=device).to(torch.bfloat16)
            out = wk.w8a16_block_mm_kernel(x, d.weight, d.scale, BLOCK, torch.bfloat16, groups)
            mt = DM.metrics(out, dense_ref(x, w64, groups))
            good = DM.verdict(mt, DM.TOL_DENSE) and out.dtype == torch.bfloat16
            ok &= good
            path = "gemv" if m <= wk.GEMV_MAX_M else "dequant+mm"
            log(f"dense {name:22s} M={m:4d} {path:10s} vs f64: rel={mt['rel']:.2e} "
                f"cos={mt['cos']:.8f} finite={mt['finite']} {'ok' if good else 'FAIL'}")
            if wk.GEMV_MAX_M < m <= 16:  # the GEMV the engine runs here when steps run eagerly
                out16 = wk.w8a16_block_mm_kernel(x, d.weight, d.scale, BLOCK, torch.bfloat16,
                                                 groups, gemv_max_m=16)
                mt16 = DM.metrics(out16, dense_ref(x, w64, groups))
                good16 = DM.verdict(mt16, DM.TOL_DENSE) and out16.dtype == torch.bfloat16
                ok &= good16
                log(f"dense {name:22s} M={m:4d} {'gemv eager':10s} vs f64: "
                    f"rel={mt16['rel']:.2e} cos={mt16['cos']:.8f} finite={mt16['finite']} "
                    f"{'ok' if good16 else 'FAIL'}")
            if m in (1, 16):
                first = out.clone()
                same = all(torch.equal(first, wk.w8a16_block_mm_kernel(
                    x, d.weight, d.scale, BLOCK, torch.bfloat16, groups)) for _ in range(50))
                ok &= same
                log(f"dense {name:22s} M={m:4d} 50 repeats bitwise identical: {same}")
        if si == 0:  # float32 block scales (FP8 checkpoints with float scales)
            s32 = torch.exp2(d.u8.float() - 127)
            x = torch.randn(5, groups * k, device=device).to(torch.bfloat16)
            out = wk.w8a16_block_mm_kernel(x, d.weight, s32, BLOCK, torch.bfloat16, groups)
            mt = DM.metrics(out, dense_ref(x, w64, groups))
            good = DM.verdict(mt, DM.TOL_DENSE)
            ok &= good
            log(f"dense {name:22s} M=   5 float32 scales vs f64: rel={mt['rel']:.2e} "
                f"{'ok' if good else 'FAIL'}")
        del w64, d
    return ok


def routing(cfg, m, kind, device, seed):
    """(topk_weights f32, topk_ids i32, expert_map or None, local id of each pair)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e_glob = 2 * cfg.experts if kind == "expert_map" else cfg.experts
    logits = torch.randn(m, e_glob, generator=g)
    wts, ids = logits.softmax(-1).topk(cfg.topk, -1)
    wts = wts / wts.sum(-1, keepdim=True)
    emap = None
    if kind == "repeat":  # slot 1 routes to the same expert as slot 0
        ids[:, 1] = ids[:, 0]
    elif kind == "one_expert":  # slot 0 of every token on expert 7, the rest distinct
        r = torch.stack([torch.randperm(cfg.experts - 1, generator=g)[: cfg.topk - 1]
                         for _ in range(m)])
        ids[:, 0] = 7
        ids[:, 1:] = r + (r >= 7).long()
    elif kind == "expert_map":  # even global ids live here as local id // 2
        emap = torch.full((e_glob,), -1, dtype=torch.int32)
        emap[0::2] = torch.arange(cfg.experts, dtype=torch.int32)
    local = ids if emap is None else emap[ids].long()
    return (wts.float().to(device), ids.to(torch.int32).to(device),
            None if emap is None else emap.to(device), local)


def moe_oracle(moe, x, wts, local, weight_on_input):
    cfg = moe.cfg
    out = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float64, device=x.device)
    hs = []
    for ex in sorted(set(local.flatten().tolist()) - {-1}):
        tok, slot = (local == ex).nonzero(as_tuple=True)
        tok = tok.to(x.device)
        w = wts[tok, slot.to(x.device)].double()[:, None]
        xe = x.double().index_select(0, tok)
        if weight_on_input:
            xe = xe * w
        h = xe @ DM.MoE.w64(moe.w13[ex], moe.u13[ex]).t()
        hs.append(h)
        y = DM.swiglu64(h, cfg.alpha, cfg.limit) @ DM.MoE.w64(moe.w2[ex], moe.u2[ex]).t()
        out.index_add_(0, tok, y if weight_on_input else y * w)
    hs = torch.cat(hs)
    d = cfg.inter
    clamped = float(((hs[:, :d] > cfg.limit) | (hs[:, d:].abs() > cfg.limit)).double().mean())
    return out, clamped


def moe_call(mk, moe, x, wts, ids, emap, force=None, weight_on_input=False, gemms=None):
    out = torch.empty(x.shape[0], moe.cfg.hidden, dtype=torch.bfloat16, device=x.device)
    path = mk.mxfp4_moe_kernel(out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, emap,
                               moe.cfg.alpha, moe.cfg.limit, weight_on_input, force=force,
                               prefill_gemms=gemms)
    return out, path


def moe_check(mx, mk, label, cfg, cases, device, sdtype, log):
    ok = True
    ops = torch.ops._gfx936_C
    moe = DM.MoE(cfg, device, sdtype)
    active = torch.tensor([3, 200, -1, 0], dtype=torch.int32, device=device)
    for name, w, s in (("w13", moe.w13, moe.s13), ("w2", moe.w2, moe.s2)):
        f32 = torch.empty(4, w.shape[1], 2 * w.shape[2], device=device)
        bf = torch.empty(4, w.shape[1], 2 * w.shape[2], device=device, dtype=torch.bfloat16)
        ops.mxfp4_dequant_experts(w, s.view(torch.uint8), active, 0, f32)
        ops.mxfp4_dequant_experts(w, s.view(torch.uint8), active, 0, bf)
        u = s.view(torch.uint8)
        e1 = all(torch.equal(f32[i].double(), DM.MoE.w64(w[e], u[e])) for i, e in
                 ((0, 3), (1, 200), (3, 0)))
        e2 = all(torch.equal(bf[i], mx.dequant_mxfp4_torch(w[e], s[e], torch.bfloat16))
                 for i, e in ((0, 3), (1, 200), (3, 0)))
        ok &= e1 and e2
        log(f"moe {label} {name}: mxfp4_dequant_experts fp32 == f64 LUT decode bitwise {e1}, "
            f"bf16 == torch reference bitwise {e2}")
    for m, kind, force, woi in cases:
        wts, ids, emap, local = routing(cfg, m, kind, device, seed=31 * m + len(kind))
        gx = torch.Generator(device=device).manual_seed(500 + m)
        x = torch.randn(m, cfg.hidden, generator=gx, device=device).to(torch.bfloat16)
        out, path = moe_call(mk, moe, x, wts, ids, emap, force, woi)
        ref, clamped = moe_oracle(moe, x, wts, local, woi)
        mt = DM.metrics(out, ref)
        good = DM.verdict(mt, DM.TOL_MOE)
        same = True
        if m in (1, 64, 512) and not woi:
            same = all(torch.equal(out, moe_call(mk, moe, x, wts, ids, emap, force)[0])
                       for _ in range(50))
        if path == "direct":  # the grouped path's bits (moe_mxfp4.cu, the direct path)
            grouped = moe_call(mk, moe, x, wts, ids, emap, "gemv", woi)[0]
            same_g = torch.equal(out, grouped)
            ok &= same_g
            log(f"moe {label} M={m:4d} {kind:10s} direct == grouped bitwise: {same_g}")
        if path == "prefill":  # the GEMMs ROCm (gfx936) runs: bucketed torch.bmm
            mb = DM.metrics(moe_call(mk, moe, x, wts, ids, emap, "prefill", woi,
                                     "bucketed")[0], ref)
            good_b = DM.verdict(mb, DM.TOL_MOE)
            ok &= good_b
            log(f"moe {label} M={m:4d} {kind:10s} prefill bucketed bmm vs f64: "
                f"rel={mb['rel']:.2e} cos={mb['cos']:.8f} {'ok' if good_b else 'FAIL'}")
        ok &= good and same
        log(f"moe {label} M={m:4d} {kind:10s}{' w-on-input' if woi else '':11s} {path:7s} "
            f"vs f64: rel={mt['rel']:.2e} cos={mt['cos']:.8f} finite={mt['finite']} "
            f"clamp-active={clamped:.1%}" + (" 50x bitwise-identical" if same and m in
                                             (1, 64, 512) and not woi else "")
            + f" {'ok' if good and same else 'FAIL'}")
    return ok


# ---- speed ---------------------------------------------------------------------------
COLD_BYTES = 384 << 20  # > 7x the H200's 50 MB L2: rotating copies read cold


def copies_for(nbytes, lo=4, hi=64):
    return max(lo, min(hi, -(-COLD_BYTES // max(1, nbytes))))


def graph_per_call(fns, timer):
    """ms per call when the calls run back to back in one CUDA graph (as a
    decode step's layers do): every closure works on its own copy of the
    weights (together > L2), the replay is timed like one call (L2 flushed,
    device idle) and divided by the number of calls, which amortises the
    timer's own floor. None when the calls cannot be captured."""
    def run_all():
        for f in fns:
            f()
    replay, err, g = C.capture(run_all)
    if replay is None:
        print(f"note: capture failed: {err}")
        return None
    t = timer(replay, reps=max(5, timer.reps // 3))
    del g
    return t / len(fns)


def seq_routes(cfg, m, device, n=32):
    """n random routings of m tokens (one per back-to-back call: each reads other experts)."""
    return [routing(cfg, m, "random", device, seed=1000 * m + i)[:2] for i in range(n)]


def moe_seq(mk, moe, cfg, x, out, routes, timer, force=None):
    """ms per MoE call back to back, one call per routing of ``routes``."""
    return graph_per_call([
        (lambda w=w, i=i: mk.mxfp4_moe_kernel(
            out, x, moe.w13, moe.s13, moe.w2, moe.s2, w, i, None, 1.0, cfg.limit, False,
            force=force)) for w, i in routes], timer)


def dense_seq(wk, x, copies, scale, groups, timer, **kw):
    """ms per W8A16 call back to back, one call per weight copy (together > L2)."""
    return graph_per_call([
        (lambda w=w: wk.w8a16_block_mm_kernel(x, w, scale, BLOCK, torch.bfloat16, groups, **kw))
        for w in copies], timer)


def profile(fn, label, n=5):
    """Per-kernel device times of ``fn`` (torch.profiler / CUPTI), printed."""
    from torch.profiler import ProfilerActivity, profile as tprof
    fn()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(f"--- profile {label} ({n} calls) ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def launch_floor(timer, n):
    t = torch.zeros(1, device="cuda")

    def fn():
        for _ in range(n):
            t.add_(1)
    return DM.timed(timer, fn, True)


def dense_speed(w8, wk, shapes, tokens, today_tokens, device, sdtype, timer):
    rows = []
    for si, (name, (n, k, groups)) in enumerate(shapes.items()):
        d = DM.Dense(n, k, device, sdtype, seed=41 + si)
        wbf = w8.dequantize_fp8_block(d.weight, d.scale, BLOCK)
        wg = wbf.view(groups, n // groups, k).transpose(1, 2)
        for m in tokens:
            x = torch.randn(m, groups * k, device=device).to(torch.bfloat16)
            xg = x.view(m, groups, k).transpose(0, 1)
            r = {"name": name, "n": n, "k": k, "m": m, "wbytes": n * k + d.u8.numel()}
            r["kernel"] = DM.timed(timer, lambda: wk.w8a16_block_mm_kernel(
                x, d.weight, d.scale, BLOCK, torch.bfloat16, groups), True)
            r["bf16"] = DM.timed(timer, (lambda: torch.mm(x, wbf.t())) if groups == 1 else
                                 (lambda: torch.bmm(xg, wg)), True)
            nc = copies_for(r["wbytes"])
            wc = [d.weight.clone() for _ in range(nc)]
            r["kernel_seq"] = dense_seq(wk, x, wc, d.scale, groups, timer)
            if 4 <= m <= 64:  # the other side of the GEMV / dequant+BLAS switch
                alt = 0 if m <= wk.GEMV_MAX_M else 1 << 30
                r["alt_seq"] = dense_seq(wk, x, wc, d.scale, groups, timer, gemv_max_m=alt)
            del wc
            bc = [wbf.clone() for _ in range(copies_for(2 * n * k))]
            r["bf16_seq"] = graph_per_call([(lambda b=b: torch.mm(x, b.t())) for b in bc]
                                           if groups == 1 else [lambda: torch.bmm(xg, wg)],
                                           timer)
            del bc
            if m in today_tokens and groups == 1:
                r["today"] = DM.timed(timer, lambda: w8.w8a16_block_mm(
                    x, d.weight, d.scale, BLOCK), True)
            rows.append(r)
        del wbf, d
    return rows


def moe_speed(mx, sw, mk, cfg, tokens, emu_tokens, prefill, device, sdtype, timer):
    moe = DM.MoE(cfg, device, sdtype)
    per_expert = (2 * cfg.inter * cfg.hidden + cfg.hidden * cfg.inter) // 2 \
        + (2 * cfg.inter * cfg.hidden + cfg.hidden * cfg.inter) // 32
    rows = []
    for m in tokens:
        wts, ids, emap, local = routing(cfg, m, "random", device, seed=m)
        x = torch.randn(m, cfg.hidden, device=device).to(torch.bfloat16)
        out = torch.empty(m, cfg.hidden, dtype=torch.bfloat16, device=device)
        n_act = len(set(local.flatten().tolist()))
        r = {"m": m, "active": n_act, "bytes": n_act * per_expert}
        r["path"] = mk.mxfp4_moe_kernel(out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids,
                                        None, 1.0, cfg.limit, False)
        r["kernel"] = DM.timed(timer, lambda: mk.mxfp4_moe_kernel(
            out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, None, 1.0, cfg.limit, False),
            True)
        # back to back with a different routing per call: each reads other experts; the
        # grouped GEMV path (moe_route + gate/up + down [+ reduce]) in the same run
        routes = seq_routes(cfg, m, device)
        forced = [("kernel_seq", None), ("grouped_seq", "gemv")]
        if mk.direct_ok(m, cfg.topk, cfg.hidden, cfg.inter, max_tokens=64):
            forced.append(("direct_seq", "direct"))  # where the crossover lies
        for key, force in forced:
            r[key] = moe_seq(mk, moe, cfg, x, out, routes, timer, force)
        r["seq_bytes"] = sum(len(set(i.flatten().tolist())) for _, i in routes) / len(
            routes) * per_expert
        if m in emu_tokens:
            plan = moe.route(m, device, seed=m)
            slow = C.Timer(device, 3, 1)
            r["emulation"] = DM.timed(slow, lambda: DM.moe_product(mx, sw, moe, x, plan), True)
        rows.append(r)
    prow = []
    if prefill:
        w13 = mx.dequant_mxfp4_torch(moe.w13, moe.s13, torch.bfloat16)
        w2 = mx.dequant_mxfp4_torch(moe.w2, moe.s2, torch.bfloat16)
        use_grouped = mk._grouped_mm_works("cuda")
        for m in prefill:
            wts, ids, emap, local = routing(cfg, m, "random", device, seed=m)
            x = torch.randn(m, cfg.hidden, device=device).to(torch.bfloat16)
            out = torch.empty(m, cfg.hidden, dtype=torch.bfloat16, device=device)

            def base():  # same routing, gather, grouped GEMM, reduce; weights pre-dequantized
                rt = mk.MoeRoute(ids, None, cfg.experts)
                starts = rt.expert_start.tolist()
                counts = [starts[e + 1] - starts[e] for e in range(cfg.experts)]
                pr = rt.sorted_pairs[: starts[-1]].long()
                xs = x.index_select(0, pr // cfg.topk)
                ys = mk.expert_gemms(xs, w13, w2, counts, 1.0, cfg.limit, use_grouped).float()
                y = torch.zeros(m * cfg.topk, cfg.hidden, device=device)
                y.index_copy_(0, pr, ys * wts.view(-1).index_select(0, pr).unsqueeze(1))
                torch.ops._gfx936_C.moe_reduce(y, rt.pair_expert, cfg.topk, out)

            r = {"m": m, "grouped_mm": use_grouped}
            r["prefill"] = (C.Timer(device, 5, 1)(lambda: mk.mxfp4_moe_kernel(
                out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, None, 1.0, cfg.limit,
                False, force="prefill")), None, None)
            r["bf16_base"] = (C.Timer(device, 5, 1)(base), None, None)
            # the GEMMs ROCm (gfx936) runs: torch.bmm over buckets of similar-count experts
            r["prefill_bucketed"] = (C.Timer(device, 5, 1)(lambda: mk.mxfp4_moe_kernel(
                out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, None, 1.0, cfg.limit,
                False, force="prefill", prefill_gemms="bucketed")), None, None)
            r["gemv"] = DM.timed(C.Timer(device, 5, 1), lambda: mk.mxfp4_moe_kernel(
                out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, None, 1.0, cfg.limit,
                False, force="gemv"), True)
            prow.append(r)
        del w13, w2
    return rows, prow


def layer_step(w8, mx, sw, wk, mk, batches, device, sdtype, timer, stage_dir, layers=4):
    """DeepSeek V4 Flash decoder layers (TP8, compressed-4 kind) without norms /
    RoPE / mHC: the FP8 projections, part 1's Sparse MLA decode, shared + routed
    experts. ``layers`` distinct layers run back to back in one graph (cold
    weights, as in a decode step); ms per layer. today = the same layers on
    today's gfx936 path (torch dequant per call, MXFP4 emulation)."""
    ref, up, writer = C.load_staged(stage_dir)
    fast, _, note = C.load_fast(stage_dir, None)
    if fast is None or not C.kernel_loaded():
        return [], f"Sparse MLA kernel unavailable ({note})"
    names = list(DENSE_TP8)
    nets = [({k: DM.Dense(n, kk, device, sdtype, seed=61 + 10 * li + i)
              for i, (k, (n, kk, _)) in enumerate(DENSE_TP8.items())},
             DM.MoE(MOE_TP8, device, sdtype, seed=5 + li)) for li in range(layers)]
    rows = []
    for b in batches:
        inp = C.Inputs(C.Case("c4", batch=b, heads=8), writer, device)
        x = torch.randn(b, 4096, device=device).to(torch.bfloat16)
        wts, ids, _, _ = routing(MOE_TP8, b, "random", device, seed=b)
        plans = [moe.route(b, device, seed=b) for _, moe in nets]
        out = torch.empty(b, 4096, dtype=torch.bfloat16, device=device)

        def step(li, kernels):
            dense, moe = nets[li]

            def lin(t, nm):
                d = dense[nm]
                if kernels:
                    return wk.w8a16_block_mm_kernel(t, d.weight, d.scale, BLOCK,
                                                    torch.bfloat16)
                return w8.w8a16_block_mm(t, d.weight, d.scale, BLOCK)

            qkv = lin(x, names[0])
            lin(qkv[:, :1024], names[1])
            lin(qkv[:, :1024], names[2])
            o = inp.call_fast(fast.sparse_mla_decode_kernel)
            z = lin(o.reshape(b, -1)[:, :4096], names[3])
            lin(z, names[4])
            lin(sw.clamped_swiglu(lin(x, names[5]), 10.0, 1.0), names[6])
            if kernels:
                mk.mxfp4_moe_kernel(out, x, moe.w13, moe.s13, moe.w2, moe.s2, wts, ids, None,
                                    1.0, 10.0, False)
            else:
                DM.moe_product(mx, sw, moe, x, plans[li])

        r = {"b": b, "layers": layers,
             "kernels": graph_per_call([lambda li=li: step(li, True)
                                        for li in range(layers)], timer),
             "today": graph_per_call([lambda li=li: step(li, False) for li in range(layers)],
                                     C.Timer(device, 3, 1)),
             "attention": graph_per_call([lambda: inp.call_fast(fast.sparse_mla_decode_kernel)]
                                         * 8, timer)}
        rows.append(r)
    return rows, "ok"


# ---- report ----------------------------------------------------------------------------
def us(t):
    return "n/a" if t is None else f"{t * 1e3:.1f}"


def report(meta, log, drows, mrows, prows, lrows, floors, copy_bw) -> str:
    L = [f"# csrc_gfx936 part 2 kernels on {meta['device']}", ""]
    L += [f"- {k}: {v}" for k, v in meta.items() if k != "device"]
    L += [f"- copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s",
          "- launch floor (graph replay of n tiny kernels, same timer): " +
          ", ".join(f"{n}: {us(f[1])} us" for n, f in floors.items()), ""]
    L += ["## Dense W8A16 (DeepSeek V4 Flash TP8 per-rank shapes)", "",
          "seq = per call, calls back to back in one CUDA graph on rotating weight copies "
          "(cold L2); iso = one isolated call (graph replay / eager), which includes the "
          "timer's launch floor. BW% = FP8 weight + scale bytes / seq time / copy bandwidth. "
          "vs BF16 and vs today are time ratios (> 1: the kernel is faster); other path = "
          "the dequant+BLAS path where the GEMV runs and vice versa; today = torch "
          "dequant per call + GEMM (isolated graph replay, so vs today is conservative).", "",
          "| weight | M | kernel seq us | BW% | BF16 GEMM seq us | vs BF16 | other path seq us "
          "| kernel iso graph / eager us | BF16 iso graph us | today iso graph us | vs today |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in drows:
        ks, bs = r["kernel_seq"], r["bf16_seq"]
        kg = r["kernel"][1]
        bw = r["wbytes"] / (ks * 1e-3) / copy_bw * 100 if ks else float("nan")
        td = r.get("today", (None, None, None))[1]
        L.append(f"| {r['name']} | {r['m']} | {us(ks)} | {bw:.0f}% | {us(bs)} | "
                 f"{bs / ks:.2f}x | {us(r.get('alt_seq'))} | {us(kg)} / {us(r['kernel'][0])} | "
                 f"{us(r['bf16'][1])} | "
                 f"{us(td)} | " + (f"{td / kg:.0f}x |" if td else "n/a |"))
    L += ["", "## MXFP4 MoE decode (TP8: 256 experts, H 4096, I 256, top-6; GEMV kernels)", "",
          "seq = per call, 32 calls back to back in one graph, each with its own random "
          "routing (other experts: cold); BW% on the bytes of the routed experts (packed "
          "weights + scales) / seq time / copy bandwidth. iso = one isolated call. vs "
          "emulation = emulation iso graph / kernel iso graph. path = the one the front end "
          "takes (direct: no routing launch, M <= DIRECT_MAX_TOKENS); grouped / direct seq = "
          "that path forced, same run.", "",
          "| M | path | routed experts | MB read | seq us | BW% | grouped seq us | direct seq us "
          "| iso graph us | iso eager us | emulation iso graph ms | vs emulation |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in mrows:
        kg, ks = r["kernel"][1], r["kernel_seq"]
        bw = r["seq_bytes"] / (ks * 1e-3) / copy_bw * 100 if ks else float("nan")
        em = r.get("emulation", (None, None, None))[1]
        L.append(f"| {r['m']} | {r.get('path', 'gemv')} | {r['active']} | "
                 f"{r['seq_bytes'] / 1e6:.1f} | {us(ks)} | {bw:.0f}% | "
                 f"{us(r.get('grouped_seq'))} | {us(r.get('direct_seq'))} | {us(kg)} | "
                 f"{us(r['kernel'][0])} | " +
                 (f"{em:.1f} | {em / kg:.0f}x |" if em else "n/a | n/a |"))
    if prows:
        L += ["", "## MXFP4 MoE prefill (TP8; eager, one host sync for the routing's sizes)",
              "",
              "| M | routed experts dequant + grouped GEMM ms | same GEMMs on pre-dequantized "
              "BF16 ms | ratio | dequant + bucketed bmm (ROCm's GEMMs) ms | ratio | "
              "GEMV kernels forced ms (graph) | torch._grouped_mm |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in prows:
            p, b = r["prefill"][0], r["bf16_base"][0]
            q = (r.get("prefill_bucketed") or (None,))[0]
            g = r["gemv"][1] or r["gemv"][0]
            qs = f"{q:.3f} | {q / b:.2f}x" if q else "n/a | n/a"
            L.append(f"| {r['m']} | {p:.3f} | {b:.3f} | {p / b:.2f}x | {qs} | {g:.3f} | "
                     f"{r['grouped_mm']} |")
    if lrows:
        L += ["", "## Decoder layer step (TP8, c4 layer; layers back to back in one graph, "
              "per layer)", "",
              "FP8 projections (wqa+wkv, wq_b, indexer wq_b, wo_a, wo_b, shared expert) + part "
              "1's Sparse MLA decode (8 heads, 128 SWA + 512 top-k keys) + routed MoE. today = "
              "torch dequant per call + MXFP4 emulation (every local expert).", "",
              "| batch | kernels us/layer | today ms/layer | speed-up | 43 layers, kernels ms | "
              "43 layers, today ms | Sparse MLA decode alone us |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in lrows:
            k, t = r["kernels"], r["today"]
            L.append(f"| {r['b']} | {us(k)} | {t:.2f} | {t / k:.0f}x | {43 * k:.2f} | "
                     f"{43 * t:.0f} | {us(r['attention'])} |")
    L += ["", "## Numerics log", "", "```"] + log + ["```", ""]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel-lib", default=str(C.REPO / "build" / "kernels" / "_gfx936_C.so"))
    ap.add_argument("--stage-dir", default=None, help="dense_moe stage (default .device/dense_moe)")
    ap.add_argument("--sparse-stage-dir", default=None)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and sizes")
    ap.add_argument("--profile", action="store_true", help="print per-kernel times and exit")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gfx936_kernels: no CUDA/ROCm device; the kernels need one (CPU CI runs "
              "`make kernel-check` and the dispatch tests instead)", file=sys.stderr)
        return 2
    if not Path(args.kernel_lib).is_file():
        print(f"gfx936_kernels: {args.kernel_lib} missing: run `make kernels` first",
              file=sys.stderr)
        return 2
    device = "cuda"
    w8, mx, sw, wk, mk = load(args.stage_dir, args.kernel_lib)
    sdtype, sdesc = DM.e8m0_dtype(device)
    meta = {"device": f"{C.device_name(device)}; {C.versions()}",
            "date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "command": "python3 bench/gfx936_kernels.py " + " ".join(sys.argv[1:]),
            "scale dtype": sdesc}
    for k, v in meta.items():
        print(f"{k}: {v}", flush=True)
    log = []

    def out(line):
        print(line, flush=True)
        log.append(line)

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if args.profile:
        moe = DM.MoE(MOE_TP8, device, sdtype)
        for m in (1, 16, 64):
            wts, ids, _, _ = routing(MOE_TP8, m, "random", device, seed=m)
            x = torch.randn(m, 4096, device=device).to(torch.bfloat16)
            profile(lambda: moe_call(mk, moe, x, wts, ids, None), f"moe TP8 M={m}")
            other = "gemv" if mk.direct_ok(m, 6, 4096, 256) else "direct"
            profile(lambda: moe_call(mk, moe, x, wts, ids, None, force=other),
                    f"moe TP8 M={m} {other} forced")
        for name, (n, k, g) in DENSE_TP8.items():
            d = DM.Dense(n, k, device, sdtype, seed=1)
            for m in (1, 16):
                x = torch.randn(m, k * g, device=device).to(torch.bfloat16)
                profile(lambda: wk.w8a16_block_mm_kernel(x, d.weight, d.scale, BLOCK,
                                                         torch.bfloat16, g), f"{name} M={m}")
        return 0
    dtok = [1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 64, 512]
    dshapes = dict(DENSE_TP8, **DENSE_TP4) if not args.quick else {
        k: DENSE_TP8[k] for k in list(DENSE_TP8)[:2]} | {"wo_a 2x1024x4096": (2048, 4096, 2)}
    ok = dense_check(w8, wk, dshapes, dtok if not args.quick else [1, 16, 33], device, sdtype,
                     out)
    cases = [(1, "random", None, False), (1, "random", "gemv", False),
             (3, "random", None, False), (3, "random", "gemv", False),
             (3, "expert_map", None, False), (4, "repeat", None, False),
             (2, "random", None, True),
             (16, "random", None, False), (64, "random", None, False),
             (16, "repeat", None, False), (64, "one_expert", None, False),
             (16, "expert_map", None, False), (16, "random", None, True),
             (65, "random", None, False), (512, "random", None, False),
             (512, "random", "gemv", False), (512, "one_expert", None, False),
             (512, "expert_map", None, False)]
    ok &= moe_check(mx, mk, "TP8", MOE_TP8, cases, device, sdtype, out)
    ok &= moe_check(mx, mk, "TP4", MOE_TP4, [c for c in cases if c[0] in (1, 16, 512)],
                    device, sdtype, out)
    out("GFX936-KERNELS CHECK " + ("PASS" if ok else "FAIL"))
    if args.no_speed or not ok:
        if args.out:
            Path(args.out).write_text("\n".join(log) + "\n")
        return 0 if ok else 1
    torch.cuda.empty_cache()
    timer = C.Timer(device, args.reps, args.warmup)
    copy_bw = C.copy_bandwidth(device, 2048 << 20, timer)
    meta["timing"] = ("median of isolated calls, 256 MiB L2 flush + idle device before each, "
                      "CUDA events around the call; graph = CUDA-graph replay of the call")
    floors = {n: launch_floor(timer, n) for n in (1, 4, 8)}
    drows = dense_speed(w8, wk, DENSE_TP8, [1, 4, 8, 16, 32, 64, 512], [1, 16, 512], device,
                        sdtype, timer)
    mrows, prows = moe_speed(mx, sw, mk, MOE_TP8, [1, 2, 4, 8, 16, 32, 64], [1, 16],
                             [] if args.quick else [128, 512, 1024, 2048, 4096], device,
                             sdtype, timer)
    if args.json:  # first: the raw numbers survive a layer-step or report bug
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "copy_bw": copy_bw, "floors": floors, "dense": drows, "moe": mrows,
             "prefill": prows}, indent=1, default=str))
    try:  # the kernels-only layer sum; the real layer step is bench/layer_step.py
        lrows, lnote = layer_step(w8, mx, sw, wk, mk, [1, 16], device, sdtype, timer,
                                  args.sparse_stage_dir)
    except ImportError as e:
        lrows, lnote = [], f"its staged modules did not import ({e}); see make bench-layer"
    if lnote != "ok":
        out(f"layer step skipped: {lnote}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "copy_bw": copy_bw, "floors": floors, "dense": drows, "moe": mrows,
             "prefill": prows, "layer": lrows}, indent=1, default=str))
    text = report(meta, log, drows, mrows, prows, lrows, floors, copy_bw)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
