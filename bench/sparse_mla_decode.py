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
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import sparse_mla_common as C  # noqa: E402

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
    return ap.parse_args(argv)


def smoke_args(args):
    args.batches, args.heads, args.layers = "2", "4", "c4,c128,swa"
    args.topk, args.window, args.ctx = 32, 16, 256
    args.reps, args.warmup, args.copy_mib = 2, 1, 4
    return args


def run_case(case, ref, up, writer, device, timer, cuda, smoke, probes, fast=None, tri=None):
    inp = C.Inputs(case, writer, device, seed=case.batch * 1000 + case.heads)
    r = {"case": case.label(), "layer": case.layer, "batch": case.batch,
         "heads": case.heads, "keys": case.n_main + case.n_extra,
         "bytes": case.useful_bytes(), "eager": {}, "graph": {}, "graph_error": {}}
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
    del inp
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
    return "\n".join(L) + "\n"


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
    results, failed = [], []
    for case in C.cases(args):
        try:
            r = run_case(case, ref, up, writer, device, timer, cuda, args.smoke,
                         meta["ref_capture"], fast, tri)
        except Exception as e:  # noqa: BLE001 - one case must not lose the run
            failed.append(f"{case.label()}: {type(e).__name__}: {e}")
            print(f"{case.label()}: FAILED {type(e).__name__}: {e}", flush=True)
            if args.smoke:
                raise
            continue
        results.append(r)
        print(f"{r['case']}: eager " + " ".join(
            f"{k}={v:.3f}" for k, v in r["eager"].items()) + " | graph " + " ".join(
            f"{k}={v:.3f}" for k, v in r["graph"].items()), flush=True)
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
