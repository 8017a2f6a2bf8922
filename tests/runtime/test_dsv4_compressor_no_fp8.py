# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek V4 compressor on the no-FP8 path (gfx936, CPU): torch twins of upstream's kernels.

References, each independent of the product:
- ``save_partial_states``: upstream's Triton kernel under the interpreter (no FP8 in it), bit exact.
- compress -> RMSNorm -> RoPE -> FP8 cache: a float64 model of the math written from
  DeepSeek V4's definition (compressor_reference.py beside this file: window softmax over
  score + ape, overlap halves for C4, RoPE at ``(p // ratio) * ratio``), compared with the
  cache bytes decoded by the fork's decoders (``lowp_codecs_torch``) and the block layouts read
  back with address formulas written here.
Tolerance: E4M3 keeps 3 mantissa bits (half ulp = 2**-4 relative) after a bf16 rounding
(2**-9), subnormal half ulp is scale * 2**-10; RoPE tail bytes are bf16 (2**-9 relative).
Scenarios: chunked prefill (state carried across steps), decode after prefill, two requests
in one batch, windows across state-cache blocks, compressed slots across KV-cache pages,
padded tokens (slot -1).
"""
from __future__ import annotations

import pytest
import torch

from compressor_reference import compressed_entry_f64, cos_sin_table, step_tensors

from vllm.models.deepseek_v4.common.ops import gfx936_compressor as comp
from vllm.model_executor.layers.quantization.utils.lowp_codecs_torch import (
    decode_e4m3fn,
    decode_ue8m0,
)

ROPE = 64


class _Meta:
    def __init__(self, slot_mapping):
        self.slot_mapping = slot_mapping


class Scenario:
    """Two requests, paged state cache and paged compressed cache, run step by step."""

    def __init__(self, ratio, head, kv_block, lens, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.g, self.ratio, self.head = g, ratio, head
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        self.state_bs = 4 if ratio == 4 else 8
        self.kv_block = kv_block
        self.lens = lens
        w = self.coff * head
        n_state_blocks = len(lens) * (-(-max(lens) // self.state_bs)) + 3
        self.state = torch.randn(n_state_blocks, self.state_bs, 2 * w, generator=g)
        self.state_bt = torch.randperm(n_state_blocks, generator=g)[
            : len(lens) * (-(-max(lens) // self.state_bs))].view(len(lens), -1).to(torch.int32)
        n_comp = max(lens) // ratio + 1
        kv_blocks_per_req = -(-max(n_comp, 1) // kv_block)
        nkb = len(lens) * kv_blocks_per_req + 2
        self.kv_bt = torch.randperm(nkb, generator=g)[: len(lens) * kv_blocks_per_req].view(
            len(lens), -1).to(torch.int32)
        token_bytes = 576 + 8 if head == 512 else 132
        self.kv_cache = torch.randint(0, 256, (nkb, kv_block, token_bytes), generator=g,
                                      dtype=torch.uint8)
        self.kv_cache_before = self.kv_cache.clone()
        self.ape = torch.randn(ratio, w, generator=g)
        self.weight = 1 + 0.1 * torch.randn(head, generator=g)
        self.cos_sin = cos_sin_table(max(lens) + 8, ROPE)
        # Per-request history of the projected kv / score (bf16 as the linear emits).
        self.kv_hist = [torch.randn(n, w, generator=g).to(torch.bfloat16) for n in lens]
        self.sc_hist = [(2 * torch.randn(n, w, generator=g)).to(torch.bfloat16) for n in lens]
        self.written: dict[int, tuple[int, int]] = {}

    def step(self, chunks, pad=0):
        """chunks: [(req, start, end)]; runs save + compress like DeepseekCompressor.forward."""
        b = step_tensors(self.kv_hist, self.sc_hist, chunks, ratio=self.ratio,
                         state_bt=self.state_bt, state_bs=self.state_bs, kv_bt=self.kv_bt,
                         kv_block=self.kv_block, pad=pad)
        for r, p, k in b.closing:
            self.written[k] = (r, p)
        kv, sc, pos, req, slots, kv_slots = b.kv, b.sc, b.pos, b.req, b.slots, b.kv_slots
        w = self.state.shape[-1] // 2
        comp.save_partial_states_torch(kv, sc, self.ape, pos, self.state, slots,
                                       self.state_bs, w, self.ratio)
        comp.compress_norm_rope_store_torch(
            state_cache=self.state, num_actual=slots.shape[0], token_to_req_indices=req,
            positions=pos, slot_mapping=slots, block_table=self.state_bt,
            block_size=self.state_bs, state_width=w, cos_sin_cache=self.cos_sin,
            kv_cache=self.kv_cache, k_cache_metadata=_Meta(kv_slots), pdl_kwargs={},
            head_dim=self.head, rope_head_dim=ROPE, compress_ratio=self.ratio,
            overlap=self.overlap, use_fp4_cache=False, rms_norm_weight=self.weight,
            rms_norm_eps=1e-6, quant_block=64 if self.head == 512 else 128,
            token_stride=576 if self.head == 512 else 128,
            scale_dim=8 if self.head == 512 else 4)

    # ---- float64 reference ------------------------------------------------------------------
    def reference(self, r: int, p: int) -> torch.Tensor:
        return compressed_entry_f64(
            self.kv_hist[r], self.sc_hist[r], self.ape, self.weight, self.cos_sin, p,
            head=self.head, ratio=self.ratio, overlap=self.overlap, rope=ROPE, eps=1e-6)

    # ---- read the cache back (layouts written from the drawings) -----------------------------
    def read(self, slot: int):
        b, t = divmod(slot, self.kv_block)
        blk = self.kv_cache[b].reshape(-1)
        bs = self.kv_block
        if self.head == 512:
            data = blk[t * 576:(t + 1) * 576]
            scales = decode_ue8m0(blk[bs * 576 + t * 8: bs * 576 + t * 8 + 7])
            nope = decode_e4m3fn(data[:448]).view(7, 64) * scales[:, None]
            rope = data[448:].contiguous().view(torch.bfloat16).float()
            assert int(blk[bs * 576 + t * 8 + 7]) == 0, "scale pad byte must be 0"
            return (torch.cat([nope.flatten(), rope]),
                    torch.cat([scales.repeat_interleave(64), torch.ones(64)]))
        vals = decode_e4m3fn(blk[t * 128:(t + 1) * 128])
        scale = blk[bs * 128 + t * 4: bs * 128 + t * 4 + 4].contiguous().view(torch.float32)
        return vals * scale, scale.expand(128)

    def check(self):
        assert self.written, "scenario wrote nothing"
        for slot, (r, p) in self.written.items():
            ref = self.reference(r, p).float()
            got, scale = self.read(slot)
            tol = ref.abs() * (2.0**-4 + 2.0**-8) + scale * 2.0**-10 + 1e-7
            if self.head == 512:
                tol[448:] = ref[448:].abs() * 2.0**-8 + 1e-6
            bad = (got - ref).abs() > tol
            assert not bad.any(), (
                f"req {r} pos {p}: {int(bad.sum())} values off, first at "
                f"{int(bad.nonzero()[0])}: got {got[bad][0]} want {ref[bad][0]}")
            # The UE8M0 scale rule on the (bf16-rounded) block maxima.
            blocks = ref.view(-1, 64 if self.head == 512 else 128)[:7 if self.head == 512 else 1]
            amax = blocks.to(torch.bfloat16).float().abs().amax(-1).clamp(min=1e-4)
            want = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
            have = scale.view(-1, 64 if self.head == 512 else 128)[: want.shape[0], 0]
            assert torch.equal(have, want), (r, p, have, want)
        # Every byte outside the written slots is untouched.
        mask = torch.ones_like(self.kv_cache, dtype=torch.bool)
        mv = mask.view(mask.shape[0], -1)
        bs = self.kv_block
        tb, sb = (576, 8) if self.head == 512 else (128, 4)
        for slot in self.written:
            b, t = divmod(slot, bs)
            mv[b, t * tb:(t + 1) * tb] = False
            mv[b, bs * tb + t * sb: bs * tb + (t + 1) * sb] = False
        assert torch.equal(self.kv_cache[mask], self.kv_cache_before[mask])


@pytest.mark.parametrize("ratio,head,kv_block", [(4, 128, 4), (4, 512, 4), (128, 512, 1)])
def test_chunked_prefill_then_decode_matches_float64_compressor(ratio, head, kv_block):
    """Windows cross state-cache blocks (4/8 tokens) and compressed slots cross KV pages; the
    state of a window opened in one step is finished in a later one (chunked prefill, decode)."""
    if ratio == 4:
        lens = [43, 30]
        steps = [[(0, 0, 13), (1, 0, 9)], [(0, 13, 38), (1, 9, 27)],
                 [(0, 38, 39), (1, 27, 28)], [(0, 39, 40), (1, 28, 29)],
                 [(0, 40, 43), (1, 29, 30)]]
    else:
        lens = [300, 260]
        steps = [[(0, 0, 100), (1, 0, 127)], [(0, 100, 255), (1, 127, 200)],
                 [(0, 255, 256), (1, 200, 256)], [(0, 256, 300), (1, 256, 260)]]
    sc = Scenario(ratio, head, kv_block, lens, seed=ratio + head)
    for i, chunks in enumerate(steps):
        sc.step(chunks, pad=3 if i == 1 else 0)
    sc.check()


def test_fp4_indexer_cache_is_refused_by_name():
    sc = Scenario(4, 128, 4, [8])
    with pytest.raises(NotImplementedError, match="use_fp4_indexer_cache"):
        comp.compress_norm_rope_store_torch(
            state_cache=sc.state, num_actual=1, token_to_req_indices=torch.zeros(1),
            positions=torch.tensor([3]), slot_mapping=torch.tensor([0]),
            block_table=sc.state_bt, block_size=4, state_width=256,
            cos_sin_cache=sc.cos_sin, kv_cache=sc.kv_cache,
            k_cache_metadata=_Meta(torch.tensor([0])), pdl_kwargs={}, head_dim=128,
            rope_head_dim=ROPE, compress_ratio=4, overlap=True, use_fp4_cache=True,
            rms_norm_weight=sc.weight, rms_norm_eps=1e-6, quant_block=32,
            token_stride=64, scale_dim=4)


def test_indexer_k_writer_round_trips_through_the_fork_decoders():
    """write_indexer_k_fp8 bytes == torch's own float8_e4m3fn cast (an independent encoder)."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn(20, 128, generator=g) * torch.logspace(-4, 3, 20)[:, None]
    cache = torch.zeros(3, 8, 132, dtype=torch.uint8)
    slots = torch.randperm(24, generator=g)[:20]
    slots[3] = -1
    comp.write_indexer_k_fp8(cache, slots, k)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, t = divmod(s, 8)
        blk = cache[b].reshape(-1)
        scale = blk[1024 + 4 * t: 1028 + 4 * t].view(torch.float32)
        v = k[i].to(torch.bfloat16).float()
        want = (v / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(blk[128 * t: 128 * (t + 1)], want)


def test_save_partial_states_matches_upstream_triton_kernel():
    triton_interp = pytest.importorskip("triton_interp")
    mod = triton_interp.import_with_real_triton(
        "vllm.models.deepseek_v4.common.ops.save_partial_states")
    g = torch.Generator().manual_seed(3)
    for ratio, head in ((4, 2 * 128), (128, 512)):
        bs = 4 if ratio == 4 else 8
        n = 19
        kv = torch.randn(n, head, generator=g).to(torch.bfloat16)
        score = torch.randn(n, head, generator=g).to(torch.bfloat16)
        ape = torch.randn(ratio, head, generator=g)
        pos = torch.randint(0, 1000, (n,), generator=g)
        slots = torch.randperm(6 * bs, generator=g)[:n]
        slots[[2, 11]] = -1
        ours = torch.randn(6, bs, 2 * head, generator=g)
        theirs = ours.clone()
        comp.save_partial_states_torch(kv, score, ape, pos, ours, slots, bs, head, ratio)
        mod.save_partial_states(kv, score, ape, pos, theirs, slots, bs, head, ratio)
        assert torch.equal(ours, theirs)


def test_deepseek_compressor_forward_takes_the_no_fp8_twins_on_cpu(monkeypatch):
    """The hook in DeepseekCompressor.forward: on the CPU (no FP8, no Triton device) a real
    forward writes the state and the indexer K cache exactly as the twins called directly."""
    from types import SimpleNamespace

    from torch import nn

    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.models.deepseek_v4 import compressor as compressor_mod
    from vllm.models.deepseek_v4.compressor import CompressorMetadata, DeepseekCompressor
    from vllm.platforms import gfx936_capability as cap
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(cap, "current_platform", CpuPlatform())
    sc = Scenario(4, 128, 4, [23], seed=5)
    state0, cache0 = sc.state.clone(), sc.kv_cache.clone()
    sc.step([(0, 0, 23)])  # the twins, called directly
    want_state, want_cache = sc.state, sc.kv_cache

    c = object.__new__(DeepseekCompressor)
    nn.Module.__init__(c)
    for k, v in dict(compress_ratio=4, head_dim=128, coff=2, overlap=True, rope_head_dim=ROPE,
                     rms_norm_eps=1e-6, use_fp4_cache=False, _quant_block=128,
                     _token_stride=128, _scale_dim=4, _use_two_stage_fused_compressor=False,
                     eager_scratch_pool=None, k_cache_prefix="kc").items():
        setattr(c, k, v)
    # what DeepseekCompressor.__init__ decides once on the CPU
    c.no_fp8 = cap.lacks_fp8_conversion()
    c.save_partial_states = compressor_mod.save_partial_states_gfx936
    c.ape = nn.Parameter(sc.ape, requires_grad=False)
    c.state_cache = SimpleNamespace(kv_cache=state0, prefix="sc")
    c.norm = SimpleNamespace(weight=sc.weight)
    c._static_forward_context = {"kc": SimpleNamespace(kv_cache=cache0)}
    p = torch.arange(23)
    slots = sc.state_bt[0, p // 4].long() * 4 + p % 4
    cpos = p // 4
    ks = sc.kv_bt[0, cpos // 4].long() * 4 + cpos % 4
    kv_slots = torch.where((p + 1) % 4 == 0, ks, torch.full_like(ks, -1))
    meta = {"sc": CompressorMetadata(block_table=sc.state_bt, slot_mapping=slots, block_size=4,
                                     token_to_req_indices=torch.zeros(23, dtype=torch.int32)),
            "kc": _Meta(kv_slots)}
    kv_score = torch.cat([sc.kv_hist[0], sc.sc_hist[0]], dim=-1)
    fc = ForwardContext(no_compile_layers={}, attn_metadata=meta, slot_mapping={})
    with override_forward_context(fc):
        c.forward(kv_score, p, SimpleNamespace(cos_sin_cache=sc.cos_sin))
    assert torch.equal(state0, want_state)
    assert torch.equal(cache0, want_cache)
