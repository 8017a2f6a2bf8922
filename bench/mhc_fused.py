# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936's fused mHC (three Triton kernels) against the torch chain it replaces, on the GPU torch
sees: numerics against float64 and speed, eager and CUDA-graph replay, as ratios in one run.

What runs is staged byte for byte by ``make bench-stage`` into ``.device/mhc``: ``mhc_torch.py``
(``mhc_pre_torch`` / ``mhc_post_torch``, what gfx936 ran before) and ``mhc_gfx936_triton.py``
(the kernels the ``gfx936_fused_mhc_*`` ops launch on the device).

Shapes: DeepSeek V4 Flash, hidden 4096, hc_mult 4, 20 Sinkhorn passes; batch 1, 16, 64. One
decoder layer = 2 x (pre + post) (attention and MoE sides; gfx936 runs the unfused path).

Numerics (exit 1 on a mismatch), float64 evaluation of the same formulas as the oracle:
  post_mix rel <= 1e-5, comb_mix rel <= 1e-4 (float32 sums; the Sinkhorn contracts errors);
  layer_input and post output within half a bf16 ulp of the float64 value plus 1e-6 of the
  summed magnitudes (one bf16 rounding of a float32 sum); the torch chain is held to the same
  bounds and its errors are printed beside. Graph replay equals eager bitwise.
Speed: eager = median of isolated layer calls (L2 flushed, device idle before each, host launch
work included: sparse_mla_common.Timer); back-to-back = mean over 50 consecutive calls (eager)
or 50 consecutive replays of one captured layer (graph). Launches: CUDA kernels per layer
counted by torch.profiler.

    python bench/mhc_fused.py [--out docs/bench/mhc-fused-h200.md] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / ".device" / "mhc"))

import torch  # noqa: E402

import sparse_mla_common as C  # noqa: E402

HIDDEN, HC, SINKHORN = 4096, 4, 20
EPS, RMS_EPS, POST_MULT = 1e-6, 1e-6, 2.0
BATCHES = (1, 16, 64)


def inputs(t, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = HC * (2 + HC)
    r = (torch.randn(t, HC, HIDDEN, generator=g) * 3).to(torch.bfloat16)
    fn = torch.randn(n, HC * HIDDEN, generator=g) * 0.02
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n, generator=g) * 0.5
    x = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    return [v.to(dev) for v in (r, fn, scale, base, x)]


def pre_f64(r, fn, scale, base):
    """Float64 mHC pre on r [t, hc, h] (shapes from r; also tests/runtime's oracle)."""
    t, hc, h = r.shape
    xf = r.double().reshape(t, hc * h)
    mixes = xf @ fn.double().t()
    mixes = mixes / torch.sqrt((xf * xf).sum(-1, keepdim=True) / (hc * h) + RMS_EPS)
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(mixes[:, :hc] * s[0] + b[:hc]) + EPS
    post = torch.sigmoid(mixes[:, hc:2 * hc] * s[1] + b[hc:2 * hc]) * POST_MULT
    comb = torch.softmax(mixes[:, 2 * hc:].reshape(t, hc, hc) * s[2] + b[2 * hc:].reshape(hc, hc), -1)
    comb = comb + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(SINKHORN - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    return post.unsqueeze(-1), comb, (pre.unsqueeze(-1) * r.double()).sum(1)


def post_f64(x, r, post, comb):
    return torch.einsum("tij,tih->tjh", comb.double(), r.double()) + post.double() * x.double().unsqueeze(1)


def make_paths(chain, kern):
    def chain_pre(r, fn, s, b):
        return chain.mhc_pre_torch(r, fn, s, b, RMS_EPS, EPS, EPS, POST_MULT, SINKHORN)

    def fused_pre(r, fn, s, b):
        mix, sq = kern.mhc_pre_mix_triton(r, fn, kern.mhc_pre_splits(r.shape[0], HC * HIDDEN))
        return kern.mhc_pre_apply_triton(r, mix, sq, s, b, RMS_EPS, EPS, EPS, POST_MULT, SINKHORN)

    def layer(pre, post):
        def run(r, fn, s, b, x):
            p, c, li = pre(r, fn, s, b)          # attention side
            r = post(x, r, p, c)
            p, c, li = pre(r, fn, s, b)          # MoE side
            return post(x, r, p, c)
        return run

    return {"torch chain": (chain_pre, chain.mhc_post_torch),
            "fused Triton": (fused_pre, kern.mhc_post_triton_fused)}, layer


def bound_ok(got, want64, mag):
    err = (got.double() - want64).abs()
    return bool((err <= want64.abs() * 2**-8 + mag * 1e-6).all()), float(err.max())


def check(paths, dev) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for t in BATCHES:
        r, fn, s, b, x = inputs(t, dev, seed=t)
        p64, c64, l64 = pre_f64(r, fn, s, b)
        mag = r.double().abs().sum(1) * 2
        for name, (pre, post) in paths.items():
            p, c, li = pre(r, fn, s, b)
            ep = float(((p.double() - p64).abs() / p64.abs()).max())
            ec = float(((c.double() - c64).abs() / c64.abs().clamp_min(1e-30)).max())
            okl, el = bound_ok(li, l64, mag)
            out = post(x, r, p64.float(), c64.float())
            o64 = post_f64(x, r, p64.float(), c64.float())
            okp, eo = bound_ok(out, o64, r.double().abs().sum(1, keepdim=True) + 2 * x.double().abs().unsqueeze(1))
            good = ep <= 1e-5 and ec <= 1e-4 and okl and okp and not torch.isnan(out).any()
            ok &= good
            lines.append(f"| {t} | {name} | {ep:.1e} | {ec:.1e} | {el:.1e} | {eo:.1e} | "
                         f"{'ok' if good else 'FAIL'} |")
    return ok, lines


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def back_to_back(fn, n=50) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU: numerics of the chain only")
    a = ap.parse_args(argv)
    import mhc_torch as chain

    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if dev == "cpu":
        global BATCHES
        BATCHES = (1, 2)
        paths = {"torch chain": (lambda r, fn, s, b: chain.mhc_pre_torch(
            r, fn, s, b, RMS_EPS, EPS, EPS, POST_MULT, SINKHORN), chain.mhc_post_torch)}
        ok, lines = check(paths, dev)
        print("\n".join(lines))
        return 0 if ok else 1
    import mhc_gfx936_triton as kern

    paths, layer = make_paths(chain, kern)
    ok, num = check(paths, dev)
    timer = C.Timer(dev, reps=30, warmup=3)
    rows = []
    for t in BATCHES:
        args = inputs(t, dev, seed=100 + t)
        res = {}
        for name, (pre, post) in paths.items():
            run = layer(pre, post)
            eager_out = run(*args)
            launches = count_kernels(lambda: run(*args))
            eager = timer(lambda: run(*args))
            eager_b2b = back_to_back(lambda: run(*args))
            replay, why, g = C.capture(lambda: run(*args))
            graph = back_to_back(replay) if replay else float("nan")
            same = None
            if replay:
                static = {}

                def cap():
                    static["o"] = run(*args)
                replay2, _, g2 = C.capture(cap)
                replay2()
                torch.cuda.synchronize()
                same = torch.equal(static["o"], eager_out)
                ok &= bool(same)
            res[name] = (launches, eager, eager_b2b, graph, same, why)
        rows.append((t, res))
    dev_name = torch.cuda.get_device_name()
    md = [f"# mHC: gfx936's fused Triton kernels vs the torch chain ({dev_name})", "",
          f"Generated by `bench/mhc_fused.py` on {_dt.date.today()}; tier: H200 (not gfx936). "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}.",
          f"DeepSeek V4 Flash shapes: hidden {HIDDEN}, hc_mult {HC}, {SINKHORN} Sinkhorn passes. One "
          "decoder layer = 2 x (mHC pre + post), as gfx936 runs it (unfused path).", "",
          "## Numerics vs float64 (same formulas)", "",
          "Bounds: post_mix rel <= 1e-5, comb_mix rel <= 1e-4, layer_input / post output within half "
          "a bf16 ulp + 1e-6 of the summed magnitudes.", "",
          "| batch | path | post_mix max rel | comb_mix max rel | layer_input max abs | post out max abs | |",
          "|---|---|---|---|---|---|---|", *num, "",
          "## Speed, one decoder layer (2 x pre + post)", "",
          "eager = median isolated call (L2 flushed, idle device, host launch work included); "
          "b2b = mean of 50 back-to-back calls; graph = mean of 50 back-to-back replays of the "
          "captured layer; replay == eager output bitwise in the last column.", "",
          "| batch | path | kernels/layer | eager us | eager b2b us | graph us | graph == eager | "
          "ratio eager (chain/fused) | ratio graph (chain/fused) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for t, res in rows:
        ch, fu = res["torch chain"], res["fused Triton"]
        for name, (n, e, eb, gr, same, why) in res.items():
            ratio_e = f"{ch[1] / fu[1]:.1f}x" if name == "fused Triton" else ""
            ratio_g = f"{ch[3] / fu[3]:.1f}x" if name == "fused Triton" else ""
            md.append(f"| {t} | {name} | {n} | {e * 1e3:.1f} | {eb * 1e3:.1f} | {gr * 1e3:.1f} | "
                      f"{same if why is None else why} | {ratio_e} | {ratio_g} |")
    md += ["", f"Per token over 43 layers (eager, isolated): " + ", ".join(
        f"batch {t}: chain {res['torch chain'][1] * 43:.1f} ms, fused {res['fused Triton'][1] * 43:.2f} ms"
        for t, res in rows), "", f"Numerics: {'all within bounds' if ok else 'MISMATCH'}."]
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
