// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// DeepSeek V4 Sparse MLA decode over the fp8_ds_mla KV cache, without FP8 hardware.
// One source for DTK hipcc (gfx936), upstream hipcc (gfx90a compile check) and nvcc.
//
// fp8_ds_mla block (block_size = bs, block stride from the tensor, not from the shape):
//   base = cache + block * stride(0)          slot = block * bs + pos
//   [0, bs*576)            token t data at t*576:
//                            [0, 448)   448 x e4m3fn NoPE (OCP, bias 7)
//                            [448, 576) 64 x bf16 RoPE (little endian)
//   [bs*576, bs*584)       token t scales at bs*576 + t*8: 7 x ue8m0 | 1 pad
//   [bs*584, stride(0))    not this block's
//
// The decode is lowp_decode.h's (nothing here reads bits as a float):
//   e4m3 byte b -> decode_e4m3x4_nan: float32 bits (b & 0x80) << 24 | (b & 0x7f) << 20
//   = x * 2^-120 (exact for normals and subnormals, the latter as float32
//   denormals; 0x7f / 0xff are NaN), times e4m3_block_scale(ue8m0): the 2^120
//   folded into the group's scale, 2^(ue8m0 - 127) * 2^120 = 2^(ue8m0 - 7)
//   (ue8m0 0xff is NaN); x * 2^(ue8m0 - 127) bit for bit as PyTorch decodes it.
//
// Work split. Grid = (split s, head block, query); a block is 8 lane groups of
// kLanes = 32 lanes (<= every wave size: wave32 and wave64 run the same code). A
// group always owns 4 heads (kHT) and one half of the 512 dims (dh), so every key
// float it reads from LDS feeds 4 FMAs: lane l owns dims {256 dh + 128 j + 4 l + c}
// (j < 2, c < 4) of those heads' q (in registers, times scale * log2 e: the softmax
// runs in base 2) and float32 accumulators (4 x 8 + 4 x 8 registers: the tile fits
// two blocks per CU on gfx90a without AGPRs or scratch). Group g = (hq * KG + kg) *
// 2 + dh: HQ = 4 / KG head groups x KG key groups x 2 dim halves; KG = 1 (16 heads
// per block) above 8 local heads, KG = 2 (8 heads: 2 head groups x 2 key groups x 2
// halves) at <= 8, and also above 8 when the 16-head grid, split as far as it goes,
// would still leave CUs without a block (small batches at TP4 / TP1: twice the
// blocks, each reading its keys for 8 heads instead of 16).
//
// Keys of a query are the main (SWA) keys then the extra (compressed top-k) keys;
// split s of S walks the s-th ceil(n / S) of them in tiles of 8, a pipeline of three
// stages kept one tile apart:
//   slot ids of tile i+2:  threads 0..7 load indices[k] into a register, and after
//                          tile i's softmax write the key's byte offsets (from the
//                          source's cache; int64, not pointers) and source (-1 skip,
//                          0 main, 1 extra) to s_doff/s_soff/s_src[i & 1]
//   bytes of tile i+1:     8 keys x 36 16-byte chunks (+ the chunk's ue8m0 byte)
//                          over 256 threads, loaded into registers right after the
//                          barrier that makes tile i visible
//   tile i:                those registers decoded into LDS, then the math:
//     ks[key][32 j + l]    float4 = dims 128 j + 4 l .. +3 of the key (16 KB, float32);
//                          a group reads ks[key][64 dh + 32 j + lane], j < 2
//     1. group (hq, kg, dh) takes keys kg * 8/KG .. +8/KG of the tile: a lane's
//        partial scores of its 4 heads x 8/KG keys (V = 32/KG values) over its 8 dims;
//     2. reduce-scatter over the 32 lanes (V/2 + V/4 + .. shuffles, not 5 per score):
//        lane l ends with the half-score of value l / (32/V) = (head l / 8, key
//        (l % 8) / (32/V)); the two halves meet in LDS (s_half) and both add them in
//        the order dh 0 + dh 1, so both hold the same full score;
//     3. online softmax on that score (max over the 8 lanes of the head by xor 1, 2,
//        4); p and the head's rescale alpha go through LDS (s_p, s_alpha) to every
//        lane of the group, which updates its 4 x 8 accumulators from ks.
// Four barriers per tile: A (ks written), B1 (half-scores), B2 (p), C (ks read).
// After the last tile: l summed over the lanes of a head; with KG = 2 the key groups'
// (acc, m, l) are merged in LDS into key group 0 in the fixed order kg = 0, 1.
// S = 1: key group 0 adds the attention sink and writes the output. S > 1 (only when
// queries x head blocks is below the CU count, from shapes: no host sync): the block
// writes its (acc[512], m, l) rows to part[query][s][head][516]; the block that
// finishes a (query, head block) last (a per-tile atomic counter in device memory,
// zero at load, reset to zero by that block) merges the S rows in the fixed order
// s = 0 .. S-1 with the sink and writes the output: bitwise the same whoever is last,
// one launch, capturable in a CUDA/HIP graph. Launches that use the counters must not
// run concurrently on two streams (stream order serialises the layers of a model).
#include "gfx936_compat.h"
#include "last_block.h"
#include "lowp_decode.h"
#include "sparse_mla_decode.h"

namespace gfx936 {
namespace {

constexpr int kLanes = 32;  // lanes sharing one 512-d row; <= every wave size
constexpr int kGroups = 8;
constexpr int kThreads = kGroups * kLanes;
constexpr int kHT = 4;         // heads per lane group
constexpr int kTileKeys = 8;   // keys staged in LDS per step
constexpr int kChunks = 36;    // 576 data bytes / 16
constexpr int kNopeChunks = 28;
constexpr int kLoadItems = (kTileKeys * kChunks + kThreads - 1) / kThreads;
constexpr int kPartStride = 516;  // acc[512] | m | l | 2 pad: rows stay 16-byte aligned
constexpr int kMaxSplits = 16;
constexpr int kMaxTileCounters = 1 << 16;  // (query, head block) tiles of a split launch
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegLarge = -3.402823466e38f;
static_assert(kLanes <= GFX936_WARP_SIZE, "a lane group must fit in one wave");
static_assert(kThreads % GFX936_WARP_SIZE == 0, "whole waves per block");
static_assert(kHT * kTileKeys == kLanes, "one score per lane at KG = 1");

// a load of another block's partial, after __threadfence(): from L2, never a stale
// L1 line (HIP: the fence's acquire invalidates the CU's L1; CUDA: ld.global.cg)
#if defined(GFX936_HIP)
  #define SPARSE_MLA_LOAD_L2(ptr) (*(ptr))
#else
  #define SPARSE_MLA_LOAD_L2(ptr) __ldcg(ptr)
#endif

// per (query, head block) arrival counters of the split-K merge; zero at module
// load, every launch leaves them zero again (the last block of a tile resets it)
__device__ unsigned int g_sparse_mla_tile_count[kMaxTileCounters];

struct Segment { int64_t start; int n; };

__device__ __forceinline__ Segment segment(const SparseMlaSource& s, int qi) {
  Segment g;
  if (s.indptr != nullptr) {
    g.start = s.indptr[qi];
    g.n = s.indptr[qi + 1] - s.indptr[qi];
  } else {
    g.start = static_cast<int64_t>(qi) * s.width;
    g.n = s.width;
    if (s.lens != nullptr) g.n = min(max(s.lens[qi], 0), s.width);
  }
  g.n = max(g.n, 0);
  return g;
}

// slot id of key k of the query (main keys first); -1 past hi
__device__ __forceinline__ int key_slot(const SparseMlaParams& p, const Segment& ms,
                                        const Segment& es, int k, int hi) {
  if (k >= hi) return -1;
  // field by field: a reference to either kernel-argument struct would copy both to
  // scratch memory
  return k < ms.n ? p.main.idx[ms.start + k] : p.extra.idx[es.start + (k - ms.n)];
}

// byte offsets of key k's data and scales from its source's cache; src = -1 (skipped:
// negative or >= num_rows), 0 (main) or 1 (extra)
__device__ __forceinline__ void key_offsets(const SparseMlaParams& p, int k, int n_main,
                                            int slot, int64_t& doff, int64_t& soff,
                                            int& src) {
  const bool is_main = k < n_main;
  const int64_t rows = is_main ? p.main.num_rows : p.extra.num_rows;
  doff = 0;
  soff = 0;
  src = -1;
  if (slot >= 0 && slot < rows) {
    // 32-bit division (slot and bs are int32): a 64-bit one is a long register-hungry sequence
    const uint32_t bs = static_cast<uint32_t>(is_main ? p.main.block_size : p.extra.block_size);
    const uint32_t blk = static_cast<uint32_t>(slot) / bs;
    const uint32_t pos = static_cast<uint32_t>(slot) - blk * bs;
    const int64_t base = static_cast<int64_t>(blk) * (is_main ? p.main.stride0 : p.extra.stride0);
    doff = base + static_cast<int64_t>(pos) * 576;
    soff = base + static_cast<int64_t>(bs) * 576 + static_cast<int64_t>(pos) * 8;
    src = is_main ? 0 : 1;
  }
}

// q[t][4 j + c] = q[qi, h0 + t, 256 dh + 128 j + 4 lane + c] * scale * log2 e (0 past p.h);
// the kind is a template argument so the 32 loads carry no branch
template <int KIND>
__device__ __forceinline__ void load_q(const SparseMlaParams& p, int qi, int h0, int dh,
                                       int lane, float (&qr)[kHT][8]) {
#pragma unroll
  for (int t = 0; t < kHT; ++t) {
    const int h = h0 + t;
    const bool hv = h < p.h;
    const int64_t row =
        static_cast<int64_t>(qi) * p.q_s0 + static_cast<int64_t>(hv ? h : 0) * p.q_s1;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i = row + 256 * dh + 128 * j + 4 * lane + c;
        float v;
        if constexpr (KIND == kF32) v = static_cast<const float*>(p.q)[i];
        else if constexpr (KIND == kF16) v = f16_to_float(static_cast<const uint16_t*>(p.q)[i]);
        else v = bf16_to_float(static_cast<const uint16_t*>(p.q)[i]);
        qr[t][4 * j + c] = hv ? v * (p.scale * kLog2e) : 0.0f;
      }
  }
}

template <int KG, bool VEC>
__global__ void __launch_bounds__(kThreads, 2)
sparse_mla_decode_kernel(const SparseMlaParams p) {
  constexpr int HQ = kGroups / (2 * KG);  // head groups of kHT heads (each two dim halves)
  constexpr int HB = HQ * kHT;            // heads per block
  constexpr int KPG = kTileKeys / KG;     // keys of a tile per key group
  constexpr int V = kHT * KPG;            // score partials per lane and tile
  constexpr int DUP = kLanes / V;         // lanes holding one score after the reduce-scatter
  static_assert(DUP * KPG == kTileKeys, "the lanes of head t are t * 8 .. t * 8 + 7");
  __shared__ float4 ks[kTileKeys][128];  // decoded keys, float32 [kTileKeys][512]
  __shared__ int64_t s_doff[2][kTileKeys], s_soff[2][kTileKeys];
  __shared__ int s_src[2][kTileKeys];
  __shared__ float s_half[kGroups][V];    // a dim half's score of (head, key)
  __shared__ float s_p[kGroups][V];       // p of (head, key)
  __shared__ float s_alpha[kGroups][kHT];  // per head rescale of the tile
  __shared__ float s_m[kGroups][kHT], s_l[kGroups][kHT];
  __shared__ int last_flag;
  const int split = blockIdx.x, hb = blockIdx.y, qi = blockIdx.z;
  const int tid = threadIdx.x, grp = tid / kLanes, lane = tid % kLanes;
  // grp = (hq * KG + kg) * 2 + dh: the two dim halves of a (head group, key group) are
  // neighbours (grp ^ 1)
  const int dh = grp % 2, kg = grp / 2 % KG, hq = grp / (2 * KG);
  const int h0 = hb * HB + hq * kHT;  // the group's first head
  const int own = lane / DUP;         // the value whose score this lane ends with
  const int own_t = own / KPG, own_k = kg * KPG + own % KPG;

  float qr[kHT][8], acc[kHT][8];
  if (p.q_kind == kF32) load_q<kF32>(p, qi, h0, dh, lane, qr);
  else if (p.q_kind == kF16) load_q<kF16>(p, qi, h0, dh, lane, qr);
  else load_q<kBF16>(p, qi, h0, dh, lane, qr);
#pragma unroll
  for (int t = 0; t < kHT; ++t)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[t][j] = 0.0f;
  float m_run = kNegLarge, l_run = 0.0f;  // of head own_t, the lane's keys

  const Segment ms = segment(p.main, qi);
  Segment es{0, 0};
  if (p.has_extra) es = segment(p.extra, qi);
  const int n_tot = ms.n + es.n;
  const int chunk = (n_tot + p.num_splits - 1) / p.num_splits;
  const int lo = min(split * chunk, n_tot);
  const int hi = min(lo + chunk, n_tot);
  const int ntiles = (hi - lo + kTileKeys - 1) / kTileKeys;

  // prologue: offsets of tiles 0 and 1 (threads 0..15), then tile 0's bytes
  if (tid < 2 * kTileKeys) {
    const int k = lo + tid;
    int64_t d, s;
    int src;
    key_offsets(p, k, ms.n, key_slot(p, ms, es, k, hi), d, s, src);
    s_doff[tid / kTileKeys][tid % kTileKeys] = d;
    s_soff[tid / kTileKeys][tid % kTileKeys] = s;
    s_src[tid / kTileKeys][tid % kTileKeys] = src;
  }
  __syncthreads();
  uint4 raw[kLoadItems];
  uint32_t sbyte[kLoadItems];
  // the 16-byte chunks (and their scale bytes) of the tile whose offsets are in buf
  auto load_tile = [&](int buf) {
#pragma unroll
    for (int i = 0; i < kLoadItems; ++i) {
      const int it = tid + i * kThreads, key = it / kChunks, c = it % kChunks;
      raw[i] = make_uint4(0u, 0u, 0u, 0u);
      sbyte[i] = 127u;
      if (it < kTileKeys * kChunks && s_src[buf][key] >= 0) {
        const uint8_t* base = s_src[buf][key] == 0 ? p.main.cache : p.extra.cache;
        const uint8_t* src = base + s_doff[buf][key] + 16 * c;
        if (VEC) {
          raw[i] = GFX936_LDG(reinterpret_cast<const uint4*>(src));
        } else {
          uint32_t w[4];
#pragma unroll
          for (int b = 0; b < 4; ++b)
            w[b] = src[4 * b] | (src[4 * b + 1] << 8) | (src[4 * b + 2] << 16) |
                   (static_cast<uint32_t>(src[4 * b + 3]) << 24);
          raw[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
        if (c < kNopeChunks) sbyte[i] = base[s_soff[buf][key] + (c >> 2)];
      }
    }
  };
  load_tile(0);
  int next_slot = -1;

  for (int i = 0; i < ntiles; ++i) {
    const int buf = i & 1;
    // registers -> LDS (skipped keys: zero bytes, scale byte 127: zeros, masked below)
    float* ksf = reinterpret_cast<float*>(&ks[0][0]);
#pragma unroll
    for (int r = 0; r < kLoadItems; ++r) {
      const int it = tid + r * kThreads, key = it / kChunks, c = it % kChunks;
      if (it >= kTileKeys * kChunks) continue;
      float v[16];
      const uint32_t w[4] = {raw[r].x, raw[r].y, raw[r].z, raw[r].w};
      if (c < kNopeChunks) {
        const E4m3Scale s = e4m3_block_scale(sbyte[r]);
#pragma unroll
        for (int j = 0; j < 4; ++j) decode_e4m3x4_nan(w[j], v + 4 * j);
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = e4m3_scaled(v[j], s);
        float4* dst = reinterpret_cast<float4*>(ksf + key * 512 + 16 * c);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          dst[j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          v[j] = bf16_to_float(static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1))));
        float4* dst = reinterpret_cast<float4*>(ksf + key * 512 + 448 + 8 * (c - kNopeChunks));
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
    const bool own_valid = s_src[buf][own_k] >= 0;
    __syncthreads();  // A: ks holds tile i; s_*[buf] is free for tile i + 2
    if (i + 1 < ntiles) load_tile(buf ^ 1);  // in flight during tile i's math
    const int k2 = lo + (i + 2) * kTileKeys + tid;
    if (tid < kTileKeys) next_slot = key_slot(p, ms, es, k2, hi);

    // 1. partial scores of the group's 4 heads x KPG keys over the lane's 8 dims
    float sc[V];
#pragma unroll
    for (int kl = 0; kl < KPG; ++kl) {
      float4 kv[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) kv[j] = ks[kg * KPG + kl][64 * dh + 32 * j + lane];
#pragma unroll
      for (int t = 0; t < kHT; ++t) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s = fmaf(qr[t][4 * j], kv[j].x, s);
          s = fmaf(qr[t][4 * j + 1], kv[j].y, s);
          s = fmaf(qr[t][4 * j + 2], kv[j].z, s);
          s = fmaf(qr[t][4 * j + 3], kv[j].w, s);
        }
        sc[t * KPG + kl] = s;
      }
    }
    // 2. one half-score per lane (value own = lane / DUP), the two halves added
    reduce_scatter<kLanes>(sc, lane);
    if (lane % DUP == 0) s_half[grp][own] = sc[0];
    __syncthreads();  // B1: both halves' scores
    const float s = own_valid ? s_half[grp & ~1][own] + s_half[grp | 1][own] : kNegLarge;
    // 3. online softmax of head own_t over the tile: max over the head's 8 lanes
    float mt = s;
#pragma unroll
    for (int o = 1; o < kTileKeys; o <<= 1) mt = fmaxf(mt, GFX936_SHFL_XOR(mt, o));
    const float m_new = fmaxf(m_run, mt);
    const float alpha = exp2f(m_run - m_new);
    const float pk = own_valid ? exp2f(s - m_new) : 0.0f;
    l_run = l_run * alpha + pk;
    m_run = m_new;
    if (lane % DUP == 0) s_p[grp][own] = pk;
    if (lane % kTileKeys == 0) s_alpha[grp][own_t] = alpha;
    // tile i + 2's offsets into the buffer tile i no longer reads: here, not after the
    // accumulator update (there the divergent 64-bit math spills on a 128-VGPR budget)
    if (tid < kTileKeys) {
      int64_t d, sf;
      int src;
      key_offsets(p, k2, ms.n, next_slot, d, sf, src);
      s_doff[buf][tid] = d;
      s_soff[buf][tid] = sf;
      s_src[buf][tid] = src;
    }
    __syncthreads();  // B2: s_p / s_alpha complete
#pragma unroll
    for (int t = 0; t < kHT; ++t) {
      const float a = s_alpha[grp][t];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[t][j] *= a;
    }
#pragma unroll
    for (int kl = 0; kl < KPG; ++kl) {
      float4 kv[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) kv[j] = ks[kg * KPG + kl][64 * dh + 32 * j + lane];
#pragma unroll
      for (int t = 0; t < kHT; ++t) {
        const float pt = s_p[grp][t * KPG + kl];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          acc[t][4 * j] = fmaf(pt, kv[j].x, acc[t][4 * j]);
          acc[t][4 * j + 1] = fmaf(pt, kv[j].y, acc[t][4 * j + 1]);
          acc[t][4 * j + 2] = fmaf(pt, kv[j].z, acc[t][4 * j + 2]);
          acc[t][4 * j + 3] = fmaf(pt, kv[j].w, acc[t][4 * j + 3]);
        }
      }
    }
    __syncthreads();  // C: ks, s_half and s_p are rewritten by the next tile
  }

  // l of head own_t over its distinct key lanes; (m, l) of every head to LDS
#pragma unroll
  for (int o = DUP; o < kTileKeys; o <<= 1) l_run += GFX936_SHFL_XOR(l_run, o);
  if (lane % kTileKeys == 0) {
    s_m[grp][own_t] = m_run;
    s_l[grp][own_t] = l_run;
  }
  __syncthreads();
  float mh[kHT], lh[kHT];  // the head group's (m, l); acc rescaled to mh
#pragma unroll
  for (int t = 0; t < kHT; ++t) {
    float mx = kNegLarge;
#pragma unroll
    for (int g = 0; g < KG; ++g) mx = fmaxf(mx, s_m[(hq * KG + g) * 2 + dh][t]);
    float lsum = 0.0f;
#pragma unroll
    for (int g = 0; g < KG; ++g) {
      const int gg = (hq * KG + g) * 2 + dh;
      lsum += exp2f(s_m[gg][t] - mx) * s_l[gg][t];
    }
    if constexpr (KG > 1) {
      const float w = exp2f(s_m[grp][t] - mx);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[t][j] *= w;
    }
    mh[t] = mx;
    lh[t] = lsum;
  }
  if constexpr (KG > 1) {
    // key groups 1 .. KG-1 hand their accumulators to key group 0 through LDS (ks is
    // free), added in the order kg = 1 .. KG-1
    static_assert(HQ * 2 * (KG - 1) * kHT * 2 * kLanes <= kTileKeys * 128, "fits in ks");
    float4* red = &ks[0][0];
    if (kg > 0) {
#pragma unroll
      for (int t = 0; t < kHT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          red[((((hq * (KG - 1) + kg - 1) * 2 + dh) * kHT + t) * 2 + j) * kLanes + lane] =
              make_float4(acc[t][4 * j], acc[t][4 * j + 1], acc[t][4 * j + 2], acc[t][4 * j + 3]);
    }
    __syncthreads();
    if (kg == 0) {
#pragma unroll
      for (int g = 1; g < KG; ++g)
#pragma unroll
        for (int t = 0; t < kHT; ++t)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float4 v =
                red[((((hq * (KG - 1) + g - 1) * 2 + dh) * kHT + t) * 2 + j) * kLanes + lane];
            acc[t][4 * j] += v.x;
            acc[t][4 * j + 1] += v.y;
            acc[t][4 * j + 2] += v.z;
            acc[t][4 * j + 3] += v.w;
          }
    }
  }

  if (p.num_splits == 1) {
    if (kg != 0) return;
#pragma unroll
    for (int t = 0; t < kHT; ++t) {
      const int h = h0 + t;
      if (h >= p.h) continue;
      float mf = mh[t];
      float sink2 = 0.0f;
      if (p.sink != nullptr) {
        sink2 = p.sink[h] * kLog2e;
        mf = fmaxf(mf, sink2);
      }
      const float a = exp2f(mh[t] - mf);
      float lf = lh[t] * a;
      if (p.sink != nullptr) lf += exp2f(sink2 - mf);
      const float inv = lf > 0.0f ? a / lf : 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          store_kind(p.out, p.out_kind,
                     qi * p.o_s0 + h * p.o_s1 + 256 * dh + 128 * j + 4 * lane + c,
                     acc[t][4 * j + c] * inv);
    }
    return;
  }

  // split-K: this split's rows, then the tile's last block merges the S rows in order
  const int S = p.num_splits;
  if (kg == 0) {
#pragma unroll
    for (int t = 0; t < kHT; ++t) {
      const int h = h0 + t;
      if (h >= p.h) continue;
      float* row = p.part + ((static_cast<int64_t>(qi) * S + split) * p.h + h) * kPartStride;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        reinterpret_cast<float4*>(row)[64 * dh + 32 * j + lane] =
            make_float4(acc[t][4 * j], acc[t][4 * j + 1], acc[t][4 * j + 2], acc[t][4 * j + 3]);
      if (lane == 0 && dh == 0) { row[512] = mh[t]; row[513] = lh[t]; }
    }
  }
  __threadfence();
  __syncthreads();
  const int tile = qi * gridDim.y + hb;
  if (tid == 0) {
    GFX936_ARRIVE(&g_sparse_mla_tile_count[tile], S, last_flag);
  }
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  // The merge waits on L2 a few times, not twice per split and item: the S rows' (m, l) of
  // the block's heads go to LDS in one pass (ks is free), one thread per head turns them
  // into the rows' weights and 1 / l, then each item issues its float4 loads 8 at a time.
  // The same fmaxf / exp2f / fmaf order over s = 0 .. S-1 as row by row: the same bits.
  float* s_rw = reinterpret_cast<float*>(&ks[0][0]);  // [kMaxSplits][HB]: m, then weight
  float* s_rl = s_rw + kMaxSplits * HB;                // [kMaxSplits][HB]: l
  float* s_inv = s_rl + kMaxSplits * HB;               // [HB]: 1 / l of the head (0: none)
  static_assert((2 * kMaxSplits + 1) * HB <= kTileKeys * 512, "the merge's table fits in ks");
  const int64_t step = static_cast<int64_t>(p.h) * kPartStride;
  const float* qrows = p.part + static_cast<int64_t>(qi) * S * step;
  for (int i = tid; i < S * HB; i += kThreads) {
    const int sp = i / HB, h = hb * HB + i % HB;
    float m = kNegLarge, l = 0.0f;
    if (h < p.h) {
      const float* r = qrows + sp * step + static_cast<int64_t>(h) * kPartStride;
      m = SPARSE_MLA_LOAD_L2(r + 512);
      l = SPARSE_MLA_LOAD_L2(r + 513);
    }
    s_rw[i] = m;
    s_rl[i] = l;
  }
  __syncthreads();
  if (tid < HB && hb * HB + tid < p.h) {
    const int h = hb * HB + tid;
    float mf = kNegLarge, sink2 = 0.0f;
    for (int sp = 0; sp < S; ++sp) mf = fmaxf(mf, s_rw[sp * HB + tid]);
    if (p.sink != nullptr) { sink2 = p.sink[h] * kLog2e; mf = fmaxf(mf, sink2); }
    float lf = p.sink != nullptr ? exp2f(sink2 - mf) : 0.0f;
    for (int sp = 0; sp < S; ++sp) {
      const float w = exp2f(s_rw[sp * HB + tid] - mf);
      lf += w * s_rl[sp * HB + tid];
      s_rw[sp * HB + tid] = w;
    }
    s_inv[tid] = lf > 0.0f ? 1.0f / lf : 0.0f;
  }
  __syncthreads();
  for (int it = tid; it < HB * 128; it += kThreads) {
    const int t = it / 128, h = hb * HB + t, d4 = it % 128;
    if (h >= p.h) continue;
    const float4* rows = reinterpret_cast<const float4*>(qrows + static_cast<int64_t>(h) *
                                                                     kPartStride) + d4;
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < S; s0 += 8) {
      // 8 loads in flight, none behind a branch (hipcc waited out each guarded load before
      // the next); past S a row that exists (the last) is loaded and never added
      float4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = SPARSE_MLA_LOAD_L2(rows + min(s0 + j, S - 1) * (step / 4));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (s0 + j < S) {
          const float w = s_rw[(s0 + j) * HB + t];
          a[0] += w * v[j].x; a[1] += w * v[j].y; a[2] += w * v[j].z; a[3] += w * v[j].w;
        }
      }
    }
    const float inv = s_inv[t];
#pragma unroll
    for (int c = 0; c < 4; ++c)
      store_kind(p.out, p.out_kind, qi * p.o_s0 + h * p.o_s1 + 4 * d4 + c, a[c] * inv);
  }
  if (tid == 0) GFX936_RESET(&g_sparse_mla_tile_count[tile], S);
}

// The launch plan for p: key groups per head group, head blocks, splits; the binding
// sizes the split-K workspace from the same plan.
struct DecodePlan {
  int kg, head_blocks, splits;
};

DecodePlan plan_for_kg(const SparseMlaParams& p, int kg) {
  DecodePlan g{};
  g.kg = kg;
  const int hb = kGroups / (2 * kg) * kHT;
  g.head_blocks = (p.h + hb - 1) / hb;
  const int64_t base = static_cast<int64_t>(p.b) * g.head_blocks;
  g.splits = 1;
  // split-K only when the grid alone would leave CUs idle: at most two blocks per CU (the
  // kernel's residency: one round, where rounding up left a second, part-filled one, e.g.
  // 288 blocks on 132 CUs at 8 queries x 64 heads), never fewer than two tiles of keys
  // per split
  if (base < p.num_cus && base <= kMaxTileCounters) {
    const int64_t want = 2 * static_cast<int64_t>(p.num_cus) / base;
    const int64_t keys = p.avg_keys > 1 ? p.avg_keys : 1;
    int64_t s = (keys + 2 * kTileKeys - 1) / (2 * kTileKeys);
    s = s < want ? s : want;
    g.splits = static_cast<int>(s < kMaxSplits ? s : kMaxSplits);
  }
  return g;
}

DecodePlan decode_plan(const SparseMlaParams& p) {
  if (p.h <= 8) return plan_for_kg(p, 2);
  const DecodePlan wide = plan_for_kg(p, 1);
  // fewer blocks than CUs even after splitting (the split cap or too few keys): 8-head
  // blocks double the grid
  if (static_cast<int64_t>(p.b) * wide.head_blocks * wide.splits < p.num_cus)
    return plan_for_kg(p, 2);
  return wide;
}

template <int KG>
void launch_kg(const SparseMlaParams& p, const DecodePlan& g, bool vec, gfx936Stream_t st) {
  const dim3 grid(g.splits, g.head_blocks, p.b);
  if (vec) sparse_mla_decode_kernel<KG, true><<<grid, kThreads, 0, st>>>(p);
  else sparse_mla_decode_kernel<KG, false><<<grid, kThreads, 0, st>>>(p);
}

bool aligned16(const SparseMlaSource& s) {
  return (reinterpret_cast<uintptr_t>(s.cache) % 16 == 0) && (s.stride0 % 16 == 0);
}

}  // namespace

int sparse_mla_decode_splits(const SparseMlaParams& p) {
  if (p.b == 0 || p.h == 0) return 1;
  return decode_plan(p).splits;
}

int sparse_mla_decode_heads_per_block(const SparseMlaParams& p) {
  return kGroups / (2 * decode_plan(p).kg) * kHT;
}

int64_t sparse_mla_decode_workspace_floats(const SparseMlaParams& p) {
  const int s = sparse_mla_decode_splits(p);
  return s > 1 ? static_cast<int64_t>(p.b) * s * p.h * kPartStride : 0;
}

int sparse_mla_decode_launch(const SparseMlaParams& params, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (params.b == 0 || params.h == 0) return 0;
  const DecodePlan g = decode_plan(params);
  SparseMlaParams p = params;
  p.num_splits = g.splits;
  if (g.splits > 1 && p.part == nullptr) {
    *msg = "split-K workspace missing (sparse_mla_decode_workspace_floats)";
    return -1;
  }
  const bool vec = aligned16(p.main) && (!p.has_extra || aligned16(p.extra));
  if (g.kg == 2) launch_kg<2>(p, g, vec, st);
  else launch_kg<1>(p, g, vec, st);
  const gfx936Error_t err = gfx936GetLastError();
  if (err != gfx936Success) {
    *msg = gfx936GetErrorString(err);
    return static_cast<int>(err);
  }
  return 0;
}

}  // namespace gfx936
