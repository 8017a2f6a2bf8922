// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Block-FP8 W8A16 dense linear without FP8 hardware: out = x @ dequant(w).T.
// One source for DTK hipcc (gfx936), upstream hipcc (gfx90a compile check), nvcc.
//
// Bytes read (row-major, strides from the tensors):
//
//   w      [n, k] uint8 = float8_e4m3fn (OCP, bias 7), row stride w_s0 bytes
//            row r: | k0 .. k0+7 | ...   8 bytes per lane per step (one 8-byte load)
//   scale  [ceil(n/bn), ceil(k/bk)] per bn x bk block (DeepSeek: 128 x 128)
//            uint8 UE8M0 (2^(u-127), 255 = NaN) or float32, row stride s_s0
//   x      [m, groups*k] bf16 | f16 | f32, row stride x_s0 (16-byte aligned rows)
//            output row r reads x[:, g*k : (g+1)*k] with g = r / (n / groups)
//            (groups > 1: DeepSeek V4's grouped wo_a, one weight slice per group)
//   w[r, c] = e4m3(w[r, c]) * scale[r / bn, c / bk]
//
// w8a16_gemv (decode sizes): a block of 8 groups of kLanes = 32 lanes (<= every
// wave size, so wave32 and wave64 run the same code) owns R rows per row set;
// the S groups of a row set split k (S = 4 for k = 4096: each lane keeps 4 * R
// 8-byte loads in flight to cover HBM latency). Lane l reads 8 weight bytes per row per step, decodes
// them in registers (lowp_decode.h: value * 2^-120) and does 8 * MT FMAs per
// row against MT tokens' activations (pre-scaled by 2^64) held in registers.
// The 8 columns of a lane lie in one k block (bk % 8 == 0), so the block scale
// (times 2^56) multiplies the 8-term partial once. Sums are reduced over the
// 32 lanes with xor shuffles, then over the S groups in LDS in a fixed order
// (bitwise reproducible). The weight is read once per MT tokens; a batch of m
// tokens is grid.y = ceil(m / MT) passes (the later ones mostly from L2).
//
// fp8_block_dequant (prefill sizes): the same decode, written once as
// bf16/f16/f32 for the platform BLAS: decode(w) * 2^120 * scale in float32
// (exact), rounded once, as gfx936_w8a16.dequantize_fp8_block does.
#include "gfx936_compat.h"
#include "lowp_decode.h"
#include "w8a16_fp8.h"

namespace gfx936 {
namespace {

constexpr int kLanes = 32;
constexpr int kThreads = 256;
constexpr int kGroupsPerBlock = kThreads / kLanes;
static_assert(kLanes <= GFX936_WARP_SIZE, "a lane group must fit in one wave");
static_assert(kThreads % GFX936_WARP_SIZE == 0, "whole waves per block");

// block scale of (scale row pointer, k block) times 2^56
// (= 2^120 decode bias - 2^64 activation pre-scale)
__device__ __forceinline__ float dense_scale(const W8A16Params& p, const void* srow, int kb) {
  if (p.scale_kind == kScaleUE8M0) return ue8m0_pow2(static_cast<const uint8_t*>(srow)[kb], 56);
  return static_cast<const float*>(srow)[kb] * 72057594037927936.0f;  // 2^56
}

__device__ __forceinline__ const void* scale_row(const W8A16Params& p, int64_t r) {
  const int64_t off = (r / p.bn) * p.s_s0;  // once per row, outside the k loop
  return p.scale_kind == kScaleUE8M0
             ? static_cast<const void*>(static_cast<const uint8_t*>(p.scale) + off)
             : static_cast<const void*>(static_cast<const float*>(p.scale) + off);
}

template <int MT, int R, int S, int XK>
__global__ void __launch_bounds__(kThreads) w8a16_gemv_kernel(const W8A16Params p) {
  // block = (kGroupsPerBlock / S) row sets x S k-splits of kLanes lanes; a row set
  // owns R rows, k-split s reads the 8-byte chunks c = s * kLanes + lane (mod S * kLanes)
  constexpr int kSets = kGroupsPerBlock / S;
  __shared__ float red[kSets][S][R][MT];
  const int lane = threadIdx.x % kLanes, grp = threadIdx.x / kLanes;
  const int set = grp / S, split = grp % S;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kSets + set) * R;
  const int m0 = blockIdx.y * MT;
  const int64_t rows_per_group = p.n / p.groups;
  // rows_per_group % R == 0 (host check): a row set never straddles two groups
  const int64_t xcol = row0 < p.n ? (row0 / rows_per_group) * p.k : 0;
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;

  const uint8_t* wrow[R];
  const void* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t rr = row0 + r < p.n ? row0 + r : 0;
    wrow[r] = p.w + rr * p.w_s0;
    srow[r] = scale_row(p, rr);
  }
  const void* xrow[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t)
    xrow[t] = m0 + t < p.m ? static_cast<const void*>(
                                 static_cast<const char*>(p.x) +
                                 ((m0 + t) * p.x_s0 + xcol) * (XK == kF32 ? 4 : 2))
                           : nullptr;
  // 32-bit k offsets and a shift for the k block: no 64-bit divisions in the loop
#pragma unroll 4
  for (int c = 8 * (split * kLanes + lane); c < p.k; c += 8 * S * kLanes) {
    uint2 q[R];
#pragma unroll
    for (int r = 0; r < R; ++r) q[r] = *reinterpret_cast<const uint2*>(wrow[r] + c);
    float xv[MT][8];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (xrow[t] != nullptr) load_x8<XK>(xrow[t], c, xv[t]);
      else
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[t][j] = 0.0f;
    }
    const int kb = c >> p.bk_shift;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float w[8];
      decode_e4m3x4(q[r].x, w);
      decode_e4m3x4(q[r].y, w + 4);
      const float sc = row0 + r < p.n ? dense_scale(p, srow[r], kb) : 0.0f;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(xv[t][j], w[j], s);
        acc[r][t] = fmaf(s, sc, acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const float v = group_sum<kLanes>(acc[r][t]);
      if (lane == 0) red[set][split][r][t] = v;
    }
  __syncthreads();
  // one thread per (row, token) of each row set adds the S partials in order
  const int i = threadIdx.x % kLanes;
  if (split == 0 && i < R * MT) {
    const int r = i / MT, t = i % MT;
    float v = 0.0f;
#pragma unroll
    for (int s2 = 0; s2 < S; ++s2) v += red[set][s2][r][t];
    if (row0 + r < p.n && m0 + t < p.m) store_kind(p.out, p.out_kind, (m0 + t) * p.o_s0 + row0 + r, v);
  }
}

template <int OK>
__global__ void __launch_bounds__(kThreads) fp8_block_dequant_kernel(const W8A16Params p) {
  // grid: (row, chunks of kThreads * 8 columns); k % 8 == 0 (host check)
  const int64_t r = blockIdx.x;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * 8;
  if (c >= p.k) return;
  const uint2 q = *reinterpret_cast<const uint2*>(p.w + r * p.w_s0 + c);
  float w[8];
  decode_e4m3x4(q.x, w);
  decode_e4m3x4(q.y, w + 4);
  const void* srow = scale_row(p, r);
  const int kb = c >> p.bk_shift;
  const float sc = p.scale_kind == kScaleUE8M0
                       ? ue8m0_pow2(static_cast<const uint8_t*>(srow)[kb], 0)
                       : static_cast<const float*>(srow)[kb];
#pragma unroll
  for (int j = 0; j < 8; ++j)  // * 2^120 first: exact, then the scale: one rounding
    w[j] = (w[j] * 1.329227995784916e36f) * sc;
  store_out8<OK>(p.out, r * p.o_s0 + c, w);
}

template <int MT, int R, int S, int XK>
void launch_gemv_ok(const W8A16Params& p, gfx936Stream_t st) {
  const int64_t rows_per_block = static_cast<int64_t>(kGroupsPerBlock / S) * R;
  const dim3 grid(static_cast<unsigned>((p.n + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>((p.m + MT - 1) / MT));
  w8a16_gemv_kernel<MT, R, S, XK><<<grid, kThreads, 0, st>>>(p);
}

template <int MT, int R, int S>
void launch_gemv_xk(const W8A16Params& p, gfx936Stream_t st) {
  if (p.x_kind == kBF16) launch_gemv_ok<MT, R, S, kBF16>(p, st);
  else if (p.x_kind == kF16) launch_gemv_ok<MT, R, S, kF16>(p, st);
  else launch_gemv_ok<MT, R, S, kF32>(p, st);
}

// k-splits: about four 8-byte steps per lane, so each lane keeps 4 * R loads in
// flight (K >= 4096 -> 4 splits, 2048 -> 2, 1024 and below -> 1)
template <int MT, int R>
void launch_gemv_s(const W8A16Params& p, gfx936Stream_t st) {
  if (p.k >= 8 * 4 * kLanes * 4) launch_gemv_xk<MT, R, 4>(p, st);
  else if (p.k >= 8 * 4 * kLanes * 2) launch_gemv_xk<MT, R, 2>(p, st);
  else launch_gemv_xk<MT, R, 1>(p, st);
}

int finish(const char** msg) {
  const gfx936Error_t err = gfx936GetLastError();
  if (err != gfx936Success) {
    *msg = gfx936GetErrorString(err);
    return static_cast<int>(err);
  }
  return 0;
}

}  // namespace

int w8a16_gemv_launch(const W8A16Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.m == 0 || p.n == 0) return 0;
  // MT tokens share each decoded weight (8 * MT activations in registers); R rows
  // share each activation load. Larger m: grid.y passes of 8 tokens (L2 reuse).
  // R rows per row set must divide the rows of one group (grouped wo_a)
  const int64_t rows = p.n / p.groups;
  if (p.m <= 1) { if (rows % 4 == 0) launch_gemv_s<1, 4>(p, st); else launch_gemv_s<1, 1>(p, st); }
  else if (p.m <= 2) { if (rows % 4 == 0) launch_gemv_s<2, 4>(p, st); else launch_gemv_s<2, 1>(p, st); }
  else if (p.m <= 4) { if (rows % 4 == 0) launch_gemv_s<4, 4>(p, st); else launch_gemv_s<4, 1>(p, st); }
  else { if (rows % 4 == 0) launch_gemv_s<8, 4>(p, st); else launch_gemv_s<8, 1>(p, st); }
  return finish(msg);
}

int fp8_block_dequant_launch(const W8A16Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.n == 0 || p.k == 0) return 0;
  const dim3 grid(static_cast<unsigned>(p.n),
                  static_cast<unsigned>((p.k / 8 + kThreads - 1) / kThreads));
  if (p.out_kind == kBF16) fp8_block_dequant_kernel<kBF16><<<grid, kThreads, 0, st>>>(p);
  else if (p.out_kind == kF16) fp8_block_dequant_kernel<kF16><<<grid, kThreads, 0, st>>>(p);
  else fp8_block_dequant_kernel<kF32><<<grid, kThreads, 0, st>>>(p);
  return finish(msg);
}

}  // namespace gfx936
