# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA decode baseline: the fork's PyTorch reference vs upstream's Triton
decode vs a read-only gather of the same fp8_ds_mla rows vs device copy bandwidth.

Run ``make bench`` (stages ``.device/sparse_mla`` from the applied vllm/ tree,
then runs this on a CUDA/ROCm GPU), or on the GPU machine directly:
``python3 bench/sparse_mla_decode.py [--out FILE.md]``. ``--smoke`` runs a tiny
CPU version (fp32 interpreter for the gather, upstream skipped) that proves
the code paths work; its numbers mean nothing.

Timed per case (median of --reps isolated calls, L2 flushed before each; see
``Timer``), eager and, where capturable, replayed from a CUDA graph:

* ref      ``rocm_sparse_attn_decode_reference`` called as the ROCm DeepSeek V4
           model calls it (ragged SWA/top-k indices given; the reference then
           reads ``lens.max().item()``, a host sync, so it cannot be captured);
* ref-dense the same function given only the dense [b, w] indices + lengths;
* up       upstream ``_rocm_sparse_attn_decode_ragged_triton`` + copy into the
           output, generic branch = ``_sparse_attn_decode_ragged_kernel`` (what
           upstream runs on a GPU that is neither gfx942 nor gfx950: H200 here);
* up-splitk the same launcher's gfx942/gfx950 branch (split-K partial + reduce
           kernels, split count from upstream's heuristic with this GPU's SM count);
* gather   a Triton kernel that only reads each key row's 584 bytes (+ index)
           and writes a checksum: the bandwidth ceiling of any decode kernel.

An isolated call of a small shape reads the ~10 us timer/launch floor, not the
kernel, so the issue's targets (back-to-back device time) get their own table:
``seq`` = N calls of kernel / triton / up-splitk / gather captured back to back
in ONE CUDA graph, each call on its own input set (own q, caches and indices),
L2 flushed once before the replay, time = replay / N; next to it the timer
floor (a one-kernel graph, isolated and back to back), the roofline floor
max(bytes / copy BW, FLOPs / FP32 peak) and a PASS/MISS per target. ``--smoke``
runs the same sets eagerly on the CPU (wall clock; no graph).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import sparse_mla_common as C  # noqa: E402
from sparse_mla_common import (  # noqa: E402,F401 - the bench and its tests use these names
    H200_FP32_TFLOPS, floor_us, fp32_peak, fp32_peak_flops)

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CPU run (TRITON_INTERPRET=1 gather, no upstream)")
    ap.add_argument("--stage-dir", default=None)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--heads", default="8,16,64",
                    help="q heads per rank (DSV4 Flash: 64 heads -> TP1 64, TP4 16, TP8 8)")
    ap.add_argument("--layers", default="c4,c128,swa")
    ap.add_argument("--topk", type=int, default=512, help="index_topk (DSV4 Flash: 512)")
    ap.add_argument("--window", type=int, default=128, help="SWA window (DSV4: 128)")
    ap.add_argument("--ctx", type=int, default=8192, help="context length per request")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="write raw numbers here")
    ap.add_argument("--kernel-lib", default=None,
                    help="csrc_gfx936 library (build/kernels/_gfx936_C.so of `make kernels`)")
    ap.add_argument("--seq", type=int, default=16,
                    help="calls per back-to-back graph (at least; 0 = no seq table)")
    ap.add_argument("--seq-max", type=int, default=64,
                    help="calls per graph at most: small shapes take more sets, up to "
                         "this, so the distinct bytes reach 2x L2")
    ap.add_argument("--seq-gib", type=float, default=48.0,
                    help="device memory the seq input sets of one case may take (GiB)")
    ap.add_argument("--fp32-tflops", type=float, default=None,
                    help="FP32 FMA peak for the floor; default: SMs x 128 lanes x 2 x "
                         "nvidia-smi clocks.max.sm (H200: 132 x 128 x 2 x 1980 MHz = 66.9)")
    return ap.parse_args(argv)


def smoke_args(args):
    args.batches, args.heads, args.layers = "2", "4", "c4,c128,swa"
    args.topk, args.window, args.ctx = 32, 16, 256
    args.reps, args.warmup, args.copy_mib = 2, 1, 4
    args.seq, args.seq_max = min(args.seq, 2), min(args.seq_max, 2)
    return args


# ---- back-to-back (seq) time, roofline floor, the issue's targets -------------------------
SEQ_PATHS = ("kernel", "triton", "up-splitk", "gather")
L2_FALLBACK = 50 << 20  # H100/H200 L2 when torch does not say
# the issue's named decode targets (us, back to back) at DSV4 Flash shapes:
# (layer, batch, heads, keys) -> limit
NAMED_TARGETS_US = {("c4", 64, 64, 640): 150.0, ("swa", 64, 64, 128): 40.0,
                    ("c4", 64, 8, 640): 40.0}
B1_TARGET_US = 10.0
FLOOR_X = 1.6  # within 1.6x of the floor at H >= 32


def case_flops(case) -> int:
    """FLOPs of one decode: every (query, head, key) does QK^T over the 512
    latent dims (448 NoPE + 64 RoPE) and PV over the 512 value dims (the same
    latent), 2 FLOPs per FMA: b * H * keys * 2 * (512 + 512). Softmax and the
    fp8 dequant are not counted (the issue's convention)."""
    keys = case.n_main + case.n_extra
    return case.batch * case.heads * keys * 2 * (C.HEAD + C.HEAD)


def l2_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK
    return L2_FALLBACK


def verdict(case, us, floor, up_us) -> str:
    """PASS/MISS of one back-to-back time against the issue's decode targets that
    apply to this shape: the named ones, b=1 <= 10 us, <= 1.6x floor at H >= 32,
    faster than upstream's split-K. "-" when none applies."""
    if us is None:
        return "n/a"
    keys = case.n_main + case.n_extra
    checks = []
    lim = NAMED_TARGETS_US.get((case.layer, case.batch, case.heads, keys))
    if lim is not None:
        checks.append((f"<= {lim:g} us", us <= lim))
    if case.batch == 1:
        checks.append((f"b=1 <= {B1_TARGET_US:g} us", us <= B1_TARGET_US))
    if case.heads >= 32 and floor:
        checks.append((f"<= {FLOOR_X}x floor", us <= FLOOR_X * floor))
    if up_us is not None:
        checks.append(("< up-splitk", us < up_us))
    if not checks:
        return "-"
    miss = [name for name, ok in checks if not ok]
    return "PASS" if not miss else "MISS: " + ", ".join(miss)


def seq_sets(case, writer, device, args, l2):
    """Distinct input sets for one back-to-back graph: at least --seq, more (up
    to --seq-max) until their useful bytes reach 2x L2, fewer if one set's
    allocation (caches with the 1 MB block stride) would pass --seq-gib."""
    want = max(args.seq, min(args.seq_max, math.ceil(2 * l2 / case.useful_bytes())))
    base = (case.batch * 1000 + case.heads) * 1000 + 7  # unlike run_case's seeds
    sets = [C.Inputs(case, writer, device, seed=base)]
    i0 = sets[0]
    per = sum(t.untyped_storage().nbytes() for t in (i0.main, i0.extra, i0.q, i0.out)
              if t is not None)
    n = max(2, min(want, int(args.seq_gib * 2**30 // per)))
    sets += [C.Inputs(case, writer, device, seed=base + 10 * i) for i in range(1, n)]
    return sets


def seq_ms(fns, timer, cuda):
    """(ms per call, error): the calls back to back in one CUDA graph, the
    replay timed like one call (L2 flushed, device idle) over len(fns). CPU
    (smoke): the same calls eagerly, wall clock."""
    def run_all():
        for f in fns:
            f()
    if not cuda:
        return timer(run_all) / len(fns), None
    replay, err, g = C.capture(run_all)
    if replay is None:
        return None, err
    t = timer(replay, reps=max(5, timer.reps // 3))
    del g
    return t / len(fns), None


def timer_floor(timer, n, cuda) -> dict:
    """What the timer reads for (almost) no work: a one-element add replayed
    from a graph alone (isolated, the floor of every isolated column) and n of
    them back to back (per add, the floor a seq time cannot go below)."""
    t = torch.zeros(1, device=timer.device)

    def one():
        t.add_(1)

    def many():
        for _ in range(n):
            t.add_(1)
    if not cuda:
        return {"isolated_us": 1e3 * timer(one), "b2b_us": 1e3 * timer(many) / n, "n": n}
    out = {"n": n}
    for key, fn, k in (("isolated_us", one, 1), ("b2b_us", many, n)):
        replay, err, g = C.capture(fn)
        out[key] = None if replay is None else 1e3 * timer(replay) / k
        del g
    return out


def run_seq(case, r, ref, up, writer, device, timer, cuda, args, l2, fast=None, tri=None,
            paths=SEQ_PATHS):
    """Fills r["seq"] (ms per call), r["seq_n"], r["seq_mb"], r["seq_error"] for
    ``paths`` (a subset of SEQ_PATHS)."""
    sets = seq_sets(case, writer, device, args, l2)
    r["seq_n"] = len(sets)
    r["seq_mb"] = len(sets) * case.useful_bytes() / 1e6
    calls = [s.decode_calls(ref, None if args.smoke else up, fast, tri) for s in sets]
    for name in paths:
        try:
            fns = ([C.Gather(s) for s in sets] if name == "gather"
                   else [c[name] for c in calls] if name in calls[0] else None)
        except Exception as e:  # noqa: BLE001 - gather needs triton
            fns, r["seq_error"][name] = None, f"{type(e).__name__}: {e}"
        if fns is None:
            r["seq_error"].setdefault(name, "absent")
            continue
        try:
            ms, err = seq_ms(fns, timer, cuda)
        except Exception as e:  # noqa: BLE001 - one path must not lose the others
            ms, err = None, f"{type(e).__name__}: {e}"
        if ms is None:
            r["seq_error"][name] = err
        else:
            r["seq"][name] = ms
    del calls, sets


def run_case(case, ref, up, writer, device, timer, cuda, smoke, probes, fast=None, tri=None,
             seq=None):
    """One case's numbers; ``seq`` = (args, l2 bytes, copy bw, fp32 peak) adds the
    back-to-back table's (None: skipped)."""
    inp = C.Inputs(case, writer, device, seed=case.batch * 1000 + case.heads)
    r = {"case": case.label(), "layer": case.layer, "batch": case.batch,
         "heads": case.heads, "keys": case.n_main + case.n_extra,
         "bytes": case.useful_bytes(), "eager": {}, "graph": {}, "graph_error": {},
         "flops": case_flops(case), "seq": {}, "seq_error": {}}
    fns = inp.decode_calls(ref, None if smoke else up, fast, tri)
    try:
        g = C.Gather(inp)
        fns["gather"] = g
    except Exception as e:  # noqa: BLE001
        r["graph_error"]["gather"] = f"gather unavailable: {type(e).__name__}: {e}"
        g = None
    for name, fn in fns.items():
        r["eager"][name] = timer(fn)
    if g is not None:  # the gather must have read the right bytes
        g()
        want = C.gather_checksum_torch(ref, inp)
        if not torch.equal(g.checksum().cpu(), want.cpu()):
            raise SystemExit(f"{case.label()}: gather checksum mismatch")
    if cuda:
        for name, fn in fns.items():
            if name in probes and probes[name] != "CAPTURED":
                # The reference paths are probed in a child process first: a
                # failed capture must not leave this process's context unusable.
                r["graph_error"][name] = probes[name]
                continue
            replay, err, graph = C.capture(fn)
            if replay is None:
                r["graph_error"][name] = err
                continue
            r["graph"][name] = timer(replay)
            del graph
    del fns, g, inp
    if seq is not None:
        args, l2, copy_bw, peak = seq
        if cuda:
            torch.cuda.empty_cache()
        run_seq(case, r, ref, up, writer, device, timer, cuda, args, l2, fast, tri)
        r["floor_us"] = floor_us(r["bytes"], r["flops"], copy_bw, peak)
        subj = "kernel" if "kernel" in r["seq"] else "triton"
        us = lambda k: 1e3 * r["seq"][k] if k in r["seq"] else None  # noqa: E731
        r["verdict_of"] = subj
        r["verdict"] = verdict(case, us(subj), r["floor_us"], us("up-splitk"))
    return r


def probe_ref_capture(stage_dir) -> dict:
    """Try to capture both reference call forms in a child process (a failed
    capture must not poison the measuring process): {name: verdict}."""
    import subprocess
    code = (
        "import sys; sys.path.insert(0, %r); import sparse_mla_common as C\n"
        "ref, up, w = C.load_staged(%r)\n"
        "i = C.Inputs(C.Case('c4', 2, 8), w, 'cuda')\n"
        "for name, rg in (('ref-dense', False), ('ref', True)):\n"
        "    replay, err, g = C.capture(lambda: i.call_reference(ref, ragged=rg))\n"
        "    print('PROBE', name, 'CAPTURED' if replay else 'not capturable: ' + err,"
        " flush=True)\n"
    ) % (str(Path(__file__).resolve().parent), stage_dir)
    out = {"ref": "probe failed", "ref-dense": "probe failed"}
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=240)
        for ln in p.stdout.splitlines():
            if ln.startswith("PROBE "):
                _, name, verdict = ln.split(" ", 2)
                out[name] = verdict
        if p.returncode:
            tail = (p.stderr.strip().splitlines() or [""])[-1][:160]
            for k, v in out.items():
                if v == "probe failed":
                    out[k] = f"probe failed (rc {p.returncode}): {tail}"
    except Exception as e:  # noqa: BLE001
        out = {k: f"probe failed: {e}" for k in out}
    return out


def report(results, meta) -> str:
    bw = meta["copy_bw"]
    L = []
    L.append("# Sparse MLA decode baseline\n")
    L.append(f"- date (UTC): {meta['date']}")
    L.append(f"- device: {meta['device']}; {meta['versions']}")
    L.append(f"- command: `{meta['command']}`")
    L.append(f"- staged from: vllm/ HEAD {meta['stage'].get('vllm_head')}, "
             f"rocm_aiter_mla_sparse.py sha256 {meta['stage'].get('upstream_sha256', '')[:16]}")
    L.append(f"- measured copy bandwidth (device-to-device, read+write): "
             f"{bw / 1e9:.0f} GB/s ({meta['copy_mib']} MiB buffer)")
    L.append("- reference under CUDA graph capture (child-process probe): "
             + "; ".join(f"{k}: {v}" for k, v in meta["ref_capture"].items()))
    L.append(f"- shapes: head dim 512 (448 e4m3 NoPE + 64 bf16 RoPE, 584 B/row), "
             f"window {meta['window']} (main, block 64), c4 top-k {meta['topk']} "
             f"(block 64), c128 = ctx/128 keys (block 2), ctx {meta['ctx']}, "
             f"attn sink on, block stride {C.SEED_BLOCK_STRIDE} B")
    L.append(f"- timing: median of {meta['reps']} isolated calls, L2 flushed and device "
             "idle before each, events around the call (includes host launch work)\n")
    L.append("## Latency (ms per call)\n")
    L.append("| case | MB | ref eager | ref-dense eager | ref-dense graph | up eager | "
             "up graph | up-splitk eager | up-splitk graph | gather eager | gather graph |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e, g = r["eager"], r["graph"]
        L.append(
            f"| {r['case']} | {r['bytes'] / 1e6:.2f} | {C.fmt(e.get('ref'))} | "
            f"{C.fmt(e.get('ref-dense'))} | {C.fmt(g.get('ref-dense'))} | "
            f"{C.fmt(e.get('up'))} | {C.fmt(g.get('up'))} | {C.fmt(e.get('up-splitk'))} | "
            f"{C.fmt(g.get('up-splitk'))} | {C.fmt(e.get('gather'))} | "
            f"{C.fmt(g.get('gather'))} |"
        )
    L.append("\n## Ratios and bandwidth (same run)\n")
    L.append("| case | ref/up eager | ref/up-splitk eager | ref-dense/up graph | "
             "up/gather graph | % copy BW: ref eager | ref-dense graph | up graph | "
             "up-splitk graph | gather graph |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")

    def ratio(a, b):
        return a / b if a and b else None

    def pct(ms):
        return 100 * r["bytes"] / (ms * 1e-3) / bw if ms else None

    for r in results:
        e, g = r["eager"], r["graph"]
        L.append(
            f"| {r['case']} | {C.fmt(ratio(e.get('ref'), e.get('up')), '.1f')} | "
            f"{C.fmt(ratio(e.get('ref'), e.get('up-splitk')), '.1f')} | "
            f"{C.fmt(ratio(g.get('ref-dense'), g.get('up')), '.1f')} | "
            f"{C.fmt(ratio(g.get('up'), g.get('gather')), '.1f')} | "
            f"{C.fmt(pct(e.get('ref')), '.1f')} | {C.fmt(pct(g.get('ref-dense')), '.1f')} | "
            f"{C.fmt(pct(g.get('up')), '.1f')} | {C.fmt(pct(g.get('up-splitk')), '.1f')} | "
            f"{C.fmt(pct(g.get('gather')), '.1f')} |"
        )
    L.append("\n## Fork decodes vs upstream split-K and the gather (same run)\n")
    L.append("| case | kernel graph | kernel eager | triton graph | triton eager | "
             "up-splitk graph | gather graph | kernel/gather | triton/gather | "
             "up-splitk/kernel | kernel eager/graph |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e, g = r["eager"], r["graph"]
        L.append(
            f"| {r['case']} | {C.fmt(g.get('kernel'))} | {C.fmt(e.get('kernel'))} | "
            f"{C.fmt(g.get('triton'))} | {C.fmt(e.get('triton'))} | "
            f"{C.fmt(g.get('up-splitk'))} | {C.fmt(g.get('gather'))} | "
            f"{C.fmt(ratio(g.get('kernel'), g.get('gather')), '.2f')} | "
            f"{C.fmt(ratio(g.get('triton'), g.get('gather')), '.2f')} | "
            f"{C.fmt(ratio(g.get('up-splitk'), g.get('kernel')), '.2f')} | "
            f"{C.fmt(ratio(e.get('kernel'), g.get('kernel')), '.2f')} |")
    errs = sorted({f"{k}: {v}" for r in results for k, v in r["graph_error"].items()})
    if errs:
        L.append("\nNot captured / not run: " + "; ".join(errs))
    L.append("""
Columns: `MB` = useful bytes of one call (each key row's 584 B + its int32 index
once, q and the bf16 output once): `% copy BW` = MB / time / measured copy
bandwidth. `ref` = the fork's reference as the ROCm model calls it (ragged
indices; host sync inside, so eager only). `ref-dense` = the same function on
dense indices. `up` = upstream `_rocm_sparse_attn_decode_ragged_triton` generic
branch (`_sparse_attn_decode_ragged_kernel`, native FP8 bitcasts; cannot lower on
gfx936), `up-splitk` = its gfx942/gfx950 split-K branch. `gather` = read-only
Triton gather of the same rows (bandwidth ceiling). `graph` = one CUDA graph
replay. Ratios > 1 mean the first is slower.""")
    if meta.get("seq"):
        L.extend(seq_report(results, meta))
    return "\n".join(L) + "\n"


def seq_report(results, meta) -> list[str]:
    """The back-to-back table (lines), under the isolated ones."""
    tf, l2 = meta["timer_floor"], meta["l2_bytes"]
    mode = ("eager calls, wall clock (--smoke: CPU, no graph; numbers mean nothing)"
            if meta["smoke"] else "one CUDA graph of the N calls, L2 flushed and device "
            "idle before the replay, replay / N")
    peak = meta["fp32_peak"]
    L = ["\n## Back-to-back device time (us per call) vs the floor and the issue's targets\n"]
    L.append(f"- seq: {mode}; each call on its own input set (own q, caches, indices: "
             f"distinct rows), N >= {meta['seq']} and up to {meta['seq_max']} until the "
             f"sets' useful bytes reach 2x L2 ({l2 / 2**20:.0f} MiB), <= "
             f"{meta['seq_gib']:g} GiB of sets per case")
    how = "(eager)" if meta["smoke"] else "replayed from a graph"
    L.append(f"- timer floor: a one-element add {how}, isolated "
             f"{C.fmt(tf.get('isolated_us'), '.1f')} us, {tf['n']} back to back "
             f"{C.fmt(tf.get('b2b_us'), '.2f')} us each")
    L.append(f"- FP32 FMA peak: {C.fmt(peak and peak / 1e12, '.1f')} TFLOP/s "
             f"({meta['fp32_source']}); copy BW {meta['copy_bw'] / 1e9:.0f} GB/s")
    L.append(f"- FLOPs = b * H * keys * 2 * (512 + 512) (QK^T over the 512 latent dims + "
             f"PV over the 512 value dims, FMA = 2); floor = max(MB / copy BW, FLOPs / "
             f"FP32 peak)\n")
    L.append("| case | N | sets MB | GFLOP | floor | kernel seq | triton seq | "
             "up-splitk seq | gather seq | kernel/floor | up-splitk/kernel | "
             "kernel TFLOP/s | targets |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    small = []
    for r in results:
        if "floor_us" not in r:
            continue
        q = {k: 1e3 * v for k, v in r["seq"].items()}
        k, up = q.get("kernel"), q.get("up-splitk")
        tfl = r["flops"] / (k * 1e-6) / 1e12 if k and r["heads"] >= 32 else None
        if r["seq_mb"] * 1e6 < 2 * l2:
            small.append(r["case"])
        sub = " (triton)" if r["verdict_of"] != "kernel" and r["verdict"][0] in "PM" else ""
        L.append(
            f"| {r['case']} | {r['seq_n']} | {r['seq_mb']:.1f} | {r['flops'] / 1e9:.3f} | "
            f"{r['floor_us']:.2f} | {C.fmt(k, '.2f')} | {C.fmt(q.get('triton'), '.2f')} | "
            f"{C.fmt(up, '.2f')} | {C.fmt(q.get('gather'), '.2f')} | "
            f"{C.fmt(k and k / r['floor_us'], '.2f')} | {C.fmt(up and k and up / k, '.2f')} | "
            f"{C.fmt(tfl, '.1f')} | {r['verdict']}{sub} |")
    L.append(f"""
Columns: `N` calls in the graph on `N` distinct input sets (`sets MB` = N x the
call's useful MB); `floor` = the roofline floor (us); `... seq` = us per call
back to back; `up-splitk/kernel` > 1 = the kernel is faster; `kernel TFLOP/s`
for H >= 32. `targets` (the kernel's seq time, else the Triton twin's, marked):
c4 b=64 H=64 <= 150 us, swa b=64 H=64 <= 40 us, c4 b=64 H=8 <= 40 us (DSV4 keys
only), b=1 <= {B1_TARGET_US:g} us, <= {FLOOR_X}x floor at H >= 32, faster than
up-splitk at every shape; `-` = none applies.""")
    if small:
        L.append(f"\nSets below 2x L2 (--seq-max / --seq-gib): {', '.join(small)}: each set "
                 "is still read once per replay after the flush, so its reads are cold, "
                 "but the graph is short of the issue's >= 2x L2.")
    errs = sorted({f"{k}: {v}" for r in results for k, v in r.get("seq_error", {}).items()})
    if errs:
        L.append("\nseq not run: " + "; ".join(errs))
    return L


def main(argv=None) -> int:
    args = parse(argv)
    if args.smoke:
        args = smoke_args(args)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            print("no CUDA/ROCm device: run `make bench` on a GPU machine "
                  "(or --smoke for the CPU check of the code)", file=sys.stderr)
            return 2
        device = "cuda"
    ref, up, writer = C.load_staged(args.stage_dir)
    fast, tri, knote = C.load_fast(args.stage_dir, args.kernel_lib)
    print(f"fork decodes: kernel: {knote}; triton twin: {'staged' if tri else 'absent'}")
    cuda = device == "cuda"
    timer = C.Timer(device, args.reps, args.warmup)
    stage_info = {}
    stamp = Path(args.stage_dir or C.DEFAULT_STAGE) / "STAGED.json"
    if stamp.is_file():
        stage_info = json.loads(stamp.read_text())
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": C.device_name(device), "versions": C.versions(),
        "command": "python3 bench/sparse_mla_decode.py " + " ".join(argv or sys.argv[1:]),
        "stage": stage_info, "copy_mib": args.copy_mib, "reps": args.reps,
        "topk": args.topk, "window": args.window, "ctx": args.ctx,
    }
    meta["copy_bw"] = C.copy_bandwidth(device, args.copy_mib << 20, timer)
    print(f"copy bandwidth: {meta['copy_bw'] / 1e9:.0f} GB/s", flush=True)
    meta["ref_capture"] = (probe_ref_capture(str(args.stage_dir or C.DEFAULT_STAGE))
                           if cuda else {"ref": "not tried (no GPU)",
                                         "ref-dense": "not tried (no GPU)"})
    print(f"reference capture probe: {meta['ref_capture']}", flush=True)
    seq = None
    if args.seq > 0:
        peak, src = fp32_peak(device, args.fp32_tflops, args.smoke)
        meta.update(seq=args.seq, seq_max=args.seq_max, seq_gib=args.seq_gib,
                    smoke=args.smoke, l2_bytes=l2_bytes(device), fp32_peak=peak,
                    fp32_source=src, timer_floor=timer_floor(timer, args.seq, cuda))
        seq = (args, meta["l2_bytes"], meta["copy_bw"], peak)
        print(f"FP32 peak: {C.fmt(peak and peak / 1e12, '.1f')} TFLOP/s ({src}); "
              f"timer floor: {meta['timer_floor']}", flush=True)
    results, failed = [], []
    for case in C.cases(args):
        try:
            r = run_case(case, ref, up, writer, device, timer, cuda, args.smoke,
                         meta["ref_capture"], fast, tri, seq)
        except Exception as e:  # noqa: BLE001 - one case must not lose the run
            failed.append(f"{case.label()}: {type(e).__name__}: {e}")
            print(f"{case.label()}: FAILED {type(e).__name__}: {e}", flush=True)
            if args.smoke:
                raise
            continue
        results.append(r)
        print(f"{r['case']}: eager " + " ".join(
            f"{k}={v:.3f}" for k, v in r["eager"].items()) + " | graph " + " ".join(
            f"{k}={v:.3f}" for k, v in r["graph"].items()) + (" | seq us " + " ".join(
            f"{k}={1e3 * v:.2f}" for k, v in r["seq"].items())
            + f" floor={r['floor_us']:.2f} {r['verdict']}" if "floor_us" in r else ""),
            flush=True)
        if cuda:
            torch.cuda.empty_cache()
        text = report(results, meta) + "".join(f"\nFAILED {f}" for f in failed)
        if args.out:  # rewritten after every case: a killed run keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"meta": meta, "results": results, "failed": failed}, indent=1))
    print(report(results, meta) + "".join(f"\nFAILED {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
