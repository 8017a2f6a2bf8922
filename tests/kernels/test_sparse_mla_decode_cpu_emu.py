# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936/sparse_mla_decode.cu, the kernel source itself, run on the CPU by g++ under the
emulation of the HIP/CUDA subset it uses (cpu_emu_compat.h: a block's threads as fibers in
rounds between barriers and shuffles) and compared with a float64 attention written here over
the K that the test's own fp8_ds_mla writer stored (tests/runtime/fp8_ds_mla_writer.py: its
own quantizer and decoder, not the product's). The launcher picks its own plan: 8 local heads
(2 key groups per head group, merged in LDS), 16, 24, 64 and 128 (16 heads per block, several
head blocks, the last one partly used at 24), SWA only and SWA + top-k, dense (with prefix
lengths) and ragged indices, -1 and out-of-range slots, a query whose keys are all skipped,
block strides larger than bs * 584 (16-byte aligned: the 16-byte load path; not: the byte
path), bf16 / f16 / f32 q, the sink, and split-K off and on (forced through the CU count given to the launcher: split-K only when
queries x head blocks is below it). The emulator's main calls the launcher four times and
fails when the second call's output differs in any bit (exit 5: the split-K tile counters
reset), when the third, with the blocks run in reverse grid order (split 0's block is then
the last of each tile, not split S-1's), does (exit 6: the merge does not depend on which
block is last), or when the fourth, with 3 blocks running at once and the first block to
count itself in held at its next barrier, does (exit 7: no block is counted before its rows
are written; test_blocks_at_once_catch_a_split_counted_in_before_its_rows).

What this tier cannot prove: the emulation's blocks at once are OS threads on x86 (a strong
memory order, fences as full fences): a missing fence or a stale L1 read on a GPU does not
show; the last-block protocol on real hardware (the fences, the L2 loads) is proven only on a
device (`make device-check`, bench/gfx936_kernels.py).

Tolerance: the output is float32 from float32 sums of <= 512 products per score and <= 64
keys per value, exp2 in float32; observed max abs error 7e-6 .. 2.1e-5, on the outlier dim
(|value| ~64, a float32 ulp there is 7.6e-6), asserted atol = rtol = 2e-5. A lost key, a
wrong LDS offset or a missing barrier is > 1e-2."""

import math
import subprocess
from pathlib import Path

import cpu_emu
import pytest
import torch
from fp8_ds_mla_writer import alloc_fp8_ds_mla_cache, dequantize_written_k, write_fp8_ds_mla

SCALE = 1.0 / math.sqrt(512)
QDTYPE = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}  # kBF16, kF16, kF32
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def emu_exe(tmp_path_factory):
    return cpu_emu.kernel_exe(tmp_path_factory.mktemp("sparse_mla_emu"), "sparse_mla_decode.cu",
                              "sparse_mla_emu", "sparse_mla_cpu_emu_main.cpp", 2)


def _cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The bytes from element [0, 0, 0] to the end of the last block (what the kernel may read)."""
    n = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1] * 584
    return torch.as_strided(cache, (n,), (1,), cache.storage_offset())


def _source(rng: torch.Generator, blocks: int, bs: int, stride_pad: int, n_keys: int,
            seed: int):
    """(cache, float64 K of every slot): random K written through the test's writer into
    `n_keys` slots of a cache whose block stride is bs * 584 + stride_pad."""
    cache = alloc_fp8_ds_mla_cache(blocks, bs, block_stride=bs * 584 + stride_pad,
                                   storage_offset=0, seed=seed)
    k = torch.randn(n_keys, 512, generator=rng) * 1.5
    # one NoPE group = an outlier + values below 2^-8: E4M3 subnormals (m * 2^-9)
    k[:, 64:128] = (torch.rand(n_keys, 64, generator=rng) * 2 - 1) * 0.003
    k[:, 64] = 64.0
    write_fp8_ds_mla(cache, k, torch.arange(n_keys))
    return cache, dequantize_written_k(k)


def _f64_attention(q, keys, sink):
    """softmax(scale * q k^T, with the sink as one more logit without a value) @ k, float64."""
    b, h, _ = q.shape
    out = torch.zeros(b, h, 512, dtype=torch.float64)
    for i in range(b):
        k = keys[i]
        if k.shape[0] == 0:
            continue
        s = SCALE * (q[i].double() @ k.T)
        m = s.max(dim=1, keepdim=True).values
        if sink is not None:
            m = torch.maximum(m, sink.double()[:h, None])
        e = torch.exp(s - m)
        den = e.sum(1, keepdim=True)
        if sink is not None:
            den = den + torch.exp(sink.double()[:h, None] - m)
        out[i] = (e / den) @ k
    return out


def _write_indices(tmp: Path, pre: str, rows, ragged: bool, width: int, lens: bool):
    if ragged:
        flat = [s for r in rows for s in r]
        torch.tensor(flat if flat else [0], dtype=torch.int32).numpy().tofile(tmp / f"{pre}idx.bin")
        ptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
        ptr.numpy().tofile(tmp / f"{pre}ptr.bin")
        return
    idx = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        if lens:  # garbage past each prefix length: the kernel must not read it
            idx[i, len(r):] = 3
    idx.numpy().tofile(tmp / f"{pre}idx.bin")
    if lens:
        torch.tensor([len(r) for r in rows], dtype=torch.int32).numpy().tofile(
            tmp / f"{pre}lens.bin")


def run_case(exe, tmp: Path, h: int, swa, topk=None, *, num_cus: int = 1, ragged=False,
             q_kind=0, sink=True, stride_pad=40, seed=0):
    """(kernel output float32 [b, h, 512], float64 attention, split count and heads per block
    the plan took)."""
    rng = torch.Generator().manual_seed(seed)
    b = len(swa)
    mcache, mk = _source(rng, 6, 16, stride_pad, 96, seed)
    q = (torch.randn(b, h, 512, generator=rng) * 0.5).to(QDTYPE[q_kind])
    sink_t = torch.randn(h, generator=rng) if sink else None
    lens = not ragged
    meta = [f"{b} {h} {q_kind} {SCALE!r} {int(sink)} {num_cus}",
            f"6 16 {mcache.stride(0)} {int(ragged)} 24 {int(lens)}"]
    _cache_bytes(mcache).numpy().tofile(tmp / "mcache.bin")
    _write_indices(tmp, "m", swa, ragged, 24, lens)
    keys = [[mk[s] for s in r if 0 <= s < 96] for r in swa]
    if topk is not None:
        ecache, ek = _source(rng, 5, 8, stride_pad + 16, 40, seed + 1)
        meta.append(f"1 5 8 {ecache.stride(0)} {int(ragged)} 40 {int(lens)}")
        _cache_bytes(ecache).numpy().tofile(tmp / "ecache.bin")
        _write_indices(tmp, "e", topk, ragged, 40, lens)
        for i, r in enumerate(topk):
            keys[i] += [ek[s] for s in r if 0 <= s < 40]
    else:
        meta.append("0")
    (tmp / "meta.txt").write_text("\n".join(meta) + "\n")
    q.contiguous().view(torch.uint8).numpy().tofile(tmp / "q.bin")
    if sink_t is not None:
        sink_t.numpy().tofile(tmp / "sink.bin")
    done = subprocess.run([str(exe), str(tmp)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = torch.from_file(str(tmp / "out.bin"), size=b * h * 512, dtype=torch.float32)
    keys = [torch.stack(k) if k else torch.zeros(0, 512, dtype=torch.float64) for k in keys]
    want = _f64_attention(q, keys, sink_t)
    splits, per_block = map(int, (tmp / "splits.txt").read_text().split())
    # the kernel's plan: split_count's rule (the Triton twin's) over 8-key tiles, keys per
    # query = dense width or ceil(nnz / b) per source; 8 heads per block at <= 8 heads, and
    # above 8 when 16-head blocks split as far as they go still leave CUs without a block
    from vllm.v1.attention.ops.gfx936_sparse_mla_launch import split_count

    def per_query(rows, width):
        return -(-sum(len(r) for r in rows) // b) if ragged else width

    avg = per_query(swa, 24) + (per_query(topk, 40) if topk is not None else 0)

    def plan(per):
        return per, split_count(b, -(-h // per), avg, num_cus, 8)

    rule = plan(8) if h <= 8 else plan(16)
    if h > 8 and b * -(-h // 16) * rule[1] < num_cus:
        rule = plan(8)
    assert (per_block, splits) == rule, (per_block, splits, rule)
    return out.view(b, h, 512), want, splits, per_block


# query 0: -1, slots past the cache (96, 400) and 22 valid keys; query 1: none valid (every
# slot skipped); query 2: three keys
SWA = [[5, -1, 17, 95, 96, 400, 3] + list(range(30, 45)), [-1, 96, 1000], [0, 1, 2]]
TOPK = [[7, 39, -2, 40, 12] + list(range(13, 33)), [41, -1], [1, 2, 3, 0]]


# (CUs, heads) -> (heads per block, split or not) the plan must take for the 3 queries below
PLANS = {(1, 8): (8, False), (1, 16): (16, False), (1, 24): (16, False), (1, 64): (16, False),
         (1, 128): (16, False), (8, 16): (16, True), (8, 24): (16, True), (64, 8): (8, True),
         (64, 16): (8, True), (64, 24): (8, True), (64, 64): (8, True), (64, 128): (16, True)}


@pytest.mark.parametrize("cus,h", sorted(PLANS), ids=[f"{c}cus-{h}h" for c, h in sorted(PLANS)])
def test_kernel_matches_float64_attention_swa_and_topk(emu_exe, tmp_path, cus, h):
    """SWA + top-k keys, dense indices with prefix lengths, -1 / out-of-range slots, a query
    with no valid key (its output is exactly 0), sink; 1 CU: no split; 8 CUs: 16-head blocks
    split; 64 CUs: 8-head blocks split (16-head blocks would leave CUs idle) except at 128
    heads; 24 heads: a head block only partly used."""
    out, want, splits, per_block = run_case(emu_exe, tmp_path, h, SWA, TOPK, num_cus=cus,
                                            seed=h)
    assert (per_block, splits > 1) == PLANS[cus, h], (per_block, splits)
    torch.testing.assert_close(out.double(), want, **TOL)
    assert torch.equal(out[1], torch.zeros(h, 512))


def test_split_k_takes_the_splits_that_fit_two_blocks_per_cu_rounded_down(emu_exe, tmp_path):
    """3 queries x 1 head block on 8 CUs, 90 keys each: 16 // 3 = 5 splits (15 blocks, one
    round of two per CU); rounding up (6: 18 blocks) left a second, part-filled round."""
    swa = [list(range(90)), list(range(5, 95)), list(range(2, 92))]
    out, want, splits, per_block = run_case(emu_exe, tmp_path, 8, swa, None, num_cus=8,
                                            ragged=True, seed=5)
    assert (splits, per_block) == (5, 8), (splits, per_block)
    torch.testing.assert_close(out.double(), want, **TOL)


def test_split_k_merge_of_sixteen_splits(emu_exe, tmp_path):
    """Two queries of about 300 keys (slots repeat) on 64 CUs: 16 splits, the most the merge
    takes (two passes of 8 loads, the second one full); the second query's last splits hold
    only skipped slots."""
    swa = [list(range(96)) * 3 + [7, 8, 9, -1, 200, 11, 12, 13, 14, 15, 16, 17],
           list(range(50, 96)) * 5 + [-1] * 60]
    out, want, splits, per_block = run_case(emu_exe, tmp_path, 16, swa, None, num_cus=64,
                                            ragged=True, seed=9)
    assert (splits, per_block) == (16, 8), (splits, per_block)
    torch.testing.assert_close(out.double(), want, **TOL)


def test_split_rule_check_catches_a_kernel_rounding_up(tmp_path):
    """The plan check above goes red when the kernel's decode_plan rounds the split count up
    again (the Python rule unchanged: the kernel and the Triton twin then disagree too)."""
    exe = cpu_emu.kernel_exe(
        tmp_path, "sparse_mla_decode.cu", "sparse_mla_emu_ceil", "sparse_mla_cpu_emu_main.cpp", 2,
        (("    const int64_t want = 2 * static_cast<int64_t>(p.num_cus) / base;\n",
          "    const int64_t want = (2 * static_cast<int64_t>(p.num_cus) + base - 1) / base;\n"),))
    with pytest.raises(AssertionError):
        test_split_k_takes_the_splits_that_fit_two_blocks_per_cu_rounded_down(exe, tmp_path)


@pytest.mark.parametrize("split", [False, True], ids=["one_split", "split_k"])
def test_kernel_swa_only_ragged_without_sink(emu_exe, tmp_path, split):
    """SWA only, ragged indices (indptr), no sink: an empty query gives 0, not NaN."""
    swa = [[4, 8, 15, 16, 23, 42] + list(range(40, 90)), [-1, 500], []]
    out, want, splits, _ = run_case(emu_exe, tmp_path, 16, swa, None,
                                    num_cus=64 if split else 1, ragged=True, sink=False, seed=3)
    assert (splits > 1) == split, splits
    torch.testing.assert_close(out.double(), want, **TOL)
    assert torch.equal(out[1:], torch.zeros(2, 16, 512))


@pytest.mark.parametrize("q_kind", [1, 2], ids=["f16_q", "f32_q"])
def test_kernel_16_byte_loads_ragged_topk_and_q_kinds(emu_exe, tmp_path, q_kind):
    """Block strides that are multiples of 16 (the 16-byte load path), ragged SWA + top-k,
    f16 and f32 q, split-K on at 8 heads (2 key groups merged in LDS)."""
    out, want, splits, _ = run_case(emu_exe, tmp_path, 8, SWA, TOPK, num_cus=64, ragged=True,
                                    q_kind=q_kind, stride_pad=48, seed=11)
    assert splits > 1
    torch.testing.assert_close(out.double(), want, **TOL)


# the split-K rows' last-block protocol with the count taken before the rows are written: in
# grid order, in reverse and twice in a row the last block still finds every row written (each
# block runs to its end before the next starts); only blocks running at once, one held after
# counting itself in, catch it (the emulation's kEmuAtOnce schedule, exit 7)
COUNT_BEFORE_ROWS = (
    ("  const int S = p.num_splits;\n  if (kg == 0) {",
     "  const int S = p.num_splits;\n  const int tile = qi * gridDim.y + hb;\n"
     "  if (tid == 0) {\n    GFX936_ARRIVE(&g_sparse_mla_tile_count[tile], S, last_flag);\n"
     "  }\n  __syncthreads();\n  if (kg == 0) {"),
    ("  __syncthreads();\n  const int tile = qi * gridDim.y + hb;\n  if (tid == 0) {\n"
     "    GFX936_ARRIVE(&g_sparse_mla_tile_count[tile], S, last_flag);\n  }\n"
     "  __syncthreads();\n  if (!last_flag) return;",
     "  __syncthreads();\n  if (!last_flag) return;"),
)


def test_blocks_at_once_catch_a_split_counted_in_before_its_rows(tmp_path):
    exe = cpu_emu.kernel_exe(tmp_path, "sparse_mla_decode.cu", "sparse_mla_emu_mut",
                             "sparse_mla_cpu_emu_main.cpp", 2, COUNT_BEFORE_ROWS)
    with pytest.raises(AssertionError, match="blocks running at once differ"):
        run_case(exe, tmp_path, 16, SWA, TOPK, num_cus=64, seed=16)
