# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused compressor store (patch dsv4-compressor-fused-gfx936): the Triton kernel of
gfx936_compressor_triton.py under TRITON_INTERPRET on the CPU (``--device cuda``: compiled, on
the H200 tier, from the modules bench/stage.py stages into .device/layer).

References:
- the fork's PyTorch twin (``compress_norm_rope_store_torch``, the op's CPU implementation), on
  the same state: every byte the twin leaves alone stays alone, and the written tokens decode
  to within one quantization step of the twin's. Bound, not bitwise: the kernel sums the
  softmax (online, 16 rows at a time for C128) and the RMS in another order than torch, so the
  float32 values differ by a few ulps, and a value that close to a bf16 / E4M3 rounding
  boundary lands on the neighbouring code (measured: none of these cases' bytes under the
  interpreter; compiled on the H200, 0-3 of a decode step's bytes at batch 1-64);
- a float64 model of the compressor written from DeepSeek V4's definition
  (tests/runtime/compressor_reference.py: softmax over score + ape per column, C4's
  previous-window half, RMSNorm, GPT-J RoPE at (p // r) * r), against the written bytes
  decoded with torch's own float8_e4m3fn and bfloat16 dtypes;
- source mutations of the kernel (window without the overlap half, RoPE on the wrong half,
  RoPE at the token's own position, C128's online softmax not rescaled between row blocks) and
  of the state the store reads (ape dropped) must fail the float64 check.
Scenarios: C4 (main, head 512; indexer, head 128) and C128 (head 512); several requests of
different lengths in chunked prefill and decode steps, windows that close and that do not,
padded tokens (slot -1), state and compressed-cache blocks of different sizes, a block-packed
fp8_ds_mla cache with a gap between blocks.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compressor_reference import compressed_entry_f64, cos_sin_table, step_tensors

REPO = Path(__file__).resolve().parents[2]
ROPE = 64
EPS = 1e-6


@pytest.fixture(scope="module")
def dev(request) -> str:
    return request.config.getoption("--device", default="cpu")


def _modules():
    from vllm.models.deepseek_v4.common.ops import gfx936_compressor as twin
    from vllm.models.deepseek_v4.common.ops import gfx936_compressor_triton as kern

    return twin, kern


class Case:
    """Requests of different lengths over a paged state cache and a paged compressed cache."""

    def __init__(self, ratio, head, kv_block, lens, seed):
        g = torch.Generator().manual_seed(seed)
        self.g, self.ratio, self.head, self.lens = g, ratio, head, lens
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        self.state_bs = 4 if ratio == 4 else 8
        self.kv_block = kv_block
        w = self.coff * head
        per_req = -(-max(lens) // self.state_bs)
        nsb = len(lens) * per_req + 3
        self.state = torch.randn(nsb, self.state_bs, 2 * w, generator=g)  # garbage rows
        self.state_bt = torch.randperm(nsb, generator=g)[: len(lens) * per_req].view(
            len(lens), -1).to(torch.int32)
        kpr = -(-(max(lens) // ratio + 1) // kv_block)
        nkb = len(lens) * kpr + 2
        self.kv_bt = torch.randperm(nkb, generator=g)[: len(lens) * kpr].view(
            len(lens), -1).to(torch.int32)
        if head == 512:  # block-packed, a 96-byte gap between blocks
            self.row, self.stride = 584, kv_block * 584 + 96
        else:
            self.row, self.stride = 132, kv_block * 132
        self.nkb = nkb
        self.flat = torch.randint(0, 256, ((nkb - 1) * self.stride + kv_block * self.row,),
                                  generator=g, dtype=torch.uint8)
        self.ape = torch.randn(ratio, w, generator=g)
        self.weight = 1 + 0.1 * torch.randn(head, generator=g)
        self.cos_sin = cos_sin_table(max(lens) + 8, ROPE)
        self.kv_hist = [torch.randn(n, w, generator=g).to(torch.bfloat16) for n in lens]
        self.sc_hist = [(2 * torch.randn(n, w, generator=g)).to(torch.bfloat16) for n in lens]

    def cache(self, flat):
        if self.head == 512:
            return flat.as_strided((self.nkb, self.kv_block, 584), (self.stride, 584, 1))
        return flat.view(self.nkb, self.kv_block, 132)

    def batch(self, chunks, pad=0):
        """chunks [(req, start, end)] -> the step's tensors, as the engine lays them out."""
        return step_tensors(self.kv_hist, self.sc_hist, chunks, ratio=self.ratio,
                            state_bt=self.state_bt, state_bs=self.state_bs, kv_bt=self.kv_bt,
                            kv_block=self.kv_block, pad=pad, generator=self.g)

    def args(self, b, state, flat):
        return dict(state_cache=state, kv_cache=self.cache(flat), token_to_req_indices=b.req,
                    positions=b.pos, slot_mapping=b.slots, kv_slot_mapping=b.kv_slots,
                    block_table=self.state_bt, cos_sin_cache=self.cos_sin,
                    rms_norm_weight=self.weight, block_size=self.state_bs,
                    state_width=state.shape[-1] // 2, head_dim=self.head, rope_head_dim=ROPE,
                    compress_ratio=self.ratio, overlap=self.overlap, rms_norm_eps=EPS)

    # float64 model --------------------------------------------------------------------------
    def reference(self, r, p, ape=True):
        return compressed_entry_f64(
            self.kv_hist[r], self.sc_hist[r], self.ape if ape else None, self.weight,
            self.cos_sin, p, head=self.head, ratio=self.ratio, overlap=self.overlap, rope=ROPE,
            eps=EPS)

    def read(self, flat, slot):
        """(values, per-value scale) of compressed token ``slot``, decoded with torch's dtypes."""
        b, t = divmod(slot, self.kv_block)
        blk = flat[b * self.stride: b * self.stride + self.kv_block * self.row]
        bs = self.kv_block
        if self.head == 512:
            data = blk[t * 576:(t + 1) * 576]
            sb = blk[bs * 576 + t * 8: bs * 576 + t * 8 + 8]
            assert int(sb[7]) == 0, "scale pad byte must be 0"
            scales = torch.pow(2.0, sb[:7].double() - 127)
            nope = data[:448].view(torch.float8_e4m3fn).double().view(7, 64) * scales[:, None]
            rope = data[448:].clone().view(torch.bfloat16).double()
            return (torch.cat([nope.flatten(), rope]),
                    torch.cat([scales.repeat_interleave(64), torch.zeros(64, dtype=torch.float64)]))
        vals = blk[t * 128:(t + 1) * 128].view(torch.float8_e4m3fn).double()
        scale = blk[bs * 128 + t * 4: bs * 128 + t * 4 + 4].clone().view(torch.float32).double()
        return vals * scale, scale.expand(128)

    def footprint(self, slots):
        """Bool mask of the bytes that compressed tokens ``slots`` own."""
        m = torch.zeros_like(self.flat, dtype=torch.bool)
        tb, sb = (576, 8) if self.head == 512 else (128, 4)
        for s in slots:
            b, t = divmod(s, self.kv_block)
            o = b * self.stride
            m[o + t * tb: o + (t + 1) * tb] = True
            m[o + self.kv_block * tb + t * sb: o + self.kv_block * tb + (t + 1) * sb] = True
        return m


def _quant_tol(ref, scale, head):
    """E4M3 half ulp (2^-4 relative) after a bf16 rounding (2^-9), subnormal step scale*2^-10;
    RoPE bf16 (2^-9 relative)."""
    tol = ref.abs() * (2.0**-4 + 2.0**-8) + scale * 2.0**-10 + 1e-7
    if head == 512:
        tol[448:] = ref[448:].abs() * 2.0**-8 + 1e-6
    return tol


# C4 main, C4 indexer, C128 main; compressed-cache blocks of 64, 4, 2 and 1 tokens
C4_STEPS = [[(0, 0, 13), (1, 0, 9), (2, 0, 2)], [(0, 13, 38), (1, 9, 27), (2, 2, 5)],
            [(0, 38, 39), (1, 27, 28), (2, 5, 6)], [(0, 39, 40), (1, 28, 29), (2, 6, 7)],
            [(0, 40, 43), (1, 29, 30), (2, 7, 8)]]
C128_STEPS = [[(0, 0, 100), (1, 0, 127)], [(0, 100, 255), (1, 127, 200)],
              [(0, 255, 256), (1, 200, 256)], [(0, 256, 300), (1, 256, 260)]]
CASES = [(4, 512, 64, [43, 30, 8], C4_STEPS), (4, 128, 4, [43, 30, 8], C4_STEPS),
         (4, 512, 2, [43, 30, 8], C4_STEPS), (128, 512, 1, [300, 260], C128_STEPS),
         (128, 512, 64, [300, 260], C128_STEPS)]
IDS = ["c4-main-kvblock64", "c4-indexer-kvblock4", "c4-main-kvblock2", "c128-main-kvblock1",
       "c128-main-kvblock64"]


def _run(case, kern_store, twin, dev, ape=True):
    """Run the steps: the twin saves the state (the same state for both writers), then the
    twin and ``kern_store`` each write their own copy of the compressed cache. Returns
    (twin bytes, kernel bytes, written slots)."""
    f_twin, f_kern = case.flat.clone(), case.flat.clone()
    state = case.state.clone()
    ape_t = case.ape if ape else torch.zeros_like(case.ape)
    written = {}
    for i, chunks in enumerate(case.steps):
        b = case.batch(chunks, pad=3 if i == 1 else 0)
        twin.save_partial_states_torch(b.kv, b.sc, ape_t, b.pos, state, b.slots,
                                       case.state_bs, state.shape[-1] // 2, case.ratio)
        a = case.args(b, state, f_twin)
        twin.compress_norm_rope_store_torch(
            num_actual=b.slots.shape[0], k_cache_metadata=SimpleNamespace(
                slot_mapping=a.pop("kv_slot_mapping")), pdl_kwargs={}, use_fp4_cache=False,
            quant_block=0, token_stride=0, scale_dim=0, **a)
        d = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
             for k, v in case.args(b, state, f_kern).items()}
        d["kv_cache"] = case.cache(f_kern.to(dev) if dev != "cpu" else f_kern)
        kern_store(**d)
        if dev != "cpu":
            f_kern.copy_(d["kv_cache"].as_strided((f_kern.numel(),), (1,)).cpu())
        for r, p, k in b.closing:
            written[k] = (r, p)
    return f_twin, f_kern, written


def _case(params, seed=0):
    ratio, head, kv_block, lens, steps = params
    c = Case(ratio, head, kv_block, lens, seed=seed + ratio + head + kv_block)
    c.steps = steps
    return c


@pytest.mark.parametrize("params", CASES, ids=IDS)
def test_kernel_writes_the_twins_bytes_within_one_rounding_step(params, dev):
    twin, kern = _modules()
    case = _case(params)
    f_twin, f_kern, written = _run(case, kern.compress_norm_rope_store_triton_gfx936, twin, dev)
    assert written, "the scenario closes no window"
    own = case.footprint(written)
    # bytes no written token owns: untouched by both (skipped slots, non-closing tokens)
    assert torch.equal(f_kern[~own], case.flat[~own]), "the kernel wrote outside its slots"
    assert torch.equal(f_twin[~own], case.flat[~own])
    diff = int((f_kern[own] != f_twin[own]).sum())
    assert diff <= max(2, own.sum() // 200), f"{diff} of {int(own.sum())} bytes differ"
    for slot, (r, p) in written.items():
        a, sa = case.read(f_twin, slot)
        b, sb = case.read(f_kern, slot)
        # one E4M3 step of the tile (2^-3 relative + the subnormal step) or one bf16 ulp
        tol = torch.maximum(a.abs(), b.abs()) * 2.0**-3 + torch.maximum(sa, sb) * 2.0**-9
        if case.head == 512:
            tol[448:] = torch.maximum(a[448:].abs(), b[448:].abs()) * 2.0**-7
        assert bool(((a - b).abs() <= tol).all()), (r, p, float((a - b).abs().max()))


@pytest.mark.parametrize("params", CASES, ids=IDS)
def test_kernel_matches_the_float64_compressor(params, dev):
    twin, kern = _modules()
    case = _case(params, seed=11)
    _, f_kern, written = _run(case, kern.compress_norm_rope_store_triton_gfx936, twin, dev)
    _check_float64(case, f_kern, written)


def _check_float64(case, flat, written, ape=True):
    for slot, (r, p) in written.items():
        ref = case.reference(r, p, ape=ape)
        got, scale = case.read(flat, slot)
        bad = (got - ref).abs() > _quant_tol(ref, scale, case.head)
        assert not bool(bad.any()), (
            f"req {r} pos {p}: {int(bad.sum())} values off, max err "
            f"{float((got - ref).abs().max())}")
        # the UE8M0 rule on the bf16-rounded tile maxima of the float64 values
        tile = 64 if case.head == 512 else 128
        ntile = 7 if case.head == 512 else 1
        amax = ref[: tile * ntile].view(ntile, tile).to(torch.bfloat16).double().abs()
        want = torch.pow(2.0, torch.ceil(torch.log2(amax.amax(-1).clamp(min=1e-4) / 448)))
        assert torch.equal(scale[: tile * ntile: tile], want), (r, p)


# mutations of the product that the float64 check must catch --------------------------------
KERNEL = "models/deepseek_v4/common/ops/gfx936_compressor_triton.py"
MUTATIONS = {
    "overlap-dropped": ("ROWS: tl.constexpr = (1 + OVERLAP) * RATIO",
                        "ROWS: tl.constexpr = RATIO"),
    "overlap-half-not-shifted": ("row += (r >= RATIO).to(tl.int64) * HEAD",
                                 "row += 0 * HEAD"),
    "rope-on-the-first-half": ("i = tl.arange(0, HEAD // 2) - NOPE // 2",
                               "i = ROPE // 2 - 1 - tl.arange(0, HEAD // 2)"),
    "rope-at-own-position": ("cs = cs_ptr + (p // RATIO) * RATIO * cs_s0",
                             "cs = cs_ptr + p * cs_s0"),
    "online-softmax-not-rescaled": ("acc = acc * alpha + tl.sum(kv * e, axis=0)",
                                    "acc = acc + tl.sum(kv * e, axis=0)"),
}
C128_MUTATIONS = ("rope-at-own-position", "online-softmax-not-rescaled")


def _mutated(tmp_path, name, old, new):
    twin, kern = _modules()
    src = Path(kern.__file__).read_text()
    assert src.count(old) == 1, f"mutation {name}: {old!r} not found once in {KERNEL}"
    path = tmp_path / f"gfx936_compressor_triton_mut_{name.replace('-', '_')}.py"
    path.write_text(src.replace(old, new))
    modname = kern.__name__.rsplit(".", 1)[0] + "." + path.stem
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_float64_check_catches_kernel_mutations(name, tmp_path, dev):
    twin, _ = _modules()
    mod = _mutated(tmp_path, name, *MUTATIONS[name])
    params = CASES[3] if name in C128_MUTATIONS else CASES[0]
    case = _case(params, seed=11)
    _, f_kern, written = _run(case, mod.compress_norm_rope_store_triton_gfx936, twin, dev)
    with pytest.raises(AssertionError):
        _check_float64(case, f_kern, written)


def test_float64_check_catches_a_state_without_ape(dev):
    """ape dropped from the saved score: the store reads it, so the float64 check must fail."""
    twin, kern = _modules()
    case = _case(CASES[0], seed=11)
    _, f_kern, written = _run(case, kern.compress_norm_rope_store_triton_gfx936, twin, dev,
                              ape=False)
    with pytest.raises(AssertionError):
        _check_float64(case, f_kern, written)
    _check_float64(case, f_kern, written, ape=False)  # and it is that model it follows


def test_bad_inputs_name_the_tensor():
    twin, kern = _modules()
    case = _case(CASES[1])
    b = case.batch(C4_STEPS[0])
    a = case.args(b, case.state.clone(), case.flat.clone())
    with pytest.raises(ValueError, match=r"head_dim 256"):
        kern.compress_norm_rope_store_triton_gfx936(**{**a, "head_dim": 256})
    with pytest.raises(ValueError, match=r"kv_cache \(indexer K\)"):
        kern.compress_norm_rope_store_triton_gfx936(
            **{**a, "kv_cache": a["kv_cache"].view(torch.int8)})
    with pytest.raises(ValueError, match=r"state_cache must be float32"):
        kern.compress_norm_rope_store_triton_gfx936(
            **{**a, "state_cache": a["state_cache"].double()})


# the ops (CPU: the twins) ---------------------------------------------------------------------
def test_the_ops_run_the_twins_on_the_cpu_and_have_fakes(dev):
    if dev != "cpu":
        pytest.skip("the registered ops need vLLM (the CPU tier)")
    from vllm.models.deepseek_v4.common.ops import gfx936_compressor as twin
    from vllm.models.deepseek_v4.common.ops import gfx936_compressor_fused as fused

    case = _case(CASES[0])
    s_op, s_twin = case.state.clone(), case.state.clone()
    f_op, f_twin = case.flat.clone(), case.flat.clone()
    for chunks in case.steps:
        b = case.batch(chunks)
        w = s_op.shape[-1] // 2
        fused.save_partial_states_gfx936(kv=b.kv, score=b.sc, ape=case.ape, positions=b.pos,
                                         state_cache=s_op, slot_mapping=b.slots,
                                         block_size=case.state_bs, state_width=w,
                                         compress_ratio=case.ratio, pdl_kwargs={})
        twin.save_partial_states_torch(b.kv, b.sc, case.ape, b.pos, s_twin, b.slots,
                                       case.state_bs, w, case.ratio)
        kw = dict(num_actual=b.slots.shape[0], pdl_kwargs={}, use_fp4_cache=False,
                  quant_block=64, token_stride=576, scale_dim=8)
        for fn, s, f in ((fused.compress_norm_rope_store_gfx936, s_op, f_op),
                         (twin.compress_norm_rope_store_torch, s_twin, f_twin)):
            a = case.args(b, s, f)
            fn(k_cache_metadata=SimpleNamespace(slot_mapping=a.pop("kv_slot_mapping")),
               **kw, **a)
    assert torch.equal(s_op, s_twin) and torch.equal(f_op, f_twin)
    a = case.args(b, s_op, f_op)
    assert fused._store_fake(**a, quant_block=64, token_stride=576, scale_dim=8) is None
    assert fused._save_fake(b.kv, b.sc, case.ape, b.pos, s_op, b.slots, 4, 1024, 4) is None
    with pytest.raises(NotImplementedError, match="use_fp4_indexer_cache"):
        fused.compress_norm_rope_store_gfx936(
            k_cache_metadata=SimpleNamespace(slot_mapping=a.pop("kv_slot_mapping")),
            **{**kw, "use_fp4_cache": True}, **a)
