# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936/moe_mxfp4.cu's decode path (moe_route, gate/up + clamped SwiGLU, down, per-token
sum), the kernel source itself, run on the CPU by g++ under a small emulation of the HIP/CUDA
subset it uses (cpu_emu_compat.h: a block's threads as fibers in rounds between barriers) and
compared with a float64 oracle that decodes the packed bytes on its own (E2M1 table,
2^(u - 127)). The launcher picks its own tiles: the cases reach gate/up's MT = 1, 2, 4 and 8
tokens per weight load (down's 1, 2, 4), an expert with more tokens than MT (several chunks,
the next chunk's weights prefetched), H not a multiple of the 1024-column tile, rows that are only 8-byte aligned (the
two-8-byte-load path), bf16 / f16 / f32 activations, routing weight on the input, the
per-token sum folded into down (M <= 4: the row tile's last block) and as its own launch; a
second call gives the same bits (the fold's tile counters reset), and so does a third with 3
blocks running at once, the first to count itself in held at its next barrier (a block counted
before its y is written shows; test_blocks_at_once_catch_a_down_block_counted_in_before_its_y;
x86 threads do not show a missing GPU fence); where its shape limits allow
the direct path (no routing launch, moe_mxfp4_direct_launch) gives the grouped path's bits. No GPU
needed: the device tier (bench/gfx936_kernels.py --no-speed) checks the same kernels compiled.

Tolerance: the output is float32 (no bf16 rounding) from float32 sums of <= 2048 products per
value; observed rel ~2e-7, asserted rel <= 1e-5 and cos >= 1 - 1e-9. A wrong LDS layout, a
lost tile or a missing barrier gives rel > 1e-1."""

import subprocess
from pathlib import Path

import cpu_emu
import pytest
import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX: s ee m
LUT = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
XDTYPE = {0: torch.bfloat16, 1: torch.float16, 2: torch.float32}  # kBF16, kF16, kF32


def dyn_lds(src: str) -> str:
    """moe_mxfp4.cu with its dynamic LDS as g_dyn_shmem."""
    return src.replace("extern __shared__ int32_t sh[];",
                       "int32_t* sh = reinterpret_cast<int32_t*>(g_dyn_shmem);")


@pytest.fixture(scope="module")
def emu_exe(tmp_path_factory):
    return cpu_emu.kernel_exe(tmp_path_factory.mktemp("moe_emu"), "moe_mxfp4.cu", "moe_mxfp4_emu",
                              "moe_mxfp4_cpu_emu_main.cpp", 5, prepare=dyn_lds)


def w64(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed E2M1, [N, K/32] UE8M0 -> float64 [N, K]."""
    v = torch.stack([LUT[(w & 15).long()], LUT[(w >> 4).long()]], -1).reshape(w.shape[0], -1)
    return v * torch.pow(2.0, u.double() - 127).repeat_interleave(32, 1)


def run_case(exe, tmp: Path, m, h, i, e, k, xk=0, woi=0, pad=0, hot=None, seed=0,
             alpha=1.702, limit=7.0, unrouted=False):
    """(kernel output float32 [m, h], float64 oracle)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(XDTYPE[xk])
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2 + pad), generator=g, dtype=torch.uint8)
    s13 = torch.randint(119, 124, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, i // 2 + pad), generator=g, dtype=torch.uint8)
    s2 = torch.randint(119, 124, (e, h, i // 32), generator=g, dtype=torch.uint8)
    logits = torch.randn(m, e, generator=g)
    if hot is not None:  # every token routes to expert `hot`
        logits[:, hot] += 100.0
    wts, ids = logits.softmax(-1).topk(k, -1)
    wts = (wts / wts.sum(-1, keepdim=True)).float()
    if unrouted:  # slots on no local expert: -1 (another rank) and an id >= E; both skipped
        ids[0, 0] = -1
        ids[-1, -1] = e + 3
    (tmp / "meta.txt").write_text(
        f"{m} {h} {i} {e} {k} {xk} {woi} {h // 2 + pad} {i // 2 + pad} {alpha} {limit}\n")
    x.contiguous().view(torch.uint8).numpy().tofile(tmp / "x.bin")
    for name, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
        t.numpy().tofile(tmp / f"{name}.bin")
    ids.to(torch.int32).numpy().tofile(tmp / "ids.bin")
    wts.numpy().tofile(tmp / "wts.bin")
    done = subprocess.run([str(exe), str(tmp)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = torch.from_file(str(tmp / "out.bin"), size=m * h, dtype=torch.float32).view(m, h)
    ref = torch.zeros(m, h, dtype=torch.float64)
    for t in range(m):
        for s in range(k):
            ex, rw = int(ids[t, s]), float(wts[t, s])
            if not 0 <= ex < e:
                continue
            hh = w64(w13[ex, :, : h // 2], s13[ex]) @ (x[t].double() * (rw if woi else 1.0))
            gate, up = hh[:i].clamp(max=limit), hh[i:].clamp(-limit, limit)
            z = alpha * gate
            y = w64(w2[ex, :, : i // 2], s2[ex]) @ (z / (1 + torch.exp(-z)) * up)
            ref[t] += y if woi else y * rw
    return out, ref


# (m, h, i, e, k, extra): m and pairs vs slots = min(pairs, e) pick gate/up's MT (1 at m = 1,
# 2 while pairs <= slots, 4 up to 2 x slots, else 8 tokens per chunk); down's MT is 1, 2 or 4
CASES = {
    "mt1_bf16": (1, 2048, 64, 16, 4, {}),
    "mt2_flash_tp8_shape": (2, 4096, 256, 16, 6, {}),  # H 4096, I 256: 4 tiles, down G = 8
    "mt2_f16": (5, 2048, 64, 32, 4, {"xk": 1}),
    "mt8_hot_expert_three_chunks": (20, 2048, 64, 8, 3, {"hot": 2}),
    "mt2_partial_tile_8byte_rows": (3, 1056, 64, 8, 2, {"pad": 8, "xk": 1}),
    "mt4_f32_weight_on_input_8byte_rows": (6, 1056, 96, 8, 2, {"xk": 2, "woi": 1, "pad": 8}),
    "direct_flash_tp4_shape": (3, 4096, 512, 8, 6, {}),  # I 512: down G = 16
    "direct_f32_weight_on_input_8byte_rows": (4, 1056, 64, 8, 2,
                                              {"xk": 2, "woi": 1, "pad": 8}),
    "direct_refused_two_down_steps": (2, 1024, 96, 8, 2, {}),  # I 96 > 32 x G = 64
    "unrouted_slots": (3, 1024, 64, 8, 3, {"unrouted": True}),  # act rows left NaN: skipped
    # down_direct's slot table and act loads at every lane count and the most slots it takes
    # (k = 8 fills all four act-load passes at G = 16); from a review of its rewrite
    "direct_g4_topk8_unrouted": (2, 1024, 128, 8, 8, {"unrouted": True}),
    "direct_g16_topk8_weight_on_input_unrouted": (2, 1056, 512, 8, 8,
                                                  {"unrouted": True, "woi": 1}),
    "direct_g8_topk7_unrouted": (3, 2048, 256, 16, 7, {"unrouted": True}),
    "direct_g2_topk1": (2, 1024, 64, 8, 1, {}),
}
# cases whose shape moe_direct_supported takes (M <= 64, one down step): the direct path runs
# after the grouped one and must give its bits (exit 6 otherwise)
DIRECT = set(CASES) - {"mt4_f32_weight_on_input_8byte_rows", "direct_refused_two_down_steps"}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_mxfp4_decode_kernels_match_float64_oracle_on_cpu(emu_exe, tmp_path, name):
    m, h, i, e, k, extra = CASES[name]
    out, ref = run_case(emu_exe, tmp_path, m, h, i, e, k, **extra)
    assert (tmp_path / "direct.txt").read_text().strip() == ("1" if name in DIRECT else "0")
    assert out.isfinite().all()
    rel = float((out.double() - ref).norm() / ref.norm())
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), 0))
    assert rel <= 1e-5 and cos >= 1 - 1e-9, (name, rel, cos)


def test_front_end_direct_ok_is_the_kernels_moe_direct_supported(emu_exe, tmp_path):
    """The front end's rule (direct_ok, gfx936_mxfp4_moe_kernel.py) says "direct" exactly where
    the kernels' moe_direct_supported (moe_mxfp4.cu) takes the shape, over a grid around every
    limit: a shape the front end sends that the op refuses would fail a decode step; one it
    withholds would run the slower grouped path."""
    from vllm.model_executor.layers.fused_moe.experts.gfx936_mxfp4_moe_kernel import (
        DIRECT_MAX_TOKENS, direct_ok)

    grid = [(m, k, h, i) for m in (0, 1, 2, 63, 64, 65, 256) for k in (0, 1, 6, 8, 9)
            for h in (0, 16, 32, 48, 1024, 4064, 4096, 4128, 7168)
            for i in list(range(0, 1056, 16)) + [1536, 2048, 4096]]
    (tmp_path / "grid.txt").write_text("".join(f"{m} {k} {h} {i}\n" for m, k, h, i in grid))
    done = subprocess.run([str(emu_exe), "supported", str(tmp_path / "grid.txt"),
                           str(tmp_path / "ok.txt")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    kernel = [line == "1" for line in (tmp_path / "ok.txt").read_text().split()]
    assert len(kernel) == len(grid) and any(kernel) and not all(kernel)
    front = [direct_ok(*s, max_tokens=64) for s in grid]
    differ = [(s, f, kn) for s, f, kn in zip(grid, front, kernel) if f != kn]
    assert not differ, f"(M, topk, H, I), direct_ok, moe_direct_supported: {differ[:10]}"
    # the default limit sends no shape the kernels refuse
    assert all(kn for s, kn in zip(grid, kernel) if direct_ok(*s)), DIRECT_MAX_TOKENS


# the folded sum's last-block protocol with the count taken before the block's y is written:
# in grid order and twice in a row the last block still finds every y written (each block runs
# to its end before the next starts); only blocks running at once, one held after counting
# itself in, catch it (the emulation's kEmuAtOnce schedule, cpu_emu_schedule.h)
COUNT_BEFORE_Y = (
    "  if (e >= 0) moe_down_expert<MT, G>(p, e, as, s_pair);  // uniform per block\n"
    "  if (p.m > kFoldTokens || gridDim.x > kMaxDownTiles) return;  // moe_reduce sums\n"
    "  // 2. the folded per-token sum: the row tile's last block adds every slot's y in order\n"
    "  __threadfence();\n  __syncthreads();\n  if (threadIdx.x == 0) {\n"
    "    GFX936_ARRIVE(&g_moe_down_tile_count[blockIdx.x], gridDim.y, last_flag);\n  }\n"
    "  __syncthreads();",
    "  const bool fold = !(p.m > kFoldTokens || gridDim.x > kMaxDownTiles);\n"
    "  if (fold && threadIdx.x == 0) {\n"
    "    GFX936_ARRIVE(&g_moe_down_tile_count[blockIdx.x], gridDim.y, last_flag);\n  }\n"
    "  __syncthreads();\n"
    "  if (e >= 0) moe_down_expert<MT, G>(p, e, as, s_pair);\n  if (!fold) return;\n"
    "  __threadfence();\n  __syncthreads();")


def test_blocks_at_once_catch_a_down_block_counted_in_before_its_y(tmp_path):
    exe = cpu_emu.kernel_exe(tmp_path, "moe_mxfp4.cu", "moe_mxfp4_emu_mut",
                             "moe_mxfp4_cpu_emu_main.cpp", 5, (COUNT_BEFORE_Y,), prepare=dyn_lds)
    m, h, i, e, k, extra = CASES["mt1_bf16"]  # M 1 <= kFoldTokens: down folds the sum
    with pytest.raises(AssertionError, match="a call with blocks running at once differs"):
        run_case(exe, tmp_path, m, h, i, e, k, **extra)


# the prefill path's decode (mxfp4_dequant_experts): (E, N, K, row pad bytes, active, slot0,
# slots); K = 256 is w2 at TP8 (8 scale groups a row: a block of 256 threads spans 32 rows),
# K = 4096 is w13's H, K = 96 leaves the last block part-filled; -1 slots stay untouched
DEQUANT = {
    "w2_tp8_k256": (4, 40, 256, 0, [2, -1, 0, 3], 1, 3),
    "w13_k4096_padded_rows": (3, 6, 4096, 16, [1, 2, 0], 0, 3),
    "k96_partial_block_first_slot_unrouted": (2, 7, 96, 16, [-1, 1, 0], 0, 3),
}


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("name", list(DEQUANT))
def test_mxfp4_dequant_experts_is_the_float64_decode_bit_for_bit_on_cpu(emu_exe, tmp_path,
                                                                      name, kind):
    """Each routed slot's [N, K] is the exact decode (E2M1 x 2^(u - 127), exact in float32)
    rounded once to the output dtype; a slot whose expert is -1 is not written."""
    e, n, k, pad, active, slot0, slots = DEQUANT[name]
    g = torch.Generator().manual_seed(n * k + kind)
    w = torch.randint(0, 256, (e, n, k // 2 + pad), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 140, (e, n, k // 32), generator=g, dtype=torch.uint8)
    (tmp_path / "dq_meta.txt").write_text(f"{e} {n} {k} {slot0} {slots} {kind} {k // 2 + pad}\n")
    w.numpy().tofile(tmp_path / "w.bin")
    s.numpy().tofile(tmp_path / "s.bin")
    torch.tensor(active, dtype=torch.int32).numpy().tofile(tmp_path / "active.bin")
    done = subprocess.run([str(emu_exe), "dequant", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    dt = XDTYPE[kind]  # the kernels' kind codes for out as for x
    raw = (tmp_path / "dq_out.bin").read_bytes()
    got = torch.frombuffer(bytearray(raw), dtype=dt).view(slots, n, k)
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    size = n * k * got.element_size()
    for i, ex in enumerate(active[slot0:slot0 + slots]):
        if ex < 0:
            assert set(raw[i * size:(i + 1) * size]) == {0xff}, (name, "slot", i, "written")
            continue
        want = w64(w[ex, :, : k // 2], s[ex]).float().to(dt)
        differ = (got[i].view(bits) != want.view(bits)).sum().item()
        assert differ == 0, (name, "slot", i, "expert", ex, differ, "elements differ")


def test_dequant_check_catches_an_output_placed_by_expert_not_slot(tmp_path):
    """The check above goes red when a slot's rows land at its expert's index (the workspace
    holds the chunk's experts in slot order, not by id)."""
    exe = cpu_emu.kernel_exe(
        tmp_path, "moe_mxfp4.cu", "moe_mxfp4_emu_dq_mut", "moe_mxfp4_cpu_emu_main.cpp", 5,
        (("const int64_t o = (static_cast<int64_t>(blockIdx.y) * p.n + n) * p.k + 32 * gi;",
          "const int64_t o = (static_cast<int64_t>(e % p.slots) * p.n + n) * p.k + 32 * gi;"),),
        prepare=dyn_lds)
    with pytest.raises(AssertionError, match="differ|written"):
        test_mxfp4_dequant_experts_is_the_float64_decode_bit_for_bit_on_cpu(
            exe, tmp_path, "w2_tp8_k256", 2)
