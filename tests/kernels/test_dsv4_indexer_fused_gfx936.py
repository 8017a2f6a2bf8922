# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused Lightning-indexer ops (patch dsv4-indexer-fused-gfx936): the Triton kernels under
TRITON_INTERPRET on the CPU.

References: the fork's PyTorch twins, the ops' CPU implementations (``indexer_q_rope_quant_torch``,
``_paged_decode_logits``, ``top_k_per_row``): q bytes and weights, logits and top-k indices must
be identical (the twins fix one rounding order for that: float64 dots, heads summed in order);
and references written here: logits in float64 from torch's own float8_e4m3fn cast (within the
fp32 rounding of the head sum), top-k as Python's sort by (-logit, index) on crafted ties.
Mutated copies of the kernel module (top-k ascending, the causal bound off by one, the K scale
inverted, q's scale exponent off by one) must fail the same comparisons. The H200 tier runs the
compiled kernels against the twins (the helper's report; bench numbers there)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.quantization.utils.lowp_codecs_torch import ue8m0_exponent
from vllm.models.deepseek_v4.common.ops import gfx936_indexer_q_triton as qtri
from vllm.models.deepseek_v4.common.ops.gfx936_indexer_q import indexer_q_rope_quant_torch
from vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton import _ue8m0_exp
from vllm.v1.attention.ops import gfx936_indexer_topk_triton as ktri
from vllm.v1.attention.ops import gfx936_sparse_attn_indexer as idx

D, SB = 128, 4  # indexer head dim, scale bytes per key


# ---- inputs ---------------------------------------------------------------------------------
def _cos_sin(n=4096):
    ang = torch.arange(n).double()[:, None] / (10000 ** (torch.arange(0, 64, 2).double() / 64))
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def _no_nan(codes: torch.Tensor) -> torch.Tensor:
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)


def _cache(nb: int, bs: int, g: torch.Generator, gap: int = 40) -> torch.Tensor:
    """A paged FP8 indexer K cache ``[nb, bs, 132]`` whose blocks sit ``gap`` bytes apart (the
    reader must take the block stride from the tensor): random E4M3 bytes (no NaN), fp32
    power-of-two scales, block-packed token-major."""
    stride = bs * (D + SB) + gap
    flat = torch.randint(0, 256, ((nb - 1) * stride + bs * (D + SB),), dtype=torch.uint8,
                         generator=g)
    cache = flat.as_strided((nb, bs, D + SB), (stride, D + SB, 1))
    blocks = cache.view(nb, -1)
    blocks[:, : bs * D] = _no_nan(blocks[:, : bs * D])
    scales = torch.pow(2.0, torch.randint(-12, 3, (nb, bs), generator=g).float())
    blocks[:, bs * D:] = scales.view(torch.uint8).view(nb, bs * SB)
    return cache


def _requests(lens, bs, nb, g, cols=None):
    """Block table (distinct random blocks, unused columns -1) and compressed lengths."""
    need = [max(1, -(-n // bs)) for n in lens]
    cols = cols or max(need)
    perm = torch.randperm(nb, generator=g).tolist()
    bt = torch.full((len(lens), cols), -1, dtype=torch.int32)
    for r, k in enumerate(need):
        bt[r, :k] = torch.tensor(perm[:k], dtype=torch.int32)
        perm = perm[k:]
    return bt, torch.tensor(lens, dtype=torch.int32)


def _q(rows: int, heads: int, g: torch.Generator):
    codes = _no_nan(torch.randint(0, 256, (rows, heads, D), dtype=torch.uint8, generator=g))
    return codes, torch.randn(rows, heads, generator=g)


def _pipeline(mod, q, w, cache, bt, seq, next_n, top_k, max_len, block_n=16, splits=2, block=64):
    logits = mod.indexer_logits_triton(q, w, cache, bt, seq, max_len, block_n=block_n,
                                       splits=splits)
    out = torch.full((q.shape[0] * next_n + 2, top_k), 99, dtype=torch.int32)
    mod.indexer_topk_triton(logits, seq, next_n, top_k, out, block=block)
    return logits, out


def _twin(q, w, cache, bt, seq, next_n, top_k, max_len):
    ends = idx.decode_row_ends(seq, next_n)
    logits = idx._paged_decode_logits(q, cache, w, ends, bt, max_len)
    out = torch.full((q.shape[0] * next_n + 2, top_k), 99, dtype=torch.int32)
    idx.top_k_per_row(logits, None, ends.clamp(max=logits.shape[1]), top_k, out)
    return logits, out, ends


# (compressed lengths, block size, next_n, per-row seq lens, heads, top_k)
CASES = [
    ([0, 3, 8, 9, 37, 130], 16, 1, False, 4, 8),  # shorter than, equal to, one over top-k
    ([200, 1, 64], 64, 1, False, 4, 8),
    ([21, 70], 16, 2, False, 4, 8),  # MTP: row (b, j) ends at len - 2 + j + 1
    ([[9, 40], [70, 71]], 16, 2, True, 4, 8),  # per-row lengths [B, next_n]
    ([75, 300], 64, 1, False, 64, 16),  # Flash's 64 heads
]


def _case(lens, bs, next_n, per_row, heads, seed):
    g = torch.Generator().manual_seed(seed)
    flat = [max(x) if per_row else x for x in lens]
    nb = sum(max(1, -(-n // bs)) for n in flat) + 3
    cache = _cache(nb, bs, g)
    bt, seq = _requests(flat, bs, nb, g)
    if per_row:
        seq = torch.tensor(lens, dtype=torch.int32)
    q, w = _q(len(flat) * next_n, heads, g)
    return cache, bt, seq, q.view(len(flat), next_n, heads, D), w


@pytest.mark.parametrize("lens,bs,next_n,per_row,heads,top_k", CASES)
def test_logits_and_topk_match_the_twins_bit_for_bit(lens, bs, next_n, per_row, heads, top_k):
    cache, bt, seq, q, w = _case(lens, bs, next_n, per_row, heads, seed=len(str(lens)) + bs)
    max_len = bt.shape[1] * bs + 5  # wider than the block table: W = table width * bs
    t_logits, t_out, ends = _twin(q, w, cache, bt, seq, next_n, top_k, max_len)
    k_logits, k_out = _pipeline(ktri, q, w, cache, bt, seq, next_n, top_k, max_len)
    assert k_logits.shape == t_logits.shape == (q.shape[0] * next_n, bt.shape[1] * bs)
    for r, e in enumerate(ends.tolist()):
        assert torch.equal(k_logits[r, :e], t_logits[r, :e]), r
    assert torch.equal(k_out, t_out)
    assert bool((k_out[-2:] == 99).all()), "rows past the batch must stay untouched"


@pytest.mark.parametrize("block_n,splits", [(8, 1), (16, 3), (64, 7)])
def test_logits_do_not_depend_on_the_chunking(block_n, splits):
    cache, bt, seq, q, w = _case([0, 3, 8, 9, 37, 130], 16, 1, False, 4, seed=5)
    ref = ktri.indexer_logits_triton(q, w, cache, bt, seq, 4096, block_n=32, splits=1)
    got = ktri.indexer_logits_triton(q, w, cache, bt, seq, 4096, block_n=block_n, splits=splits)
    for r, e in enumerate(seq.tolist()):
        assert torch.equal(got[r, :e], ref[r, :e])


def test_logits_against_float64_from_torch_fp8_casts():
    """Written from the contract: logits[n] = k_scale[n] * sum_h relu(q_h . k_n) * w_h, q/K
    decoded by torch's float8_e4m3fn cast, in float64. The kernel's dots are exact and rounded
    once to fp32; its head sum runs in fp32: within (H + 2) * 2^-24 of sum_h |term_h|."""
    lens, bs, heads = [37, 130], 16, 8
    cache, bt, seq, q, w = _case(lens, bs, 1, False, heads, seed=11)
    got = ktri.indexer_logits_triton(q, w, cache, bt, seq, 4096, block_n=16, splits=2)
    blocks = cache.view(cache.shape[0], -1)
    for r, n_keys in enumerate(lens):
        n = torch.arange(n_keys)
        blk, p = bt[r, n // bs].long(), n % bs
        codes = blocks[blk[:, None], p[:, None] * D + torch.arange(D)]
        k = codes.view(torch.float8_e4m3fn).double()
        sbytes = blocks[blk[:, None], bs * D + p[:, None] * SB + torch.arange(SB)]
        scale = sbytes.contiguous().view(torch.float32).double().view(-1)
        qd = q[r, 0].view(torch.float8_e4m3fn).double()
        dot = (qd @ k.T).float().double()  # exact in float64; one fp32 rounding, as specified
        terms = dot.clamp_min(0) * w[r].double()[:, None]
        want = terms.sum(0) * scale
        tol = terms.abs().sum(0) * scale * (heads + 2) * 2.0**-24
        assert bool(((got[r, :n_keys].double() - want).abs() <= tol).all()), r


def _topk_reference(v: list[float], end: int, k: int) -> list[int]:
    if end <= k:
        return [i if i < end else -1 for i in range(k)]
    return sorted(range(end), key=lambda i: (-v[i], i))[:k]


@pytest.mark.parametrize("top_k,ends", [(8, [0, 5, 8, 9, 100, 1000]), (512, [300, 512, 513, 2048])])
def test_topk_on_crafted_ties_matches_the_twin_and_a_python_sort(top_k, ends):
    """Logits from a handful of values (most keys tie), with -0.0 beside +0.0 (equal) and
    +-inf: the order is descending logit, ties to the lower index (the twin's stable sort)."""
    g = torch.Generator().manual_seed(top_k)
    width = max(ends) + 7
    vals = torch.tensor([-3.0, -0.0, 0.0, 0.5, 0.5, 2.0, float("inf"), float("-inf")])
    logits = vals[torch.randint(0, len(vals), (len(ends), width), generator=g)]
    logits[-1, : width // 2] = torch.randn(width // 2, generator=g)  # and a row of distinct values
    seq = torch.tensor(ends, dtype=torch.int32)
    out = torch.full((len(ends), top_k), 7, dtype=torch.int32)
    ktri.indexer_topk_triton(logits, seq, 1, top_k, out, block=128)
    twin = torch.full_like(out, 7)
    idx.top_k_per_row(logits, None, seq, top_k, twin)
    assert torch.equal(out, twin)
    for r, e in enumerate(ends):
        assert out[r].tolist() == _topk_reference(logits[r].tolist(), e, top_k), r


def test_topk_nan_sorts_first_as_in_the_twin():
    logits = torch.tensor([[1.0, float("nan"), 3.0, float("nan"), 2.0, 0.0, -1.0, 5.0, 4.0,
                            float("nan")]])
    seq = torch.tensor([10], dtype=torch.int32)
    out = torch.empty((1, 4), dtype=torch.int32)
    ktri.indexer_topk_triton(logits, seq, 1, 4, out, block=4)
    twin = torch.empty_like(out)
    idx.top_k_per_row(logits, None, seq, 4, twin)
    assert torch.equal(out, twin) and out[0].tolist() == [1, 3, 9, 7]


# ---- q side ---------------------------------------------------------------------------------
@pytest.mark.parametrize("T,H,cs_dtype", [(1, 4, torch.float32), (7, 64, torch.float32),
                                         (33, 5, torch.bfloat16)])
def test_q_rope_quant_matches_the_twin_bit_for_bit(T, H, cs_dtype):
    g = torch.Generator().manual_seed(T * H)
    q = (torch.randn(T, H, D, generator=g) * torch.logspace(-6, 3, T)[:, None, None]).to(
        torch.bfloat16)
    q[0, 0] *= 1e-3  # a head under the 1e-4 scale floor
    pos = torch.randint(0, 4096, (T,), generator=g)
    cs = _cos_sin().to(cs_dtype)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16)
    t_codes, t_w = indexer_q_rope_quant_torch(pos, q, cs, w, D**-0.5, H**-0.5)
    k_codes, k_w = qtri.indexer_q_rope_quant_triton(pos, q, cs, w, D**-0.5, H**-0.5)
    assert k_codes.dtype == torch.uint8 and k_codes.shape == (T, H, D)
    assert torch.equal(k_codes, t_codes.view(torch.uint8))
    assert torch.equal(k_w, t_w)


def test_q_rope_quant_bad_shapes_name_the_tensor():
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"index_q \(2, 4, 64\)"):
        qtri.indexer_q_rope_quant_triton(torch.zeros(2, dtype=torch.long), q, _cos_sin(8),
                                         torch.zeros(2, 4), 1.0, 1.0)
    q = torch.zeros(2, 4, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"index_weights \(2, 3\)"):
        qtri.indexer_q_rope_quant_triton(torch.zeros(2, dtype=torch.long), q, _cos_sin(8),
                                         torch.zeros(2, 3), 1.0, 1.0)


def test_logits_and_topk_bad_inputs_name_the_tensor():
    cache, bt, seq, q, w = _case([9], 16, 1, False, 4, seed=1)
    with pytest.raises(ValueError, match=r"kv_cache \(4, 16, 128\)"):
        ktri.indexer_logits_triton(q, w, cache[..., :D], bt, seq, 64)
    with pytest.raises(ValueError, match=r"weights \(1, 3\)"):
        ktri.indexer_logits_triton(q, w[:, :3], cache, bt, seq, 64)
    with pytest.raises(ValueError, match=r"out torch.int64"):
        ktri.indexer_topk_triton(torch.zeros(1, 16), seq, 1, 8,
                                 torch.zeros(1, 8, dtype=torch.int64))


# ---- the ops --------------------------------------------------------------------------------
def test_the_ops_run_the_twins_on_the_cpu_and_have_fakes():
    from vllm.models.deepseek_v4.common.ops import gfx936_indexer_q_fused as qop
    from vllm.v1.attention.ops import gfx936_indexer_topk as kop

    cache, bt, seq, q, w = _case([3, 37], 16, 1, False, 4, seed=2)
    logits = kop.paged_indexer_logits_gfx936(q.view(torch.float8_e4m3fn), w, cache, bt, seq, 64)
    t_logits, t_out, _ = _twin(q, w, cache, bt, seq, 1, 8, 64)
    assert torch.equal(logits, t_logits)  # the twin's -inf past each end included
    out = torch.full_like(t_out, 99)
    kop.indexer_topk_gfx936(logits, seq, 1, 8, out)
    assert torch.equal(out, t_out)
    fake = kop._logits_fake(q, w, cache, bt, seq, 1000)
    assert fake.shape == (2, bt.shape[1] * 16) and fake.dtype == torch.float32

    g = torch.Generator().manual_seed(3)
    pos, xq = torch.arange(4), torch.randn(4, 4, D, generator=g).to(torch.bfloat16)
    xw = torch.randn(4, 4, generator=g)
    codes, w_out = qop.indexer_q_rope_quant_gfx936(pos, xq, _cos_sin(8), xw, 0.5, 0.25)
    t_codes, t_w = indexer_q_rope_quant_torch(pos, xq, _cos_sin(8), xw, 0.5, 0.25)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(torch.uint8), t_codes.view(torch.uint8))
    assert torch.equal(w_out, t_w)
    f_codes, f_w = qop._indexer_q_fake(pos, xq, _cos_sin(8), xw, 0.5, 0.25)
    assert f_codes.shape == (4, 4, D) and f_codes.dtype == torch.uint8
    assert f_w.shape == (4, 4) and f_w.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="use_fp4_indexer_cache"):
        qop.indexer_q_rope_quant_gfx936(pos, xq, _cos_sin(8), xw, 0.5, 0.25, use_fp4=True)


@pytest.mark.parametrize("requires_padding", [False, True])
def test_indexer_decode_takes_the_kernels_when_on_a_device(monkeypatch, requires_padding):
    """The whole no-FP8 indexer op on a decode batch with the ops' device branch forced (the
    Triton kernels, interpreted): the same top-k buffer as the CPU's twins; with MTP padding
    (a request decoding fewer tokens than next_n) too."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
    )
    from vllm.v1.attention.ops import gfx936_indexer_topk as kop

    next_n = 2 if requires_padding else 1
    decode_lens = torch.tensor([2, 1, 2] if requires_padding else [1, 1, 1], dtype=torch.int32)
    nd = int(decode_lens.sum())
    cache, bt, seq, _, _ = _case([5, 60, 129], 16, 1, False, 4, seed=4)
    g = torch.Generator().manual_seed(8)
    q, w = _q(nd, 4, g)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=seq, max_seq_len=int(seq.max()) * 4, slot_mapping=torch.zeros(nd),
        num_decodes=3, num_decode_tokens=nd, num_prefills=0, num_prefill_tokens=0,
        decode=DeepSeekV32IndexerDecodeMetadata(
            block_table=bt, seq_lens=seq, decode_lens=decode_lens,
            requires_padding=requires_padding, schedule_metadata=torch.zeros(1)))
    results = []
    for device_branch in (False, True):
        monkeypatch.setattr(kop, "_kernels", lambda t, _on=device_branch: _on)
        buf = torch.full((nd + 2, 8), 55, dtype=torch.int32)
        fc = ForwardContext(no_compile_layers={}, attn_metadata={"kc": meta}, slot_mapping={})
        with override_forward_context(fc):
            idx.gfx936_sparse_attn_indexer(
                torch.zeros(nd + 2, 8), "kc", cache, q.view(torch.float8_e4m3fn), None, w,
                128, "ue8m0", 8, D, 4096, 1000, buf, True)
        results.append(buf)
    assert torch.equal(results[0], results[1])
    assert bool((results[1][nd:] == -1).all())


# ---- mutations: the comparisons above must catch a broken kernel -----------------------------
MUTATIONS = [
    ("topk-ascending", ktri, "c = tl.sort(c, descending=True)", "c = tl.sort(c, descending=False)"),
    ("causal-bound-off-by-one", ktri, "return tl.minimum(tl.maximum(end, 0), width)",
     "return tl.minimum(tl.maximum(end + 1, 0), width)"),
    ("k-scale-inverted", ktri, "acc * k_scale, mask=n < end", "acc / k_scale, mask=n < end"),
    ("q-scale-exponent", qtri, "inv = ((127 - e) << 23)", "inv = ((126 - e) << 23)"),
]


def _mutant(module, old: str, new: str, tmp_path: Path, name: str):
    src = Path(module.__file__).read_text()
    assert src.count(old) == 1, f"mutation anchor moved: {old!r}"
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,module,old,new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutated_kernels_fail_the_twin_comparison(tmp_path, name, module, old, new):
    mod = _mutant(module, old, new, tmp_path, name)
    if module is qtri:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(3, 4, D, generator=g).to(torch.bfloat16)
        pos, w = torch.arange(3), torch.randn(3, 4, generator=g)
        t_codes, t_w = indexer_q_rope_quant_torch(pos, q, _cos_sin(8), w, 0.5, 0.5)
        codes, w_out = mod.indexer_q_rope_quant_triton(pos, q, _cos_sin(8), w, 0.5, 0.5)
        assert not (torch.equal(codes, t_codes.view(torch.uint8)) and torch.equal(w_out, t_w))
        return
    cache, bt, seq, q, w = _case([0, 3, 8, 9, 37, 130], 16, 1, False, 4, seed=6)
    t_logits, t_out, ends = _twin(q, w, cache, bt, seq, 1, 8, 4096)
    k_logits, k_out = _pipeline(mod, q, w, cache, bt, seq, 1, 8, 4096)
    same_logits = all(torch.equal(k_logits[r, :e], t_logits[r, :e])
                      for r, e in enumerate(ends.tolist()))
    assert not (same_logits and torch.equal(k_out, t_out)), name


@triton.jit
def _exp_probe(a_ptr, e_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(e_ptr + i, _ue8m0_exp(tl.load(a_ptr + i, mask=i < n, other=1.0)), mask=i < n)


def test_scale_exponent_helper_matches_log2_for_every_bf16_amax():
    """The kernel's exponent comes from amax's bits, the twin's from ceil(log2(a / 448)) in
    fp32: equal for every positive finite bf16 value (q's amax is a bf16 value), so the q op
    is bitwise the twin."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)  # every positive finite bf16
    a = (bits << 16).view(torch.float32)
    got = torch.empty_like(bits)
    _exp_probe[(triton.cdiv(a.numel(), 4096),)](a, got, a.numel(), BLOCK=4096)
    assert torch.equal(got, ue8m0_exponent(a))
    assert math.isclose(float(a[-1]), 3.3895313892515355e38)
