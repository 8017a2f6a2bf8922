# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One DeepSeek V4 Flash decoder layer's decode step (SWA layer kind, per-rank TP8 shapes) through
the fork's own ops, eagerly and replayed as one CUDA graph, on the GPU torch sees (H200 tier):
kernel launches per layer (torch.profiler), us per layer, the per-token figure over 43 layers, and
the graph replay checked against eager (bitwise: same kernels, same inputs).

The step, in the order ``DeepseekV4DecoderLayer`` runs it on the gfx936 path (issue #19):

    mHC pre -> RMSNorm -> wq_a+wkv -> q/kv RMSNorm -> wq_b -> q norm + RoPE + fp8_ds_mla KV insert
    -> Sparse MLA decode (SWA window, 128 keys) -> inverse RoPE + grouped wo_a -> wo_b -> mHC post
    -> mHC pre -> RMSNorm -> router (sqrt-softplus, bias, top-6) -> shared expert + routed MXFP4
    experts -> mHC post

Two paths, in one run:

* ``kernels``: what gfx936 runs with the csrc_gfx936 extension (``make kernels``): fused mHC
  (Triton), the W8A16 GEMV kernel for every FP8 linear (grouped wo_a included), the MXFP4 MoE
  kernel, the Sparse MLA decode kernel; the steps with no fused op yet run the fork's PyTorch
  twins (``gfx936_attention_torch``: q/kv RMSNorm, q norm + RoPE + KV insert) or the fused ops
  (the inverse RoPE before wo_a; the KV insert in the ``kernels + fused KV insert`` path).
* ``pytorch``: the same layer without the extension: the torch mHC chain, W8A16 dequantized per
  call, the MXFP4 emulation, the Sparse MLA reference decode (one host sync: not capturable).

What is staged (``make bench-stage``): ``.device/layer`` (the attention twins and the W8A16 kernel
front end with their vllm import closure, byte for byte, plus one stand-in: the tier table answers
``kernel``), ``.device/sparse_mla``, ``.device/dense_moe`` and ``.device/mhc`` as the other benches.
Not modelled: the metadata build (once per step, not per layer), the RMSNorms (vLLM's own op on
gfx936: one launch each, a torch twin here), the router's upstream kernel (a torch twin here), the
compressor and indexer of C4/C128 layers (their decode twins still hold host syncs, issue #19).

    python bench/layer_step.py --kernel-lib build/kernels/_gfx936_C.so [--out docs/bench/x.md]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dense_moe as DM  # noqa: E402
import gfx936_kernels as GK  # noqa: E402
import sparse_mla_common as C  # noqa: E402

HIDDEN, HC, SINKHORN, EPS = 4096, 4, 20, 1e-6
HEAD, ROPE, Q_LORA, O_LORA = 512, 64, 1024, 1024
# per-rank shapes: local heads, wo_a groups, routed experts' config, shared expert intermediate
TP_SHAPES = {8: (8, 1, GK.MOE_TP8, 256), 4: (16, 2, GK.MOE_TP4, 512)}
HEADS, GROUPS, MOE, SHARED = TP_SHAPES[8]


def set_tp(tp: int, smoke: bool = False) -> None:
    """Per-rank shapes of ``tp``; the CPU smoke keeps 16 of the 256 experts (the emulation
    dequantizes every local expert per call: GBs at 256)."""
    import dataclasses

    global HEADS, GROUPS, MOE, SHARED
    HEADS, GROUPS, MOE, SHARED = TP_SHAPES[tp]
    if smoke:
        MOE = dataclasses.replace(MOE, experts=16)
TOPK, SCALING, LAYERS_PER_TOKEN = 6, 1.5, 43
BATCHES = (1, 16, 64)
# (name, kernels, fused KV insert): today's kernels path, the same with the fused insert, and
# the path without the extension
PATHS = (("kernels", True, False), ("kernels + fused KV insert", True, True),
         ("pytorch", False, False))


def load(kernel_lib, smoke=False, device_dir=REPO / ".device"):
    """The staged modules. Each staged folder has its own ``vllm`` stub package, so the order
    matters: the Sparse MLA and dense/MoE stages load first, then ``.device/layer``'s package
    replaces theirs in ``sys.modules`` (the attention twins import from it at call time)."""
    d = Path(device_dir) / "layer"
    if not (d / "vllm").is_dir():
        raise SystemExit(f"{d} is not staged: run `make bench-stage` where vllm/ is applied")
    ref, _, writer = C.load_staged(Path(device_dir) / "sparse_mla")
    fast, _, note = C.load_fast(Path(device_dir) / "sparse_mla", None)
    if smoke:  # CPU: the PyTorch path only (no kernels, no Triton device)
        w8, mx, sw = DM.load_staged(Path(device_dir) / "dense_moe")
        wk = mk = None
    else:
        w8, mx, sw, wk, mk = GK.load(Path(device_dir) / "dense_moe", kernel_lib)
        if fast is None or not C.kernel_loaded():
            raise SystemExit(f"the Sparse MLA kernel is not loaded ({note}); pass --kernel-lib")
    sys.path.insert(0, str(Path(device_dir) / "mhc"))
    chain = importlib.import_module("mhc_torch")
    kern = None if smoke else importlib.import_module("mhc_gfx936_triton")
    sys.path.insert(0, str(d))
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    attn = importlib.import_module("vllm.models.deepseek_v4.amd.gfx936_attention_torch")
    kvi = None if smoke else importlib.import_module(
        "vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton")
    inv_rope = None if smoke else importlib.import_module(
        "vllm.models.deepseek_v4.common.ops.gfx936_inv_rope").inv_rope_gfx936
    if not str(Path(attn.__file__).resolve()).startswith(str(d.resolve())):
        raise SystemExit(f"the attention twins came from {attn.__file__}, not {d}")
    return types.SimpleNamespace(attn=attn, kvi=kvi, inv_rope=inv_rope, chain=chain, kern=kern, w8=w8, mx=mx, sw=sw, wk=wk,
                                 mk=mk, ref=ref, writer=writer, fast=fast)


class Layer:
    """One SWA decoder layer's weights and caches at batch ``b`` (random, fixed seeds)."""

    def __init__(self, m, b, dev, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        sd = torch.uint8

        def dense(n, k, s):
            return DM.Dense(n, k, dev, sd, seed=seed * 10 + s)

        self.wqa_wkv = dense(Q_LORA + HEAD, HIDDEN, 1)
        self.wq_b = dense(HEADS * HEAD, Q_LORA, 2)
        self.wo_a = dense(GROUPS * O_LORA, HEADS * HEAD // GROUPS, 3)
        self.wo_b = dense(HIDDEN, GROUPS * O_LORA, 4)
        self.w13 = dense(2 * SHARED, HIDDEN, 5)
        self.w2 = dense(HIDDEN, SHARED, 6)
        self.moe = DM.MoE(MOE, dev, sd, seed=seed)
        self.gate = torch.randn(MOE.experts, HIDDEN, device=dev, generator=g).to(torch.bfloat16) * 0.02
        self.bias = torch.randn(MOE.experts, device=dev, generator=g) * 0.1
        self.norms = [1 + 0.1 * torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
                      for n in (HIDDEN, Q_LORA, HEAD, HIDDEN)]
        n = HC * (2 + HC)
        self.mhc = [(torch.randn(n, HC * HIDDEN, device=dev, generator=g) * 0.02,
                     torch.rand(3, device=dev, generator=g) + 0.5,
                     torch.randn(n, device=dev, generator=g) * 0.5) for _ in range(2)]
        self.inp = C.Inputs(C.Case("swa", batch=b, heads=HEADS), m.writer, dev, seed=seed)
        pos = torch.arange(8192, device=dev, dtype=torch.float32)
        freqs = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE))
        ang = pos[:, None] * freqs[None, :]
        self.rotary = types.SimpleNamespace(cos_sin_cache=torch.cat([ang.cos(), ang.sin()], -1))
        self.positions = torch.full((b,), 8191, dtype=torch.int64, device=dev)
        # the new token goes to the last slot of each request's window
        self.slots = self.inp.main_slots[:, -1].to(torch.int64).contiguous()
        self.wo_a_mod = types.SimpleNamespace(weight=self.wo_a.weight,
                                              weight_scale_inv=self.wo_a.scale)
        # without the extension the twin keeps a BF16 copy of wo_a (dequantized once)
        self.wo_a_bf16 = types.SimpleNamespace(
            weight=self.wo_a.weight, weight_scale_inv=self.wo_a.scale,
            _gfx936_wo_a_bf16=m.w8.dequantize_fp8_block(
                self.wo_a.weight, self.wo_a.scale, DM.BLOCK).view(GROUPS, O_LORA, -1))


class Parts:
    """Kernel launches per step part: when ``on``, each ``part(name)`` runs under its own
    torch.profiler and its CUDA kernels are added to ``counts[name]``."""

    on = False
    counts: dict[str, int] = {}

    @classmethod
    def part(cls, name):
        import contextlib

        if not cls.on:
            return contextlib.nullcontext()
        return cls._count(name)

    @classmethod
    @__import__("contextlib").contextmanager
    def _count(cls, name):
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        cls.counts[name] = cls.counts.get(name, 0) + n


def step(m, L: Layer, r, kernels: bool, fused_insert: bool = False):
    """One decode step of the layer on the mHC residual ``r`` [b, hc, hidden] (bf16);
    ``fused_insert``: the q norm + RoPE + KV insert as the one Triton launch."""
    a = m.attn
    b = r.shape[0]

    def lin(x, d):
        if kernels:
            return m.wk.w8a16_block_mm_kernel(x, d.weight, d.scale, DM.BLOCK, torch.bfloat16)
        return m.w8.w8a16_block_mm(x, d.weight, d.scale, DM.BLOCK)

    def mhc_pre(fn, s, base, r):
        if kernels:
            mix, sq = m.kern.mhc_pre_mix_triton(r, fn, m.kern.mhc_pre_splits(b, HC * HIDDEN))
            return m.kern.mhc_pre_apply_triton(r, mix, sq, s, base, EPS, EPS, EPS, 2.0, SINKHORN)
        return m.chain.mhc_pre_torch(r, fn, s, base, EPS, EPS, EPS, 2.0, SINKHORN)

    post = m.kern.mhc_post_triton_fused if kernels else m.chain.mhc_post_torch

    def rms(x, w):
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS).to(x.dtype)

    P = Parts.part
    # attention
    with P("mHC pre + post (x2)"):
        p, c, x = mhc_pre(*L.mhc[0], r)
    with P("RMSNorm (x2, torch twin)"):
        h = rms(x, L.norms[0])
    with P("FP8 linears (W8A16: wqa+wkv, wq_b, wo_b, shared w13/w2)"):
        qkv = lin(h, L.wqa_wkv)
    with P("q/kv RMSNorm (twin)"):
        qr, kv = a.q_kv_rmsnorm(qkv[:, :Q_LORA], qkv[:, Q_LORA:], L.norms[1], L.norms[2], EPS)
    with P("FP8 linears (W8A16: wqa+wkv, wq_b, wo_b, shared w13/w2)"):
        q = lin(qr, L.wq_b).view(b, HEADS, HEAD)
    with P("q norm + RoPE + fp8_ds_mla KV insert (twin)"):
        insert = (m.kvi.qnorm_rope_kv_insert_triton if fused_insert
                  else a.qnorm_rope_kv_insert)
        q = insert(q, kv, L.inp.main, L.slots, L.positions, L.rotary.cos_sin_cache, HEADS, EPS,
                   L.inp.main.shape[1])
    L.inp.q = q
    with P("Sparse MLA decode"):
        o = (L.inp.call_fast(m.fast.sparse_mla_decode_kernel) if kernels
             else L.inp.call_reference(m.ref, ragged=True))
    with P("inverse RoPE + grouped wo_a (twin)"):
        z = a.inv_rope_einsum(L.rotary, o, L.positions, ROPE, GROUPS, O_LORA,
                              L.wo_a_mod if kernels else L.wo_a_bf16)
    with P("FP8 linears (W8A16: wqa+wkv, wq_b, wo_b, shared w13/w2)"):
        y = lin(z.reshape(b, -1), L.wo_b)
    with P("mHC pre + post (x2)"):
        r = post(y, r, p, c)
        # MoE
        p, c, x = mhc_pre(*L.mhc[1], r)
    with P("RMSNorm (x2, torch twin)"):
        h = rms(x, L.norms[3])
    with P("router (torch twin)"):
        scores = torch.sqrt(F.softplus(F.linear(h, L.gate).float()))
        ids = torch.topk(scores + L.bias, TOPK, dim=-1).indices
        wts = scores.gather(1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * SCALING
    with P("FP8 linears (W8A16: wqa+wkv, wq_b, wo_b, shared w13/w2)"):
        shared = lin(m.sw.clamped_swiglu(lin(h, L.w13), 10.0, 1.0), L.w2)
    with P("routed MXFP4 experts"):
        if kernels:
            routed = torch.empty_like(h)
            m.mk.mxfp4_moe_kernel(routed, h, L.moe.w13, L.moe.s13, L.moe.w2, L.moe.s2, wts,
                                  ids.to(torch.int32), None, 1.0, 10.0, False)
        else:  # the emulation's routing plan is built on the host (one sync, as the product's)
            ids_h, wts_h = ids.cpu(), wts.cpu()
            plan = []
            for ex in ids_h.unique().tolist():
                tok, slot = (ids_h == ex).nonzero(as_tuple=True)
                plan.append((ex, tok.to(h.device), wts_h[tok, slot].to(h.device)))
            routed = DM.moe_product(m.mx, m.sw, L.moe, h, plan)
    with P("mHC pre + post (x2)"):
        return post(shared + routed, r, p, c)


def measure(m, dev, layers=4):
    import mhc_fused as MF

    rows = []
    for b in BATCHES:
        Ls = [Layer(m, b, dev, seed=11 + i) for i in range(layers)]
        g = torch.Generator(device=dev).manual_seed(b)
        r0 = (torch.randn(b, HC, HIDDEN, device=dev, generator=g) * 3).to(torch.bfloat16)
        res = {}
        for name, kernels, fused in PATHS:
            def run(kernels=kernels, fused=fused):
                r = r0
                for L in Ls:
                    r = step(m, L, r, kernels, fused)
                return r
            eager_out = run()
            launches = MF.count_kernels(run) / layers
            eager = MF.back_to_back(run, n=10) / layers
            static = {}

            def cap(run=run):
                static["o"] = run()
            replay, why, graph = C.capture(cap)
            gr, same = float("nan"), None
            if replay is not None:
                replay()
                torch.cuda.synchronize()
                same = bool(torch.equal(static["o"], eager_out))
                gr = MF.back_to_back(replay, n=20) / layers
            Parts.on, Parts.counts = True, {}
            step(m, Ls[0], r0, kernels, fused)
            Parts.on = False
            parts = dict(Parts.counts)
            res[name] = dict(parts=parts, launches=launches, eager_ms=eager, graph_ms=gr, same=same,
                             why=why, finite=bool(torch.isfinite(eager_out.float()).all()))
        # the paths compute the same layers: per-token relative difference of the outputs
        # (informative: a near-tie in the router's top-6 may pick another expert on one side)
        outs = {}
        for name, kernels, fused in PATHS:
            r = r0
            for L in Ls:
                r = step(m, L, r, kernels, fused)
            outs[name] = r.float().reshape(b, -1)

        def rel(a, b_):
            d = (outs[a] - outs[b_]).norm(dim=-1) / outs[b_].norm(dim=-1)
            return float(d.median()), float(d.max())
        res["kernels"]["vs_pytorch"] = rel("kernels", "pytorch")
        res["kernels + fused KV insert"]["vs_kernels"] = rel("kernels + fused KV insert", "kernels")
        rows.append((b, res))
        for name, r in res.items():
            print(f"b={b} {name}: {r['launches']:.0f} launches/layer, eager "
                  f"{r['eager_ms']*1e3:.0f} us, graph {r['graph_ms']*1e3:.0f} us, "
                  f"graph==eager {r['same']} {r['why'] or ''}", flush=True)
    return rows


def insert_check(m) -> list:
    """The Triton q norm + RoPE + KV insert against the fork's PyTorch twin on this device:
    the cache bytes identical, q_out within one bf16 ulp (its RMS sum runs in another order),
    padding heads zero, slots < 0 untouched."""
    bad = []
    for T, H, P, bs in ((1, 8, 8, 64), (16, 16, 16, 64), (64, 8, 16, 256)):
        g = torch.Generator(device="cuda").manual_seed(T)
        q = (torch.randn(T, H, HEAD, device="cuda", generator=g) * 2).to(torch.bfloat16)
        kv = (torch.randn(T, HEAD, device="cuda", generator=g) * 3).to(torch.bfloat16)
        nb, stride = 2 * T // bs + 3, bs * 584 + 256
        flat = torch.randint(0, 256, ((nb - 1) * stride + bs * 584,), dtype=torch.uint8,
                             device="cuda", generator=g)
        slots = torch.randperm(nb * bs, device="cuda", generator=g)[:T]
        slots[T // 2] = -1
        pos = torch.randint(0, 8192, (T,), device="cuda", generator=g)
        pos_f = torch.arange(8192, device="cuda", dtype=torch.float32)
        freqs = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device="cuda").float() / ROPE))
        ang = pos_f[:, None] * freqs[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
        f1, f2 = flat.clone(), flat.clone()
        c1 = f1.as_strided((nb, bs, 584), (stride, 584, 1))
        c2 = f2.as_strided((nb, bs, 584), (stride, 584, 1))
        qa = m.attn.qnorm_rope_kv_insert(q, kv, c1, slots, pos, cos_sin, P, EPS, bs)
        qb = m.kvi.qnorm_rope_kv_insert_triton(q, kv, c2, slots, pos, cos_sin, P, EPS, bs)
        same_cache = bool(torch.equal(f1, f2))
        q_ok = bool(((qa.float() - qb.float()).abs() <= qa.float().abs() * 2**-8).all())
        print(f"KV insert check T={T} H={H} padded={P} bs={bs}: cache bytes identical "
              f"{same_cache}, q_out within 1 bf16 ulp {q_ok}, q_out bitwise "
              f"{bool(torch.equal(qa, qb))}", flush=True)
        if not (same_cache and q_ok):
            bad.append(("kv insert", T, H, P, bs))
        # the fused inverse RoPE (gfx936_fused_inv_rope) against the twin's rope_gptj
        o = (torch.randn(T, H, HEAD, device="cuda", generator=g) * 3).to(torch.bfloat16)
        twin = m.attn.rope_gptj(o.float(), pos, cos_sin, ROPE, inverse=True).to(torch.bfloat16)
        got = m.inv_rope(o, pos, cos_sin, ROPE)
        inv_ok = bool(((got.float() - twin.float()).abs() <= twin.float().abs() * 2**-7).all())
        print(f"inverse RoPE check T={T} H={H}: within 1 bf16 ulp {inv_ok}, bitwise "
              f"{bool(torch.equal(got, twin))}", flush=True)
        if not inv_ok:
            bad.append(("inv rope", T, H))
    return bad


def header(dev_name) -> str:
    return (f"# One DeepSeek V4 Flash decoder layer's decode step through the fork's ops "
            f"({dev_name})\n\nGenerated by `bench/layer_step.py` on {_dt.date.today()}; tier: H200 "
            f"(not gfx936). torch {torch.__version__}, triton {__import__('triton').__version__}. "
            "SWA layer kind (mHC, attention over the 128-token window, shared + routed experts); 4 "
            "layers with their own weights run back to back (cold weights) and the figures are per "
            "layer. Eager: mean of 10 back-to-back runs; graph: the 4 layers captured as one CUDA "
            "graph, mean of 20 replays; graph == eager: the replay's output equals the eager output "
            f"bitwise. Per token: x {LAYERS_PER_TOKEN} layers (the C4/C128 layers' compressor and "
            "indexer are not in this step). Paths: see the module docstring.\n")


def report(tp, rows) -> str:
    L = ["", f"## TP{tp} per-rank shapes ({HEADS} heads of 512, wo_a in {GROUPS} group(s), "
         f"shared expert {SHARED}, 256 experts of {MOE.inter}, top-6)", "",
         "| batch | path | launches / layer | eager us / layer | graph us / layer | graph == eager "
         "| eager ms / token (43 layers) | graph ms / token |", "|---|---|---|---|---|---|---|---|"]
    agree = []
    for b, res in rows:
        for name, r in res.items():
            ok = {True: "yes", False: "NO", None: f"not capturable: {r['why']}"}[r["same"]]
            L.append(f"| {b} | {name} | {r['launches']:.0f} | {r['eager_ms']*1e3:.0f} | "
                     f"{r['graph_ms']*1e3:.0f} | {ok} | {r['eager_ms']*LAYERS_PER_TOKEN:.1f} | "
                     f"{r['graph_ms']*LAYERS_PER_TOKEN:.1f} |")
        med, mx = res["kernels"]["vs_pytorch"]
        fm, fx = res["kernels + fused KV insert"]["vs_kernels"]
        agree.append(f"batch {b}: kernels vs pytorch median {med:.1e}, max {mx:.1e}; fused KV "
                     f"insert vs kernels median {fm:.1e}, max {fx:.1e}")
    L += ["", "Launches per layer by step part (batch: " + ", ".join(str(b) for b, _ in rows)
          + "; each part profiled on its own):", "",
          "| part | " + " | ".join(f"{p[0]} b={b}" for b, _ in rows for p in PATHS) + " |",
          "|---|" + "---|" * (len(PATHS) * len(rows))]
    names = list(rows[0][1]["kernels"]["parts"])
    for n in names:
        L.append(f"| {n} | " + " | ".join(
            str(res[p[0]]["parts"].get(n, 0)) for _, res in rows for p in PATHS) + " |")
    L += ["", "Paths compared after the 4 layers, per token ||a - b|| / ||b|| (same weights and "
          "inputs; BF16 roundings, "
          "other summation orders, and any near-tie the router breaks differently): "
          + "; ".join(agree) + "."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel-lib")
    ap.add_argument("--out")
    ap.add_argument("--tp", type=int, action="append", choices=sorted(TP_SHAPES),
                    help="per-rank shapes (default: 8 and 4)")
    ap.add_argument("--device-dir", default=str(REPO / ".device"),
                    help="where make bench-stage put the staged folders")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: one eager step of the PyTorch path at batch 1 and 2 (finite output)")
    a = ap.parse_args(argv)
    a.tp = a.tp or [8, 4]
    if a.smoke:
        m = load(None, smoke=True, device_dir=a.device_dir)
        for tp, b in ((8, 1), (4, 2)):
            set_tp(tp, smoke=True)
            L = Layer(m, b, "cpu", seed=11)
            r = (torch.randn(b, HC, HIDDEN) * 3).to(torch.bfloat16)
            out = step(m, L, r, kernels=False)
            ok = out.shape == r.shape and bool(torch.isfinite(out.float()).all())
            print(f"smoke TP{tp} b={b}: out {tuple(out.shape)} finite={ok}")
            if not ok:
                return 1
        return 0
    if not a.kernel_lib:
        ap.error("--kernel-lib build/kernels/_gfx936_C.so is required on the GPU")
    if not torch.cuda.is_available():
        print("layer_step: no GPU visible to torch; run it on the H200 tier (make bench)")
        return 0
    m = load(a.kernel_lib, device_dir=a.device_dir)
    md = header(torch.cuda.get_device_name())
    rows = []
    for tp in a.tp:
        set_tp(tp)
        r = measure(m, "cuda")
        rows += r
        md += report(tp, r)
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    bad = [(b, n) for b, res in rows for n, r in res.items()
           if r["same"] is False or not r["finite"] or (n != "pytorch" and r["same"] is None)]
    bad += insert_check(m)
    if bad:
        print(f"layer_step: FAIL: {bad} (kernels path must capture and replay == eager)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
