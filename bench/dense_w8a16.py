# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936 dense W8A16 GEMV (issue 21 item 3): numerics against float64 and
back-to-back speed against the memory/FP32 floor, the BF16 GEMM and the
previous kernel, in one run.

    python3 bench/dense_w8a16.py --stage-old      # here: previous kernel sources
    make kernels KERNEL_PY=python3                 # GPU machine: the new library
    python3 bench/dense_w8a16.py --out FILE.md     # GPU machine (carry .device)

``--stage-old`` writes ``git show REV:csrc_gfx936/...`` (default: the commit
with the single-pass kernel, 8daad70) into ``.device/w8a16_old`` with the namespace renamed,
plus a small binding; the bench builds it as ``torch.ops._gfx936_C_w8old``.

Numerics (exit 1 on a mismatch): float64 oracle (torch's float8_e4m3fn cast,
``2.0 ** (u - 127)``, as bench/dense_moe.py), rel <= 1e-2 and cos >= 0.9999,
finite, on every DeepSeek V4 Flash TP8/TP4 projection (grouped wo_a included)
at M = 1, 2, 3, 4, 5, 8, 16, 17, 33, plus odd shapes (K % 16 == 8, rows not
16-byte aligned, N not a multiple of the tile), f16/f32 activations, float32
scales and f32 output; 50 repeats bitwise identical (split-K sum order).

Speed: per call, calls back to back in one CUDA graph, each on its own weight
copy and its own activations (copies together > 7x L2: cold), the graph replay
timed with L2 flushed and divided by the number of calls; the timer floor (an
empty-kernel graph replay) is shown, divided the same way. floor = max(bytes /
copy BW, FLOPs / FP32 FMA peak); bytes = FP8 weight + scales + x + out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OLD_DIR = REPO / ".device" / "w8a16_old"
BLOCK = (128, 128)
TOL, COS_MIN = 1e-2, 0.9999
TP8 = {  # name -> (N, K, groups): DeepSeek V4 Flash per-rank FP8 projections
    "wqa+wkv 1536x4096": (1536, 4096, 1),
    "wq_b 4096x1024": (4096, 1024, 1),
    "idx wq_b 8192x1024": (8192, 1024, 1),
    "wo_a 1024x4096": (1024, 4096, 1),
    "wo_b 4096x1024": (4096, 1024, 1),
    "shared w13 512x4096": (512, 4096, 1),
    "shared w2 4096x256": (4096, 256, 1),
}
TP4 = {
    "tp4 wq_b 8192x1024": (8192, 1024, 1),
    "tp4 wo_a 2x1024x4096": (2048, 4096, 2),
    "tp4 wo_b 4096x2048": (4096, 2048, 1),
    "tp4 shared w13 1024x4096": (1024, 4096, 1),
    "tp4 shared w2 4096x512": (4096, 512, 1),
}
ODD = {"odd 264x392": (264, 392, 1), "odd 100x200": (100, 200, 1),
       "odd grouped 2x24x136": (48, 136, 2)}

OLD_BINDING = r'''
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include "w8a16_fp8.h"
namespace {
int kind(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? gfx936_old::kBF16
       : t.scalar_type() == at::kHalf ? gfx936_old::kF16 : gfx936_old::kF32;
}
void gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t bn,
          int64_t bk, int64_t groups, at::Tensor& out) {
  gfx936_old::W8A16Params p{};
  p.w = static_cast<const uint8_t*>(w.data_ptr()); p.w_s0 = w.stride(0);
  p.scale = s.data_ptr(); p.scale_kind = s.element_size() == 1 ? 0 : 1; p.s_s0 = s.stride(0);
  p.n = w.size(0); p.k = w.size(1); p.bn = bn; p.bk = bk;
  while ((1 << p.bk_shift) < p.bk) ++p.bk_shift;
  p.groups = groups; p.x = x.data_ptr(); p.x_kind = kind(x); p.x_s0 = x.stride(0);
  p.out = out.data_ptr(); p.out_kind = kind(out); p.o_s0 = out.stride(0); p.m = x.size(0);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const char* msg = nullptr;
  TORCH_CHECK(gfx936_old::w8a16_gemv_launch(
      p, at::cuda::getCurrentCUDAStream().stream(), &msg) == 0, msg);
}
}  // namespace
TORCH_LIBRARY(_gfx936_C_w8old, m) {
  m.def("w8a16_gemv(Tensor x, Tensor weight, Tensor weight_scale, int block_n, int block_k, "
        "int groups, Tensor(a!) out) -> ()");
}
TORCH_LIBRARY_IMPL(_gfx936_C_w8old, CUDA, m) { m.impl("w8a16_gemv", &gemv); }
'''
OLD_FILES = ("w8a16_fp8.cu", "w8a16_fp8.h", "gfx936_compat.h", "lowp_decode.h",
             "sparse_mla_decode.h")


def stage_old(rev: str) -> None:
    OLD_DIR.mkdir(parents=True, exist_ok=True)
    for f in OLD_FILES:
        src = subprocess.run(["git", "show", f"{rev}:csrc_gfx936/{f}"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        src = re.sub(r"\bnamespace gfx936\b", "namespace gfx936_old", src)
        src = src.replace("gfx936::", "gfx936_old::")
        (OLD_DIR / f).write_text(src)
    (OLD_DIR / "bind_old.cpp").write_text(OLD_BINDING)
    (OLD_DIR / "REV").write_text(subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True,
                                                capture_output=True, text=True).stdout)
    print(f"staged the W8A16 kernel of {rev} into {OLD_DIR}")


def build_old():
    from torch.utils import cpp_extension
    out = REPO / "build" / "w8a16_old"
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="_gfx936_C_w8old",
                       sources=[str(OLD_DIR / "bind_old.cpp"), str(OLD_DIR / "w8a16_fp8.cu")],
                       build_directory=str(out), extra_cflags=["-O3", "-std=c++17"],
                       extra_cuda_cflags=["-O3", "-std=c++17"],
                       extra_include_paths=[str(OLD_DIR)], is_python_module=False)
    return torch.ops._gfx936_C_w8old


class Dense:
    """E4M3 weight [N, K] + UE8M0 block scales, quantized from N(0, 0.02**2);
    ``pad`` extra bytes per row (rows not 16-byte aligned when pad % 16 == 8)."""

    def __init__(self, n, k, seed, pad=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        bn, bk = BLOCK
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        nb, kb = -(-n // bn), -(-k // bk)
        full = torch.zeros(nb * bn, kb * bk, device=device)
        full[:n, :k] = w
        amax = full.view(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        exp = torch.ceil(torch.log2(amax / 448.0))
        self.u8 = (exp + 127).to(torch.uint8)
        scale = torch.exp2(exp).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q = (w / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        store = torch.zeros(n, k + pad, dtype=torch.uint8, device=device)
        store[:, :k] = q
        self.w = store[:, :k]
        self.n, self.k = n, k

    def w64(self):
        bn, bk = BLOCK
        s = torch.exp2(self.u8.double() - 127)
        s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: self.n, : self.k]
        return self.w.view(torch.float8_e4m3fn).to(torch.float64) * s


def oracle(x, w64, groups):
    n, k = w64.shape
    g = n // groups
    return torch.cat([x[:, i * k:(i + 1) * k].double() @ w64[i * g:(i + 1) * g].t()
                      for i in range(groups)], dim=1)


def metrics(out, ref):
    o = out.double()
    finite = bool(torch.isfinite(o).all())
    d = (o - ref).abs()
    rel = float(d.max()) / max(1e-30, float(ref.abs().max())) if finite else float("inf")
    cos = float(torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0))
    return rel, cos, finite


def gemv(ops, x, d, s, groups, out_dtype=torch.bfloat16):
    out = torch.empty(x.shape[0], d.n, dtype=out_dtype, device=x.device)
    ops.w8a16_gemv(x, d.w, s, *BLOCK, groups, out)
    return out


def check(ops, old, log) -> bool:
    ok = True
    shapes = dict(TP8, **TP4, **ODD)
    for si, (name, (n, k, groups)) in enumerate(shapes.items()):
        pad = 8 if name.startswith("odd 264") else 0
        d = Dense(n, k, seed=21 + si, pad=pad)
        w64 = d.w64()
        for m in (1, 2, 3, 4, 5, 8, 16, 17, 33):
            gen = torch.Generator(device="cuda").manual_seed(7000 + 97 * si + m)
            x = torch.randn(m, groups * k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = oracle(x, w64, groups)
            out = gemv(ops, x, d, d.u8, groups)
            rel, cos, fin = metrics(out, ref)
            good = fin and rel <= TOL and cos >= COS_MIN
            line = f"{name:26s} M={m:3d} new vs f64: rel={rel:.2e} cos={cos:.8f} finite={fin}"
            if old is not None:
                orel, _, ofin = metrics(gemv(old, x, d, d.u8, groups), ref)
                line += f" | old rel={orel:.2e}"
            if m in (1, 16):
                same = all(torch.equal(out, gemv(ops, x, d, d.u8, groups)) for _ in range(50))
                good &= same
                line += f" | 50x bitwise {same}"
            ok &= good
            log(line + (" ok" if good else " FAIL"))
        if si == 0 or name.startswith("odd 264"):  # other kinds: f16 / f32 x, f32 scales + out
            s32 = torch.exp2(d.u8.float() - 127)
            for xd, sc, od in ((torch.float16, d.u8, torch.bfloat16),
                               (torch.float32, s32, torch.float32)):
                x = torch.randn(5, groups * k, device="cuda").to(xd)
                out = gemv(ops, x, d, sc, groups, od)
                rel, cos, fin = metrics(out, oracle(x, w64, groups))
                good = fin and rel <= TOL and cos >= COS_MIN and out.dtype == od
                ok &= good
                log(f"{name:26s} M=  5 x {xd} scale {sc.dtype} out {od}: rel={rel:.2e} "
                    f"cos={cos:.8f} {'ok' if good else 'FAIL'}")
        del w64, d
    return ok


# ---- speed ---------------------------------------------------------------------------------
COLD = 384 << 20


def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def replay_ms(g, reps, flush):
    ts = []
    for _ in range(reps + 2):
        flush.sum()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts = sorted(ts[2:])
    return ts[len(ts) // 2]


def seq_us(fns, reps, flush):
    """us per call: the calls back to back in one graph, replay / len(fns)."""
    def run_all():
        for f in fns:
            f()
    g = capture(run_all)
    t = replay_ms(g, reps, flush)
    del g
    return 1e3 * t / len(fns)


def kernel_us(fns):
    """Mean device time of the GPU kernels of one call (CUPTI via torch.profiler),
    calls run eagerly on their rotating copies; launch gaps excluded."""
    from torch.profiler import ProfilerActivity, profile
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for f in fns:
            f()
        torch.cuda.synchronize()
    tot = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        tot += t
    return tot / len(fns)


def speed(ops, old, tokens, reps, log, fp32_tflops=None):
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda").uniform_()
    props = torch.cuda.get_device_properties(0)
    import sparse_mla_common as C  # the repo's copy bandwidth (2 GiB, as gfx936_kernels.py)
    copy_bw = C.copy_bandwidth("cuda", 2048 << 20, C.Timer("cuda", 30, 3))
    # the Sparse MLA bench's rule (one home): --fp32-tflops, else the NVIDIA SM clock; unknown
    # (AMD without the flag): the floor is bytes only
    fp32_peak, peak_src = C.fp32_peak("cuda", fp32_tflops)
    log(f"FP32 peak: {fp32_peak / 1e12 if fp32_peak else 0:.1f} TFLOP/s ({peak_src})")
    tiny = torch.zeros(1, device="cuda")
    meta = {"copy_bw_GBs": copy_bw / 1e9,
            "fp32_peak_TFLOPs": fp32_peak / 1e12 if fp32_peak else None,
            "fp32_peak_source": peak_src, "sms": props.multi_processor_count}
    rows = []
    for name, (n, k, groups) in TP8.items():
        d = Dense(n, k, seed=41)
        wbytes = n * k + d.u8.numel()
        nc = max(8, min(64, -(-COLD // wbytes)))
        copies = [Dense(n, k, seed=41 + i) for i in range(nc)]
        nb = max(4, min(64, -(-COLD // (2 * n * k))))
        wbf = [c.w64().to(torch.bfloat16) for c in copies[:nb]]
        for m in tokens:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(nc)]
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            r = {"name": name, "n": n, "k": k, "m": m, "calls": nc}
            r["new"] = seq_us([lambda c=c, x=x, o=o: ops.w8a16_gemv(x, c.w, c.u8, *BLOCK, 1, o)
                               for c, x, o in zip(copies, xs, outs)], reps, flush)
            r["old"] = seq_us([lambda c=c, x=x, o=o: old.w8a16_gemv(x, c.w, c.u8, *BLOCK, 1, o)
                               for c, x, o in zip(copies, xs, outs)], reps, flush) \
                if old is not None else None
            r["bf16"] = seq_us([lambda b=b, x=x: torch.matmul(x, b.t())
                                for b, x in zip(wbf, xs)], reps, flush)
            dst = torch.empty(n, k, dtype=torch.uint8, device="cuda")
            r["copy"] = seq_us([lambda c=c: dst.copy_(c.w) for c in copies], reps, flush)
            if m in (1, 16):
                try:
                    r["new_kernel"] = kernel_us(
                        [lambda c=c, x=x, o=o: ops.w8a16_gemv(x, c.w, c.u8, *BLOCK, 1, o)
                         for c, x, o in zip(copies, xs, outs)])
                    if old is not None:
                        r["old_kernel"] = kernel_us(
                            [lambda c=c, x=x, o=o: old.w8a16_gemv(x, c.w, c.u8, *BLOCK, 1, o)
                             for c, x, o in zip(copies, xs, outs)])
                    r["bf16_kernel"] = kernel_us([lambda b=b, x=x: torch.matmul(x, b.t())
                                                  for b, x in zip(wbf, xs)])
                except Exception as e:  # noqa: BLE001
                    log(f"profiler: {type(e).__name__}: {e}")
            r["timer_floor_per_call"] = seq_us([lambda: tiny.add_(1)], reps, flush) / nc
            byts = wbytes + m * k * 2 + m * n * 2
            r["floor_us"] = C.floor_us(byts, 2 * m * n * k, copy_bw, fp32_peak)
            r["bw_pct"] = 100 * wbytes / (r["new"] * 1e-6) / copy_bw
            rows.append(r)
            log(f"{name:22s} M={m:3d} new {r['new']:.2f} us ({r['bw_pct']:.0f}% BW, "
                f"{r['floor_us'] / r['new']:.2f} of floor {r['floor_us']:.2f}) old "
                f"{r['old'] if r['old'] is None else round(r['old'], 2)} us bf16 "
                f"{r['bf16']:.2f} us")
            del xs, outs
        del copies, wbf, d
    return meta, rows


def report(meta, log, rows):
    L = [f"# csrc_gfx936 dense W8A16 GEMV (split-K) on {meta['device']}", ""]
    L += [f"- {k}: {v}" for k, v in meta.items() if k != "device"]
    L += ["", "## Speed (per call, back to back in one graph, cold L2)", "",
          "floor = max(bytes / copy BW, 2 M N K / FP32 peak); ratio = floor / time (1 = at the "
          "floor); BW% = FP8 weight + scale bytes / time / copy BW. timer floor = an empty "
          "kernel's graph replay divided by the number of calls (already inside each "
          "per-call time). old = the previous kernel (same run), bf16 = torch.matmul on a "
          "BF16 copy of the weight.", "",
          "copy = a device copy of the same FP8 weight bytes (read + write) in the same "
          "harness: what a plain streaming kernel of this size gets here. kernel-only = CUPTI "
          "device time of the call's kernels (eager, rotating copies; no launch gaps), "
          "new / old / BF16.", "",
          "| weight | M | calls | new us | BW% | floor us | ratio | old us | new vs old | "
          "BF16 us | new vs BF16 | copy us | kernel-only new / old / BF16 us | "
          "timer floor/call us |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        o = r["old"]
        L.append(f"| {r['name']} | {r['m']} | {r['calls']} | {r['new']:.2f} | "
                 f"{r['bw_pct']:.0f}% | {r['floor_us']:.2f} | {r['floor_us'] / r['new']:.2f} | "
                 + (f"{o:.2f} | {o / r['new']:.2f}x | " if o else "n/a | n/a | ")
                 + f"{r['bf16']:.2f} | {r['bf16'] / r['new']:.2f}x | {r['copy']:.2f} | "
                 + (" / ".join(f"{r[key]:.2f}" if r.get(key) is not None else "n/a"
                               for key in ("new_kernel", "old_kernel", "bf16_kernel"))
                    if "new_kernel" in r else "") + " | "
                 f"{r['timer_floor_per_call']:.2f} |")
    L += ["", "## Numerics log", "", "```"] + log + ["```", ""]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-old", nargs="?", const="8daad70", default=None,
                    help="stage the previous kernel from this git revision (default: 8daad70, "
                    "the last commit with the single-pass kernel) and exit")
    ap.add_argument("--kernel-lib", default=str(REPO / "build" / "kernels" / "_gfx936_C.so"))
    ap.add_argument("--no-old", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fp32-tflops", type=float, default=None,
                    help="FP32 FMA peak for the floor (default: NVIDIA SMs x 128 lanes x 2 x "
                         "max SM clock; on AMD pass it, else the floor is bytes only)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.stage_old:
        stage_old(args.stage_old)
        return 0
    if not torch.cuda.is_available():
        print("dense_w8a16: no CUDA/ROCm device", file=sys.stderr)
        return 2
    torch.ops.load_library(args.kernel_lib)
    ops = torch.ops._gfx936_C
    old = None if args.no_old or not (OLD_DIR / "bind_old.cpp").is_file() else build_old()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    p = torch.cuda.get_device_properties(0)
    meta = {"device": f"{p.name} ({p.multi_processor_count} SMs)",
            "date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "torch": torch.__version__,
            "old kernel": (OLD_DIR / "REV").read_text().strip() if old is not None else "n/a",
            "command": "python3 bench/dense_w8a16.py " + " ".join(sys.argv[1:])}
    log = []

    def out(line):
        print(line, flush=True)
        log.append(line)

    ok = check(ops, old, out)
    out("DENSE-W8A16 CHECK " + ("PASS" if ok else "FAIL"))
    rows = []
    if ok and not args.no_speed:
        m2, rows = speed(ops, old, [int(t) for t in args.tokens.split(",")], args.reps, out,
                         args.fp32_tflops)
        meta.update(m2)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = report(meta, log, rows)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
