# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the Sparse MLA decode bench and device check.

Imports only torch, triton and the leaf modules that ``bench/stage.py`` copies
into ``.device/sparse_mla`` (the fork's PyTorch reference, upstream's Triton
decode sliced out of ``rocm_aiter_mla_sparse.py``, the fp8_ds_mla test writer),
so it runs on a GPU machine that has no vLLM dependencies.

Decode shapes (DeepSeek V4 Flash; pass other values on the command line):

* head dim 512 = 448 NoPE (e4m3 + 7 ue8m0 scales) + 64 RoPE (bf16), one latent
  that is both K and V; q heads per rank H (Flash has 64 attention heads:
  H=64 at TP1, 16 at TP4, 8 at TP8);
* main = SWA cache, block size 64, the last ``window`` (128) positions of each
  request;
* extra = the compressed cache of the layer type, logical block 256 tokens:
  C4 layers: block size 256/4 = 64, the indexer's top-k (index_topk, 512 for
  Flash) of the ctx/4 compressed positions; C128 layers: block size 256/128 =
  2, all ctx/128 compressed positions; SWA-only layers: no extra cache;
* every cache block is ``block_stride`` bytes apart (1,002,240 by default, the
  stride the seed saw on gfx936 for a 64-token block of 37,376 bytes), and each
  request's blocks are distinct random physical blocks (a block table).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STAGE = REPO / ".device" / "sparse_mla"
ROW_BYTES = 584  # 576 data + 8 scale bytes per token: the last dim of the cache view
NOPE, ROPE, HEAD = 448, 64, 512
SEED_BLOCK_STRIDE = 1002240
LOGICAL_BLOCK = 256


def load_staged(stage_dir: str | os.PathLike | None = None):
    """(reference, upstream, writer) modules from the staged folder."""
    d = Path(stage_dir) if stage_dir else DEFAULT_STAGE
    needed = ["gfx936_sparse_mla_reference.py", "upstream_sparse_mla_decode.py",
              "fp8_ds_mla_writer.py"]
    missing = [n for n in needed if not (d / n).is_file()]
    if missing:
        raise SystemExit(
            f"staged files {missing} missing in {d}: run `make bench-stage` "
            "(python3 bench/stage.py) where the applied vllm/ tree is"
        )
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    ref = importlib.import_module("gfx936_sparse_mla_reference")
    writer = importlib.import_module("fp8_ds_mla_writer")
    try:
        up = importlib.import_module("upstream_sparse_mla_decode")
    except ImportError as e:  # no triton: the reference alone still runs
        up = None
        print(f"note: upstream decode not importable ({e})")
    return ref, up, writer


def load_fast(stage_dir=None, kernel_lib=None):
    """(fast, triton_twin, kernel_note): the staged fork decodes. ``fast`` is
    None when not staged; ``triton_twin`` None without triton; the kernel
    library (``_gfx936_C.so`` from ``make kernels``) is loaded into torch.ops
    when ``kernel_lib`` is given; ``kernel_note`` says what happened."""
    d = Path(stage_dir) if stage_dir else DEFAULT_STAGE
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    try:
        fast = importlib.import_module("gfx936_sparse_mla_launch")
    except ImportError as e:
        return None, None, f"not staged ({e})"
    try:
        tri = importlib.import_module("gfx936_sparse_mla_triton")
    except ImportError as e:
        tri = None
        print(f"note: Triton twin not importable ({e})")
    note = "no kernel library given"
    if kernel_lib:
        try:
            torch.ops.load_library(str(kernel_lib))
            note = f"loaded {kernel_lib}"
        except Exception as e:  # noqa: BLE001 - reported
            note = f"load failed: {type(e).__name__}: {e}"
    return fast, tri, note


def kernel_loaded() -> bool:
    try:
        return hasattr(torch.ops._gfx936_C, "sparse_mla_decode")
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class Case:
    layer: str  # "c4" | "c128" | "swa"
    batch: int
    heads: int
    window: int = 128
    topk: int = 512
    ctx: int = 8192
    main_block: int = 64
    block_stride: int | None = SEED_BLOCK_STRIDE
    sink: bool = True

    @property
    def extra_block(self) -> int:
        return {"c4": LOGICAL_BLOCK // 4, "c128": LOGICAL_BLOCK // 128}.get(self.layer, 0)

    @property
    def n_main(self) -> int:
        return min(self.window, self.ctx)

    @property
    def n_extra(self) -> int:
        if self.layer == "c4":
            return min(self.topk, self.ctx // 4)
        if self.layer == "c128":
            return self.ctx // 128
        return 0

    def useful_bytes(self) -> int:
        """Fewest bytes one decode call must move: each K row (584 B) and its
        int32 index once, q and the bf16 output once, the fp32 sink."""
        keys = self.batch * (self.n_main + self.n_extra)
        qo = 2 * self.batch * self.heads * HEAD * 2
        return keys * (ROW_BYTES + 4) + qo + (4 * self.heads if self.sink else 0)

    def label(self) -> str:
        extra = f"+{self.n_extra}" if self.n_extra else ""
        return f"{self.layer} b={self.batch} H={self.heads} keys={self.n_main}{extra}"


def cases(args) -> list[Case]:
    """One :class:`Case` per layer x heads x batch of the comma lists in ``args``
    (``layers``, ``heads``, ``batches``; ``window``, ``topk``, ``ctx`` shared)."""
    return [Case(layer=layer, batch=b, heads=h, window=args.window, topk=args.topk,
                 ctx=args.ctx)
            for layer in args.layers.split(",")
            for h in map(int, args.heads.split(","))
            for b in map(int, args.batches.split(","))]


def _alloc_cache(num_blocks, block_size, block_stride, device, gen_seed):
    """uint8 [num_blocks, block_size, 584] view with stride(0)=block_stride over
    random background bytes (wrong reads show as garbage, not zeros)."""
    block_bytes = block_size * ROW_BYTES
    stride = block_bytes if block_stride is None else max(block_stride, block_bytes)
    total = (num_blocks - 1) * stride + block_bytes
    g = torch.Generator(device=device).manual_seed(gen_seed)
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=g)
    return flat.as_strided((num_blocks, block_size, ROW_BYTES), (stride, ROW_BYTES, 1))


def _random_k(n, device, g):
    """K rows with the seed's magnitudes: NoPE group absmax in [0.5, 1.6], RoPE <= 5.75."""
    amax = 0.5 + 1.1 * torch.rand(n, NOPE // 64, device=device, generator=g)
    nope = (torch.rand(n, NOPE, device=device, generator=g) * 2 - 1)
    nope = nope * amax.repeat_interleave(64, dim=1)
    rope = (torch.rand(n, ROPE, device=device, generator=g) * 2 - 1) * 5.75
    return torch.cat([nope, rope], dim=1)


class Inputs:
    """Caches and indices of one case, in every form the callers take."""

    def __init__(self, case: Case, writer, device, seed: int = 0):
        self.case = case
        b, dev = case.batch, device
        g = torch.Generator(device=dev).manual_seed(seed)
        # main (SWA): each request's window spans ceil(window/bs)+1 random blocks
        bs = case.main_block
        per_req = -(-case.n_main // bs) + 1
        nblk = b * per_req + 3
        self.main = _alloc_cache(nblk, bs, case.block_stride, dev, seed + 1)
        perm = torch.randperm(nblk, device=dev, generator=g)[: b * per_req].view(b, per_req)
        start = case.ctx - case.n_main  # positions [ctx - window, ctx)
        pos = start + torch.arange(case.n_main, device=dev)
        lpos = pos - (start // bs) * bs  # position inside this request's window blocks
        self.main_slots = (perm[:, lpos // bs] * bs + (lpos % bs)[None, :]).to(torch.int32)
        writer.write_fp8_ds_mla(
            self.main, _random_k(b * case.n_main, dev, g), self.main_slots.reshape(-1).long()
        )
        self.extra = None
        self.extra_slots = None
        if case.n_extra:
            ebs = case.extra_block
            ncomp = case.ctx // (4 if case.layer == "c4" else 128)
            per_req = -(-ncomp // ebs)
            nblk = b * per_req + 3
            self.extra = _alloc_cache(nblk, ebs, case.block_stride, dev, seed + 2)
            perm = torch.randperm(nblk, device=dev, generator=g)[: b * per_req].view(b, per_req)
            if case.layer == "c4":  # top-k: distinct random compressed positions
                cpos = torch.argsort(torch.rand(b, ncomp, device=dev, generator=g), dim=1)
                cpos = cpos[:, : case.n_extra]
            else:  # c128: every compressed position
                cpos = torch.arange(ncomp, device=dev).expand(b, ncomp)
            blk = torch.gather(perm, 1, cpos // ebs)
            self.extra_slots = (blk * ebs + cpos % ebs).to(torch.int32)
            writer.write_fp8_ds_mla(
                self.extra, _random_k(b * case.n_extra, dev, g),
                self.extra_slots.reshape(-1).long(),
            )
        self.q = (torch.randn(b, case.heads, HEAD, device=dev, generator=g) * 0.5).to(
            torch.bfloat16
        )
        self.sink = torch.randn(case.heads, device=dev, generator=g) if case.sink else None
        self.scale = HEAD ** -0.5
        self.main_lens = torch.full((b,), case.n_main, dtype=torch.int32, device=dev)
        self.main_indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * case.n_main
        self.main_ragged = self.main_slots.reshape(-1).contiguous()
        if self.extra is not None:
            self.extra_lens = torch.full((b,), case.n_extra, dtype=torch.int32, device=dev)
            self.extra_indptr = (
                torch.arange(b + 1, device=dev, dtype=torch.int32) * case.n_extra
            )
            self.extra_ragged = self.extra_slots.reshape(-1).contiguous()
        else:
            self.extra_lens = self.extra_indptr = self.extra_ragged = None
        self.out = torch.empty(b, case.heads, HEAD, device=dev, dtype=torch.bfloat16)

    # ---- the callers -------------------------------------------------------
    def reference_kwargs(self, ragged: bool) -> dict:
        """Arguments of ``rocm_sparse_attn_decode_reference``. ``ragged=True`` is
        what the ROCm DeepSeek V4 model passes (its metadata builds ragged SWA and
        top-k indices, and ragged wins); ``ragged=False`` passes only the dense
        ``[b, w]`` indices with their lengths."""
        swa_only = self.extra is None
        return dict(
            q=self.q, kv_cache=self.extra, swa_k_cache=self.main, swa_only=swa_only,
            topk_indices=None if swa_only else self.extra_slots,
            topk_lens=self.extra_lens,
            swa_indices=self.main_slots, swa_lens=self.main_lens,
            swa_ragged_indices=self.main_ragged if ragged else None,
            swa_ragged_indptr=self.main_indptr if ragged else None,
            topk_ragged_indices=self.extra_ragged if ragged else None,
            topk_ragged_indptr=self.extra_indptr if ragged else None,
            attn_sink=self.sink, scale=self.scale, head_dim=HEAD,
            nope_head_dim=NOPE, rope_head_dim=ROPE, output=self.out,
        )

    def decode_calls(self, ref, up, fast=None, tri=None) -> dict:
        """name -> zero-argument call of each decode under test: ``ref``,
        ``ref-dense`` and, when ``up`` is given, ``up`` and ``up-splitk``; the
        fork's fast decodes ``kernel`` (csrc_gfx936, when loaded) and
        ``triton`` (the Triton twin) on the model's ragged indices."""
        calls = {"ref": lambda: self.call_reference(ref, ragged=True),
                 "ref-dense": lambda: self.call_reference(ref, ragged=False)}
        if up is not None:
            calls["up"] = lambda: self.call_upstream(up, split_k=False)
            calls["up-splitk"] = lambda: self.call_upstream(up, split_k=True)
        if fast is not None and kernel_loaded():
            calls["kernel"] = lambda: self.call_fast(fast.sparse_mla_decode_kernel)
        if tri is not None:
            calls["triton"] = lambda: self.call_fast(tri.sparse_mla_decode_triton)
        return calls

    def call_fast(self, fn, ragged: bool = True):
        fn(**self.reference_kwargs(ragged))
        return self.out

    def call_reference(self, ref, ragged: bool):
        ref.rocm_sparse_attn_decode_reference(**self.reference_kwargs(ragged))
        return self.out

    def call_upstream(self, up, split_k: bool):
        """What upstream's ``rocm_sparse_attn_decode`` does after building the
        ragged indices: ``_rocm_sparse_attn_decode_ragged_triton`` + the copy into
        ``output``. ``split_k`` selects its gfx942/gfx950 branch (partial +
        reduce kernels), else the generic fallback kernel."""
        up._ON_GFX950 = bool(split_k)
        try:
            o = up._rocm_sparse_attn_decode_ragged_triton(
                q=self.q, main_cache=self.main, main_indices=self.main_ragged,
                main_indptr=self.main_indptr, scale=self.scale, attn_sink=self.sink,
                nope_head_dim=NOPE, rope_head_dim=ROPE, extra_cache=self.extra,
                extra_indices=self.extra_ragged, extra_indptr=self.extra_indptr,
            )
        finally:
            up._ON_GFX950 = False
        self.out.copy_(o.to(self.out.dtype))
        return self.out

    def oracle(self, ref) -> torch.Tensor:
        """float64 decode with the reference's math (its ``compute_dtype``)."""
        rows = self.main.shape[0] * self.main.shape[1]
        ms = self.main_slots.long()
        mv = (ms >= 0) & (ms < rows)
        kw = {}
        if self.extra is not None:
            es = self.extra_slots.long()
            kw = dict(extra_cache=self.extra, extra_slots=es,
                      extra_valid=(es >= 0) & (es < self.extra.shape[0] * self.extra.shape[1]))
        return ref.sparse_mla_decode_reference(
            self.q, self.main, ms, mv, self.scale, self.sink,
            compute_dtype=torch.float64, **kw,
        )


# ---- read-only gather: the bandwidth ceiling -----------------------------------------------
def gather_checksum_torch(ref, inp: Inputs) -> torch.Tensor:
    """int64 [b]: sum of the 146 little-endian int32 words (576 data + 8 scale
    bytes) of every key row of each query, read with the reference's addressing."""
    tot = []
    for cache, slots in ((inp.main, inp.main_slots), (inp.extra, inp.extra_slots)):
        if cache is None:
            continue
        data, scales = ref.gather_fp8_ds_mla_bytes(cache, slots.long())
        words = torch.cat([data, scales], dim=-1).contiguous().view(torch.int32)
        tot.append(words.to(torch.int64).sum(dim=(1, 2)))
    return torch.stack(tot).sum(0)


_GATHER = None


def gather_kernel():
    """The Triton read-only gather (compiled lazily: triton is optional for smoke)."""
    global _GATHER
    if _GATHER is not None:
        return _GATHER
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=[
        "main_stride0", "extra_stride0", "main_block_size", "extra_block_size",
        "main_chunks", "num_chunks"])
    def _fp8_ds_mla_gather_kernel(
        main_cache_ptr, main_indices_ptr, main_indptr_ptr,
        extra_cache_ptr, extra_indices_ptr, extra_indptr_ptr,
        out_ptr,  # int64 [num_queries, num_chunks]
        main_stride0, extra_stride0, main_block_size, extra_block_size,
        main_chunks, num_chunks,
        BLOCK_K: tl.constexpr,
    ):
        # fp8_ds_mla block (uint8 cache, block base = cache + block * stride0,
        # bs = block size, slot = block * bs + pos):
        #
        #   base + pos*576 +  [0 ............ 448) [448 ........ 576)
        #                      e4m3 NoPE x448       bf16 RoPE x64
        #   base + bs*576 + pos*8 + [0 ...... 7) [7]
        #                            ue8m0 x7     pad
        #
        # Each program reads BLOCK_K key rows of one query: the 576 data bytes
        # as 144 int32 words (128 + 16) and the 8 scale bytes as 2 words, and
        # writes their int64 sum (so nothing is optimised away; checkable).
        qi = tl.program_id(0)
        c = tl.program_id(1)
        if c < main_chunks:
            cache_ptr = main_cache_ptr
            idx_ptr = main_indices_ptr
            indptr_ptr = main_indptr_ptr
            stride0 = main_stride0
            bs = main_block_size
            chunk = c
        else:
            cache_ptr = extra_cache_ptr
            idx_ptr = extra_indices_ptr
            indptr_ptr = extra_indptr_ptr
            stride0 = extra_stride0
            bs = extra_block_size
            chunk = c - main_chunks
        start = tl.load(indptr_ptr + qi)
        n = tl.load(indptr_ptr + qi + 1) - start
        k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        valid = k < n
        slot = tl.load(idx_ptr + start + k, mask=valid, other=0)
        valid = valid & (slot >= 0)
        slot = tl.where(valid, slot, 0)
        base = cache_ptr + (slot // bs).to(tl.int64) * stride0
        pos = slot % bs
        data = (base + pos * 576).to(tl.pointer_type(tl.int32))
        w0 = tl.arange(0, 128)
        w1 = tl.arange(0, 16)
        w2 = tl.arange(0, 2)
        a = tl.load(data[:, None] + w0[None, :], mask=valid[:, None], other=0)
        b = tl.load(data[:, None] + 128 + w1[None, :], mask=valid[:, None], other=0)
        sc = (base + bs * 576 + pos * 8).to(tl.pointer_type(tl.int32))
        s = tl.load(sc[:, None] + w2[None, :], mask=valid[:, None], other=0)
        total = (
            tl.sum(tl.sum(a.to(tl.int64), axis=1), axis=0)
            + tl.sum(tl.sum(b.to(tl.int64), axis=1), axis=0)
            + tl.sum(tl.sum(s.to(tl.int64), axis=1), axis=0)
        )
        tl.store(out_ptr + qi * num_chunks + c, total)

    _GATHER = (_fp8_ds_mla_gather_kernel, triton)
    return _GATHER


class Gather:
    """Launcher of the gather kernel over an :class:`Inputs` (buffers preallocated,
    so a call is one launch and graph-capturable)."""

    BLOCK_K = 16

    def __init__(self, inp: Inputs):
        self.kernel, triton = gather_kernel()
        c = inp.case
        self.inp = inp
        self.main_chunks = triton.cdiv(c.n_main, self.BLOCK_K)
        extra_chunks = triton.cdiv(c.n_extra, self.BLOCK_K) if c.n_extra else 0
        self.num_chunks = self.main_chunks + extra_chunks
        self.part = torch.empty(c.batch, self.num_chunks, dtype=torch.int64,
                                device=inp.q.device)
        self.has_extra = inp.extra is not None

    def __call__(self):
        i = self.inp
        e = i.extra if self.has_extra else i.main
        self.kernel[(i.case.batch, self.num_chunks)](
            i.main, i.main_ragged, i.main_indptr,
            e, i.extra_ragged if self.has_extra else i.main_ragged,
            i.extra_indptr if self.has_extra else i.main_indptr,
            self.part, i.main.stride(0), e.stride(0), i.main.shape[1], e.shape[1],
            self.main_chunks, self.num_chunks, BLOCK_K=self.BLOCK_K,
        )
        return self.part

    def checksum(self) -> torch.Tensor:
        return self.part.sum(dim=1)


# ---- timing ---------------------------------------------------------------------------------
class Timer:
    """Median latency of one isolated call, L2 flushed before each.

    CUDA/ROCm: before every rep a 256 MiB buffer is read (evicting the K rows
    from L2, as the other layers of a real decode step do), the device is
    synchronised so it is idle, then events are recorded around the call: the
    time includes the host's launch work (Python, kernel launches, any host
    sync inside the call), which is what an eager decode pays. CPU (smoke):
    wall clock.
    """

    def __init__(self, device, reps: int, warmup: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.reps, self.warmup = reps, warmup
        self.flush = (
            torch.empty(64 * 1024 * 1024, dtype=torch.float32, device=self.device)
            .uniform_() if self.cuda else None
        )

    def __call__(self, fn, reps: int | None = None) -> float:
        """Median milliseconds of ``fn()``."""
        reps = reps or self.reps
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                self.flush.sum()
                torch.cuda.synchronize()
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def capture(fn):
    """(replay, None, graph) for ``fn`` captured in a CUDA graph, or
    (None, reason, None) when it cannot be captured."""
    try:
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on a side stream, as torch advises
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay, None, g
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        # The first error (the op that broke the capture) is usually the
        # context of what capture_end raised: report both.
        parts = []
        for err in (e.__context__, e):
            if err is not None:
                msg = (str(err).strip().splitlines() or [""])[0]
                parts.append(f"{type(err).__name__}: {msg[:120]}")
        return None, " <- ".join(parts), None


def copy_bandwidth(device, nbytes: int, timer: Timer) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), reps=max(5, timer.reps // 4))
    return 2 * nbytes / (ms * 1e-3)


def device_name(device) -> str:
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.multi_processor_count} SMs/CUs, {p.total_memory / 2**30:.0f} GiB)"
    return "CPU"


def versions() -> str:
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "absent"
    return f"torch {torch.__version__}, triton {tv}, python {sys.version.split()[0]}"


def fmt(x, spec=".3f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# ---- the FP32 FMA peak of a shape's floor (one rule for every bench) -----------------------
H200_FP32_TFLOPS = 66.9  # 132 SMs x 128 FP32 lanes x 2 (FMA) x 1980 MHz


def fp32_peak_flops(sms: int, mhz: float, lanes: int = 128) -> float:
    """FP32 FMA peak in FLOP/s: SMs x FP32 lanes per SM x 2 (an FMA) x clock."""
    return sms * lanes * 2 * mhz * 1e6


def fp32_peak(device, tflops: float | None, smoke: bool = False):
    """(FLOP/s or None, where it came from). An explicit --fp32-tflops wins;
    else, on NVIDIA, SM count (torch) x 128 x 2 x nvidia-smi's max SM clock."""
    if tflops:
        return tflops * 1e12, f"--fp32-tflops {tflops:g}"
    if smoke:
        return H200_FP32_TFLOPS * 1e12, f"assumed H200 {H200_FP32_TFLOPS} (--smoke, no GPU)"
    if torch.device(device).type != "cuda" or torch.version.hip is not None:
        return None, "unknown (not NVIDIA): pass --fp32-tflops; floor = bytes only"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:  # the GPUs of one host are one model: the first line serves
        p = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        mhz = float(p.stdout.split()[0])
    except Exception as e:  # noqa: BLE001 - reported
        return None, (f"unknown (nvidia-smi clocks.max.sm: {type(e).__name__}): pass "
                      f"--fp32-tflops (H200: {H200_FP32_TFLOPS}); floor = bytes only")
    return (fp32_peak_flops(sms, mhz),
            f"{sms} SMs x 128 FP32 lanes x 2 x {mhz:.0f} MHz (nvidia-smi clocks.max.sm)")


def floor_us(nbytes: float, flops: float, copy_bw: float, peak: float | None) -> float:
    """max(bytes / copy bandwidth, FLOPs / FP32 peak) in us; bytes only when
    the peak is unknown."""
    return 1e6 * max(nbytes / copy_bw, flops / peak if peak else 0.0)
