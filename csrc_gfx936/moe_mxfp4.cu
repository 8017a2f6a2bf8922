// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// MXFP4 MoE (W4A16) without FP4 hardware: only the experts routed in the batch
// are read. One source for DTK hipcc (gfx936), upstream hipcc, nvcc.
//
// Bytes read (strides from the tensors; rows are contiguous):
//
//   w13 [E, 2I, H/2] uint8   rows 0..I-1 gate, I..2I-1 up (DeepSeek V4 order)
//   w2  [E, H,  I/2] uint8   byte j of a row = elements 2j (low nibble), 2j+1 (high)
//         nibble s ee m: e > 0 -> (-1)^s 2^(e-1) (1 + m/2); e == 0 -> (-1)^s m/2
//   s13 [E, 2I, H/32], s2 [E, H, I/32] uint8 UE8M0: element c of a row is
//         scaled by 2^(s[c / 32] - 127) (255 = NaN)
//   topk_ids [M, k] int32/int64 global ids (-> expert_map -> local, -1 = elsewhere)
//   topk_weights [M, k] float32
//
// moe_route (1 block): pairs p = token * k + slot are counted per local expert,
//   prefix-summed and scattered: sorted_pairs[expert_start[e] ..
//   expert_start[e+1]) are expert e's pairs (in no particular order: every
//   pair's arithmetic below is the same whatever its neighbours, so results
//   are bitwise reproducible), active[s] = s-th routed expert, -1 after.
// gate_up (grid: I/8 x slots): a block is 8 groups of kLanes = 32 lanes; group g
//   owns the row pair (j, I + j), j = 8 * blockIdx.x + g, of expert active[slot]
//   over all of H, in tiles of kTileCols = 1024 columns. Per tile, lane l reads
//   ONE 16-byte load per row: bytes [512 t + 16 l, +16) = columns
//   [1024 t + 32 l, +32), exactly one scale group, whose UE8M0 byte is
//   s13[.., 32 t + l] (w13 and s13 are separate tensors, so the scale is a
//   second, 1-byte load; putting it in the weight load would need a repack at
//   load time, which this kernel does not ask for). Rows whose stride or start
//   is not 16-byte aligned take the same bytes as two 8-byte loads.
//
//     w13 row j (gate) and I + j (up), bytes:
//       tile 0: | lane 0: 16 B | lane 1: 16 B | ... | lane 31 | tile 1: | lane 0 | ...
//     s13 row:  | lane 0 | lane 1 | ... | lane 31 | (tile 0) | lane 0 | ... (tile 1)
//
//   The first tile's loads are issued right after the active-expert read
//   (before the expert_start / sorted_pairs chain), and tile t + 1's while tile
//   t computes (one tile ahead, in registers). A block takes the expert's pairs
//   MT at a time; the activations of those MT tokens go once into LDS as
//   float32 * 2^64 (times the routing weight when it applies on the input),
//   kStage = 4 / MT tiles at a time (1 from MT = 4: at most 16 KB, 32 KB at
//   MT = 8), laid out so that the 32 lanes of a read hit 32 consecutive float4s:
//     xs[t][tile % kStage][j4][l] = x[token t, 1024 tile + 32 l + 4 j4 .. +4]
//   (float4, j4 < 8)
//   so every weight load and its decode (lowp_decode.h: value * 2^-126) feed MT
//   tokens. Per lane and token the 32 products of a scale group are summed in
//   order, then folded with 2^(u - 127 + 62); the 32 lanes' sums are added by an
//   xor butterfly (fixed order), and lane t stores token t's DeepSeek V4
//   clamped SwiGLU silu(alpha * min(g, L)) * clamp(u, -L, L) (float32),
//   pre-scaled by 2^64, in act[pair, j] for the down GEMV.
// down (grid: H / rows x slots): a group of G lanes (G = the largest power of two
//   <= min(32, I/32), at least 2) owns kDownRows = 4 rows n of w2[e], rows = 4 * 256 / G per
//   block (128 at I = 256: 16 KB of weights). Lane l of a group reads ONE 16-byte
//   load per row per step: columns [32 (l + G s), +32) of step s, one scale group,
//   scale byte s2[.., l + G s] (two 8-byte loads where rows are not 16-byte
//   aligned). Step 0's loads are issued right after the active-expert read; when
//   I <= 32 G (one step: Flash TP8 and TP4) they stay in registers for every
//   chunk of tokens. The step's act values of MT tokens go once into LDS,
//     as[t][j4][l] = act[pair t, 32 (l + G s) + 4 j4 .. +4]  (float4, j4 < 8),
//   each feeding 4 rows; per row and token the 32 products are summed in
//   order, folded with 2^(u - 127 + 62), added over the G lanes (xor butterfly),
//   and y[pair, n] = topk_weight * sum (float32; weight 1 when it went on the input).
//   At M <= kFoldTokens the per-token sum below is folded into down: every block
//   of a row tile (active slot or not) counts itself in a per-tile counter in
//   device memory (zero at load); the last one adds the tile's y in the same
//   fixed slot order as moe_reduce, writes out, and resets the counter: 3
//   launches in all, bitwise the same output. Launches that use the counters
//   must not run concurrently on two streams (stream order serialises layers).
// reduce (M > kFoldTokens): out[m, n] = sum over slot 0..k-1 of the token's routed pairs'
//   y (fixed order, no atomics), rounded once to the output dtype.
// Slots beyond the routed experts exit at once, so the grids depend on
// shapes only (CUDA/HIP graph capturable, no host sync).
//
// The direct path (moe_direct_supported; the front end takes it up to a measured M): at a
// few tokens the pairs hardly share experts, so the grouping above buys nothing and its
// chain (moe_route, then active -> expert_start -> sorted_pairs before any activation
// moves) is most of the time.
// gate_up_direct (grid: I/8 x M * topk): block (x, pair) reads its pair's expert from
//   topk_ids (and expert_map) itself; the token's x row is loaded before that read (it does
//   not depend on it) into LDS as gate/up's stage (xs[tile][j4][l], all of H <= 4 tiles,
//   16 KB), and all of its row pair's tiles are loaded at once into registers (2 x 4
//   16-byte loads per lane): one memory round trip instead of one per tile. Same lanes,
//   columns, sums and order as gate/up at MT = 1: the same act bits. Where that grid is
//   small (kSplitResident; H of 4 tiles) S = 2 groups share a row pair
//   (grid I/4 x M * topk): group 2 jl + h dots tiles [2 h, 2 h + 2); half 0 folds its tiles
//   from zero and leaves the running sums in LDS (part[row][g / u][lane]), half 1 folds its
//   own after them, past a barrier: the same fmaf chain, the same bits, half the dots per
//   block.
// down_direct (grid: H / kDirectRows x M): block (x, token) owns kDirectRows = 16 rows of
//   out for one token. Item (slot s, row r) = the dot of w2[e_s] row n0 + r with act[pair s]
//   by G lanes (G as down's, at most 16, one step: I <= 32 G, so I <= 512); the token's
//   topk act rows are loaded first (as[slot][j4][l] = act[pair, 32 l + 4 j4 .. +4],
//   float4, in LDS), the k slots' experts and weights are read once per block into LDS
//   (one barrier, the act loads in flight across it), then each group of G lanes loads
//   its items' 16-byte weight slices at once. The dots go to LDS;
//   thread r then adds y = dot * w over the slots in order, unrouted ones skipped:
//   moe_reduce's sum of down's y, bit for bit (mul_rn: the product is not fused into the
//   add; tests/kernels/test_mul_rn_not_contracted.py).
//
// mxfp4_dequant_experts (prefill): active experts' weights decoded once to
//   bf16/f16/f32 [S, N, K] for the platform BLAS: decode * 2^126 * scale in
//   float32 (exact), one rounding, as mxfp4_torch_dequant does.
#include "gfx936_compat.h"
#include "last_block.h"
#include "lowp_decode.h"
#include "moe_mxfp4.h"

namespace gfx936 {
namespace {

constexpr int kLanes = 32;
constexpr int kThreads = 256;
constexpr int kGroupsPerBlock = kThreads / kLanes;
constexpr int kRouteThreads = 1024;
constexpr int kDownRows = 4;  // rows of w2 per lane group
constexpr int kTileCols = kLanes * 32;  // w13 columns of a gate/up tile: 16 bytes per lane
constexpr int kFoldTokens = 4;          // down sums the tokens' pairs itself up to this M
constexpr int kMaxDownTiles = 1 << 12;  // row tiles of a down launch with the sum folded in
constexpr int kDirectTokens = 64;       // the direct path's largest M (the engine's
                                        // default; VLLM_GFX936_MOE_DIRECT_MAX_M lowers it)
constexpr int kDirectMaxTopk = 8;
constexpr int kDirectTiles = 4;         // gate/up tiles held in registers: H <= 4096
constexpr int kDirectRows = 16;         // rows of out per down_direct block
// gate/up direct splits H over 2 lane groups per row pair only where the split grid fits in
// one round of kSplitResident blocks per CU: at TP8 M = 1 (192 blocks on the H100's 132 SMs)
// the SMs with two blocks set the time, and twice the blocks with half the dots each gave
// 0.94x; from M = 2 up (two rounds or more) it was 1.01-1.16x slower
// (docs/bench/moe-decode-planes-h100.md). 3: the split kernel's residency on the H100 (69
// registers) and on gfx90a (86 VGPRs; its 17 KB of LDS fit 3 times in a CU's 64 KB)
constexpr int kSplitResident = 3;
// down_direct's lanes per row at most (I <= 512): its LDS holds kDirectMaxTopk act rows of
// 32 x lanes floats, 16 KB at 16 lanes; 32 lanes (32 KB) would not fit two blocks per CU
// in gfx936's 64 KB
constexpr int kDirectMaxLanes = 16;
// Blocks per CU / SM the direct kernels are compiled for. gfx936: two (gate/up's rule). The
// CUDA twin: closer to what the gfx90a build gets from its register counts (gate/up direct
// 104 VGPRs, down direct <= 87: 4+ waves per SIMD, i.e. 4+ blocks per CU) as far as nvcc
// stays free of spills: 3, a cap of 85 registers (sm_90: gate/up 80, down <16> 78; the
// smaller G need fewer and get 4+ blocks anyway). At 2 the twin ran them at half gfx90a's
// occupancy.
#if defined(GFX936_HIP)
constexpr int kGateUpDirectBlocks = 2, kDownDirectBlocks = 2;
#else
constexpr int kGateUpDirectBlocks = 3, kDownDirectBlocks = 3;
#endif

// a load of another block's y, after __threadfence(): from L2, never a stale L1 line
// (HIP: the fence's acquire invalidates the CU's L1; CUDA: ld.global.cg)
#if defined(GFX936_HIP)
  #define MOE_LOAD_L2(ptr) (*(ptr))
#else
  #define MOE_LOAD_L2(ptr) __ldcg(ptr)
#endif

// per row tile arrival counters of the folded sum; zero at module load, every launch
// leaves them zero again (the tile's last block resets its counter)
__device__ unsigned int g_moe_down_tile_count[kMaxDownTiles];
constexpr float kInvXPrescale = 5.421010862427522e-20f;  // 2^-64
static_assert(kLanes <= GFX936_WARP_SIZE, "a lane group must fit in one wave");
static_assert(kThreads % GFX936_WARP_SIZE == 0, "whole waves per block");

__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const MoeRoute r) {
  extern __shared__ int32_t sh[];  // cnt[E] | cursor[E]
  __shared__ int32_t scan_c[kRouteThreads], scan_a[kRouteThreads];
  __shared__ int32_t tail;
  const int E = r.num_experts, P = r.m * r.topk, tid = threadIdx.x, nt = blockDim.x;
  int32_t* cnt = sh;
  int32_t* cursor = sh + E;
  for (int e = tid; e < E; e += nt) cnt[e] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int64_t g = r.ids_is_64 ? static_cast<const int64_t*>(r.topk_ids)[p]
                                  : static_cast<const int32_t*>(r.topk_ids)[p];
    int e = -1;
    if (r.expert_map != nullptr) {
      if (g >= 0 && g < r.map_len) e = r.expert_map[g];
    } else if (g >= 0 && g < E) {
      e = static_cast<int>(g);
    }
    if (e >= E) e = -1;
    r.pair_expert[p] = e;
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // thread tid owns experts [e0, e1): block-wide inclusive scan of the sums
  const int per = (E + nt - 1) / nt;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int sc = 0, sa = 0;
  for (int e = e0; e < e1; ++e) { sc += cnt[e]; sa += cnt[e] > 0; }
  scan_c[tid] = sc;
  scan_a[tid] = sa;
  __syncthreads();
  for (int o = 1; o < nt; o <<= 1) {
    const int vc = tid >= o ? scan_c[tid - o] : 0;
    const int va = tid >= o ? scan_a[tid - o] : 0;
    __syncthreads();
    scan_c[tid] += vc;
    scan_a[tid] += va;
    __syncthreads();
  }
  int pc = scan_c[tid] - sc, pa = scan_a[tid] - sa;
  for (int e = e0; e < e1; ++e) {
    r.expert_start[e] = pc;
    cursor[e] = pc;
    if (cnt[e] > 0) r.active[pa++] = e;
    pc += cnt[e];
  }
  const int routed = scan_c[nt - 1], num_active = scan_a[nt - 1];
  if (tid == 0) {
    r.expert_start[E] = routed;
    tail = routed;
  }
  for (int s = num_active + tid; s < min(P, E); s += nt) r.active[s] = -1;
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = r.pair_expert[p];
    r.sorted_pairs[e >= 0 ? atomicAdd(&cursor[e], 1) : atomicAdd(&tail, 1)] = p;
  }
}

__device__ __forceinline__ float clamped_silu_mul(float g, float u, float alpha, float limit) {
  if (limit > 0.0f) {  // comparisons, not fminf: a NaN stays NaN as in torch.clamp
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
  }
  const float z = alpha * g;
  return z / (1.0f + expf(-z)) * u;
}

// 16 packed bytes (32 elements, one scale group) of a row from column c: one 16-byte load
// where the rows are 16-byte aligned, else two 8-byte ones (same bytes)
__device__ __forceinline__ uint4 load_q32(const uint8_t* row, int c, bool aligned16) {
  const uint8_t* a = row + c / 2;
  if (aligned16) return *reinterpret_cast<const uint4*>(a);
  const uint2 lo = reinterpret_cast<const uint2*>(a)[0], hi = reinterpret_cast<const uint2*>(a)[1];
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// one lane's bytes of a gate/up tile: both rows' 32 elements and their scale bytes
struct GateUpQ {
  uint4 g, u;
  uint32_t sg, su;
};

// the gate row j and up row I + j of expert e (weights and scale bytes)
struct GateUpRows {
  const uint8_t *wg, *wu, *sg, *su;
  bool aligned16;  // 16-byte loads (else two 8-byte ones)
};

__device__ __forceinline__ GateUpRows gate_up_rows(const MoeMxfp4Params& p, int e, int j) {
  GateUpRows r;
  r.wg = p.w13 + e * p.w13_s0 + static_cast<int64_t>(j) * p.w13_s1;
  r.wu = r.wg + static_cast<int64_t>(p.inter) * p.w13_s1;
  r.sg = p.s13 + e * p.s13_s0 + static_cast<int64_t>(j) * p.s13_s1;
  r.su = r.sg + static_cast<int64_t>(p.inter) * p.s13_s1;
  r.aligned16 = p.w13_s0 % 16 == 0 && p.w13_s1 % 16 == 0 &&
                reinterpret_cast<uintptr_t>(p.w13) % 16 == 0;
  return r;
}

// columns c >= hidden (past the row, or no next tile): zeros, nothing loaded
__device__ __forceinline__ GateUpQ load_gate_up(const GateUpRows& w, int c, int hidden) {
  GateUpQ q{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), 0u, 0u};
  if (c < hidden) {
    q.g = load_q32(w.wg, c, w.aligned16);
    q.u = load_q32(w.wu, c, w.aligned16);
    q.sg = w.sg[c / 32];
    q.su = w.su[c / 32];
  }
  return q;
}

__device__ __forceinline__ void decode_e2m1x32(uint4 q, float* w) {
  decode_e2m1x8(q.x, w);
  decode_e2m1x8(q.y, w + 8);
  decode_e2m1x8(q.z, w + 16);
  decode_e2m1x8(q.w, w + 24);
}

// acc[t] += f * sum_i x[t][i] * w[i] over one lane's 32 columns (one scale group), i in
// order, for the tokens t < nt of a chunk; x from LDS laid out xs[t][j4][lane] with L lanes,
// token t at xs + t * TS (float4s)
template <int MT, int L, int TS = 8 * L>
__device__ __forceinline__ void scale_group_fma(const float4* xs, int lane, int nt,
                                                const float* w, float f, float* acc) {
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    if (t < nt) {  // uniform per block
      float s = 0.0f;
#pragma unroll
      for (int j4 = 0; j4 < 8; ++j4) {
        const float4 xv = xs[t * TS + j4 * L + lane];
        s = fmaf(xv.x, w[4 * j4], s);
        s = fmaf(xv.y, w[4 * j4 + 1], s);
        s = fmaf(xv.z, w[4 * j4 + 2], s);
        s = fmaf(xv.w, w[4 * j4 + 3], s);
      }
      acc[t] = fmaf(s, f, acc[t]);
    }
  }
}

// the same sum_i x[i] * w[i] as scale_group_fma's, one token, returned unscaled (the split
// gate/up direct folds it later); x from LDS laid out xs[j4][lane] with L lanes (float4s).
// Not called by scale_group_fma on purpose: that moved the grouped kernels' registers on
// gfx90a (moe_gate_up_kernel<8, *> 121 -> 126-127 VGPRs), away from the counts they were timed at.
template <int L>
__device__ __forceinline__ float group_dot(const float4* xs, int lane, const float* w) {
  float s = 0.0f;
#pragma unroll
  for (int j4 = 0; j4 < 8; ++j4) {
    const float4 xv = xs[j4 * L + lane];
    s = fmaf(xv.x, w[4 * j4], s);
    s = fmaf(xv.y, w[4 * j4 + 1], s);
    s = fmaf(xv.z, w[4 * j4 + 2], s);
    s = fmaf(xv.w, w[4 * j4 + 3], s);
  }
  return s;
}

// gfx936: two blocks per CU (2 waves per SIMD): <= 256 VGPRs on gfx90a with no AGPRs,
// <= 128 where a lane has 256 (gfx906-like, no AGPRs); CUDA: 2 blocks per SM
template <int MT, int XK>
__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_kernel(const MoeMxfp4Params p) {
  // tiles staged at once: 16 KB of activations while MT <= 4 (at H = 4096 and M = 1 all four
  // tiles in one stage: one activation round trip per chunk instead of four)
  constexpr int kStage = MT >= 4 ? 1 : 4 / MT;
  constexpr int kTokStride = kStage * 8 * kLanes;  // float4s per token
  __shared__ float4 xs[MT * kTokStride];  // xs[t][tile % kStage][j4][lane], see the layout above
  __shared__ int64_t s_xoff[MT];          // element offset of token t's row in x
  __shared__ float s_rw[MT];
  __shared__ int s_pair[MT];
  const int e = p.active[blockIdx.y];
  if (e < 0) return;  // uniform per block
  const int lane = threadIdx.x % kLanes, grp = threadIdx.x / kLanes;
  const int j = blockIdx.x * kGroupsPerBlock + grp;
  const bool row_ok = j < p.inter;
  const int jr = row_ok ? j : 0;
  const GateUpRows rows = gate_up_rows(p, e, jr);
  const int ntiles = (p.hidden + kTileCols - 1) / kTileCols;
  // the first tile's weights, before the routing reads below
  GateUpQ nxt = load_gate_up(rows, 32 * lane, p.hidden);
  const int beg = p.expert_start[e], end = p.expert_start[e + 1];
  for (int t0 = beg; t0 < end; t0 += MT) {
    const int nt = min(MT, end - t0);
    if (threadIdx.x < MT) {
      const int t = threadIdx.x;
      const int pr = t < nt ? p.sorted_pairs[t0 + t] : -1;
      s_pair[t] = pr;
      s_xoff[t] = pr >= 0 ? static_cast<int64_t>(pr / p.topk) * p.x_s0 : 0;
      s_rw[t] = pr >= 0 && p.weight_on_input ? p.topk_weights[pr] : 1.0f;
    }
    __syncthreads();
    const int my_pair = s_pair[lane % MT];  // lane t < nt stores token t
    float ag[MT], au[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) ag[t] = au[t] = 0.0f;
    for (int tile = 0; tile < ntiles; ++tile) {
      const GateUpQ cur = nxt;
      const int cn = tile + 1 < ntiles ? (tile + 1) * kTileCols + 32 * lane
                     : t0 + MT < end ? 32 * lane : p.hidden;  // next chunk's first tile
      nxt = load_gate_up(rows, cn, p.hidden);
      const int ts = tile % kStage;
      if (ts == 0) {
        if (tile > 0) __syncthreads();  // the previous stage is read
        // the stage's activations: item i = (token t, tile tt, 8 columns), 128 per tile
        // (MT * kStage * 128 is a multiple of kThreads: every thread's loads in flight at once)
        static_assert(MT * kStage * (kTileCols / 8) % kThreads == 0, "whole staging passes");
#pragma unroll
        for (int i = threadIdx.x; i < MT * kStage * (kTileCols / 8); i += kThreads) {
          const int t = i / (kStage * (kTileCols / 8)), tq = i % (kStage * (kTileCols / 8));
          const int tt = tq / (kTileCols / 8), q = tq % (kTileCols / 8);
          const int col = (tile + tt) * kTileCols + 8 * q;
          float v[8];
          if (t < nt && col < p.hidden) {
            load_x8<XK>(static_cast<const char*>(p.x) + s_xoff[t] * (XK == kF32 ? 4 : 2), col,
                        v);
            if (p.weight_on_input) {
#pragma unroll
              for (int k = 0; k < 8; ++k) v[k] *= s_rw[t];
            }
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
          }
          const int l = q / 4, j4 = 2 * (q % 4);
          float4* d = xs + t * kTokStride + tt * 8 * kLanes;
          d[j4 * kLanes + l] = make_float4(v[0], v[1], v[2], v[3]);
          d[(j4 + 1) * kLanes + l] = make_float4(v[4], v[5], v[6], v[7]);
        }
        __syncthreads();
      }
      const float4* xt = xs + ts * 8 * kLanes;
      float w[32];
      decode_e2m1x32(cur.g, w);
      scale_group_fma<MT, kLanes, kTokStride>(xt, lane, nt, w, ue8m0_pow2(cur.sg, 62), ag);
      decode_e2m1x32(cur.u, w);
      scale_group_fma<MT, kLanes, kTokStride>(xt, lane, nt, w, ue8m0_pow2(cur.su, 62), au);
    }
    __syncthreads();  // xs and s_pair are read before the next chunk writes them
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const float g = group_sum<kLanes>(ag[t]), u = group_sum<kLanes>(au[t]);
      if (lane == t && t < nt && row_ok)
        p.act[static_cast<int64_t>(my_pair) * p.inter + j] =
            clamped_silu_mul(g, u, p.alpha, p.limit) * kXPrescale;
    }
  }
}

// step s's bytes of a lane's kDownRows rows (columns c >= inter: zeros, nothing loaded)
__device__ __forceinline__ void load_down(uint4* q, uint32_t* u, const uint8_t* const* wrow,
                                          const uint8_t* const* srow, int c, int inter,
                                          bool aligned16) {
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) {
    q[r] = make_uint4(0u, 0u, 0u, 0u);
    u[r] = 0u;
    if (c < inter) {
      q[r] = load_q32(wrow[r], c, aligned16);
      u[r] = srow[r][c / 32];
    }
  }
}

// 1. expert e's rows of the block: y[pair, n] for the expert's pairs
template <int MT, int G>
__device__ __forceinline__ void moe_down_expert(const MoeMxfp4Params& p, int e, float4* as,
                                                int* s_pair) {
  constexpr int kRowGroups = kThreads / G;  // groups of G lanes, kDownRows rows each
  constexpr int kStepCols = 32 * G;         // act columns per step
  const int sl = threadIdx.x % G, rg = threadIdx.x / G;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kRowGroups + rg) * kDownRows;
  const bool aligned16 = p.w2_s0 % 16 == 0 && p.w2_s1 % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(p.w2) % 16 == 0;
  const uint8_t* wrow[kDownRows];
  const uint8_t* srow[kDownRows];
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) {
    const int64_t n = n0 + r < p.hidden ? n0 + r : 0;
    wrow[r] = p.w2 + e * p.w2_s0 + n * p.w2_s1;
    srow[r] = p.s2 + e * p.s2_s0 + n * p.s2_s1;
  }
  const int nsteps = (p.inter + kStepCols - 1) / kStepCols;
  // step 0's weights, before the routing reads below
  uint4 q0[kDownRows];
  uint32_t u0[kDownRows];
  load_down(q0, u0, wrow, srow, 32 * sl, p.inter, aligned16);
  const int beg = p.expert_start[e], end = p.expert_start[e + 1];
  for (int t0 = beg; t0 < end; t0 += MT) {
    const int nt = min(MT, end - t0);
    if (threadIdx.x < MT)
      s_pair[threadIdx.x] = static_cast<int>(threadIdx.x) < nt ? p.sorted_pairs[t0 + threadIdx.x]
                                                                : -1;
    __syncthreads();
    float acc[kDownRows][MT];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r)
#pragma unroll
      for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;
    for (int step = 0; step < nsteps; ++step) {
      uint4 q[kDownRows];
      uint32_t u[kDownRows];
      if (step == 0) {
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          q[r] = q0[r];
          u[r] = u0[r];
        }
      } else {
        load_down(q, u, wrow, srow, step * kStepCols + 32 * sl, p.inter, aligned16);
      }
      // the step's act values: item i = (token t, float4 k4 of the step's columns)
      for (int i = threadIdx.x; i < MT * 8 * G; i += kThreads) {
        const int t = i / (8 * G), k4 = i % (8 * G);
        const int col = step * kStepCols + 4 * k4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < nt && col < p.inter)
          v = *reinterpret_cast<const float4*>(
              p.act + static_cast<int64_t>(s_pair[t]) * p.inter + col);
        as[(t * 8 + k4 % 8) * G + k4 / 8] = v;  // column 32 l + 4 j4: l = k4 / 8, j4 = k4 % 8
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        float w[32];
        // decoded per chunk: hoisted out of the chunk loop, the kDownRows x 32 floats
        // would take 128 VGPRs (gfx906: 372 bytes of scratch at MT = 1)
        GFX936_OPAQUE_U4(q[r]);
        decode_e2m1x32(q[r], w);
        scale_group_fma<MT, G>(as, sl, nt, w, ue8m0_pow2(u[r], 62), acc[r]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < kDownRows; ++r)
#pragma unroll
      for (int t = 0; t < MT; ++t) acc[r][t] = group_sum<G>(acc[r][t]);
#pragma unroll
    for (int r = 0; r < kDownRows; ++r)
#pragma unroll
      for (int t = 0; t < MT; ++t)
        if (sl == (r * MT + t) % G && n0 + r < p.hidden && t < nt) {
          const int pr = s_pair[t];
          const float rw = p.weight_on_input ? 1.0f : p.topk_weights[pr];
          p.y[static_cast<int64_t>(pr) * p.hidden + n0 + r] = acc[r][t] * rw;
        }
    __syncthreads();  // s_pair read above before the next chunk writes it
  }
}

// gfx936: two blocks per CU, as gate/up
template <int MT, int G>
__global__ void __launch_bounds__(kThreads, 2) moe_down_kernel(const MoeMxfp4Params p) {
  __shared__ float4 as[MT * 8 * G];         // as[t][j4][lane], see the layout above
  __shared__ int s_pair[MT];
  __shared__ int last_flag;
  const int e = p.active[blockIdx.y];
  if (e >= 0) moe_down_expert<MT, G>(p, e, as, s_pair);  // uniform per block
  if (p.m > kFoldTokens || gridDim.x > kMaxDownTiles) return;  // moe_reduce sums
  // 2. the folded per-token sum: the row tile's last block adds every slot's y in order
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    GFX936_ARRIVE(&g_moe_down_tile_count[blockIdx.x], gridDim.y, last_flag);
  }
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  constexpr int kRows = kThreads / G * kDownRows;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows;
  for (int i = threadIdx.x; i < p.m * kRows; i += kThreads) {
    const int m = i / kRows;
    const int64_t n = r0 + i % kRows;
    if (n < p.hidden) {
      float s = 0.0f;  // as moe_reduce_kernel: slot order, unrouted pairs skipped
      for (int k = 0; k < p.topk; ++k) {
        const int64_t pr = static_cast<int64_t>(m) * p.topk + k;
        if (p.pair_expert[pr] >= 0) s += MOE_LOAD_L2(p.y + pr * p.hidden + n);
      }
      store_kind(p.out, p.out_kind, m * p.o_s0 + n, s);
    }
  }
  if (threadIdx.x == 0) GFX936_RESET(&g_moe_down_tile_count[blockIdx.x], gridDim.y);
}

template <int OK>
__global__ void __launch_bounds__(kThreads) moe_reduce_kernel(const MoeMxfp4Params p) {
  const int64_t n4 = p.hidden / 4;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= p.m * n4) return;
  const int64_t m = i / n4, c = (i % n4) * 4;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int k = 0; k < p.topk; ++k) {
    const int64_t pr = m * p.topk + k;
    if (p.pair_expert[pr] < 0) continue;
    const float4 v = *reinterpret_cast<const float4*>(p.y + pr * p.hidden + c);
    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
  }
  const int64_t o = m * p.o_s0 + c;
  store_out<OK>(p.out, o, s.x);
  store_out<OK>(p.out, o + 1, s.y);
  store_out<OK>(p.out, o + 2, s.z);
  store_out<OK>(p.out, o + 3, s.w);
}

// local expert of pair pr from topk_ids (and expert_map), -1 when not on this rank: the
// same mapping as moe_route_kernel's
__device__ __forceinline__ int pair_local_expert(const MoeMxfp4Params& p, int64_t pr) {
  const int64_t g = p.ids_is_64 ? static_cast<const int64_t*>(p.topk_ids)[pr]
                                : static_cast<const int32_t*>(p.topk_ids)[pr];
  int e = -1;
  if (p.expert_map != nullptr) {
    if (g >= 0 && g < p.map_len) e = p.expert_map[g];
  } else if (g >= 0 && g < p.num_experts) {
    e = static_cast<int>(g);
  }
  return e >= p.num_experts ? -1 : e;
}

template <int XK, int S>
__global__ void __launch_bounds__(kThreads, kGateUpDirectBlocks)
    moe_gate_up_direct_kernel(const MoeMxfp4Params p) {
  constexpr int kItems = kDirectTiles * (kTileCols / 8) / kThreads;  // x loads per thread
  static_assert(kDirectTiles * (kTileCols / 8) % kThreads == 0, "whole staging passes");
  __shared__ float4 xs[kDirectTiles * 8 * kLanes];  // xs[tile][j4][lane], as gate/up's stage
  const int64_t pr = blockIdx.y;
  const int64_t tok = pr / p.topk;
  static_assert(kDirectTiles % S == 0 && kGroupsPerBlock % S == 0, "whole tiles, whole pairs");
  constexpr int kMyTiles = kDirectTiles / S;
  __shared__ float part[S > 1 ? 2 * (kGroupsPerBlock / S) * kLanes : 1];  // half 0's sums
  const int lane = threadIdx.x % kLanes, grp = threadIdx.x / kLanes;
  const int half = grp % S, jl = grp / S;
  const int j = blockIdx.x * (kGroupsPerBlock / S) + jl;
  // 1. the token's x: item i = (tile, 8 columns); its loads do not wait for the routing
  float xv[kItems][8];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int i = threadIdx.x + it * kThreads, col = 8 * i;  // tile i / 128, q = i % 128
    if (col < p.hidden) {
      load_x8<XK>(static_cast<const char*>(p.x) + tok * p.x_s0 * (XK == kF32 ? 4 : 2), col,
                  xv[it]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) xv[it][k] = 0.0f;
    }
  }
  // 2. the pair's expert, then every tile of the block's row pair at once
  const int e = pair_local_expert(p, pr);
  if (e < 0) return;  // uniform per block: down skips the pair
  const bool row_ok = j < p.inter;
  const int jr = row_ok ? j : 0;
  const GateUpRows rows = gate_up_rows(p, e, jr);
  GateUpQ q[kMyTiles];
#pragma unroll
  for (int i = 0; i < kMyTiles; ++i)
    q[i] = load_gate_up(rows, (half * kMyTiles + i) * kTileCols + 32 * lane, p.hidden);
  const float rw = p.weight_on_input ? p.topk_weights[pr] : 1.0f;
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int i = threadIdx.x + it * kThreads;
    const int tt = i / (kTileCols / 8), qq = i % (kTileCols / 8);
    if (p.weight_on_input) {
#pragma unroll
      for (int k = 0; k < 8; ++k) xv[it][k] *= rw;
    }
    const int l = qq / 4, j4 = 2 * (qq % 4);
    float4* d = xs + tt * 8 * kLanes;
    d[j4 * kLanes + l] = make_float4(xv[it][0], xv[it][1], xv[it][2], xv[it][3]);
    d[(j4 + 1) * kLanes + l] = make_float4(xv[it][4], xv[it][5], xv[it][6], xv[it][7]);
  }
  __syncthreads();
  // 3. gate/up's sums at MT = 1, tile by tile
  const int ntiles = (p.hidden + kTileCols - 1) / kTileCols;
  float ag = 0.0f, au = 0.0f;
  if constexpr (S == 1) {
#pragma unroll
    for (int t = 0; t < kDirectTiles; ++t) {
      if (t < ntiles) {
        const float4* xt = xs + t * 8 * kLanes;
        float w[32];
        decode_e2m1x32(q[t].g, w);
        scale_group_fma<1, kLanes>(xt, lane, 1, w, ue8m0_pow2(q[t].sg, 62), &ag);
        decode_e2m1x32(q[t].u, w);
        scale_group_fma<1, kLanes>(xt, lane, 1, w, ue8m0_pow2(q[t].su, 62), &au);
      }
    }
  } else {
    // each half of the groups dots its tiles; the fold in tile order: half 0 from zero
    // before the barrier, half 1 from half 0's sums after it (the same chain as S = 1;
    // a barrier every thread reaches)
    float dg[kMyTiles], du[kMyTiles], fg[kMyTiles], fu[kMyTiles];
#pragma unroll
    for (int i = 0; i < kMyTiles; ++i) {
      const int t = half * kMyTiles + i;
      dg[i] = du[i] = fg[i] = fu[i] = 0.0f;
      if (t < ntiles) {
        const float4* xt = xs + t * 8 * kLanes;
        float w[32];
        decode_e2m1x32(q[i].g, w);
        dg[i] = group_dot<kLanes>(xt, lane, w);
        fg[i] = ue8m0_pow2(q[i].sg, 62);
        decode_e2m1x32(q[i].u, w);
        du[i] = group_dot<kLanes>(xt, lane, w);
        fu[i] = ue8m0_pow2(q[i].su, 62);
      }
    }
    for (int pass = 0; pass < S; ++pass) {
      if (pass > 0) {
        __syncthreads();  // part
        if (half == pass) {
          ag = part[(2 * jl) * kLanes + lane];
          au = part[(2 * jl + 1) * kLanes + lane];
        }
      }
      if (half == pass) {
#pragma unroll
        for (int i = 0; i < kMyTiles; ++i) {
          if (half * kMyTiles + i < ntiles) {
            ag = fmaf(dg[i], fg[i], ag);
            au = fmaf(du[i], fu[i], au);
          }
        }
        if (pass + 1 < S) {
          part[(2 * jl) * kLanes + lane] = ag;
          part[(2 * jl + 1) * kLanes + lane] = au;
        }
      }
    }
  }
  const float g = group_sum<kLanes>(ag), u = group_sum<kLanes>(au);
  if (lane == 0 && row_ok && half == S - 1)
    p.act[pr * p.inter + j] = clamped_silu_mul(g, u, p.alpha, p.limit) * kXPrescale;
}

template <int G>
__global__ void __launch_bounds__(kThreads, kDownDirectBlocks)
    moe_down_direct_kernel(const MoeMxfp4Params p) {
  constexpr int kRowGroups = kThreads / G;
  constexpr int kItems = (kDirectRows * kDirectMaxTopk + kRowGroups - 1) / kRowGroups;
  constexpr int kActLoads = (kDirectMaxTopk * 8 * G + kThreads - 1) / kThreads;
  __shared__ float4 as[kDirectMaxTopk * 8 * G];  // as[slot][j4][lane], see the layout above
  __shared__ float dots[kDirectMaxTopk * kDirectRows];
  __shared__ int s_e[kDirectMaxTopk];     // each slot's local expert (-1: not on this rank)
  __shared__ float s_rw[kDirectMaxTopk];  // its weight in the token's sum
  const int64_t tok = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kDirectRows;
  const int k = p.topk, items = k * kDirectRows;
  const int sl = threadIdx.x % G, rg = threadIdx.x / G;
  // 1. the token's act rows (written by gate_up_direct; an unrouted pair's row is never
  //    read into a sum) into registers, and each slot's expert and weight, read once per
  //    block (not per lane and item: the lookups and their checks were most of this
  //    kernel's instructions)
  float4 av[kActLoads];
#pragma unroll
  for (int j = 0; j < kActLoads; ++j) {
    const int i = threadIdx.x + j * kThreads, s = i / (8 * G), col = 4 * (i % (8 * G));
    av[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (s < k && col < p.inter)
      av[j] = *reinterpret_cast<const float4*>(p.act + (tok * k + s) * p.inter + col);
  }
  if (threadIdx.x < k) {
    const int64_t pr = tok * k + threadIdx.x;
    const int e = pair_local_expert(p, pr);
    s_e[threadIdx.x] = e;
    s_rw[threadIdx.x] = p.weight_on_input || e < 0 ? 1.0f : p.topk_weights[pr];
  }
  __syncthreads();  // s_e
  // 2. every item's 16-byte weight slice at once; item = slot * kDirectRows + row
  const bool aligned16 = p.w2_s0 % 16 == 0 && p.w2_s1 % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(p.w2) % 16 == 0;
  uint4 q[kItems];
  uint32_t u[kItems];
#pragma unroll
  for (int ii = 0; ii < kItems; ++ii) {
    const int it = rg + kRowGroups * ii;
    q[ii] = make_uint4(0u, 0u, 0u, 0u);
    u[ii] = 0u;
    if (it < items) {
      const int64_t n = n0 + it % kDirectRows;
      const int e = s_e[it / kDirectRows];
      if (e >= 0 && n < p.hidden) {
        q[ii] = load_q32(p.w2 + e * p.w2_s0 + n * p.w2_s1, 32 * sl, aligned16);
        u[ii] = p.s2[e * p.s2_s0 + n * p.s2_s1 + sl];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kActLoads; ++j) {
    const int i = threadIdx.x + j * kThreads, s = i / (8 * G), k4 = i % (8 * G);
    if (s < k) as[(s * 8 + k4 % 8) * G + k4 / 8] = av[j];
  }
  __syncthreads();  // as is written
  float acc[kItems];
#pragma unroll
  for (int ii = 0; ii < kItems; ++ii) {
    const int it = rg + kRowGroups * ii;
    acc[ii] = 0.0f;
    if (it < items) {
      float w[32];
      decode_e2m1x32(q[ii], w);
      scale_group_fma<1, G>(as + (it / kDirectRows) * 8 * G, sl, 1, w,
                            ue8m0_pow2(u[ii], 62), &acc[ii]);
    }
  }
#pragma unroll
  for (int ii = 0; ii < kItems; ++ii) {
    const float v = group_sum<G>(acc[ii]);  // every lane: the shuffles are block-uniform
    const int it = rg + kRowGroups * ii;
    if (sl == 0 && it < items) dots[it] = v;
  }
  __syncthreads();
  // 3. the token's sum over its slots, moe_reduce's order
  for (int r = threadIdx.x; r < kDirectRows; r += kThreads) {
    const int64_t n = n0 + r;
    if (n >= p.hidden) continue;
    float sum = 0.0f;
    for (int s = 0; s < k; ++s)
      if (s_e[s] >= 0) sum += mul_rn(dots[s * kDirectRows + r], s_rw[s]);
    store_kind(p.out, p.out_kind, tok * p.o_s0 + n, sum);
  }
}

template <int OK>
__global__ void __launch_bounds__(kThreads) mxfp4_dequant_kernel(const Mxfp4DequantParams p) {
  // grid: (chunks of kThreads of the slot's N x K/32 scale groups, slot): every thread decodes
  // one 16-byte group (32 elements) whatever K is; one block per (row, chunk of K) left 248 of
  // 256 threads idle on w2 at TP8 (K = 256: 8 groups a row) and launched a block per 256
  // elements. Adjacent threads read adjacent 16-byte groups and scale bytes of a row, then
  // the next row's (rows are K/2 bytes apart, contiguous in the packed checkpoint)
  const int e = p.active[p.slot0 + blockIdx.y];
  if (e < 0) return;  // uniform per block
  const int groups = p.k / 32;
  const int t = blockIdx.x * kThreads + threadIdx.x;  // < N x K/32 <= INT32_MAX: launcher
  if (t >= p.n * groups) return;
  const int n = t / groups, gi = t - n * groups;
  const uint4 q = *reinterpret_cast<const uint4*>(p.w + e * p.w_s0 + n * p.w_s1 + 16 * gi);
  const float f = ue8m0_pow2(p.s[e * p.s_s0 + n * p.s_s1 + gi], 0);
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  const int64_t o = (static_cast<int64_t>(blockIdx.y) * p.n + n) * p.k + 32 * gi;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    float w[8];
    decode_e2m1x8(words[b], w);
#pragma unroll
    for (int i2 = 0; i2 < 8; ++i2)  // * 2^126 (exact), then the scale: one rounding
      w[i2] = (w[i2] * 8.507059173023462e37f) * f;
    store_out8<OK>(p.out, o + 8 * b, w);
  }
}

template <int MT, int XK>
void launch_gate_up(const MoeMxfp4Params& p, gfx936Stream_t st) {
  const dim3 grid((p.inter + kGroupsPerBlock - 1) / kGroupsPerBlock, p.num_slots);
  moe_gate_up_kernel<MT, XK><<<grid, kThreads, 0, st>>>(p);
}

// returns the row tiles (grid.x) of the launch
template <int MT, int G>
int launch_down(const MoeMxfp4Params& p, gfx936Stream_t st) {
  const int rows = (kThreads / G) * kDownRows;
  const dim3 grid((p.hidden + rows - 1) / rows, p.num_slots);
  moe_down_kernel<MT, G><<<grid, kThreads, 0, st>>>(p);
  return static_cast<int>(grid.x);
}

// down's lanes per row (both paths): the largest power of two <= min(32, I / 32) scale
// groups of a w2 row (I % 32 == 0: host check), at least 2 (I = 32: lane 1 idle; G = 1
// would spill on gfx906)
int down_lanes(int inter) {
  const int groups = inter / 32;
  int g = 2;
  while (g < 32 && 2 * g <= groups) g *= 2;
  return g;
}

template <int MT>
int launch_down_mt(const MoeMxfp4Params& p, gfx936Stream_t st) {
  switch (down_lanes(p.inter)) {
    case 32: return launch_down<MT, 32>(p, st);
    case 16: return launch_down<MT, 16>(p, st);
    case 8: return launch_down<MT, 8>(p, st);
    case 4: return launch_down<MT, 4>(p, st);
    default: return launch_down<MT, 2>(p, st);
  }
}

template <int MT>
void launch_gate_up_mt(const MoeMxfp4Params& p, gfx936Stream_t st) {
  if (p.x_kind == kBF16) launch_gate_up<MT, kBF16>(p, st);
  else if (p.x_kind == kF16) launch_gate_up<MT, kF16>(p, st);
  else launch_gate_up<MT, kF32>(p, st);
}

template <int G>
void launch_down_direct(const MoeMxfp4Params& p, gfx936Stream_t st) {
  const dim3 grid((p.hidden + kDirectRows - 1) / kDirectRows, p.m);
  moe_down_direct_kernel<G><<<grid, kThreads, 0, st>>>(p);
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

int moe_route_launch(const MoeRoute& r, void* stream, const char** msg) {
  *msg = "ok";
  if (r.m == 0) return 0;
  const size_t shmem = 2 * sizeof(int32_t) * static_cast<size_t>(r.num_experts);
  // fewer threads = fewer scan steps; each thread owns ceil(E / threads) experts
  const int threads = r.num_experts <= 256 && r.m * r.topk <= 4096 ? 256 : kRouteThreads;
  moe_route_kernel<<<1, threads, shmem, static_cast<gfx936Stream_t>(stream)>>>(r);
  return finish(msg);
}

int moe_reduce_launch(const MoeMxfp4Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.m == 0) return 0;
  const int64_t total = static_cast<int64_t>(p.m) * (p.hidden / 4);
  const unsigned blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  if (p.out_kind == kBF16) moe_reduce_kernel<kBF16><<<blocks, kThreads, 0, st>>>(p);
  else if (p.out_kind == kF16) moe_reduce_kernel<kF16><<<blocks, kThreads, 0, st>>>(p);
  else moe_reduce_kernel<kF32><<<blocks, kThreads, 0, st>>>(p);
  return finish(msg);
}

int moe_mxfp4_gemv_launch(const MoeMxfp4Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.m == 0) return 0;
  // tokens per expert chunk. Both GEMVs skip a chunk's missing tokens (uniform branch), so a
  // chunk larger than the average routed count costs LDS and registers, not FMAs: one token
  // only at M = 1, else one level above the average (random routing puts 2-3 tokens on some
  // experts long before the average passes 1); down holds kDownRows x MT sums: at most 4.
  const int pairs = p.m * p.topk;
  int tiles;
  if (p.m == 1) {
    launch_gate_up_mt<1>(p, st);
    tiles = launch_down_mt<1>(p, st);
  } else if (pairs <= p.num_slots) {
    launch_gate_up_mt<2>(p, st);
    tiles = launch_down_mt<2>(p, st);
  } else {
    if (pairs <= 2 * p.num_slots) launch_gate_up_mt<4>(p, st);
    else launch_gate_up_mt<8>(p, st);
    tiles = launch_down_mt<4>(p, st);
  }
  const int rc = finish(msg);
  if (rc != 0) return rc;
  // the same test as moe_down_kernel's: there the tile's last block summed already
  if (p.m <= kFoldTokens && tiles <= kMaxDownTiles) return 0;
  return moe_reduce_launch(p, stream, msg);
}

bool moe_direct_supported(int m, int topk, int hidden, int inter) {
  return m >= 1 && m <= kDirectTokens && topk >= 1 && topk <= kDirectMaxTopk &&
         hidden >= 32 && hidden <= kDirectTiles * kTileCols && hidden % 32 == 0 &&
         inter >= 32 && inter % 32 == 0 && down_lanes(inter) <= kDirectMaxLanes &&
         inter <= 32 * down_lanes(inter);
}

// gate/up direct's grid with S lane groups per row pair: (row-pair blocks, pairs)
template <int S>
dim3 gate_up_direct_grid(const MoeMxfp4Params& p) {
  constexpr int kPairsPerBlock = kGroupsPerBlock / S;
  return dim3((p.inter + kPairsPerBlock - 1) / kPairsPerBlock, p.m * p.topk);
}

template <int S>
void launch_gate_up_direct_s(const MoeMxfp4Params& p, gfx936Stream_t st) {
  const dim3 gu = gate_up_direct_grid<S>(p);
  if (p.x_kind == kBF16) moe_gate_up_direct_kernel<kBF16, S><<<gu, kThreads, 0, st>>>(p);
  else if (p.x_kind == kF16) moe_gate_up_direct_kernel<kF16, S><<<gu, kThreads, 0, st>>>(p);
  else moe_gate_up_direct_kernel<kF32, S><<<gu, kThreads, 0, st>>>(p);
}

// S = 2 where the split grid still fits in one round of kSplitResident blocks per CU and H
// has all kDirectTiles tiles (the measured case); num_cus 0 (unknown) keeps S = 1
void launch_gate_up_direct(const MoeMxfp4Params& p, gfx936Stream_t st) {
  const dim3 unsplit = gate_up_direct_grid<1>(p);
  const int64_t blocks = static_cast<int64_t>(unsplit.x) * unsplit.y;
  const int ntiles = (p.hidden + kTileCols - 1) / kTileCols;
  if (2 * blocks <= static_cast<int64_t>(kSplitResident) * p.num_cus && ntiles == kDirectTiles)
    launch_gate_up_direct_s<2>(p, st);
  else
    launch_gate_up_direct_s<1>(p, st);
}

int moe_mxfp4_direct_launch(const MoeMxfp4Params& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.m == 0) return 0;
  if (!moe_direct_supported(p.m, p.topk, p.hidden, p.inter)) {
    *msg = "moe_mxfp4_direct: shape outside moe_direct_supported (1 <= M <= 64, "
           "1 <= topk <= 8, H a multiple of 32 up to 4096, I a multiple of 32 up to 512 that "
           "down takes in one step)";
    return -1;
  }
  launch_gate_up_direct(p, st);
  switch (down_lanes(p.inter)) {
    case 16: launch_down_direct<16>(p, st); break;
    case 8: launch_down_direct<8>(p, st); break;
    case 4: launch_down_direct<4>(p, st); break;
    default: launch_down_direct<2>(p, st); break;
  }
  return finish(msg);
}

int mxfp4_dequant_experts_launch(const Mxfp4DequantParams& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.slots == 0 || p.n == 0 || p.k == 0) return 0;
  const int64_t groups = static_cast<int64_t>(p.n) * (p.k / 32);
  if (groups > INT32_MAX - kThreads || p.slots > 65535) {
    *msg = "mxfp4_dequant_experts: N x K/32 must stay below 2^31 - 256 and the slots at "
           "65535 or fewer (the grid's y)";
    return -1;
  }
  const dim3 grid(static_cast<unsigned>((groups + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.slots));
  if (p.out_kind == kBF16) mxfp4_dequant_kernel<kBF16><<<grid, kThreads, 0, st>>>(p);
  else if (p.out_kind == kF16) mxfp4_dequant_kernel<kF16><<<grid, kThreads, 0, st>>>(p);
  else mxfp4_dequant_kernel<kF32><<<grid, kThreads, 0, st>>>(p);
  return finish(msg);
}

}  // namespace gfx936
