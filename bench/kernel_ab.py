# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936 A/B: two builds of the kernels timed in one run, back to back.

A kernel change is judged against the revision before it on the same warm
machine (issue 21: ratios measured in one run). ``make ab-stage BASE=<rev>``
(here, where git is) puts ``csrc_gfx936/`` of that revision into
``.device/base/``; ``make bench-ab`` (on the GPU machine, carry ``.device``)
builds it next to the working tree's and runs this script::

    python3 bench/kernel_ab.py --base-lib build/kernels_base/_gfx936_C.so \\
        --lib build/kernels/_gfx936_C.so [--parts smla,moe,dense,dequant] [--quick] \\
        [--rounds 2] [--out ab.md] [--json ab.json]

Each library is loaded in its own child process (both register
``torch.ops._gfx936_C``), one part at a time, base then new, for ``--rounds``
rounds: drift of the machine shows as the spread between rounds, and a run cut
short keeps whole pairs (the report is rewritten after every child). What a child times
(us per call; every call in a CUDA graph of N calls on N distinct input sets,
L2 flushed and the device idle before the replay, replay / N: the
back-to-back time a decode step sees):

* ``smla``    Sparse MLA decode (the kernel; upstream's split-K in the first
              base round, as the yardstick of issue 21), c4 / c128 / swa x heads x
              batches, the sets of ``bench/sparse_mla_decode.py``'s seq table;
* ``moe``     MXFP4 MoE decode through the front end (TP8 and TP4), 32 calls
              each with its own routing, as ``bench/gfx936_kernels.py``;
* ``dense``   W8A16 GEMV through the front end, the TP8 projections at M = 1
              and 16, on copies of the weight that together pass L2;
* ``dequant`` the prefill dequant kernels alone (all experts of a TP8 MoE
              layer; the TP8 dense projections), median of isolated calls.

The report is one table per part: base, new, new / base (< 1 = the new build
is faster) and, with two or more rounds, the largest relative spread of either
build's rounds. Numerics are not checked here (``make device-check``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("smla", "moe", "dense", "dequant")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-lib", help="the base revision's _gfx936_C.so")
    ap.add_argument("--lib", required=True, help="the new build's _gfx936_C.so")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--rounds", type=int, default=1, help="base/new alternations")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    bad = [p for p in a.parts.split(",") if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {','.join(PARTS)}")
    if a.child_out is None and not a.base_lib:
        ap.error("--base-lib is required (make ab-stage BASE=<rev>, then make bench-ab)")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: at least 1")
    return a


# ---- child: one library, every part ------------------------------------------------------

def smla_cases(quick):
    heads, batches = ("8,64", "1,64") if quick else ("8,16,64", "1,8,64")
    return types.SimpleNamespace(batches=batches, heads=heads, layers="c4,c128,swa", topk=512,
                                 window=128, ctx=8192, seq=16, seq_max=48, seq_gib=16.0,
                                 smoke=False)


def child_smla(lib, quick, upstream, timer, rows):
    import torch

    import sparse_mla_common as C
    import sparse_mla_decode as B
    args = smla_cases(quick)
    ref, up, writer = C.load_staged(None)
    fast, _, note = C.load_fast(None, lib)
    if fast is None or not note.startswith("loaded"):
        raise SystemExit(f"kernel_ab: {lib}: Sparse MLA kernel not loaded ({note})")
    l2 = B.l2_bytes("cuda")
    paths = ("kernel", "up-splitk") if upstream else ("kernel",)
    for case in C.cases(args):
        r = {"seq": {}, "seq_error": {}}  # upstream's Triton failing (DAS Triton): a row's error
        B.run_seq(case, r, ref, up if upstream else None, writer, "cuda", timer, True, args, l2,
                  fast, None, paths=paths)
        if "kernel" not in r["seq"]:
            raise SystemExit(f"kernel_ab: {lib}: {case.label()}: {r['seq_error'].get('kernel')}")
        for name in paths:
            ms = r["seq"].get(name)
            rows.append({"part": "smla", "case": case.label(), "path": name,
                         "us": None if ms is None else 1e3 * ms,
                         "error": r["seq_error"].get(name), "n": r["seq_n"]})
        torch.cuda.empty_cache()


def child_moe(mk, DM, K, quick, timer, rows):
    import torch
    plans = [(K.MOE_TP8, "TP8", (1, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64)),
             (K.MOE_TP4, "TP4", (1, 16, 64))]
    sdtype, _ = DM.e8m0_dtype("cuda")
    for cfg, tp, tokens in plans:
        moe = DM.MoE(cfg, "cuda", sdtype)
        for m in tokens:
            x = torch.randn(m, cfg.hidden, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, cfg.hidden, dtype=torch.bfloat16, device="cuda")
            routes = K.seq_routes(cfg, m, "cuda")
            ms = K.moe_seq(mk, moe, cfg, x, out, routes, timer)
            rows.append({"part": "moe", "case": f"{tp} M={m}", "path": "kernel",
                         "us": None if ms is None else 1e3 * ms, "n": len(routes)})
        del moe
        torch.cuda.empty_cache()


def child_dense(wk, DM, K, quick, timer, rows):
    import torch
    sdtype, _ = DM.e8m0_dtype("cuda")
    shapes = dict(list(K.DENSE_TP8.items())[:3]) if quick else K.DENSE_TP8
    for si, (name, (n, k, groups)) in enumerate(shapes.items()):
        d = DM.Dense(n, k, "cuda", sdtype, seed=41 + si)
        wc = [d.weight.clone() for _ in range(K.copies_for(n * k))]
        for m in (1, 16):
            x = torch.randn(m, groups * k, device="cuda").to(torch.bfloat16)
            ms = K.dense_seq(wk, x, wc, d.scale, groups, timer)
            rows.append({"part": "dense", "case": f"{name} M={m}", "path": "kernel",
                         "us": None if ms is None else 1e3 * ms, "n": len(wc)})
        del wc, d
        torch.cuda.empty_cache()


def child_dequant(mk, wk, DM, K, C, rows):
    import torch
    ops = torch.ops._gfx936_C
    sdtype, _ = DM.e8m0_dtype("cuda")
    cfg = K.MOE_TP8
    moe = DM.MoE(cfg, "cuda", sdtype)
    t = C.Timer("cuda", 7, 1)
    order = torch.arange(cfg.experts, dtype=torch.int32, device="cuda")
    for name, w, s, shape in (
            ("MoE w13 (all experts)", moe.w13, moe.s13, (2 * cfg.inter, cfg.hidden)),
            ("MoE w2 (all experts)", moe.w2, moe.s2, (cfg.hidden, cfg.inter))):
        ws = torch.empty(cfg.experts, *shape, dtype=torch.bfloat16, device="cuda")
        wu, su = mk._u8(w), mk._u8(s)
        rows.append({"part": "dequant", "case": name, "path": "kernel",
                     "us": 1e3 * t(lambda: ops.mxfp4_dequant_experts(wu, su, order, 0, ws))})
        del ws
    del moe
    for si, (name, (n, k, groups)) in enumerate(K.DENSE_TP8.items()):
        d = DM.Dense(n, k * groups, "cuda", sdtype, seed=41 + si)
        wd = torch.empty(n, k * groups, dtype=torch.bfloat16, device="cuda")
        wu, su = wk._u8(d.weight), wk.kernel_scale(d.scale)
        rows.append({"part": "dequant", "case": f"fp8 {name}", "path": "kernel",
                     "us": 1e3 * t(lambda: ops.fp8_block_dequant(wu, su, 128, 128, wd))})


def child(a) -> int:
    import torch

    import dense_moe as DM
    import gfx936_kernels as K
    import sparse_mla_common as C
    if not torch.cuda.is_available():
        print("kernel_ab: no CUDA/ROCm device (the A/B times the kernels; CPU CI runs "
              "`make kernel-check`)", file=sys.stderr)
        return 2
    parts = a.parts.split(",")
    timer = C.Timer("cuda", a.reps, 3)
    rows: list[dict] = []
    if {"moe", "dense", "dequant"} & set(parts):
        _, _, _, wk, mk = K.load(None, a.lib)
    if "smla" in parts:
        child_smla(a.lib, a.quick, a.upstream, timer, rows)
    if "moe" in parts:
        child_moe(mk, DM, K, a.quick, timer, rows)
    if "dense" in parts:
        child_dense(wk, DM, K, a.quick, timer, rows)
    if "dequant" in parts:
        child_dequant(mk, wk, DM, K, C, rows)
    Path(a.child_out).write_text(json.dumps(rows, indent=1))
    return 0


# ---- parent: alternate the builds, then the table ----------------------------------------

def merge(runs: list[tuple[str, list[dict]]]) -> dict:
    """{(part, case, path): {"base": [us...], "new": [us...]}} in first-seen order."""
    table: dict = {}
    for build, rows in runs:
        for r in rows:
            key = (r["part"], r["case"], r["path"])
            cell = table.setdefault(key, {"base": [], "new": []})
            if r.get("us") is not None:
                cell[build].append(r["us"])
    return table


def mean(v):
    return sum(v) / len(v) if v else None


def spread(v):
    """Largest relative distance of a round from the rounds' mean (None below 2)."""
    if len(v) < 2:
        return None
    m = mean(v)
    return max(abs(x - m) for x in v) / m


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def report(table: dict, meta: dict) -> str:
    L = ["# csrc_gfx936 A/B: base vs new, one run", ""]
    L += [f"- {k}: {v}" for k, v in meta.items()]
    L += ["- us per call back to back (N calls in one CUDA graph on distinct inputs, L2 flushed "
          "before the replay); dequant: median of isolated calls",
          "- new / base < 1: the new build is faster; spread: largest relative distance of a "
          "round from the mean, either build; up / new > 1: the new kernel beats upstream's "
          "split-K (timed in the first base round)", ""]
    for part in PARTS:
        keys = [k for k in table if k[0] == part and k[2] != "up-splitk"]
        if not keys:
            continue
        smla = part == "smla"
        L += [f"## {part}", "", "| case | base us | new us | new / base | spread |"
              + (" up-splitk us | up / new |" if smla else ""),
              "|---|---|---|---|---|" + ("---|---|" if smla else "")]
        for key in keys:
            c = table[key]
            b, n = mean(c["base"]), mean(c["new"])
            sp = [s for s in (spread(c["base"]), spread(c["new"])) if s is not None]
            row = (f"| {key[1]} | {fmt(b)} | {fmt(n)} | {fmt(n / b if b and n else None, '.3f')}"
                   f" | {fmt(100 * max(sp) if sp else None, '.1f')}{'%' if sp else ''} |")
            if smla:
                up = mean(table.get((part, key[1], "up-splitk"), {}).get("base", []))
                row += f" {fmt(up)} | {fmt(up / n if up and n else None, '.3f')} |"
            L.append(row)
        L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    a = parse(argv)
    if a.child_out is not None:
        return child(a)
    for lib in (a.base_lib, a.lib):
        if not Path(lib).is_file():
            print(f"kernel_ab: {lib} missing (make bench-ab builds both)", file=sys.stderr)
            return 2
    runs, tmp = [], Path(a.json or "kernel_ab.json").with_suffix(".child.json")
    # part by part, base then new: a run cut short keeps whole A/B pairs
    order = [(rnd, part, build, lib) for rnd in range(a.rounds) for part in a.parts.split(",")
             for build, lib in (("base", a.base_lib), ("new", a.lib))]
    for rnd, part, build, lib in order:
        cmd = [sys.executable, __file__, "--lib", lib, "--parts", part,
               "--reps", str(a.reps), "--child-out", str(tmp)]
        cmd += ["--quick"] if a.quick else []
        cmd += ["--upstream"] if (rnd == 0 and build == "base") else []
        print(f"kernel_ab: round {rnd + 1} {part} {build}: {lib}", flush=True)
        if subprocess.run(cmd).returncode:
            print(f"kernel_ab: the {build} child of {part} failed ({lib})", file=sys.stderr)
            return 1
        runs.append((build, json.loads(tmp.read_text())))
        table = merge(runs)
        meta = {"date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                "base": a.base_lib, "new": a.lib, "rounds": a.rounds, "parts": a.parts}
        text = report(table, meta)
        if a.out:  # rewritten after every child: a killed run keeps what it measured
            Path(a.out).write_text(text)
        if a.json:
            Path(a.json).write_text(json.dumps(
                {"meta": meta, "runs": runs}, indent=1))
    tmp.unlink(missing_ok=True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
