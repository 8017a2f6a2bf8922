// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Block-FP8 W8A16 dense linear without FP8 hardware: out = x @ dequant(w).T.
// One source for DTK hipcc (gfx936), upstream hipcc (gfx90a compile check), nvcc.
//
// Bytes read (row-major, strides from the tensors):
//
//   w      [n, k] uint8 = float8_e4m3fn (OCP, bias 7), row stride w_s0 bytes
//            row r: | c .. c+15 | ...   16 bytes per lane and row (one 16-byte load
//            where the row start and stride are 16-byte aligned, else two 8-byte ones)
//   scale  [ceil(n/bn), ceil(k/bk)] per bn x bk block (DeepSeek: 128 x 128)
//            uint8 UE8M0 (2^(u-127), 255 = NaN) or float32, row stride s_s0
//   x      [m, groups*k] bf16 | f16 | f32, row stride x_s0 (16-byte aligned rows)
//            output row r reads x[:, g*k : (g+1)*k] with g = r / (n / groups)
//            (groups > 1: DeepSeek V4's grouped wo_a, one weight slice per group)
//   w[r, c] = e4m3(w[r, c]) * scale[r / bn, c / bk]
//
// w8a16_gemv (decode sizes, M <= 16 per pass; larger M: passes of 16 tokens on grid.z).
// The grid tiles the weight into TR x 512 tiles: blockIdx.x = row tile (TR = 8 * R
// rows), blockIdx.y = k split s (columns [512 s, 512 s + 512)), so a weight of
// n x k bytes is (n / TR) * (k / 512) blocks of 256 threads; R in {4, 2, 1} is the
// largest that still gives >= 2 blocks per CU (the host passes the CU count). A
// block is 8 row sets of kLanes = 32 lanes (<= every wave size: wave32 and wave64
// run the same code); lane l of row set j reads ONE 16-byte load per row of its R
// rows, row0 + j * R + r, columns c = 512 s + 16 l .. +16, all R loads issued
// before anything else, so a thread has 16 * R bytes in flight:
//
//   w tile (bytes)   col: 512s+0    +16      ...  +496       (16 bytes = 1 load)
//     row set 0, r=0   | lane 0 | lane 1 | ... | lane 31 |
//     row set 0, r=1   | lane 0 | lane 1 | ... | lane 31 |   ... R rows per row set
//     row set 7, r=R-1 | lane 0 | ...                    |
//
// Activations of the tile's 512 columns go once into LDS as float32 * 2^64
// (16 KB at MT = 8, 32 KB at MT = 16), laid out so that the 32 lanes of a read
// hit 32 consecutive float4s (no bank conflicts):
//   xs[t][j4][lane] = x[m0 + t, 512 s + 16 lane + 4 j4 .. +4]   (float4; j4 < 4)
// Each float4 read feeds 4 * R FMAs. The 16 bytes of a row lie in at most two k
// blocks (bk >= 8), so the two 8-column halves take their block scale (times
// 2^56) into the decoded weight (exact for UE8M0: a power of two). The R x MT
// sums of a lane are reduce-scattered over the 32 lanes (xor butterfly: each step
// sends half of the values, so about R * MT shuffles, not 5 * R * MT); every value
// then lives in one lane. With one k split it is the output; with S splits it
// goes to ws[s][token][row] (float32), and the block that finishes a tile last
// (a per-tile atomic counter in device memory, zero at load, reset to zero by
// that block) adds the S partials in the fixed order s = 0 .. S-1 and writes the
// output: bitwise the same sum whatever block is last, one launch, capturable
// in a CUDA/HIP graph. Launches that use the counters must not run concurrently
// on two streams (stream order serialises the layers of a model).
//
// fp8_block_dequant (prefill sizes): the same decode, written once as
// bf16/f16/f32 for the platform BLAS: decode(w) * 2^120 * scale in float32
// (exact), rounded once, as gfx936_w8a16.dequantize_fp8_block does.
#include "gfx936_compat.h"
#include "last_block.h"
#include "lowp_decode.h"
#include "w8a16_fp8.h"

namespace gfx936 {
namespace {

constexpr int kLanes = 32;
constexpr int kThreads = 256;
constexpr int kGroupsPerBlock = kThreads / kLanes;
static_assert(kLanes <= GFX936_WARP_SIZE, "a lane group must fit in one wave");
static_assert(kThreads % GFX936_WARP_SIZE == 0, "whole waves per block");

__device__ __forceinline__ const void* scale_row(const W8A16Params& p, int64_t r) {
  const int64_t off = (r / p.bn) * p.s_s0;  // once per row, outside the k loop
  return p.scale_kind == kScaleUE8M0
             ? static_cast<const void*>(static_cast<const uint8_t*>(p.scale) + off)
             : static_cast<const void*>(static_cast<const float*>(p.scale) + off);
}

constexpr int kTileK = kLanes * 16;          // columns of one k split (512)
constexpr int kMaxMT = 16;                      // tokens per pass
constexpr int kMaxTileCounters = 1 << 16;       // split-K tiles of one launch, at most

// a load of another block's partial, after __threadfence(): from L2, never a stale
// L1 line (HIP: the fence's acquire invalidates the CU's L1; CUDA: ld.global.cg)
#if defined(GFX936_HIP)
  #define W8A16_LOAD_L2(ptr) (*(ptr))
#else
  #define W8A16_LOAD_L2(ptr) __ldcg(ptr)
#endif

// per (row tile, token pass) arrival counters of the split-K sum; zero at module
// load, every launch leaves them zero again (the last block of a tile resets it)
__device__ unsigned int g_w8a16_tile_count[kMaxTileCounters];

// 16 weight bytes of a row from column c (zeros past k; k % 8 == 0)
__device__ __forceinline__ uint4 load_w16(const W8A16Params& p, const uint8_t* wrow, int c,
                                          bool aligned16) {
  if (aligned16 && c + 16 <= p.k) return *reinterpret_cast<const uint4*>(wrow + c);
  uint2 lo = make_uint2(0u, 0u), hi = make_uint2(0u, 0u);
  if (c < p.k) lo = *reinterpret_cast<const uint2*>(wrow + c);
  if (c + 8 < p.k) hi = *reinterpret_cast<const uint2*>(wrow + c + 8);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

template <int MT, int R>
__global__ void __launch_bounds__(kThreads) w8a16_gemv_kernel(const W8A16Params p) {
  constexpr int kSets = kGroupsPerBlock;  // row sets of kLanes lanes
  constexpr int kTR = kSets * R;          // rows per tile
  __shared__ float4 xs[MT * 4 * kLanes];  // xs[t][j4][lane], see the layout above
  __shared__ int last_flag;
  const int lane = threadIdx.x % kLanes, set = threadIdx.x / kLanes;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int64_t tile_row0 = static_cast<int64_t>(blockIdx.x) * kTR;
  const int64_t row0 = tile_row0 + set * R;
  const int m0 = blockIdx.z * MT;
  const int c = split * kTileK + lane * 16;
  const bool aligned16 =
      (p.w_s0 % 16 == 0) && (reinterpret_cast<uintptr_t>(p.w) % 16 == 0);

  // 1. every global load of the block first, nothing waits on another: the R weight
  // loads (16 bytes each), the raw block scales, the raw activations of the tile
  uint4 q[R];
  float sraw[R][2];  // the UE8M0 byte as a float (exact), or the float32 scale
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool ok = row0 + r < p.n;
    const int64_t rr = ok ? row0 + r : 0;
    q[r] = ok ? load_w16(p, p.w + rr * p.w_s0, c, aligned16) : make_uint4(0u, 0u, 0u, 0u);
    const void* srow = scale_row(p, rr);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kb = (c + 8 * h < p.k ? c + 8 * h : 0) >> p.bk_shift;
      sraw[r][h] = p.scale_kind == kScaleUE8M0
                       ? static_cast<float>(static_cast<const uint8_t*>(srow)[kb])
                       : static_cast<const float*>(srow)[kb];
    }
  }
  // activations: item i = (token t, lane l, half) = 8 columns 512 s + 16 l + 8 half; a
  // tile never straddles two groups (rows per group % kTR == 0, host check)
  constexpr int kXItems = (MT * kLanes * 2 + kThreads - 1) / kThreads;
  const int64_t rows_per_group = p.n / p.groups;
  const int64_t xcol = (tile_row0 < p.n ? tile_row0 / rows_per_group : 0) * p.k;
  const bool xf32 = p.x_kind == kF32;
  uint4 xr[kXItems][2];
#pragma unroll
  for (int it = 0; it < kXItems; ++it) {
    const int i = threadIdx.x + it * kThreads;
    const int t = i / (kLanes * 2), cc = split * kTileK + i % (kLanes * 2) * 8;
    xr[it][0] = xr[it][1] = make_uint4(0u, 0u, 0u, 0u);
    if (i < MT * kLanes * 2 && m0 + t < p.m && cc + 8 <= p.k) {
      const uint4* src = reinterpret_cast<const uint4*>(
          static_cast<const char*>(p.x) + ((m0 + t) * p.x_s0 + xcol + cc) * (xf32 ? 4 : 2));
      xr[it][0] = src[0];
      if (xf32) xr[it][1] = src[1];
    }
  }
  // 2. activations * 2^64 as float32 into LDS, xs[t][j4][lane] (see the layout above)
#pragma unroll
  for (int it = 0; it < kXItems; ++it) {
    const int i = threadIdx.x + it * kThreads;
    if (i < MT * kLanes * 2) {
      const int t = i / (kLanes * 2), l = (i / 2) % kLanes, half = i % 2;
      float v[8];
      x8_from_bits(p.x_kind, xr[it][0], xr[it][1], v);
      xs[(t * 4 + half * 2) * kLanes + l] = make_float4(v[0], v[1], v[2], v[3]);
      xs[(t * 4 + half * 2 + 1) * kLanes + l] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
  // 3. block scales (times 2^56 = 2^120 decode bias - 2^64 activation pre-scale)
  float sc[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      sc[r][h] = row0 + r >= p.n || c + 8 * h >= p.k ? 0.0f
                 : p.scale_kind == kScaleUE8M0
                     ? ue8m0_pow2(static_cast<uint32_t>(sraw[r][h]), 56)
                     : sraw[r][h] * 72057594037927936.0f;  // 2^56
  __syncthreads();

  // 4. decode 4 columns per row at a time (scale folded in), 4 * R FMAs per float4
  float acc[R * MT];
#pragma unroll
  for (int i = 0; i < R * MT; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int j4 = 0; j4 < 4; ++j4) {
    float w[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t word = j4 == 0 ? q[r].x : j4 == 1 ? q[r].y : j4 == 2 ? q[r].z : q[r].w;
      decode_e4m3x4(word, w[r]);
#pragma unroll
      for (int j = 0; j < 4; ++j) w[r][j] *= sc[r][j4 / 2];
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const float4 xv = xs[(t * 4 + j4) * kLanes + lane];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float a = acc[r * MT + t];
        a = fmaf(xv.x, w[r][0], a);
        a = fmaf(xv.y, w[r][1], a);
        a = fmaf(xv.z, w[r][2], a);
        a = fmaf(xv.w, w[r][3], a);
        acc[r * MT + t] = a;
      }
    }
  }

  // 5. totals over the 32 lanes, one (row, token) value per owning lane
  const int base = reduce_scatter<kLanes>(acc, lane);
  constexpr int kOwn = R * MT >= kLanes ? R * MT / kLanes : 1;
  const int dup_mask = R * MT >= kLanes ? 0 : kLanes / (R * MT) - 1;  // lanes sharing a value
  const bool owner = (lane & dup_mask) == 0;
  if (nsplit == 1) {
    if (owner)
#pragma unroll
      for (int i = 0; i < kOwn; ++i) {
        const int idx = base + i, r = idx / MT, t = idx % MT;
        if (row0 + r < p.n && m0 + t < p.m)
          store_kind(p.out, p.out_kind, (m0 + t) * p.o_s0 + row0 + r, acc[i]);
      }
    return;
  }
  // 6. split-K: partials, then the tile's last block sums them in split order
  float* ws = p.ws;
  const int64_t plane = static_cast<int64_t>(p.m) * p.n;  // ws [nsplit][m][n]
  if (owner)
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int idx = base + i, r = idx / MT, t = idx % MT;
      if (row0 + r < p.n && m0 + t < p.m)
        ws[split * plane + static_cast<int64_t>(m0 + t) * p.n + row0 + r] = acc[i];
    }
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.z * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) {
    GFX936_ARRIVE(&g_w8a16_tile_count[tile], nsplit, last_flag);
  }
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  // every partial of an output loaded at once (8 loads in flight), then added in split order
  for (int i = threadIdx.x; i < kTR * MT; i += kThreads) {
    const int64_t row = tile_row0 + i % kTR;
    const int t = i / kTR;
    if (row < p.n && m0 + t < p.m) {
      const int64_t off = static_cast<int64_t>(m0 + t) * p.n + row;
      float v = 0.0f;
      for (int s0 = 0; s0 < nsplit; s0 += 8) {
        float b[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          b[j] = s0 + j < nsplit ? W8A16_LOAD_L2(ws + (s0 + j) * plane + off) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (s0 + j < nsplit) v += b[j];
      }
      store_kind(p.out, p.out_kind, (m0 + t) * p.o_s0 + row, v);
    }
  }
  if (threadIdx.x == 0) GFX936_RESET(&g_w8a16_tile_count[tile], nsplit);
}

template <int OK>
__global__ void __launch_bounds__(kThreads) fp8_block_dequant_kernel(const W8A16Params p) {
  // grid: chunks of kThreads of the N x K/8 eight-byte groups, row after row (k % 8 == 0: host
  // check): every thread decodes 8 elements whatever K is; one block per (row, chunk of K)
  // left half the threads idle at K = 1024 and 7 of 8 at K = 256 (the shared expert's w2)
  const int groups = p.k / 8;
  const int t = blockIdx.x * kThreads + threadIdx.x;  // < N x K/8 <= INT32_MAX: launcher
  if (t >= p.n * groups) return;
  const int row = t / groups;
  const int64_t r = row;
  const int c = (t - row * groups) * 8;
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

// The launch plan of w8a16_gemv for p (tokens per pass, rows per row set, grid);
// the binding sizes the split-K workspace from the same plan.
struct GemvPlan {
  int mt, r, row_tiles, splits, passes;
};

GemvPlan gemv_plan(const W8A16Params& p) {
  GemvPlan g{};
  const int m1 = p.m < kMaxMT ? p.m : kMaxMT;
  g.mt = m1 <= 1 ? 1 : m1 <= 2 ? 2 : m1 <= 4 ? 4 : m1 <= 8 ? 8 : 16;
  g.passes = (p.m + g.mt - 1) / g.mt;
  g.splits = (p.k + kTileK - 1) / kTileK;
  const int64_t rows = p.n / p.groups;
  const int64_t want = 2 * static_cast<int64_t>(p.num_cus > 0 ? p.num_cus : 1);
  // the largest R with >= 2 blocks per CU; at 16 tokens R <= 2 (R = 4 needs ~180
  // registers on sm_90: one block per SM, the grid then runs in several waves)
  g.r = 1;
  for (int r = g.mt >= 16 ? 2 : 4; r >= 1; r /= 2) {
    const int64_t tiles = (p.n + kGroupsPerBlock * r - 1) / (kGroupsPerBlock * r);
    if ((p.groups == 1 || rows % (kGroupsPerBlock * r) == 0) &&
        (r == 1 || tiles * g.splits * g.passes >= want)) {
      g.r = r;
      break;
    }
  }
  g.row_tiles = static_cast<int>((p.n + kGroupsPerBlock * g.r - 1) / (kGroupsPerBlock * g.r));
  if (static_cast<int64_t>(g.row_tiles) * g.passes > kMaxTileCounters) g.splits = 1;
  return g;
}

template <int MT, int R>
void launch_gemv_ok(const W8A16Params& p, const GemvPlan& g, gfx936Stream_t st) {
  const dim3 grid(static_cast<unsigned>(g.row_tiles), static_cast<unsigned>(g.splits),
                  static_cast<unsigned>(g.passes));
  w8a16_gemv_kernel<MT, R><<<grid, kThreads, 0, st>>>(p);
}

template <int MT>
void launch_gemv_r(const W8A16Params& p, const GemvPlan& g, gfx936Stream_t st) {
  if (g.r == 4) launch_gemv_ok<MT, 4>(p, g, st);
  else if (g.r == 2) launch_gemv_ok<MT, 2>(p, g, st);
  else launch_gemv_ok<MT, 1>(p, g, st);
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

int64_t w8a16_gemv_workspace_floats(const W8A16Params& p) {
  if (p.m == 0 || p.n == 0) return 0;
  const GemvPlan g = gemv_plan(p);
  return g.splits > 1 ? static_cast<int64_t>(g.splits) * p.m * p.n : 0;
}

int w8a16_gemv_launch(const W8A16Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.m == 0 || p.n == 0) return 0;
  if (p.groups > 1 && (p.n / p.groups) % kGroupsPerBlock != 0) {
    *msg = "groups > 1 needs N / groups to be a multiple of 8";
    return -1;
  }
  const GemvPlan g = gemv_plan(p);
  if (g.splits > 1 && p.ws == nullptr) {
    *msg = "split-K workspace missing (w8a16_gemv_workspace_floats)";
    return -1;
  }
  if (g.mt == 1) launch_gemv_r<1>(p, g, st);
  else if (g.mt == 2) launch_gemv_r<2>(p, g, st);
  else if (g.mt == 4) launch_gemv_r<4>(p, g, st);
  else if (g.mt == 8) launch_gemv_r<8>(p, g, st);
  else launch_gemv_r<16>(p, g, st);
  return finish(msg);
}

int fp8_block_dequant_launch(const W8A16Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.n == 0 || p.k == 0) return 0;
  const int64_t groups = static_cast<int64_t>(p.n) * (p.k / 8);
  if (groups > INT32_MAX - kThreads) {
    *msg = "fp8_block_dequant: N x K/8 must stay below 2^31 - 256";
    return -1;
  }
  const dim3 grid(static_cast<unsigned>((groups + kThreads - 1) / kThreads));
  if (p.out_kind == kBF16) fp8_block_dequant_kernel<kBF16><<<grid, kThreads, 0, st>>>(p);
  else if (p.out_kind == kF16) fp8_block_dequant_kernel<kF16><<<grid, kThreads, 0, st>>>(p);
  else fp8_block_dequant_kernel<kF32><<<grid, kThreads, 0, st>>>(p);
  return finish(msg);
}

}  // namespace gfx936
