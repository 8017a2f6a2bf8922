# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One DeepSeek V4 Flash decoder layer's decode step, for each layer kind (SWA, C128, C4), through
the fork's own ops at per-rank TP8 / TP4 shapes, eagerly and replayed as CUDA graphs, on the GPU
torch sees (H200 tier; issue #19 item 6, issue #21 item 5): kernel launches per layer
(torch.profiler), us per layer on rotating inputs (back to back, and one cold-L2 replay beside the
timer floor), the per-token figure over 43 layers and over Flash's 43-layer mix, and every graph
replay checked against eager (bitwise: same kernels, same inputs).

The step is one table per kind, ``STEPS[kind]``: rows ``(name, part, op)`` in the order
``DeepseekV4DecoderLayer`` runs them on the gfx936 path (amd/gfx936_attention.py over
attention.py / compressor.py / the indexer, sequential as on ROCm, which has no aux streams):

    all kinds   mHC pre -> RMSNorm -> wqa+wkv [C128/C4: + compressor kv/score GEMM (bf16 in,
                fp32 out); C4: + indexer weights_proj + indexer compressor GEMM] -> q/kv RMSNorm
                -> wq_b -> q norm + RoPE + fp8_ds_mla KV insert (fused op)
    C4          indexer: wq_b -> q RoPE + quant (fused op) -> its compressor save + store (fused
                ops, head 128, FP8 indexer K cache) -> fill the top-k buffer -> paged logits ->
                top-k 512 (fused ops)
    C128 / C4   compressor save + store (fused ops: state cache, then compress + RMSNorm + RoPE +
                FP8 store into the fp8_ds_mla compressed cache, head 512)
    C4          the top-k's local indices -> global ragged slots (fused op: one launch, where
                upstream's amd/rocm.py Triton is two kernels around a torch cumsum)
    all kinds   Sparse MLA decode over the SWA window (128) [C128: + all ctx/128 compressed keys;
                C4: + the indexer's 512] -> inverse RoPE (fused op) + grouped wo_a -> wo_b ->
                mHC post -> mHC pre -> RMSNorm -> router -> shared expert (w13, clamped SwiGLU,
                w2) + routed MXFP4 experts -> add -> mHC post

Two paths, in one run:

* ``kernels``: what gfx936 runs with the csrc_gfx936 extension (``make kernels``): fused mHC
  (Triton), the W8A16 GEMV kernel for every FP8 linear (grouped wo_a included), the MXFP4 MoE
  kernel, the Sparse MLA decode kernel, and the registered fused ops (``gfx936_fused_*``: KV
  insert, inverse RoPE, compressor save/store, indexer q/logits/top-k) on their Triton kernels;
  the one-launch ops of issue 19: the shared expert's clamped SwiGLU (gfx936_swiglu_triton, one
  launch where ROCm's forward_native ran seven) and the q/kv RMSNorm pair (upstream's Triton
  ``_fused_q_kv_rmsnorm_kernel``, what ``gfx936_fused_q_kv_rmsnorm`` launches). STAND-INS
  (bench/layer_standins.py): ``attn_norm`` / ``ffn_norm`` and ``router`` run a one-launch
  Triton kernel where gfx936 launches vLLM's compiled ``_C.rms_norm`` /
  ``_moe_C.topk_softplus_sqrt`` (no build of them on the H200 stage): their launch counts are
  gfx936's, their time is the stand-ins'; the report lists them under each kind. The router
  row is the gate GEMM + the routing op (2 launches). The C4 top-k packing (``topk_ragged``)
  is ``gfx936_fused_topk_ragged_pack``'s kernel (gfx936_topk_ragged_triton, one launch).
* ``pytorch`` (today's step without the extension; unchanged by the ops above, which it runs
  as before: the RMSNorms as F.rms_norm, the q/kv twin, the torch router, clamped_swiglu
  rounded once): the torch mHC chain, W8A16 dequantized per
  call, the MXFP4 emulation, the Sparse MLA reference decode, and the same registered ops on
  their twins (``VLLM_GFX936_FUSED_OPS=torch``, through the staged tier stand-in); the MoE
  routing plan is built on the host (a sync: not capturable).

Inputs: ``--layers`` (4) layers with their own weights run back to back; ``--sets`` (4) input
sets, each with its own hidden states and its own caches for every layer (SWA window, state
caches, compressed and indexer K caches), rotate: the timed runs go set 0, 1, ..., back to back,
so no replay finds the previous one's inputs in L2 (weights: 4 layers' worth between two reads
of the same layer). ``cold``: one run (set 0) after a 256 MiB L2 flush with the device idle,
which includes the timer floor printed beside it (an empty graph replay, timed the same way).
The step's token sits at position ctx - 1 (``--ctx``, 8192), so it closes a C4 and a C128
window: the compressor stores do their full work (a FULL graph runs them every step; eager
vLLM skips them on steps that close none). The per-step metadata (slot mappings, block tables,
SWA and C128 ragged indices, seq lens) is built once per input set, outside the timed layers,
as vLLM builds it once per step for all layers; the C4 top-k packing is per layer and timed.

Adding an op (a fused RMSNorm, router, SwiGLU, packing, ...): write ``def op_x(c)`` reading and
setting the step's tensors on ``c`` (a :class:`Ctx`: ``c.kernels`` says which path, ``c.m`` the
staged modules, ``c.L`` the layer's weights, ``c.S`` the set's caches), stage its module (add
it to ``LAYER_ENTRIES`` in bench/stage.py) and put it in the table with :func:`use_op`, e.g.
``use_op("q_kv_norm", op_x, part="q/kv RMSNorm (fused op)")``, or edit ``STEPS`` directly.

    python bench/layer_step.py --kernel-lib build/kernels/_gfx936_C.so [--kind all] [--out x.md]
The CPU smoke (``--smoke``, with TRITON_INTERPRET=1) also runs each one-launch op on its kernels
path (interpreted) against its twin and counts its launches (:func:`one_launch_check`).

    python bench/layer_step.py --smoke        # CPU: every kind at TP8 and TP4, twins only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import os
import statistics
import sys
import time
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
HEAD, NOPE, ROPE, Q_LORA, O_LORA = 512, 448, 64, 1024, 1024
IDX_HEADS, IDX_DIM = 64, 128  # Flash's Lightning indexer: 64 heads of 128
WINDOW = 128  # SWA keys per query
KINDS = ("swa", "c128", "c4")
RATIO = {"swa": 0, "c128": 128, "c4": 4}
LOGICAL_BLOCK = 256  # tokens per KV block; the compressed caches hold 256 / ratio rows a block
IDX_BLOCK = LOGICAL_BLOCK // 4
# Flash's 43 layers: compress_ratios 0, 0, then 4 / 128 alternating (as the tiny model's 0, 0,
# 4, 128, 4): 2 SWA, 21 C4, 20 C128
LAYERS_PER_TOKEN = 43
MIX = {"swa": 2, "c4": 21, "c128": 20}
# per-rank shapes: local heads, wo_a groups, routed experts' config, shared expert intermediate
TP_SHAPES = {8: (8, 1, GK.MOE_TP8, 256), 4: (16, 2, GK.MOE_TP4, 512)}
HEADS, GROUPS, MOE, SHARED = TP_SHAPES[8]
TOPK, SCALING = 6, 1.5
# context (tokens; the step's token is at ctx - 1), the indexer's top-k, max_model_len (the
# indexer's logits width is max_model_len / 4 and its block table that wide, as in vLLM)
CTX, IDX_TOPK, MAX_LEN = 8192, 512, 65536
BATCHES = (1, 16, 64)
PATHS = (("kernels", True), ("pytorch", False))


def set_tp(tp: int, smoke: bool = False) -> None:
    """Per-rank shapes of ``tp``. The CPU smoke shrinks what the cache layouts leave free
    (hidden 512, LoRA ranks 256, 8 experts of 128, shared expert halved per TP): the
    emulation dequantizes every local expert and every FP8 weight per call."""
    import dataclasses

    global HEADS, GROUPS, MOE, SHARED, HIDDEN, Q_LORA, O_LORA
    HEADS, GROUPS, MOE, SHARED = TP_SHAPES[tp]
    HIDDEN, Q_LORA, O_LORA = 4096, 1024, 1024
    if smoke:
        HIDDEN, Q_LORA, O_LORA = 512, 256, 256
        MOE = dataclasses.replace(MOE, hidden=HIDDEN, inter=MOE.inter // 2, experts=8)
        SHARED //= 2


# the W8A16 GEMV's token limit (--gemv-max-m); None: the kernel module's graph default (4).
# The engine takes 16 when decode steps run eagerly (gfx936_kernel_select.w8a16_gemv_max_m).
GEMV_MAX_M = None
# the MoE direct path's token limit (--moe-direct-max-m); None: the engine's default (64)
MOE_DIRECT_MAX_M = None


def set_context(ctx: int, topk: int, max_len: int) -> None:
    global CTX, IDX_TOPK, MAX_LEN
    if ctx % 128 or ctx // 4 <= topk or max_len < ctx or max_len % LOGICAL_BLOCK:
        raise SystemExit(f"--ctx {ctx} must be a multiple of 128 with ctx/4 > the indexer's "
                         f"top-k {topk} (else vLLM takes every key, no indexer), and "
                         f"--max-model-len {max_len} >= ctx, a multiple of {LOGICAL_BLOCK}")
    CTX, IDX_TOPK, MAX_LEN = ctx, topk, max_len


def load(kernel_lib, smoke=False, device_dir=REPO / ".device"):
    """The staged modules. Each staged folder has its own ``vllm`` stub package, so the order
    matters: the Sparse MLA and dense/MoE stages load first, then ``.device/layer``'s package
    replaces theirs in ``sys.modules`` (the attention twins import from it at call time)."""
    d = Path(device_dir) / "layer"
    import stage  # the list of files the layer step needs (bench/stage.py, stdlib only)

    missing = [r for r in stage.LAYER_ENTRIES if not (d / "vllm" / r).is_file()]
    if not (d / "rocm_topk_ragged.py").is_file():
        missing.append("rocm_topk_ragged.py")
    if missing:
        raise SystemExit(f"{d} is not staged (or is stale: {', '.join(missing[:3])} missing): "
                         "run `make bench-stage` where vllm/ is applied")
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

    def mod(name):
        return importlib.import_module("vllm." + name)

    attn = mod("models.deepseek_v4.amd.gfx936_attention_torch")
    if not str(Path(attn.__file__).resolve()).startswith(str(d.resolve())):
        raise SystemExit(f"the attention twins came from {attn.__file__}, not {d}")
    ops = "models.deepseek_v4.common.ops."
    cf = mod(ops + "gfx936_compressor_fused")
    itk = mod("v1.attention.ops.gfx936_indexer_topk")
    try:  # Triton (the interpreter runs it on the CPU under TRITON_INTERPRET=1)
        ragged = mod(ops + "gfx936_topk_ragged_triton").topk_ragged_pack_triton
        ragged_up = importlib.import_module("rocm_topk_ragged")
        # the one-launch ops of issue 19: gfx936's shared-expert SwiGLU kernel, upstream's q/kv
        # RMSNorm kernel (what gfx936_fused_q_kv_rmsnorm launches), and the bench's one-launch
        # STAND-INS for _C.rms_norm / _moe_C.topk_softplus_sqrt (bench/layer_standins.py)
        swiglu = mod(ops + "gfx936_swiglu_triton").clamped_swiglu_triton
        qk_norm = mod("models.common.ops.fused_qk_rmsnorm").fused_q_kv_rmsnorm
        standins = importlib.import_module("layer_standins")
    except ImportError as e:
        if not smoke or e.name not in ("triton", "triton.language"):
            raise  # only a CPU without Triton may skip the kernels' checks
        print(f"note: the Triton kernels are not importable ({e})")
        ragged = ragged_up = swiglu = qk_norm = standins = None
    return types.SimpleNamespace(
        attn=attn, chain=chain, kern=kern, w8=w8, mx=mx, sw=sw, wk=wk, mk=mk, ref=ref,
        writer=writer, fast=fast, sel=mod("platforms.gfx936_kernel_select"),
        kv_insert=mod(ops + "gfx936_kv_insert").qnorm_rope_kv_insert_gfx936,
        save=cf.save_partial_states_gfx936, store=cf.compress_norm_rope_store_gfx936,
        index_q=mod(ops + "gfx936_indexer_q_fused").indexer_q_rope_quant_gfx936,
        logits=itk.paged_indexer_logits_gfx936, topk=itk.indexer_topk_gfx936,
        ragged_triton=ragged, ragged_upstream=None if ragged_up is None else
        ragged_up.compute_global_topk_ragged_indices_and_indptr,
        swiglu_triton=swiglu, q_kv_norm_triton=qk_norm, standins=standins,
        kvi=None if smoke else mod(ops + "gfx936_kv_insert_triton"),
        inv_rope=None if smoke else mod(ops + "gfx936_inv_rope").inv_rope_gfx936)


@contextlib.contextmanager
def tier(m, kernels: bool):
    """The registered fused ops on their Triton kernels (``kernels``) or on their twins, as
    ``VLLM_GFX936_FUSED_OPS=torch`` does (decided when each op is called, so at capture)."""
    m.sel.TIER.clear()
    if not kernels:
        m.sel.TIER["fused_ops"] = "torch"
    try:
        yield
    finally:
        m.sel.TIER.clear()


def _cos_sin(n, dev):
    pos = torch.arange(n, device=dev, dtype=torch.float32)
    freqs = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE))
    ang = pos[:, None] * freqs[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1)


class Layer:
    """One decoder layer's weights (random, fixed seeds), shared by every input set."""

    def __init__(self, m, kind, dev, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        sd = torch.uint8
        self.kind = kind

        def dense(n, k, s):
            return DM.Dense(n, k, dev, sd, seed=seed * 10 + s)

        def bf16(*shape, s=0.02):
            return (torch.randn(*shape, device=dev, generator=g) * s).to(torch.bfloat16)

        def norm(n):
            return 1 + 0.1 * torch.randn(n, device=dev, generator=g).to(torch.bfloat16)

        self.wqa_wkv = dense(Q_LORA + HEAD, HIDDEN, 1)
        self.wq_b = dense(HEADS * HEAD, Q_LORA, 2)
        self.wo_a = dense(GROUPS * O_LORA, HEADS * HEAD // GROUPS, 3)
        self.wo_b = dense(HIDDEN, GROUPS * O_LORA, 4)
        self.w13 = dense(2 * SHARED, HIDDEN, 5)
        self.w2 = dense(HIDDEN, SHARED, 6)
        self.moe = DM.MoE(MOE, dev, sd, seed=seed)
        self.gate = bf16(MOE.experts, HIDDEN)
        self.bias = torch.randn(MOE.experts, device=dev, generator=g) * 0.1
        self.norms = [norm(n) for n in (HIDDEN, Q_LORA, HEAD, HIDDEN)]
        n = HC * (2 + HC)
        self.mhc = [(torch.randn(n, HC * HIDDEN, device=dev, generator=g) * 0.02,
                     torch.rand(3, device=dev, generator=g) + 0.5,
                     torch.randn(n, device=dev, generator=g) * 0.5) for _ in range(2)]
        self.sink = torch.randn(HEADS, device=dev, generator=g)
        self.rotary = types.SimpleNamespace(cos_sin_cache=_cos_sin(CTX, dev))
        self.wo_a_mod = types.SimpleNamespace(weight=self.wo_a.weight,
                                              weight_scale_inv=self.wo_a.scale)
        # without the extension the twin keeps a BF16 copy of wo_a (dequantized once)
        self.wo_a_bf16 = types.SimpleNamespace(
            weight=self.wo_a.weight, weight_scale_inv=self.wo_a.scale,
            _gfx936_wo_a_bf16=m.w8.dequantize_fp8_block(
                self.wo_a.weight, self.wo_a.scale, DM.BLOCK).view(GROUPS, O_LORA, -1))

        def compressor(ratio, head):
            coff = 2 if ratio == 4 else 1  # C4 windows overlap the previous one
            # fused_wkv_wgate is unquantized (quant_config=None): bf16, fp32 GEMM output
            return types.SimpleNamespace(
                ratio=ratio, coff=coff, head=head, wkv_gate=bf16(2 * coff * head, HIDDEN),
                ape=torch.randn(ratio, coff * head, device=dev, generator=g), norm=norm(head),
                # (quant block, token stride, scale dim) of compressor.py
                quant=(64, NOPE + 2 * ROPE, NOPE // 64 + 1) if head == HEAD else (128, 128, 4))

        self.comp = compressor(RATIO[kind], HEAD) if RATIO[kind] else None
        if kind == "c4":
            self.idx_wq_b = dense(IDX_HEADS * IDX_DIM, Q_LORA, 7)
            self.idx_weights_proj = bf16(IDX_HEADS, HIDDEN)
            self.idx_comp = compressor(4, IDX_DIM)


def _compressor_state(cfg, b, dev, g):
    """A compressor's state cache (fp32 [blocks, bs, 2 * coff * head]: kv | score, random) with
    the block table of its sliding window and this step's slot."""
    bs = 4 if cfg.ratio == 4 else 8  # compressor.py: C4 state blocks of 4, C128 of 8
    need = -(-(cfg.coff * cfg.ratio) // bs) + 1
    nsb = b * need + 3
    state = torch.randn(nsb, bs, 2 * cfg.coff * cfg.head, device=dev, generator=g)
    bt = torch.zeros(b, CTX // bs, dtype=torch.int32, device=dev)
    last = (CTX - 1) // bs
    perm = torch.randperm(nsb, device=dev, generator=g)[: b * need].view(b, need)
    bt[:, last - need + 1: last + 1] = perm.to(torch.int32)
    slot = bt[:, last].to(torch.int64) * bs + (CTX - 1) % bs
    return types.SimpleNamespace(state=state, bt=bt, bs=bs, slot=slot)


class State:
    """One input set of one layer at batch ``b``: the SWA window (C.Inputs), and for C128/C4
    the compressor state caches, the compressed fp8_ds_mla cache (every row written), for C4
    the FP8 indexer K cache; the per-step metadata built once (vLLM: once per step)."""

    def __init__(self, m, L: Layer, b, dev, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.b = b
        self.inp = C.Inputs(C.Case("swa", batch=b, heads=HEADS, ctx=CTX), m.writer, dev,
                            seed=seed)
        self.positions = torch.full((b,), CTX - 1, dtype=torch.int64, device=dev)
        # the new token goes to the last slot of each request's window
        self.slots = self.inp.main_slots[:, -1].to(torch.int64).contiguous()
        self.req = torch.arange(b, dtype=torch.int32, device=dev)
        self.out = torch.empty(b, HEADS, HEAD, dtype=torch.bfloat16, device=dev)
        self.extra = None
        if L.comp is None:
            return
        r = L.comp.ratio
        self.comp = _compressor_state(L.comp, b, dev, g)
        cb, ncomp = LOGICAL_BLOCK // r, CTX // r
        per_req = -(-ncomp // cb)
        nblk = b * per_req + 3
        self.extra = C._alloc_cache(nblk, cb, None, dev, seed + 7)
        self.extra_bt = torch.randperm(nblk, device=dev, generator=g)[: b * per_req].view(
            b, per_req).to(torch.int32)
        c = torch.arange(ncomp, device=dev)
        slots = self.extra_bt[:, c // cb].to(torch.int64) * cb + c % cb  # [b, ncomp]
        m.writer.write_fp8_ds_mla(self.extra, C._random_k(b * ncomp, dev, g), slots.reshape(-1))
        self.comp.kv_slot = slots[:, (CTX - 1) // r].contiguous()  # the row this step closes
        if L.kind == "c128":  # every compressed key: dense + ragged indices (step metadata)
            self.c128_dense = slots.to(torch.int32).contiguous()
            self.c128_lens = torch.full((b,), ncomp, dtype=torch.int32, device=dev)
            self.c128_ragged = self.c128_dense.reshape(-1)
            self.c128_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * ncomp
            return
        # C4: the indexer's compressor state and its FP8 K cache (token-major [bs*128 e4m3 |
        # bs*4 fp32 scales] per block, random codes without NaN, power-of-two scales)
        self.idx_comp = _compressor_state(L.idx_comp, b, dev, g)
        per_req = -(-ncomp // IDX_BLOCK)
        nb = b * per_req + 2
        cache = torch.randint(0, 256, (nb, IDX_BLOCK, IDX_DIM + 4), dtype=torch.uint8,
                              device=dev, generator=g)
        flat = cache.view(nb, -1)
        codes = flat[:, : IDX_BLOCK * IDX_DIM]
        flat[:, : IDX_BLOCK * IDX_DIM] = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)
        scales = torch.pow(2.0, torch.randint(-12, 3, (nb, IDX_BLOCK), device=dev,
                                              generator=g).float())
        flat[:, IDX_BLOCK * IDX_DIM:] = scales.view(torch.uint8).view(nb, -1)
        self.idx_cache = cache
        self.idx_bt = torch.zeros(b, MAX_LEN // LOGICAL_BLOCK, dtype=torch.int32, device=dev)
        self.idx_bt[:, :per_req] = torch.randperm(nb, device=dev, generator=g)[
            : b * per_req].view(b, per_req).to(torch.int32)
        c = torch.tensor([(CTX - 1) // 4], device=dev)
        self.idx_comp.kv_slot = (self.idx_bt[:, c // IDX_BLOCK].to(torch.int64) * IDX_BLOCK
                                 + c % IDX_BLOCK).view(b).contiguous()
        self.seq_lens = torch.full((b,), ncomp, dtype=torch.int32, device=dev)  # compressed
        self.topk_buf = torch.empty(b, IDX_TOPK, dtype=torch.int32, device=dev)
        self.is_valid = torch.ones(b, dtype=torch.bool, device=dev)


# ---- the step: one table of ops per layer kind ---------------------------------------------
class Ctx:
    """What the ops of one step read and write: the path, the staged modules ``m``, the layer
    ``L``, the input set ``S``, and the step's tensors as attributes (``r``: the mHC residual
    [b, hc, hidden])."""

    def __init__(self, m, L, S, r, kernels):
        self.m, self.L, self.S, self.r, self.kernels = m, L, S, r, kernels
        self.b = r.shape[0]

    def lin(self, x, d):
        """An FP8 (block-scaled) linear: the W8A16 kernel (the GEMV up to GEMV_MAX_M tokens,
        dequantize + BLAS above), or dequantized per call."""
        if self.kernels:
            return self.m.wk.w8a16_block_mm_kernel(
                x, d.weight, d.scale, DM.BLOCK, torch.bfloat16,
                gemv_max_m=GEMV_MAX_M if GEMV_MAX_M is not None else self.m.wk.GEMV_MAX_M)
        return self.m.w8.w8a16_block_mm(x, d.weight, d.scale, DM.BLOCK)

    def mhc_pre(self, i):
        fn, s, base = self.L.mhc[i]
        m, r = self.m, self.r
        if self.kernels:
            mix, sq = m.kern.mhc_pre_mix_triton(r, fn, m.kern.mhc_pre_splits(self.b, HC * HIDDEN))
            return m.kern.mhc_pre_apply_triton(r, mix, sq, s, base, EPS, EPS, EPS, 2.0, SINKHORN)
        return m.chain.mhc_pre_torch(r, fn, s, base, EPS, EPS, EPS, 2.0, SINKHORN)

    def mhc_post(self, y):
        post = self.m.kern.mhc_post_triton_fused if self.kernels else self.m.chain.mhc_post_torch
        return post(y, self.r, self.p, self.c)


def _rms(x, w):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS).to(x.dtype)


def _mm_out_fp32(x, w):
    """attention.py's ``_mm_out_fp32`` (the compressor's kv/score GEMM: bf16 in, fp32 out)."""
    if x.is_cpu:
        return torch.mm(x.to(torch.float32), w.to(torch.float32).T)
    try:
        return torch.mm(x, w.T, out_dtype=torch.float32)
    except TypeError:  # a torch without mm(out_dtype=): say so, keep the step running
        if "mm" not in _NOTES:
            _NOTES.add("mm")
            print("note: torch.mm(out_dtype=) unavailable here: the compressor GEMMs run as "
                  "fp32 GEMMs (slower than the product's)")
        return torch.mm(x.to(torch.float32), w.to(torch.float32).T)


_NOTES: set[str] = set()


def op_mhc_pre_attn(c):
    c.p, c.c, c.x = c.mhc_pre(0)


def op_attn_norm(c):
    c.h = _rms(c.x, c.L.norms[0])


def op_wqa_wkv(c):
    c.qkv = c.lin(c.h, c.L.wqa_wkv)


def op_comp_gemm(c):
    c.kv_score = _mm_out_fp32(c.h, c.L.comp.wkv_gate)


def op_idx_weights_proj(c):
    c.idx_w = F.linear(c.h, c.L.idx_weights_proj)


def op_idx_comp_gemm(c):
    c.idx_kv_score = _mm_out_fp32(c.h, c.L.idx_comp.wkv_gate)


def op_q_kv_norm(c):
    c.qr, c.kv = c.m.attn.q_kv_rmsnorm(c.qkv[:, :Q_LORA], c.qkv[:, Q_LORA:], c.L.norms[1],
                                       c.L.norms[2], EPS)


def op_wq_b(c):
    c.q = c.lin(c.qr, c.L.wq_b).view(c.b, HEADS, HEAD)


def op_kv_insert(c):
    S = c.S
    c.q = c.m.kv_insert(c.q, c.kv, S.inp.main, S.slots, S.positions,
                        c.L.rotary.cos_sin_cache, HEADS, EPS, S.inp.main.shape[1])


def _save(c, cfg, st, kv_score):
    kv, score = kv_score.split([cfg.coff * cfg.head, cfg.coff * cfg.head], dim=-1)
    c.m.save(kv=kv, score=score, ape=cfg.ape, positions=c.S.positions, state_cache=st.state,
             slot_mapping=st.slot, block_size=st.bs, state_width=st.state.shape[-1] // 2,
             compress_ratio=cfg.ratio)


def _store(c, cfg, st, kv_cache):
    qb, ts, sd = cfg.quant
    c.m.store(state_cache=st.state, num_actual=c.b, token_to_req_indices=c.S.req,
              positions=c.S.positions, slot_mapping=st.slot, block_table=st.bt,
              block_size=st.bs, state_width=st.state.shape[-1] // 2,
              cos_sin_cache=c.L.rotary.cos_sin_cache, kv_cache=kv_cache,
              k_cache_metadata=types.SimpleNamespace(slot_mapping=st.kv_slot), pdl_kwargs={},
              head_dim=cfg.head, rope_head_dim=ROPE, compress_ratio=cfg.ratio,
              overlap=cfg.ratio == 4, use_fp4_cache=False, rms_norm_weight=cfg.norm,
              rms_norm_eps=EPS, quant_block=qb, token_stride=ts, scale_dim=sd)


def op_comp_save(c):
    _save(c, c.L.comp, c.S.comp, c.kv_score)


def op_comp_store(c):
    _store(c, c.L.comp, c.S.comp, c.S.extra)


def op_idx_wq_b(c):
    c.idx_q = c.lin(c.qr, c.L.idx_wq_b).view(c.b, IDX_HEADS, IDX_DIM)


def op_idx_q(c):
    c.idx_codes, c.idx_wts = c.m.index_q(c.S.positions, c.idx_q, c.L.rotary.cos_sin_cache,
                                         c.idx_w, IDX_DIM ** -0.5, IDX_HEADS ** -0.5)


def op_idx_comp_save(c):
    _save(c, c.L.idx_comp, c.S.idx_comp, c.idx_kv_score)


def op_idx_comp_store(c):
    _store(c, c.L.idx_comp, c.S.idx_comp, c.S.idx_cache)


def op_idx_logits(c):
    S = c.S
    S.topk_buf.fill_(-1)  # gfx936_sparse_attn_indexer: topk_indices_buffer[:T] = -1
    c.idx_logits = c.m.logits(c.idx_codes.view(torch.uint8).view(c.b, 1, IDX_HEADS, IDX_DIM),
                              c.idx_wts, S.idx_cache, S.idx_bt, S.seq_lens, MAX_LEN // 4)


def op_idx_topk(c):
    c.m.topk(c.idx_logits, c.S.seq_lens, 1, IDX_TOPK, c.S.topk_buf)


def op_topk_ragged(c):
    S = c.S
    pack = (c.m.ragged_triton if c.kernels else
            c.m.attn.compute_global_topk_ragged_indices_and_indptr)
    c.topk_ragged, c.topk_indptr, c.topk_lens = pack(
        S.topk_buf, S.req, S.extra_bt, LOGICAL_BLOCK // 4, S.is_valid)


def mla_kwargs(c) -> dict:
    """``rocm_sparse_attn_decode``'s arguments as gfx936_attention.py passes them."""
    S, i = c.S, c.S.inp
    kw = dict(q=c.q, kv_cache=S.extra, swa_k_cache=i.main, swa_only=S.extra is None,
              topk_indices=None, topk_lens=None, swa_indices=i.main_slots, swa_lens=i.main_lens,
              swa_ragged_indices=i.main_ragged, swa_ragged_indptr=i.main_indptr,
              topk_ragged_indices=None, topk_ragged_indptr=None, attn_sink=c.L.sink,
              scale=HEAD ** -0.5, head_dim=HEAD, nope_head_dim=NOPE, rope_head_dim=ROPE,
              output=S.out)
    if c.L.kind == "c128":
        kw.update(topk_indices=S.c128_dense, topk_lens=S.c128_lens,
                  topk_ragged_indices=S.c128_ragged, topk_ragged_indptr=S.c128_indptr)
    elif c.L.kind == "c4":
        kw.update(topk_lens=c.topk_lens, topk_ragged_indices=c.topk_ragged,
                  topk_ragged_indptr=c.topk_indptr)
    return kw


def op_sparse_mla(c):
    kw = mla_kwargs(c)
    if c.kernels:
        c.m.fast.sparse_mla_decode_kernel(**kw)
    else:  # as gfx936_sparse_mla_dispatch runs the reference: the ragged rows' capacity
        if kw["topk_ragged_indices"] is not None:
            kw["topk_ragged_width"] = kw["topk_ragged_indices"].numel() // c.b
        c.m.ref.rocm_sparse_attn_decode_reference(**kw)
    c.o = c.S.out


def op_wo_a(c):
    c.z = c.m.attn.inv_rope_einsum(c.L.rotary, c.o, c.S.positions, ROPE, GROUPS, O_LORA,
                                   c.L.wo_a_mod if c.kernels else c.L.wo_a_bf16)


def op_wo_b(c):
    c.y = c.lin(c.z.reshape(c.b, -1), c.L.wo_b)


def op_mhc_post_attn(c):
    c.r = c.mhc_post(c.y)


def op_mhc_pre_ffn(c):
    c.p, c.c, c.x = c.mhc_pre(1)


def op_ffn_norm(c):
    c.h = _rms(c.x, c.L.norms[3])


def op_router(c):
    scores = torch.sqrt(F.softplus(F.linear(c.h, c.L.gate).float()))
    c.ids = torch.topk(scores + c.L.bias, TOPK, dim=-1).indices
    wts = scores.gather(1, c.ids)
    c.wts = wts / wts.sum(-1, keepdim=True) * SCALING


def op_shared_w13(c):
    c.sh = c.lin(c.h, c.L.w13)


def op_swiglu(c):
    c.sh = c.m.sw.clamped_swiglu(c.sh, 10.0, 1.0)


def op_shared_w2(c):
    c.shared = c.lin(c.sh, c.L.w2)


def op_routed(c):
    L, h, m = c.L, c.h, c.m
    if c.kernels:
        c.routed = torch.empty_like(h)
        limit = {} if MOE_DIRECT_MAX_M is None else {"direct_max_m": MOE_DIRECT_MAX_M}
        m.mk.mxfp4_moe_kernel(c.routed, h, L.moe.w13, L.moe.s13, L.moe.w2, L.moe.s2, c.wts,
                              c.ids.to(torch.int32), None, 1.0, 10.0, False, **limit)
        return
    # the emulation's routing plan is built on the host (one sync)
    ids_h, wts_h = c.ids.cpu(), c.wts.cpu()
    plan = []
    for ex in ids_h.unique().tolist():
        tok, slot = (ids_h == ex).nonzero(as_tuple=True)
        plan.append((ex, tok.to(h.device), wts_h[tok, slot].to(h.device)))
    c.routed = DM.moe_product(m.mx, m.sw, L.moe, h, plan)


def op_moe_add(c):
    c.y = c.shared + c.routed


def op_mhc_post_ffn(c):
    c.r = c.mhc_post(c.y)


P_MHC = "mHC pre + post (x2)"
P_NORM = "RMSNorm (x2, torch twin)"
P_FP8 = "FP8 linears (W8A16: wqa+wkv, wq_b, wo_b, shared w13/w2; C4: indexer wq_b)"
P_COMP_GEMM = "compressor kv/score GEMMs (bf16, fp32 out; C4: x2)"
P_COMP = "compressor save + store (fused ops; C4: x2)"
P_IDX = "indexer weights_proj + q + fill + logits + top-k (fused ops)"
_ATTN_IN = [("mhc_pre_attn", P_MHC, op_mhc_pre_attn), ("attn_norm", P_NORM, op_attn_norm),
            ("wqa_wkv", P_FP8, op_wqa_wkv)]
_ATTN_QKV = [("q_kv_norm", "q/kv RMSNorm (twin)", op_q_kv_norm), ("wq_b", P_FP8, op_wq_b),
             ("kv_insert", "q norm + RoPE + fp8_ds_mla KV insert (fused op)", op_kv_insert)]
_ATTN_OUT = [("sparse_mla", "Sparse MLA decode", op_sparse_mla),
             ("wo_a", "inverse RoPE (fused op) + grouped wo_a", op_wo_a),
             ("wo_b", P_FP8, op_wo_b), ("mhc_post_attn", P_MHC, op_mhc_post_attn)]
_FFN = [("mhc_pre_ffn", P_MHC, op_mhc_pre_ffn), ("ffn_norm", P_NORM, op_ffn_norm),
        ("router", "router (torch twin)", op_router), ("shared_w13", P_FP8, op_shared_w13),
        ("swiglu", "shared clamped SwiGLU (torch)", op_swiglu),
        ("shared_w2", P_FP8, op_shared_w2), ("routed", "routed MXFP4 experts", op_routed),
        ("moe_add", "shared + routed add", op_moe_add), ("mhc_post_ffn", P_MHC, op_mhc_post_ffn)]
_COMP = [("comp_save", P_COMP, op_comp_save), ("comp_store", P_COMP, op_comp_store)]
STEPS = {
    "swa": _ATTN_IN + _ATTN_QKV + _ATTN_OUT + _FFN,
    "c128": _ATTN_IN + [("comp_gemm", P_COMP_GEMM, op_comp_gemm)] + _ATTN_QKV + _COMP
    + _ATTN_OUT + _FFN,
    "c4": _ATTN_IN + [("comp_gemm", P_COMP_GEMM, op_comp_gemm),
                      ("idx_weights_proj", P_IDX, op_idx_weights_proj),
                      ("idx_comp_gemm", P_COMP_GEMM, op_idx_comp_gemm)] + _ATTN_QKV
    + [("idx_wq_b", P_FP8, op_idx_wq_b), ("idx_q", P_IDX, op_idx_q),
       ("idx_comp_save", P_COMP, op_idx_comp_save),
       ("idx_comp_store", P_COMP, op_idx_comp_store),
       ("idx_logits", P_IDX, op_idx_logits), ("idx_topk", P_IDX, op_idx_topk)] + _COMP
    + [("topk_ragged", "C4 top-k -> global ragged slots (fused op)", op_topk_ragged)]
    + _ATTN_OUT + _FFN,
}


def use_op(name: str, op, part: str | None = None, kinds=KINDS) -> None:
    """Replace the op ``name`` in the step table of ``kinds`` (and its part label)."""
    found = False
    for k in kinds:
        for i, (n, p, _) in enumerate(STEPS[k]):
            if n == name:
                STEPS[k][i] = (n, part or p, op)
                found = True
    if not found:
        raise KeyError(f"no op {name!r} in STEPS[{kinds}]")


# ---- the one-launch ops of issue 19 (kernels path; the pytorch path keeps today's step) ----
# gfx936 runs each as ONE launch. Two are the product's kernels: the shared expert's clamped
# SwiGLU (gfx936_swiglu_triton.py; today 7 eager launches) and the q/kv RMSNorm pair (upstream's
# _fused_q_kv_rmsnorm_kernel, what gfx936_fused_q_kv_rmsnorm launches). Two are STAND-INS
# (bench/layer_standins.py): gfx936 launches vLLM's compiled _C.rms_norm and
# _moe_C.topk_softplus_sqrt, which the H200 stage has no build of; each stand-in is one Triton
# launch too, so the launch count is gfx936's and the time is the stand-in's.
STANDIN_ROWS = {"attn_norm": "_C.rms_norm", "ffn_norm": "_C.rms_norm",
                "router": "_moe_C.topk_softplus_sqrt"}
SWIGLU_LIMIT, SWIGLU_ALPHA, SWIGLU_BETA = 10.0, 1.0, 0.0  # SiluAndMulWithClamp(swiglu_limit)


def _one_launch_norm(i, twin):
    def op(c):
        if not c.kernels:
            return twin(c)
        c.h = c.m.standins.rms_norm_standin(c.x, c.L.norms[i], EPS)
    return op


def op_q_kv_norm_fused(c):
    if not c.kernels:
        return op_q_kv_norm(c)
    c.qr, c.kv = c.m.q_kv_norm_triton(c.qkv[:, :Q_LORA], c.qkv[:, Q_LORA:], c.L.norms[1],
                                      c.L.norms[2], EPS)


def op_router_fused(c):
    if not c.kernels:
        return op_router(c)
    # the gate GEMM (bf16 logits, one launch), then the routing op (one launch)
    c.wts, c.ids = c.m.standins.topk_softplus_sqrt_standin(F.linear(c.h, c.L.gate), c.L.bias,
                                                          TOPK, SCALING)


def op_swiglu_fused(c):
    if not c.kernels:
        return op_swiglu(c)
    c.sh = c.m.swiglu_triton(c.sh, SWIGLU_LIMIT, SWIGLU_ALPHA, SWIGLU_BETA)


use_op("attn_norm", _one_launch_norm(0, op_attn_norm),
       part="RMSNorm (x2; kernels: Triton STAND-IN for _C.rms_norm, 1 launch)")
use_op("ffn_norm", _one_launch_norm(3, op_ffn_norm),
       part="RMSNorm (x2; kernels: Triton STAND-IN for _C.rms_norm, 1 launch)")
use_op("q_kv_norm", op_q_kv_norm_fused,
       part="q/kv RMSNorm (kernels: upstream's Triton _fused_q_kv_rmsnorm_kernel)")
use_op("router", op_router_fused,
       part="router: gate GEMM + top-k (kernels: Triton STAND-IN for "
            "_moe_C.topk_softplus_sqrt, 1 launch)")
use_op("swiglu", op_swiglu_fused,
       part="shared clamped SwiGLU (kernels: gfx936 Triton, 1 launch)")


class Parts:
    """Kernel launches per step part: when ``on``, each op runs under its own torch.profiler
    and its CUDA kernels are added to ``counts[part]``."""

    on = False
    counts: dict[str, int] = {}

    @classmethod
    def part(cls, name):
        if not cls.on:
            return contextlib.nullcontext()
        return cls._count(name)

    @classmethod
    @contextlib.contextmanager
    def _count(cls, name):
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        cls.counts[name] = cls.counts.get(name, 0) + n


def step(m, L: Layer, S: State, r, kernels: bool):
    """One decode step of the layer on the mHC residual ``r`` [b, hc, hidden] (bf16)."""
    c = Ctx(m, L, S, r, kernels)
    for _, part, op in STEPS[L.kind]:
        with Parts.part(part):
            op(c)
    return c.r


# ---- timing --------------------------------------------------------------------------------
class Clock:
    """Device time on the GPU (CUDA events; 256 MiB read before a cold run), wall time on the
    CPU (the smoke exercises the same code)."""

    def __init__(self, dev):
        self.cuda = torch.device(dev).type == "cuda"
        self.flush = (torch.empty(64 << 20, dtype=torch.float32, device=dev).uniform_()
                      if self.cuda else None)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def b2b(self, fns, rounds, warm=True) -> float:
        """ms per call of ``fns`` run back to back in rotation, ``rounds`` times (on the GPU
        after one warm-up rotation unless ``warm`` is False)."""
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(rounds):
                for f in fns:
                    f()
            return (time.perf_counter() - t) * 1e3 / (rounds * len(fns))
        for f in fns if warm else ():
            f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(rounds):
            for f in fns:
                f()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / (rounds * len(fns))

    def cold(self, fn, reps) -> float:
        """Median ms of one call after an L2 flush, the device idle (includes the timer's
        floor: its own events and the launch of the first kernel)."""
        times = []
        for _ in range(reps):
            if not self.cuda:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
                continue
            self.flush.sum()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)


def timer_floor(clock) -> dict:
    """An empty CUDA graph's replay timed as the step's replays are (one kernel when torch
    will not replay an empty graph): what every 'cold' figure includes."""
    import warnings

    what = "empty graph"
    g = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.cuda.graph(g):
                pass
        g.replay()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - fall back to the smallest non-empty graph
        what = "one-kernel graph"
        t = torch.zeros(1, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            t.add_(1)
    return {"what": what, "b2b_us": clock.b2b([g.replay], 200) * 1e3,
            "cold_us": clock.cold(g.replay, 50) * 1e3}


def count_kernels(fn, warm=True) -> int:
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(m, kind, dev, batches, layers=4, sets=4, rounds=5, log=print, deadline=None):
    """Rows (batch, {path: result}) of one layer kind at the current TP shapes; batches not
    started by ``deadline`` (time.time()) are left out (and said so)."""
    clock = Clock(dev)
    rows = []
    for b in batches:
        t0 = time.time()
        if deadline is not None and t0 > deadline:
            log(f"{kind} b={b}: SKIPPED (--time-limit reached)")
            continue
        Ls = [Layer(m, kind, dev, seed=11 + i) for i in range(layers)]
        Ss = [[State(m, L, b, dev, seed=1000 * (s + 1) + i) for i, L in enumerate(Ls)]
              for s in range(sets)]
        g = torch.Generator(device=dev).manual_seed(b)
        r0 = [(torch.randn(b, HC, HIDDEN, device=dev, generator=g) * 3).to(torch.bfloat16)
              for _ in range(sets)]
        res = {}
        for name, kernels in PATHS:
            if not clock.cuda and kernels:
                continue  # the CPU smoke: twins only

            def run(s, kernels=kernels):
                r = r0[s]
                for L, S in zip(Ls, Ss[s]):
                    r = step(m, L, S, r, kernels)
                return r
            runs = [lambda s=s: run(s) for s in range(sets)]
            # the twins: 10-100x slower; fewer repetitions, two sets rotate, no capture (the
            # bench's host-side routing plan for the MXFP4 emulation is a host sync)
            heavy = not kernels
            if heavy:
                runs = runs[:2]
            with tier(m, kernels):
                eager_out = [f() for f in (runs[:1] if heavy else runs)]
                launches = (count_kernels(runs[0], warm=not heavy) / layers
                            if clock.cuda else None)
                eager = clock.b2b(runs, 1 if heavy else rounds, warm=not heavy) / layers
                eager_cold = clock.cold(runs[0], 1 if heavy or not clock.cuda else 5) / layers
                graph = graph_cold = float("nan")
                same, why, diff = None, "CPU: no graphs", None
                if clock.cuda and heavy:
                    why = "not attempted: the MoE emulation's routing plan is a host sync"
                elif clock.cuda:
                    replays, graphs, static = [], [], []
                    for s in range(sets):
                        out = {}

                        def cap(s=s, out=out):
                            out["o"] = run(s)
                        replay, why, gr = C.capture(cap)
                        if replay is None:
                            break
                        replays.append(replay)
                        graphs.append(gr)
                        static.append(out)
                    if len(replays) == sets:
                        for rp in replays:
                            rp()
                        torch.cuda.synchronize()
                        same = all(torch.equal(o["o"], e) for o, e in zip(static, eager_out))
                        diff = max(float((o["o"].float() - e.float()).abs().max())
                                   for o, e in zip(static, eager_out))
                        graph = clock.b2b(replays, 4 * rounds) / layers
                        graph_cold = clock.cold(replays[0], 10) / layers
                    del replays, graphs, static
                if clock.cuda:
                    Parts.on, Parts.counts = True, {}
                    step(m, Ls[0], Ss[0][0], r0[0], kernels)
                    Parts.on = False
            finite = all(bool(torch.isfinite(o.float()).all()) for o in eager_out)
            res[name] = dict(parts=dict(Parts.counts) if clock.cuda else {}, launches=launches,
                             eager_ms=eager, eager_cold_ms=eager_cold, graph_ms=graph,
                             graph_cold_ms=graph_cold, same=same, why=why, diff=diff,
                             finite=finite, out=eager_out[0].float().reshape(b, -1))
            Parts.counts = {}
            if clock.cuda:
                torch.cuda.empty_cache()
        if len(res) == 2:  # the paths compute the same layers (informative)
            a, p = res["kernels"]["out"], res["pytorch"]["out"]
            d = (a - p).norm(dim=-1) / p.norm(dim=-1)
            res["kernels"]["vs_pytorch"] = (float(d.median()), float(d.max()))
        for r in res.values():
            r.pop("out")
        rows.append((b, res))
        for name, r in res.items():
            lt = "n/a" if r["launches"] is None else f"{r['launches']:.0f}"
            log(f"{kind} b={b} {name}: {lt} launches/layer, eager {r['eager_ms']*1e3:.0f} us "
                f"(cold {r['eager_cold_ms']*1e3:.0f}), graph {r['graph_ms']*1e3:.0f} us (cold "
                f"{r['graph_cold_ms']*1e3:.0f}), graph==eager {r['same']} "
                f"{r['why'] or ''} finite {r['finite']} [{time.time() - t0:.0f} s]")
        del Ls, Ss
    return rows


# ---- report --------------------------------------------------------------------------------
def _us(x):
    return "n/a" if x is None or x != x else f"{x * 1e3:.0f}"


def _ms(x, n=LAYERS_PER_TOKEN):
    return "n/a" if x is None or x != x else f"{x * n:.1f}"


def header(dev_name, floor, args) -> str:
    import triton
    f = (f"timer floor ({floor['what']} replay): {floor['b2b_us']:.1f} us back to back, "
         f"{floor['cold_us']:.1f} us cold" if floor else "timer floor: n/a")
    return (f"# One DeepSeek V4 Flash decoder layer's decode step per layer kind through the "
            f"fork's ops ({dev_name})\n\nGenerated by `bench/layer_step.py` on "
            f"{_dt.date.today()}; tier: H200 (not gfx936). torch {torch.__version__}, triton "
            f"{triton.__version__}. ctx {CTX} tokens (the step's token at {CTX - 1}: it closes "
            f"a C4 and a C128 window), C4: {CTX // 4} compressed keys, indexer top-k "
            f"{IDX_TOPK}; C128: {CTX // 128} compressed keys; max_model_len {MAX_LEN}. "
            f"{args.layers} layers with their own weights run back to back, {args.sets} input "
            "sets (hidden states and every cache) rotate; figures per layer. eager / graph: "
            "back to back over the rotating sets (mean); cold: one run of set 0 after a "
            "256 MiB L2 flush, the device idle (median; includes the timer floor). graph == "
            "eager: every set's replay output equals its eager output bitwise. Per token: x "
            f"{LAYERS_PER_TOKEN} layers of the kind; the mix table: 2 SWA + 21 C4 + 20 C128. "
            f"Paths and step tables: see the module docstring. {f}.\n")


def report(tp, kind, rows) -> str:
    L = ["", f"## {kind.upper()} layer, TP{tp} per-rank shapes ({HEADS} heads of 512, wo_a in "
         f"{GROUPS} group(s), hidden {HIDDEN}, shared expert {SHARED}, {MOE.experts} experts of "
         f"{MOE.inter}, top-6)", "",
         "| batch | path | launches / layer | eager us | eager cold us | graph us | graph cold "
         "us | graph == eager | eager ms / token (x43) | graph ms / token (x43) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for b, res in rows:
        for name, r in res.items():
            ok = {True: "yes", False: f"NO (max abs diff {r['diff']})",
                  None: f"not capturable: {r['why']}"}[r["same"]]
            lt = "n/a" if r["launches"] is None else f"{r['launches']:.0f}"
            L.append(f"| {b} | {name} | {lt} | {_us(r['eager_ms'])} | "
                     f"{_us(r['eager_cold_ms'])} | {_us(r['graph_ms'])} | "
                     f"{_us(r['graph_cold_ms'])} | {ok} | {_ms(r['eager_ms'])} | "
                     f"{_ms(r['graph_ms'])} |")
    names = list(dict.fromkeys(n for _, res in rows for r in res.values() for n in r["parts"]))
    if names:
        paths = list(rows[0][1])
        L += ["", "Launches per layer by step part (each op profiled on its own):", "",
              "| part | " + " | ".join(f"{p} b={b}" for b, _ in rows for p in paths) + " |",
              "|---|" + "---|" * (len(paths) * len(rows))]
        for n in names:
            L.append(f"| {n} | " + " | ".join(
                str(res[p]["parts"].get(n, 0)) for _, res in rows for p in paths) + " |")
    stand = [f"{n} ({p})" for n, p, _ in STEPS[kind] if n in STANDIN_ROWS]
    if stand:
        L += ["", "STAND-IN rows of the kernels path (gfx936 launches vLLM's compiled op, which "
              "the H200 stage has no build of; each stand-in is one Triton launch as gfx936's "
              "op is, so the launch counts are gfx936's, the time is the stand-in's; "
              "bench/layer_standins.py): " + "; ".join(stand) + "."]
    agree = [f"batch {b}: median {res['kernels']['vs_pytorch'][0]:.1e}, max "
             f"{res['kernels']['vs_pytorch'][1]:.1e}" for b, res in rows
             if "vs_pytorch" in res.get("kernels", {})]
    if agree:
        L += ["", "kernels vs pytorch after the layers, per token ||a - b|| / ||b|| (BF16 "
              "roundings, other summation orders, a near-tie the router or the indexer's top-k "
              "breaks differently): " + "; ".join(agree) + "."]
    return "\n".join(L) + "\n"


def mix_report(results) -> str:
    """Flash's 43-layer token: 2 SWA + 21 C4 + 20 C128, where every kind was measured."""
    L = ["", "## Per token, Flash's 43-layer mix (2 SWA + 21 C4 + 20 C128)", "",
         "| TP | batch | path | launches / token | eager ms / token | graph ms / token |",
         "|---|---|---|---|---|---|"]
    for tp, by_kind in results.items():
        per = {k: dict(by_kind.get(k, [])) for k in KINDS}  # kind -> batch -> {path: result}
        for b in sorted(set.intersection(*(set(v) for v in per.values()))):
            for name in per["swa"][b]:
                rs = {k: per[k][b].get(name) for k in KINDS}
                if any(r is None for r in rs.values()):
                    continue

                def tot(key, rs=rs):
                    v = [rs[k][key] for k in KINDS]
                    if any(x is None or x != x for x in v):
                        return float("nan")
                    return sum(MIX[k] * rs[k][key] for k in KINDS)
                lt = tot("launches")
                L.append(f"| {tp} | {b} | {name} | {'n/a' if lt != lt else f'{lt:.0f}'} | "
                         f"{_ms(tot('eager_ms'), 1)} | {_ms(tot('graph_ms'), 1)} |")
    return "\n".join(L) + "\n" if len(L) > 5 else ""


def insert_check(m) -> list:
    """The Triton q norm + RoPE + KV insert against the fork's PyTorch twin on this device:
    the cache bytes identical, q_out within one bf16 ulp (its RMS sum runs in another order),
    padding heads zero, slots < 0 untouched; the fused inverse RoPE within one bf16 ulp."""
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
        cos_sin = _cos_sin(8192, "cuda")
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
        o = (torch.randn(T, H, HEAD, device="cuda", generator=g) * 3).to(torch.bfloat16)
        twin = m.attn.rope_gptj(o.float(), pos, cos_sin, ROPE, inverse=True).to(torch.bfloat16)
        got = m.inv_rope(o, pos, cos_sin, ROPE)
        inv_ok = bool(((got.float() - twin.float()).abs() <= twin.float().abs() * 2**-7).all())
        print(f"inverse RoPE check T={T} H={H}: within 1 bf16 ulp {inv_ok}, bitwise "
              f"{bool(torch.equal(got, twin))}", flush=True)
        if not inv_ok:
            bad.append(("inv rope", T, H))
    return bad


# ---- CPU smoke -----------------------------------------------------------------------------
def decode_contract(m, args) -> bool:
    """The C128 / C4 decode arguments this bench builds (``mla_kwargs``) through the csrc
    kernel's launcher checks (``prepare``: the widths it reads), and through the fork's Triton
    decode twin (same launcher contract, interpreted on the CPU) against the reference decode:
    max |diff| <= 2e-2 x max |ref| (the Triton twin rounds its dot operands to bf16, as
    upstream's decode does; docs/bench/sparse-mla-fast-decode-h200.md measured <= 3.5e-3)."""
    _, tri, note = C.load_fast(Path(args.device_dir) / "sparse_mla", None)
    if tri is None or m.fast is None:
        print(f"smoke decode contract: skipped (Triton decode twin not importable: {note})")
        return True
    names = ("q", "kv_cache", "swa_k_cache", "swa_only", "topk_indices", "topk_lens",
             "swa_indices", "swa_lens", "swa_ragged_indices", "swa_ragged_indptr",
             "topk_ragged_indices", "topk_ragged_indptr", "attn_sink", "head_dim",
             "nope_head_dim", "rope_head_dim", "output")
    ok = True
    for kind, width in (("c128", CTX // 128), ("c4", IDX_TOPK)):
        L = Layer(m, kind, "cpu", seed=3)
        S = State(m, L, 2, "cpu", seed=5)
        c = Ctx(m, L, S, (torch.randn(2, HC, HIDDEN) * 3).to(torch.bfloat16), False)
        for name, _, op in STEPS[kind]:
            if name == "sparse_mla":
                break
            op(c)
        kw = mla_kwargs(c)
        main, extra, _ = m.fast.prepare(**{k: kw[k] for k in names})
        tri.sparse_mla_decode_triton(**kw)
        got = kw["output"].float().clone()
        kw["output"] = torch.empty_like(kw["output"])
        if kw["topk_ragged_indices"] is not None:
            kw["topk_ragged_width"] = kw["topk_ragged_indices"].numel() // 2
        m.ref.rocm_sparse_attn_decode_reference(**kw)
        ref = kw["output"].float()
        err = float((got - ref).abs().max())
        good = (main.width == WINDOW and extra is not None and extra.width == width
                and bool(torch.isfinite(got).all()) and err <= 2e-2 * float(ref.abs().max()))
        print(f"smoke {kind} decode arguments: launcher widths {main.width}+"
              f"{extra.width if extra is not None else 0}, Triton twin vs reference max diff "
              f"{err:.2e}: {good}")
        ok = ok and good
    return ok


def _rms_ir(x, w):
    """vllm/ir/ops/layernorm.py's native rms_norm (the CPU implementation of the op gfx936 runs
    as _C.rms_norm), line for line: the twin of the RMSNorm stand-in."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return (xf.to(w.dtype) * w).to(x.dtype)


class _Launches:
    """Launches of a call on the CPU, counted as the GPU's profiler would see them: Triton
    kernel launches (the interpreter's launcher) plus the aten ops that run a kernel (the
    dispatcher; allocations, views and metadata excluded)."""

    FREE = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view",
            "as_strided", "slice", "select", "reshape", "t", "transpose", "expand", "detach",
            "alias", "unsqueeze", "squeeze", "split", "split_with_sizes", "permute",
            "lift_fresh", "is_same_size", "sym_size", "sym_stride", "sym_numel"}

    def __init__(self):
        self.ops: list[str] = []

    def __call__(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction

        ops, run, inside = self.ops, InterpretedFunction.run, []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if not inside and name not in _Launches.FREE:
                    ops.append(name)
                return func(*args, **(kwargs or {}))

        def counted(self_, *a, **k):
            ops.append("triton:" + self_.fn.__name__)
            inside.append(1)  # the interpreter's own tensor copies are not launches
            try:
                return run(self_, *a, **k)
            finally:
                inside.pop()
        InterpretedFunction.run = counted
        try:
            with Mode():
                return fn()
        finally:
            InterpretedFunction.run = run


def one_launch_check(m) -> bool:
    """The ops plugged in for issue 19 item 6, on their kernels path (Triton, interpreted on the
    CPU) against their twins, and their launches counted (what the GPU profiler counts):

    * shared clamped SwiGLU (gfx936_swiglu_triton) vs ``clamped_swiglu_stepwise`` (upstream's
      forward_native): within 1 bf16 ulp, 1 launch;
    * q/kv RMSNorm (upstream's _fused_q_kv_rmsnorm_kernel) vs the fork's twin
      ``q_kv_rmsnorm``: within 1 bf16 ulp (one rounding; the interpreter truncates it), 1 launch;
    * attn_norm / ffn_norm STAND-IN vs vLLM IR's native rms_norm: within 1 bf16 ulp, 1 launch;
    * router STAND-IN vs the pytorch path's router (upstream's _topk_softplus_sqrt_torch line
      for line): the same experts in the same order, weights within 1e-5 relative; 2 launches
      (the gate GEMM + the routing op)."""
    set_tp(8, smoke=True)
    b, ok = 3, True
    L = Layer(m, "c4", "cpu", seed=3)
    S = State(m, L, b, "cpu", seed=5)
    g = torch.Generator()

    def ctx(kernels):  # the same inputs on every call
        g.manual_seed(7)
        c = Ctx(m, L, S, torch.zeros(b, HC, HIDDEN, dtype=torch.bfloat16), kernels)
        c.x = (torch.randn(b, HIDDEN, generator=g) * 3).to(torch.bfloat16)
        c.qkv = (torch.randn(b, Q_LORA + HEAD, generator=g) * 2).to(torch.bfloat16)
        c.h = (torch.randn(b, HIDDEN, generator=g)).to(torch.bfloat16)
        # gate and up beyond the clamp (limit 10) in places
        c.sh = (torch.randn(b, 2 * SHARED, generator=g) * 6).to(torch.bfloat16)
        return c

    def ulp1(a, t):
        return bool(((a.float() - t.float()).abs() <= t.float().abs() * 2**-7).all())

    def checked(name, want, good, detail):
        nonlocal ok
        ops = []
        c = ctx(True)
        for n, _, op in STEPS["c4"]:
            if n == name:
                count = _Launches()
                count(lambda: op(c))
                ops = count.ops
        this = good(c) and len(ops) == want
        print(f"smoke one-launch {name}{' (STAND-IN)' if name in STANDIN_ROWS else ''}: "
              f"{detail(c)}; launches {len(ops)} {ops} (want {want}): {this}")
        ok = ok and this

    for name, i, key in (("attn_norm", 0, "x"), ("ffn_norm", 3, "x")):
        c0 = ctx(True)
        twin = _rms_ir(c0.x, L.norms[i])
        checked(name, 1, lambda c, t=twin: ulp1(c.h, t),
                lambda c, t=twin: f"vs IR native rms_norm within 1 bf16 ulp "
                f"{ulp1(c.h, t)}, bitwise {bool(torch.equal(c.h, t))}")
    c0 = ctx(False)
    qr_t, kv_t = m.attn.q_kv_rmsnorm(c0.qkv[:, :Q_LORA], c0.qkv[:, Q_LORA:], L.norms[1],
                                     L.norms[2], EPS)
    checked("q_kv_norm", 1, lambda c: ulp1(c.qr, qr_t) and ulp1(c.kv, kv_t),
            lambda c: f"vs twin q_kv_rmsnorm within 1 bf16 ulp "
            f"{ulp1(c.qr, qr_t) and ulp1(c.kv, kv_t)}")
    c0 = ctx(False)
    op_router(c0)

    def router_ok(c):
        return (c.ids.dtype == torch.int32 and torch.equal(c.ids.long(), c0.ids)
                and bool(((c.wts - c0.wts).abs() <= 1e-5 * c0.wts.abs()).all()))
    checked("router", 2, router_ok,
            lambda c: f"vs torch router same experts {torch.equal(c.ids.long(), c0.ids)}, "
            f"weights max rel diff {float(((c.wts - c0.wts).abs() / c0.wts).max()):.1e}")
    # and at Flash's 256 routed experts (the smoke's layer has 8)
    r0 = types.SimpleNamespace(h=(torch.randn(5, 64, generator=g) * 2).to(torch.bfloat16),
                               L=types.SimpleNamespace(
                                   gate=(torch.randn(256, 64, generator=g) * 0.3).to(
                                       torch.bfloat16),
                                   bias=torch.randn(256, generator=g) * 0.1))
    op_router(r0)
    w256, i256 = m.standins.topk_softplus_sqrt_standin(F.linear(r0.h, r0.L.gate), r0.L.bias,
                                                      TOPK, SCALING)
    good = torch.equal(i256.long(), r0.ids) and bool(
        ((w256 - r0.wts).abs() <= 1e-5 * r0.wts.abs()).all())
    print(f"smoke one-launch router (STAND-IN) at 256 experts: same experts and weights: {good}")
    ok = ok and good
    c0 = ctx(False)
    sw_t = m.sw.clamped_swiglu_stepwise(c0.sh, SWIGLU_LIMIT, SWIGLU_ALPHA, SWIGLU_BETA)
    checked("swiglu", 1, lambda c: ulp1(c.sh, sw_t),
            lambda c: f"vs clamped_swiglu_stepwise within 1 bf16 ulp {ulp1(c.sh, sw_t)}, "
            f"bitwise {bool(torch.equal(c.sh, sw_t))}")
    # today's step on the same rows, for the record (the pytorch column; CPU dispatcher ops,
    # an estimate of its GPU launches, which the H200 run's per-part table measures)
    for name in ("attn_norm", "q_kv_norm", "router", "swiglu"):
        for n, _, op in STEPS["c4"]:
            if n == name:
                c = ctx(False)
                count = _Launches()
                count(lambda op=op, c=c: op(c))
                print(f"smoke today's {name} (pytorch path): dispatcher ops {len(count.ops)} "
                      f"{count.ops}")
    return ok


def smoke(args) -> int:
    """Every kind at TP8 and TP4 through the twins on the CPU (tiny context), through the same
    measure/report code the GPU run takes; where Triton runs (TRITON_INTERPRET=1) the C4 top-k
    packing kernel is checked against its twin."""
    global BATCHES
    m = load(None, smoke=True, device_dir=args.device_dir)
    set_context(1024, 64, 4096)
    md, results = "", {}
    for tp, b in ((8, 1), (4, 2)):
        set_tp(tp, smoke=True)
        for kind in KINDS:
            rows = measure(m, kind, "cpu", [b], layers=1, sets=2, rounds=1,
                           log=lambda s: None)
            results.setdefault(tp, {})[kind] = rows
            md += report(tp, kind, rows)
            r = rows[0][1]["pytorch"]
            print(f"smoke TP{tp} {kind} b={b}: finite={r['finite']} eager "
                  f"{r['eager_ms']:.0f} ms/layer")
            if not r["finite"]:
                return 1
    md += mix_report(results)
    # the C4 step end to end: the indexer's top-k (of the twins' logits) reaches the decode
    set_tp(8, smoke=True)
    L = Layer(m, "c4", "cpu", seed=3)
    S = State(m, L, 2, "cpu", seed=5)
    c = Ctx(m, L, S, (torch.randn(2, HC, HIDDEN) * 3).to(torch.bfloat16), False)
    for _, _, op in STEPS["c4"]:
        op(c)
    top = S.topk_buf.to(torch.int64)
    ok = (bool((c.topk_lens == IDX_TOPK).all()) and bool(((top >= 0) & (top < CTX // 4)).all())
          and all(len(set(row.tolist())) == IDX_TOPK for row in top))
    print(f"smoke C4 indexer -> decode: {IDX_TOPK} distinct of {CTX // 4} compressed keys per "
          f"token: {ok}")
    if not ok:
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1" and not decode_contract(m, args):
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1" and m.standins is not None \
            and not one_launch_check(m):
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1" and m.ragged_triton is not None:
        L = Layer(m, "c4", "cpu", seed=3)
        S = State(m, L, 3, "cpu", seed=5)
        g = torch.Generator().manual_seed(0)
        topk = torch.randint(0, CTX // 4, (3, IDX_TOPK), dtype=torch.int32, generator=g)
        topk[1, IDX_TOPK // 2:] = -1  # a short row
        S.is_valid[2] = False  # a padded token
        t = m.attn.compute_global_topk_ragged_indices_and_indptr(
            topk, S.req, S.extra_bt, LOGICAL_BLOCK // 4, S.is_valid)
        n = int(t[1][-1])
        same = True
        for name, pack in (("fused op", m.ragged_triton), ("rocm.py", m.ragged_upstream)):
            a = pack(topk, S.req, S.extra_bt, LOGICAL_BLOCK // 4, S.is_valid)
            this = torch.equal(a[1], t[1]) and torch.equal(a[2], t[2]) and torch.equal(
                a[0][:n], t[0][:n])
            print(f"smoke C4 top-k packing ({name} Triton, interpreted) == twin: {this}")
            same = same and this
        if not same:
            return 1
    if args.out:
        Path(args.out).write_text(md)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel-lib")
    ap.add_argument("--out")
    ap.add_argument("--kind", default="all", choices=[*KINDS, "all"])
    ap.add_argument("--tp", type=int, action="append", choices=sorted(TP_SHAPES),
                    help="per-rank shapes (default: 8 and 4)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--ctx", type=int, default=CTX)
    ap.add_argument("--index-topk", type=int, default=IDX_TOPK)
    ap.add_argument("--max-model-len", type=int, default=MAX_LEN)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sets", type=int, default=4, help="rotating input sets")
    ap.add_argument("--rounds", type=int, default=5, help="rotations timed (graphs: 4x)")
    ap.add_argument("--time-limit", type=float, default=420,
                    help="seconds: start no new (kind, batch) after this; the report says "
                         "what was left out (the run tool allows 600 s per command)")
    ap.add_argument("--device-dir", default=str(REPO / ".device"),
                    help="where make bench-stage put the staged folders")
    ap.add_argument("--gemv-max-m", type=int, default=None,
                    help="the W8A16 GEMV's token limit (default: the graph value, 4; the engine "
                         "runs 16 eagerly): run once with 16 to time gfx936's eager default")
    ap.add_argument("--moe-direct-max-m", type=int, default=None,
                    help="the MoE direct path's token limit (VLLM_GFX936_MOE_DIRECT_MAX_M; "
                         "default: the engine's 64); 0: the grouped path at every batch")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: every kind at TP8 and TP4, the PyTorch path (twins), tiny context")
    a = ap.parse_args(argv)
    global GEMV_MAX_M, MOE_DIRECT_MAX_M
    GEMV_MAX_M = a.gemv_max_m
    MOE_DIRECT_MAX_M = a.moe_direct_max_m
    if a.gemv_max_m is not None:
        # the grouped wo_a (the engine's inv_rope_einsum) asks gfx936_kernel_select, which
        # reads the switch: the same limit for every linear of the step
        os.environ["VLLM_GFX936_W8A16_GEMV_MAX_M"] = str(a.gemv_max_m)
    if a.smoke:
        return smoke(a)
    a.tp = a.tp or [8, 4]
    kinds = KINDS if a.kind == "all" else (a.kind,)
    set_context(a.ctx, a.index_topk, a.max_model_len)
    if not a.kernel_lib:
        ap.error("--kernel-lib build/kernels/_gfx936_C.so is required on the GPU")
    if not torch.cuda.is_available():
        print("layer_step: no GPU visible to torch; run it on the H200 tier (make bench-layer)")
        return 0
    t0 = time.time()
    m = load(a.kernel_lib, device_dir=a.device_dir)
    clock = Clock("cuda")
    floor = timer_floor(clock)
    print(f"timer floor: {floor}", flush=True)
    body, results, bad, left = "", {}, [], []
    batches = [int(x) for x in a.batches.split(",")]
    for tp in a.tp:
        set_tp(tp)
        for kind in kinds:
            rows = measure(m, kind, "cuda", batches, a.layers, a.sets, a.rounds,
                           log=lambda s: print(f"[{time.time() - t0:.0f} s] TP{tp} {s}",
                                               flush=True), deadline=t0 + a.time_limit)
            if len(rows) < len(batches):
                left.append(f"TP{tp} {kind} b={[b for b in batches if b not in dict(rows)]}")
            if not rows:
                continue
            results.setdefault(tp, {})[kind] = rows
            body += report(tp, kind, rows)
            bad += [(tp, kind, b, n) for b, res in rows for n, r in res.items()
                    if r["same"] is False or not r["finite"]
                    or (n == "kernels" and r["same"] is None)]
    md = header(torch.cuda.get_device_name(), floor, a) + body + mix_report(results)
    if left:
        md += (f"\nLeft out (--time-limit {a.time_limit:.0f} s reached): " + "; ".join(left)
               + ". Run them with --tp / --kind / --batches.\n")
    with tier(m, True):
        bad += insert_check(m)
    md += f"\nWall time of this run: {time.time() - t0:.0f} s.\n"
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    if bad:
        print(f"layer_step: FAIL: {bad} (the kernels path must capture, replay == eager "
              "bitwise, and every output be finite)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
