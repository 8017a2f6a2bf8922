# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936 dense W8A16 block-FP8 linear and MXFP4-emulation MoE: numerics
against float64 and speed, on whatever GPU torch sees (plain torch ops).

``make device-check`` runs this with ``--no-speed`` (numerics only), ``make
bench`` runs numerics then speed; both exit 1 on a numerics mismatch. On the
GPU machine directly: ``python3 bench/dense_moe.py [--out FILE.md]`` after
``make bench-stage`` staged ``.device/dense_moe`` (the modules are the
applied tree's, byte for byte). ``--smoke``: tiny CPU run, numbers mean nothing.

What runs (the fork's code, staged unchanged):

* dense: ``gfx936_w8a16.w8a16_block_mm`` (E4M3 weight [N, K] + UE8M0 scales
  per 128x128 block, BF16 activations; software dequant in row chunks + BF16
  GEMM), and the same call with ``cached_weight`` = what
  ``VLLM_GFX936_FP8_WEIGHT_CACHE=1`` keeps (``dequantize_fp8_block`` once at
  load; then a plain BF16 GEMM);
* MoE: ``mxfp4_torch_dequant.dequant_mxfp4_torch`` of every local expert's
  w13 [E, 2I, H/2] and w2 [E, H, I/2] (as the emulation experts do on each
  forward), ``clamped_swiglu.clamped_swiglu`` (alpha 1, limit 10), and BF16
  GEMMs. The product runs the GEMMs in upstream's Triton ``fused_experts``,
  which imports vLLM and is not staged: here they are per-expert ``torch.mm``
  on token lists routed once on the host (so the call is graph-capturable).

Oracle: float64 dequantize-then-matmul, decoding FP8 with torch's own
``float8_e4m3fn -> float64`` cast and E2M1 with a lookup table (independent of
the product's integer decoders), scales as ``2.0 ** (u - 127)``.

Tolerances (``rel = max_abs / max|oracle|``):

* dequantized weights in float32 vs float64: bitwise equal (both decoders are
  exact; UE8M0 products are exact in float32);
* dense output: rel <= 1e-2 and cosine >= 0.9999. The product rounds the
  weight to BF16 (2**-9 relative per element, random in sign, so about
  2**-9 * sqrt(K) * typical |x w| on a sum of K terms) and the output to BF16
  (2**-9 relative); observed worst cases are far below 1e-2, a wrong block,
  scale or row moves rel by O(1);
* MoE output: rel <= 2e-2 and cosine >= 0.9999: three BF16 roundings in
  series (w13 GEMM output, the activation, the w2 GEMM output) on top of the
  exact MXFP4 weights; the float64 oracle applies the same clamp;
* clamped SwiGLU alone on inputs in [-30, 30]: per element
  |out - ref| <= 2**-8 |ref| + 1e-6 (one BF16 rounding of a float32 value).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import sparse_mla_common as C  # noqa: E402

DEFAULT_STAGE = C.REPO / ".device" / "dense_moe"
BLOCK = (128, 128)
TOL_DENSE, TOL_MOE, COS_MIN = 1e-2, 2e-2, 0.9999
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def load_staged(stage_dir=None):
    d = Path(stage_dir) if stage_dir else DEFAULT_STAGE
    need = ["gfx936_w8a16.py", "mxfp4_torch_dequant.py", "clamped_swiglu.py",
            "vllm/model_executor/layers/quantization/utils/lowp_codecs_torch.py"]
    missing = [n for n in need if not (d / n).is_file()]
    if missing:
        raise SystemExit(f"staged files {missing} missing in {d}: run `make bench-stage` "
                         "(python3 bench/stage.py) where the applied vllm/ tree is")
    sys.path.insert(0, str(d))  # first: its vllm/ stub must win over any installed vLLM
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[m]
    mods = [importlib.import_module(n)
            for n in ("gfx936_w8a16", "mxfp4_torch_dequant", "clamped_swiglu")]
    codecs = importlib.import_module(
        "vllm.model_executor.layers.quantization.utils.lowp_codecs_torch")
    if not str(Path(codecs.__file__).resolve()).startswith(str(d.resolve())):
        raise SystemExit(f"{codecs.__name__} came from {codecs.__file__}, not {d}")
    return mods


def e8m0_dtype(device):
    """float8_e8m0fnu if this torch can hold it on ``device``, else uint8."""
    dt = getattr(torch, "float8_e8m0fnu", None)
    if dt is None:
        return torch.uint8, "uint8 (torch has no float8_e8m0fnu)"
    try:
        torch.full((2,), 127, dtype=torch.uint8, device=device).view(dt).view(torch.uint8)
        return dt, "float8_e8m0fnu"
    except Exception as e:  # noqa: BLE001
        return torch.uint8, f"uint8 (float8_e8m0fnu view failed: {type(e).__name__})"


def metrics(out, want) -> dict:
    o, w = out.double(), want.double()
    finite = bool(torch.isfinite(o).all())
    d = (o - w).abs()
    maxabs = float(d.max()) if finite else float("inf")
    cos = float(torch.nn.functional.cosine_similarity(o.flatten(), w.flatten(), dim=0))
    return {"max_abs": maxabs, "rel": maxabs / max(1e-30, float(w.abs().max())),
            "cos": cos if finite else float("nan"), "finite": finite}


def verdict(m, tol) -> bool:
    return m["finite"] and m["rel"] <= tol and m["cos"] >= COS_MIN


# ---- dense W8A16 -------------------------------------------------------------
class Dense:
    """E4M3 weight [N, K] + UE8M0 block scales, quantized from N(0, 0.02**2)."""

    def __init__(self, n, k, device, sdtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        bn, bk = BLOCK
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        nb, kb = -(-n // bn), -(-k // bk)
        pad = torch.zeros(nb * bn, kb * bk, device=device)
        pad[:n, :k] = w
        amax = pad.view(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        exp = torch.ceil(torch.log2(amax / 448.0))  # UE8M0: power of two >= amax/448
        self.u8 = (exp + 127).to(torch.uint8)
        scale = torch.exp2(exp).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        self.weight = (w / scale).to(torch.float8_e4m3fn)
        self.scale = self.u8.view(sdtype) if sdtype != torch.uint8 else self.u8
        self.n, self.k = n, k

    def w64(self):
        bn, bk = BLOCK
        s = torch.exp2(self.u8.double() - 127)
        s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: self.n, : self.k]
        return self.weight.to(torch.float64) * s


def dense_check(w8, shapes, tokens, device, sdtype, log):
    ok = True
    for si, (n, k) in enumerate(shapes):
        d = Dense(n, k, device, sdtype, seed=11 + si)
        w64 = d.w64()
        deq = w8.dequantize_fp8_block(d.weight, d.scale, BLOCK, torch.float32)
        exact = bool(torch.equal(deq.double(), w64))
        ok &= exact
        log(f"dense N={n:5d} K={k:5d} dequant fp32 == float64 decode bitwise: {exact}")
        cache = w8.dequantize_fp8_block(d.weight, d.scale, BLOCK, torch.bfloat16)
        del deq
        for m in tokens:
            g = torch.Generator(device=device).manual_seed(1000 * si + m)
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            ref = x.double() @ w64.t()
            for name, out in (
                ("w8a16", w8.w8a16_block_mm(x, d.weight, d.scale, BLOCK)),
                ("w8a16+cache", w8.w8a16_block_mm(x, d.weight, d.scale, BLOCK,
                                                  cached_weight=cache)),
            ):
                mt = metrics(out, ref)
                good = verdict(mt, TOL_DENSE) and out.dtype == torch.bfloat16
                ok &= good
                log(f"dense N={n:5d} K={k:5d} M={m:4d} {name:11s} vs f64: "
                    f"max_abs={mt['max_abs']:.3e} rel={mt['rel']:.2e} cos={mt['cos']:.8f} "
                    f"finite={mt['finite']} {'ok' if good else f'FAIL (tol {TOL_DENSE})'}")
        del w64, cache
    return ok


# ---- MXFP4 MoE ---------------------------------------------------------------
@dataclass
class MoECfg:
    hidden: int
    inter: int
    experts: int
    topk: int
    alpha: float = 1.0
    limit: float = 10.0


class MoE:
    """Random packed MXFP4 experts; scales chosen so the clamp is exercised."""

    def __init__(self, cfg: MoECfg, device, sdtype, seed=5):
        g = torch.Generator(device=device).manual_seed(seed)
        e, h, i = cfg.experts, cfg.hidden, cfg.inter
        self.cfg = cfg

        def mk(rows, cols, lo, hi):
            w = torch.randint(0, 256, (e, rows, cols // 2), generator=g, device=device,
                              dtype=torch.uint8)
            u = torch.randint(lo, hi, (e, rows, cols // 32), generator=g, device=device,
                              dtype=torch.uint8)
            return w, u

        # w13 output std ~ sqrt(H) * 2.93 * 2^(u-127): u in 119..122 -> O(1..10)
        self.w13, self.u13 = mk(2 * i, h, 119, 123)
        self.w2, self.u2 = mk(h, i, 113, 117)
        cast = (lambda u: u.view(sdtype)) if sdtype != torch.uint8 else (lambda u: u)
        self.s13, self.s2 = cast(self.u13), cast(self.u2)

    @staticmethod
    def w64(w, u):
        lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64, device=w.device)
        vals = torch.stack((lut[(w & 0xF).long()], lut[(w >> 4).long()]), -1).flatten(-2)
        return vals * torch.exp2(u.double() - 127).repeat_interleave(32, -1)

    def route(self, t, device, seed):
        g = torch.Generator(device="cpu").manual_seed(seed)
        logits = torch.randn(t, self.cfg.experts, generator=g)
        wts, ids = logits.softmax(-1).topk(self.cfg.topk, -1)
        wts = wts / wts.sum(-1, keepdim=True)
        plan = []
        for ex in range(self.cfg.experts):
            tok, slot = (ids == ex).nonzero(as_tuple=True)
            if len(tok):
                plan.append((ex, tok.to(device), wts[tok, slot].to(device)))
        return plan

    def forward(self, x, plan, w13, w2, act_fn):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = torch.zeros(x.shape[0], self.cfg.hidden, dtype=acc, device=x.device)
        for ex, tok, wt in plan:
            h = x.index_select(0, tok) @ w13[ex].t()
            a = act_fn(h)
            y = a @ w2[ex].t()
            out.index_add_(0, tok, y.to(acc) * wt[:, None].to(acc))
        return out.to(x.dtype)


def swiglu64(h, alpha, limit):
    d = h.shape[-1] // 2
    gate = h[..., :d].clamp(max=limit)
    up = h[..., d:].clamp(min=-limit, max=limit)
    return gate * alpha * torch.sigmoid(gate * alpha) * up


def moe_product(mx, sw, moe, x, plan):
    cfg = moe.cfg
    w13 = mx.dequant_mxfp4_torch(moe.w13, moe.s13, torch.bfloat16)
    w2 = mx.dequant_mxfp4_torch(moe.w2, moe.s2, torch.bfloat16)
    return moe.forward(x, plan, w13, w2,
                       lambda h: sw.clamped_swiglu(h, cfg.limit, cfg.alpha))


def moe_check(mx, sw, cfg, tokens, device, sdtype, log):
    ok = True
    moe = MoE(cfg, device, sdtype)
    w13_64, w2_64 = MoE.w64(moe.w13, moe.u13), MoE.w64(moe.w2, moe.u2)
    for name, w, s, ref in (("w13", moe.w13, moe.s13, w13_64), ("w2", moe.w2, moe.s2, w2_64)):
        exact = bool(torch.equal(mx.dequant_mxfp4_torch(w, s, torch.float32).double(), ref))
        ok &= exact
        log(f"moe {name} dequant fp32 == float64 LUT decode bitwise: {exact}")
    # the activation alone, across the clamp
    g = torch.Generator(device=device).manual_seed(3)
    h = ((torch.rand(257, 2 * 96, generator=g, device=device) - 0.5) * 60).to(torch.bfloat16)
    a = sw.clamped_swiglu(h, cfg.limit, cfg.alpha)
    a64 = swiglu64(h.double(), cfg.alpha, cfg.limit)
    err = (a.double() - a64).abs()
    good = bool((err <= 2.0**-8 * a64.abs() + 1e-6).all()) and a.dtype == h.dtype
    ok &= good
    log(f"clamped_swiglu(alpha={cfg.alpha}, limit={cfg.limit}) on [-30, 30] vs f64: "
        f"max_abs={float(err.max()):.3e} {'ok' if good else 'FAIL (tol 2^-8 rel)'}")
    for t in tokens:
        gx = torch.Generator(device=device).manual_seed(100 + t)
        x = torch.randn(t, cfg.hidden, generator=gx, device=device).to(torch.bfloat16)
        plan = moe.route(t, device, seed=t)
        out = moe_product(mx, sw, moe, x, plan)
        ref = moe.forward(x.double(), plan, w13_64, w2_64,
                          lambda hh: swiglu64(hh, cfg.alpha, cfg.limit)).double()
        # fraction of gate/up values the clamp touched, in the oracle
        hs = torch.cat([x.double().index_select(0, tok) @ w13_64[ex].t()
                        for ex, tok, _ in plan])
        d = cfg.inter
        clamped = float(((hs[:, :d] > cfg.limit) | (hs[:, d:].abs() > cfg.limit))
                        .double().mean())
        mt = metrics(out, ref)
        good = verdict(mt, TOL_MOE)
        ok &= good
        log(f"moe T={t:3d} E={cfg.experts} top{cfg.topk} H={cfg.hidden} I={cfg.inter} vs f64: "
            f"max_abs={mt['max_abs']:.3e} rel={mt['rel']:.2e} cos={mt['cos']:.8f} "
            f"finite={mt['finite']} clamp-active={clamped:.1%} "
            f"{'ok' if good else f'FAIL (tol {TOL_MOE})'}")
    return ok


# ---- speed -------------------------------------------------------------------
def timed(timer, fn, cuda):
    eager = timer(fn)
    graph, err = None, None
    if cuda:
        replay, err, g = C.capture(fn)
        if replay is not None:
            graph = timer(replay)
            del g
    return eager, graph, err


def dense_speed(w8, shapes, tokens, device, sdtype, timer, cuda):
    rows = []
    for si, (n, k) in enumerate(shapes):
        d = Dense(n, k, device, sdtype, seed=11 + si)
        cache = w8.dequantize_fp8_block(d.weight, d.scale, BLOCK, torch.bfloat16)
        wbf = cache.clone()
        deq = timed(timer, lambda: w8.dequantize_fp8_block(d.weight, d.scale, BLOCK,
                                                           torch.bfloat16), cuda)
        for m in tokens:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            r = {"n": n, "k": k, "m": m, "wbytes": n * k + d.u8.numel(), "dequant": deq}
            r["w8a16"] = timed(timer, lambda: w8.w8a16_block_mm(x, d.weight, d.scale,
                                                                BLOCK), cuda)
            r["cache"] = timed(timer, lambda: w8.w8a16_block_mm(
                x, d.weight, d.scale, BLOCK, cached_weight=cache), cuda)
            r["bf16"] = timed(timer, lambda: torch.mm(x, wbf.t()), cuda)
            rows.append(r)
        del cache, wbf, d
    return rows


def moe_speed(mx, sw, cfg, tokens, device, sdtype, timer, cuda):
    moe = MoE(cfg, device, sdtype)
    w13 = mx.dequant_mxfp4_torch(moe.w13, moe.s13, torch.bfloat16)
    w2 = mx.dequant_mxfp4_torch(moe.w2, moe.s2, torch.bfloat16)
    act = lambda h: sw.clamped_swiglu(h, cfg.limit, cfg.alpha)  # noqa: E731
    deq = timed(timer, lambda: (mx.dequant_mxfp4_torch(moe.w13, moe.s13, torch.bfloat16),
                                mx.dequant_mxfp4_torch(moe.w2, moe.s2, torch.bfloat16)), cuda)
    rows = []
    for t in tokens:
        x = torch.randn(t, cfg.hidden, device=device).to(torch.bfloat16)
        plan = moe.route(t, device, seed=t)
        rows.append({
            "t": t, "active": len(plan), "dequant": deq,
            "full": timed(timer, lambda: moe_product(mx, sw, moe, x, plan), cuda),
            "experts": timed(timer, lambda: moe.forward(x, plan, w13, w2, act), cuda),
        })
    packed = moe.w13.numel() + moe.u13.numel() + moe.w2.numel() + moe.u2.numel()
    return rows, packed


def report(meta, log, drows, mrows, packed, cfg) -> str:
    f = C.fmt
    bw = meta["copy_bw"]

    def g(t, i):
        return t[i] if t and t[i] is not None else None

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    L = ["# gfx936 dense W8A16 + MXFP4 MoE (plain torch) numerics and speed", ""]
    L += [f"- {k}: {v}" for k, v in meta.items() if k != "copy_bw"]
    L += [f"- measured copy bandwidth (device-to-device, read+write): {bw / 1e9:.0f} GB/s", ""]
    L += ["## Numerics (float64 oracle)", "", "```", *log, "```", ""]
    L += ["## Dense W8A16 (ms per call, median; eager / CUDA graph)", "",
          "ratio = w8a16 / plain BF16 GEMM on the same shape (cost of software dequant); "
          "vs-cache = w8a16 / (VLLM_GFX936_FP8_WEIGHT_CACHE=1 path). FP8 GB/s = FP8 weight + "
          "scale bytes / w8a16 time; % = of copy bandwidth.", "",
          "| N x K | M | w8a16 eager | cache eager | bf16 eager | ratio eager | vs-cache "
          "eager | w8a16 graph | cache graph | bf16 graph | ratio graph | dequant-only "
          "eager/graph | FP8 GB/s (graph) | % copy BW |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in drows:
        wg = g(r["w8a16"], 1) or g(r["w8a16"], 0)
        gbs = r["wbytes"] / (wg * 1e-3) / 1e9 if wg else None
        L.append(
            f"| {r['n']}x{r['k']} | {r['m']} | {f(g(r['w8a16'], 0))} | {f(g(r['cache'], 0))} "
            f"| {f(g(r['bf16'], 0))} | {f(ratio(g(r['w8a16'], 0), g(r['bf16'], 0)), '.1f')} "
            f"| {f(ratio(g(r['w8a16'], 0), g(r['cache'], 0)), '.1f')} "
            f"| {f(g(r['w8a16'], 1))} | {f(g(r['cache'], 1))} | {f(g(r['bf16'], 1))} "
            f"| {f(ratio(g(r['w8a16'], 1), g(r['bf16'], 1)), '.1f')} "
            f"| {f(g(r['dequant'], 0))} / {f(g(r['dequant'], 1))} "
            f"| {f(gbs, '.0f')} | {f(None if gbs is None else 100 * gbs * 1e9 / bw, '.1f')} |")
    errs = {(r["n"], r["k"], name): r[name][2] for r in drows
            for name in ("w8a16", "cache", "bf16", "dequant") if r[name][2]}
    for (n, k, name), e in sorted(errs.items()):
        L.append(f"\nnot captured: {n}x{k} {name}: {e}")
    L += ["", f"## MXFP4 MoE (ms per call; E={cfg.experts} local experts, top-{cfg.topk}, "
          f"H={cfg.hidden}, I={cfg.inter}, alpha {cfg.alpha}, limit {cfg.limit})", "",
          "full = dequant of all local experts' w13+w2 (as the emulation does per forward) + "
          "clamped SwiGLU + per-expert BF16 GEMMs; experts = the GEMMs + activation on "
          f"pre-dequantized weights. Packed MXFP4 bytes read per forward: {packed / 1e6:.1f} MB.",
          "", "| tokens | experts hit | full eager | full graph | experts eager | "
          "experts graph | dequant eager | dequant graph | full graph ms/token | "
          "dequant share (graph) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in mrows:
        fg = g(r["full"], 1) or g(r["full"], 0)
        L.append(
            f"| {r['t']} | {r['active']} | {f(g(r['full'], 0))} | {f(g(r['full'], 1))} "
            f"| {f(g(r['experts'], 0))} | {f(g(r['experts'], 1))} | {f(g(r['dequant'], 0))} "
            f"| {f(g(r['dequant'], 1))} | {f(fg / r['t'] if fg else None, '.4f')} "
            f"| {f(ratio(g(r['dequant'], 1) or g(r['dequant'], 0), fg), '.2f')} |")
    for r in mrows:
        for name in ("full", "experts", "dequant"):
            if r[name][2]:
                L.append(f"\nnot captured: T={r['t']} {name}: {r[name][2]}")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run")
    ap.add_argument("--stage-dir", default=None)
    ap.add_argument("--shapes", default="7168x2048,2048x7168,4096x7168",
                    help="dense N x K list")
    ap.add_argument("--tokens", default="1,8,64,512", help="dense M list")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8, help="local experts timed")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--moe-tokens", default="1,8,64")
    ap.add_argument("--no-speed", action="store_true", help="numerics only (device-check)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the markdown report / log here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.tokens, args.moe_tokens = "256x384,130x200", "1,5", "1,6"
        args.hidden, args.inter, args.experts, args.topk = 256, 128, 4, 2
        args.reps, args.warmup, args.copy_mib = 2, 1, 4
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("no CUDA/ROCm device: run on a GPU machine (or --smoke on CPU)", file=sys.stderr)
        return 2
    w8, mx, sw = load_staged(args.stage_dir)
    sdtype, sdesc = e8m0_dtype(device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    mtokens = [int(v) for v in args.moe_tokens.split(",")]
    cfg = MoECfg(args.hidden, args.inter, args.experts, args.topk)
    stamp = Path(args.stage_dir or DEFAULT_STAGE) / "STAGED.json"
    head = json.loads(stamp.read_text()).get("vllm_head") if stamp.is_file() else None
    meta = {"date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "device": f"{C.device_name(device)}; {C.versions()}",
            "command": "python3 bench/dense_moe.py " + " ".join(sys.argv[1:]),
            "staged from": f"vllm/ HEAD {head}",
            "scale dtype": sdesc}
    for k, v in meta.items():
        print(f"{k}: {v}", flush=True)
    log = []

    def out(line):
        print(line, flush=True)
        log.append(line)

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    ok = dense_check(w8, shapes, tokens, device, sdtype, out)
    ok &= moe_check(mx, sw, cfg, mtokens, device, sdtype, out)
    v = "DENSE-MOE CHECK PASS" if ok else "DENSE-MOE CHECK FAIL"
    out(v)
    if args.no_speed or not ok:
        if args.out:
            Path(args.out).write_text("\n".join(log) + "\n")
        return 0 if ok else 1
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    timer = C.Timer(device, args.reps, args.warmup)
    meta["copy_bw"] = C.copy_bandwidth(device, args.copy_mib << 20, timer)
    meta["timing"] = (f"median of {args.reps} isolated calls, L2 flushed and device idle "
                      "before each, CUDA events around the call (eager includes host launch work)")
    drows = dense_speed(w8, shapes, tokens, device, sdtype, timer, cuda)
    mrows, packed = moe_speed(mx, sw, cfg, mtokens, device, sdtype, timer, cuda)
    text = report(meta, log, drows, mrows, packed, cfg)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "dense": drows, "moe": mrows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
