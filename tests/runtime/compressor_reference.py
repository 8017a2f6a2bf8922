"""What the compressor tests share (tests/runtime/test_dsv4_compressor_no_fp8.py: the torch twins;
tests/kernels/test_dsv4_compressor_fused_gfx936.py: the fused Triton kernel): a step's input
tensors as the engine lays them out (``step_tensors``) and the float64 model of DeepSeek V4's
compressed KV entry, written here from the model's definition (independent of the product).

Entry ``p`` (the window that closes at position ``p`` of one request): the softmax over the
window's rows of score (+ ape) weights its kv rows (C4 overlaps: the previous window's rows read
the first half of the row, its own rows the second), then RMSNorm times the weight, then GPT-J
RoPE on the last ``rope`` dims at position ``(p // ratio) * ratio``. ``cos_sin`` rows are
``cos[0:rope/2] | sin``.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def cos_sin_table(n: int, rope: int) -> torch.Tensor:
    """float32 [n, rope]: cos | sin of position x inverse frequency (base 10000)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(torch.float32)


def step_tensors(kv_hist: list[torch.Tensor], sc_hist: list[torch.Tensor], chunks, *,
                 ratio: int, state_bt: torch.Tensor, state_bs: int, kv_bt: torch.Tensor,
                 kv_block: int, pad: int = 0,
                 generator: torch.Generator | None = None) -> SimpleNamespace:
    """One step's tensors for ``chunks`` [(req, start, end)] of the requests' kv / score
    histories: kv, sc, pos, req, slots (paged state-cache slots), kv_slots (the compressed slot
    where a window closes at the token, else -1) and closing [(req, pos, compressed slot)].
    ``pad`` CUDA-graph padding rows: slot -1, a closing position, garbage values."""
    kv, sc, pos, req, slots, kv_slots, closing = [], [], [], [], [], [], []
    for r, s, e in chunks:
        kv.append(kv_hist[r][s:e])
        sc.append(sc_hist[r][s:e])
        p = torch.arange(s, e)
        pos.append(p)
        req.append(torch.full((e - s,), r, dtype=torch.int32))
        slots.append(state_bt[r, p // state_bs].long() * state_bs + p % state_bs)
        c = p // ratio
        ks = kv_bt[r, c // kv_block].long() * kv_block + c % kv_block
        close = (p + 1) % ratio == 0
        kv_slots.append(torch.where(close, ks, -1))
        closing += [(r, int(q), int(k)) for q, k, b in zip(p, ks, close) if b]
    kv, sc, pos = torch.cat(kv), torch.cat(sc), torch.cat(pos)
    req, slots, kv_slots = torch.cat(req), torch.cat(slots), torch.cat(kv_slots)
    if pad:
        kv = torch.cat([kv, torch.randn(pad, kv.shape[1], generator=generator).to(kv.dtype)])
        sc = torch.cat([sc, torch.randn(pad, sc.shape[1], generator=generator).to(sc.dtype)])
        pos = torch.cat([pos, torch.full((pad,), ratio - 1)])
        req = torch.cat([req, torch.zeros(pad, dtype=torch.int32)])
        slots = torch.cat([slots, torch.full((pad,), -1)])
        kv_slots = torch.cat([kv_slots, torch.full((pad,), -1)])
    return SimpleNamespace(kv=kv, sc=sc, pos=pos, req=req, slots=slots, kv_slots=kv_slots,
                           closing=closing)


def compressed_entry_f64(kv: torch.Tensor, sc: torch.Tensor, ape: torch.Tensor | None,
                         weight: torch.Tensor, cos_sin: torch.Tensor, p: int, *, head: int,
                         ratio: int, overlap: bool, rope: int, eps: float) -> torch.Tensor:
    """float64 [head]: entry ``p`` of one request from its kv / score history [n, (1 + overlap)
    * head]; ``ape`` [ratio, width] is added to the scores (None: left out)."""
    rows = (1 + overlap) * ratio
    kv, sc = kv.double(), sc.double()
    if ape is not None:
        sc = sc + ape.double()[torch.arange(kv.shape[0]) % ratio]
    ks, ss = [], []
    for t in range(rows):
        q = p - rows + 1 + t
        half = slice(head, 2 * head) if (overlap and t >= ratio) else slice(0, head)
        if q < 0:
            ks.append(torch.zeros(head, dtype=torch.float64))
            ss.append(torch.full((head,), -math.inf, dtype=torch.float64))
        else:
            ks.append(kv[q, half])
            ss.append(sc[q, half])
    k, s = torch.stack(ks), torch.stack(ss)
    x = (k * torch.softmax(s, 0)).sum(0)
    x = x / torch.sqrt((x * x).mean() + eps) * weight.double()
    cp = (p // ratio) * ratio
    cos, sin = cos_sin[cp, :rope // 2].double(), cos_sin[cp, rope // 2:].double()
    e, o = x[-rope::2].clone(), x[-rope + 1::2].clone()
    x[-rope::2], x[-rope + 1::2] = e * cos - o * sin, o * cos + e * sin
    return x
