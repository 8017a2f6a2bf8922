# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A PyTorch stand-in for the csrc_gfx936 library (``torch.ops._gfx936_C``) on
the CPU, written from the ops' contracts in csrc_gfx936/*.h, not from the
kernels. It lets CI run the dispatch modules (gfx936_w8a16_kernel.py,
gfx936_mxfp4_moe_kernel.py) and the selection with the extension "present";
the kernels themselves are checked on the H200 tier (bench/gfx936_kernels.py).

Decoding here is by lookup tables (E4M3 via torch's own float8 cast, E2M1 by
table), independent of the product's integer decoders. ``register()`` defines
the ops once per process (torch.library cannot drop a namespace again).
"""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
OPS = ("sparse_mla_decode", "w8a16_gemv", "fp8_block_dequant", "moe_route", "moe_mxfp4_gemv",
       "moe_mxfp4_gemv_direct", "moe_reduce", "mxfp4_dequant_experts")
CALLS: dict[str, int] = {}
_LIB = None


def _count(name):
    CALLS[name] = CALLS.get(name, 0) + 1


def fp8_weight(w, s, bn, bk):
    wf = w.view(torch.float8_e4m3fn).to(torch.float32)
    sf = torch.exp2(s.to(torch.float32) - 127) if s.element_size() == 1 else s.float()
    sf = sf.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return wf * sf


def mxfp4_weight(w, s):
    lut = torch.tensor(E2M1 + [-v for v in E2M1])
    vals = torch.stack((lut[(w & 0xF).long()], lut[(w >> 4).long()]), -1).flatten(-2)
    return vals * torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, -1)


def _w8a16_gemv(x, weight, scale, bn, bk, groups, out):
    _count("w8a16_gemv")
    w = fp8_weight(weight, scale, bn, bk)
    n, k = w.shape
    g = n // groups
    out.copy_(torch.cat([x[:, i * k:(i + 1) * k].float() @ w[i * g:(i + 1) * g].t()
                         for i in range(groups)], 1).to(out.dtype))


def _fp8_block_dequant(weight, scale, bn, bk, out):
    _count("fp8_block_dequant")
    out.copy_(fp8_weight(weight, scale, bn, bk).to(out.dtype))


def _local_experts(topk_ids, expert_map, num_experts):
    """Local expert per pair, -1 where not on this rank (moe_route's mapping)."""
    ids = topk_ids.flatten().long()
    if expert_map is not None:
        ok = (ids >= 0) & (ids < expert_map.numel())
        loc = torch.where(ok, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
    else:
        loc = torch.where((ids >= 0) & (ids < num_experts), ids, -1)
    return torch.where(loc < num_experts, loc, -1)


def _moe_route(topk_ids, expert_map, num_experts, pair_expert, sorted_pairs, expert_start,
               active):
    _count("moe_route")
    loc = _local_experts(topk_ids, expert_map, num_experts)
    pair_expert.copy_(loc.to(torch.int32))
    key = torch.where(loc >= 0, loc, num_experts)
    sorted_pairs.copy_(torch.sort(key, stable=True).indices.to(torch.int32))
    counts = torch.bincount(loc[loc >= 0], minlength=num_experts)
    expert_start.copy_(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
                       .to(torch.int32))
    routed = torch.nonzero(counts).flatten()
    active.fill_(-1)
    active[: routed.numel()] = routed.to(torch.int32)


def _experts(x, w13, s13, w2, s2, tw, pair_expert, alpha, limit, weight_on_input):
    """float32 y [P, H]: each routed pair's expert output (weighted unless on input)."""
    topk = tw.shape[1]
    y = torch.zeros(pair_expert.numel(), w2.shape[1])
    for p, e in enumerate(pair_expert.tolist()):
        if e < 0:
            continue
        xe = x[p // topk].float()
        if weight_on_input:
            xe = xe * tw.flatten()[p]
        h = mxfp4_weight(w13[e], s13[e]) @ xe
        d = h.numel() // 2
        g, u = h[:d], h[d:]
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        y[p] = mxfp4_weight(w2[e], s2[e]) @ (torch.nn.functional.silu(alpha * g) * u)
        if not weight_on_input:
            y[p] = y[p] * tw.flatten()[p]
    return y


def _moe_mxfp4_gemv(x, w13, s13, w2, s2, topk_weights, pair_expert, sorted_pairs,
                    expert_start, active, alpha, limit, weight_on_input, act, y, out):
    _count("moe_mxfp4_gemv")
    yy = _experts(x, w13, s13, w2, s2, topk_weights, pair_expert, alpha, limit,
                  weight_on_input)
    y.view(-1)[: yy.numel()].copy_(yy.flatten())
    _moe_reduce(yy, pair_expert, topk_weights.shape[1], out)


def _moe_mxfp4_gemv_direct(x, w13, s13, w2, s2, topk_weights, topk_ids, expert_map, alpha,
                           limit, weight_on_input, act, out):
    _count("moe_mxfp4_gemv_direct")
    loc = _local_experts(topk_ids, expert_map, w13.shape[0])
    yy = _experts(x, w13, s13, w2, s2, topk_weights, loc, alpha, limit, weight_on_input)
    m, h = out.shape
    keep = (loc >= 0).view(m, -1, 1)
    out.copy_(torch.where(keep, yy.view(m, -1, h), 0.0).sum(1).to(out.dtype))


def _moe_reduce(y, pair_expert, topk, out):
    _count("moe_reduce")
    m, h = out.shape
    yy = y.view(-1)[: m * topk * h].view(m, topk, h)
    valid = (pair_expert.view(m, topk) >= 0).unsqueeze(-1)
    out.copy_(torch.where(valid, yy, 0.0).sum(1).to(out.dtype))


def _mxfp4_dequant_experts(w, w_scale, active, slot0, out):
    _count("mxfp4_dequant_experts")
    for s in range(out.shape[0]):
        e = int(active[slot0 + s])
        if e >= 0:
            out[s] = mxfp4_weight(w[e], w_scale[e]).to(out.dtype)


def register() -> None:
    """Define torch.ops._gfx936_C.* with the CPU implementations above."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("_gfx936_C", "DEF")
    lib.define("sparse_mla_decode(Tensor q) -> ()")
    lib.define("w8a16_gemv(Tensor x, Tensor weight, Tensor weight_scale, int block_n, "
               "int block_k, int groups, Tensor(a!) out) -> ()")
    lib.define("fp8_block_dequant(Tensor weight, Tensor weight_scale, int block_n, "
               "int block_k, Tensor(a!) out) -> ()")
    lib.define("moe_route(Tensor topk_ids, Tensor? expert_map, int num_experts, "
               "Tensor(a!) pair_expert, Tensor(b!) sorted_pairs, Tensor(c!) expert_start, "
               "Tensor(d!) active) -> ()")
    lib.define("moe_mxfp4_gemv(Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, "
               "Tensor w2_scale, Tensor topk_weights, Tensor pair_expert, Tensor sorted_pairs, "
               "Tensor expert_start, Tensor active, float alpha, float limit, "
               "bool weight_on_input, Tensor(a!) act, Tensor(b!) y, Tensor(c!) out) -> ()")
    lib.define("moe_mxfp4_gemv_direct(Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, "
               "Tensor w2_scale, Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, "
               "float alpha, float limit, bool weight_on_input, Tensor(a!) act, "
               "Tensor(b!) out) -> ()")
    lib.define("moe_reduce(Tensor y, Tensor pair_expert, int topk, Tensor(a!) out) -> ()")
    lib.define("mxfp4_dequant_experts(Tensor w, Tensor w_scale, Tensor active, int slot0, "
               "Tensor(a!) out) -> ()")
    for name in OPS:
        if name == "sparse_mla_decode":
            lib.impl(name, lambda q: None, "CPU")
        else:  # late-bound: tests may wrap a module function (monkeypatch)
            lib.impl(name, (lambda n: lambda *a: globals()["_" + n](*a))(name), "CPU")
    _LIB = lib
