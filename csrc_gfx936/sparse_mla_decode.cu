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
// Each 584-byte token is read once per head block (up to 32 heads) with 16-byte
// vector loads (36 x 16 B of data; the scale byte of each 64-dim group), decoded
// in registers and staged once in LDS as float32, then shared by every head.
// The decode is lowp_decode.h's (nothing here reads bits as a float):
//
//   e4m3 byte b -> decode_e4m3x4_nan: float32 bits (b & 0x80) << 24 | (b & 0x7f) << 20
//   = x * 2^-120 (exact for normals and subnormals, the latter as float32
//   denormals; 0x7f / 0xff are NaN), times e4m3_block_scale(ue8m0): the 2^120
//   folded into the group's scale, 2^(ue8m0 - 127) * 2^120 = 2^(ue8m0 - 7)
//   (ue8m0 0xff is NaN); x * 2^(ue8m0 - 127) bit for bit as PyTorch decodes it.
//
// Work split: block = (split, head block, query). 8 groups of kLanes lanes; a group
// owns HT heads; lane l owns dims {128 j + 4 l + c} (j, c < 4) of q and of the
// float32 accumulator. Scores are reduced across the kLanes lanes with xor
// shuffles (kLanes <= any wave size, so the same on wave32 and wave64). Online
// softmax in base 2 (scale * log2 e folded into q). Keys of a query are the main
// (SWA) keys then the extra (compressed top-k) keys; split s of S walks the s-th
// ceil(n/S) of them and writes (acc, m, l) partials that a reduce kernel combines
// with the attention sink. S comes from shapes only: no host sync.
#include "gfx936_compat.h"
#include "lowp_decode.h"
#include "sparse_mla_decode.h"

namespace gfx936 {
namespace {

constexpr int kLanes = 32;  // lanes sharing one 512-d row; <= every wave size
constexpr int kGroups = 8;
constexpr int kThreads = kGroups * kLanes;
constexpr int kTileKeys = 8;   // keys staged in LDS per step
constexpr int kChunks = 36;    // 576 data bytes / 16
constexpr int kNopeChunks = 28;
constexpr int kPartStride = 516;  // acc[512] | m | l | 2 pad: rows stay 16-byte aligned
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegLarge = -3.402823466e38f;
static_assert(kLanes <= GFX936_WARP_SIZE, "a lane group must fit in one wave");
static_assert(kThreads % GFX936_WARP_SIZE == 0, "whole waves per block");

__device__ __forceinline__ float load_scalar(const void* p, int kind, int64_t i) {
  if (kind == kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  if (kind == kF16) return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

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

template <int HT, bool VEC>
__global__ void __launch_bounds__(kThreads)
sparse_mla_decode_kernel(const SparseMlaParams p) {
  __shared__ float4 ks[kTileKeys][128];  // decoded keys, float32 [kTileKeys][512]
  __shared__ const uint8_t* s_data[kTileKeys];
  __shared__ const uint8_t* s_scale[kTileKeys];
  __shared__ int s_valid[kTileKeys];
  constexpr int HB = kGroups * HT;
  const int split = blockIdx.x, hb = blockIdx.y, qi = blockIdx.z;
  const int tid = threadIdx.x, grp = tid / kLanes, lane = tid % kLanes;

  float qr[HT][16], acc[HT][16], m[HT], l[HT];
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    const int h = hb * HB + grp * HT + t;
    const bool hv = h < p.h;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int d = 128 * j + 4 * lane + c;
        qr[t][4 * j + c] = hv ? load_scalar(p.q, p.q_kind, qi * p.q_s0 + h * p.q_s1 + d) *
                                    (p.scale * kLog2e)
                              : 0.0f;
        acc[t][4 * j + c] = 0.0f;
      }
    m[t] = kNegLarge;
    l[t] = 0.0f;
  }

  const Segment ms = segment(p.main, qi);
  Segment es{0, 0};
  if (p.has_extra) es = segment(p.extra, qi);
  const int n_tot = ms.n + es.n;
  const int chunk = (n_tot + p.num_splits - 1) / p.num_splits;
  const int lo = split * chunk;
  const int hi = min(lo + chunk, n_tot);

  for (int k0 = lo; k0 < hi; k0 += kTileKeys) {
    if (tid < kTileKeys) {
      const int k = k0 + tid;
      int valid = 0;
      const uint8_t* data = nullptr;
      const uint8_t* sc = nullptr;
      if (k < hi) {
        // field by field: a reference to either kernel-argument struct would
        // copy both to scratch memory
        const bool is_main = k < ms.n;
        const int64_t slot = is_main ? p.main.idx[ms.start + k]
                                     : p.extra.idx[es.start + (k - ms.n)];
        const int64_t rows = is_main ? p.main.num_rows : p.extra.num_rows;
        if (slot >= 0 && slot < rows) {
          const int64_t bs = is_main ? p.main.block_size : p.extra.block_size;
          const int64_t blk = slot / bs, pos = slot % bs;
          const uint8_t* base = (is_main ? p.main.cache : p.extra.cache) +
                                blk * (is_main ? p.main.stride0 : p.extra.stride0);
          data = base + pos * 576;
          sc = base + bs * 576 + pos * 8;
          valid = 1;
        }
      }
      s_valid[tid] = valid;
      s_data[tid] = data;
      s_scale[tid] = sc;
    }
    __syncthreads();
    float* ksf = reinterpret_cast<float*>(&ks[0][0]);
#pragma unroll 1
    for (int it = tid; it < kTileKeys * kChunks; it += kThreads) {
      const int key = it / kChunks, c = it % kChunks;
      float v[16];
      if (s_valid[key]) {
        uint32_t w[4];
        const uint8_t* src = s_data[key] + 16 * c;
        if (VEC) {
          const uint4 u = GFX936_LDG(reinterpret_cast<const uint4*>(src));
          w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            w[i] = src[4 * i] | (src[4 * i + 1] << 8) | (src[4 * i + 2] << 16) |
                   (static_cast<uint32_t>(src[4 * i + 3]) << 24);
        }
        if (c < kNopeChunks) {
          const E4m3Scale s = e4m3_block_scale(s_scale[key][c >> 2]);
#pragma unroll
          for (int j = 0; j < 4; ++j) decode_e4m3x4_nan(w[j], v + 4 * j);
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] = e4m3_scaled(v[i], s);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            v[i] = bf16_to_float(static_cast<uint16_t>(w[i >> 1] >> (16 * (i & 1))));
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;
      }
      if (c < kNopeChunks) {
#pragma unroll
        for (int i = 0; i < 16; ++i) ksf[key * 512 + 16 * c + i] = v[i];
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) ksf[key * 512 + 448 + 8 * (c - kNopeChunks) + i] = v[i];
      }
    }
    __syncthreads();

    float sc[HT][kTileKeys];
#pragma unroll
    for (int kk = 0; kk < kTileKeys; ++kk) {  // sc[][kk] needs kk unrolled
      float4 kv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = ks[kk][32 * j + lane];
#pragma unroll
      for (int t = 0; t < HT; ++t) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          s += qr[t][4 * j] * kv[j].x + qr[t][4 * j + 1] * kv[j].y +
               qr[t][4 * j + 2] * kv[j].z + qr[t][4 * j + 3] * kv[j].w;
        sc[t][kk] = s;
      }
    }
#pragma unroll
    for (int t = 0; t < HT; ++t)
#pragma unroll
      for (int kk = 0; kk < kTileKeys; ++kk)
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) sc[t][kk] += GFX936_SHFL_XOR(sc[t][kk], o);
#pragma unroll
    for (int t = 0; t < HT; ++t) {
      float mt = m[t];
#pragma unroll
      for (int kk = 0; kk < kTileKeys; ++kk)
        if (s_valid[kk]) mt = fmaxf(mt, sc[t][kk]);
      const float alpha = exp2f(m[t] - mt);
      float ls = l[t] * alpha;
#pragma unroll
      for (int kk = 0; kk < kTileKeys; ++kk) {
        const float pk = s_valid[kk] ? exp2f(sc[t][kk] - mt) : 0.0f;
        sc[t][kk] = pk;
        ls += pk;
      }
      l[t] = ls;
      m[t] = mt;
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[t][i] *= alpha;
    }
#pragma unroll
    for (int kk = 0; kk < kTileKeys; ++kk) {
      float4 kv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = ks[kk][32 * j + lane];
#pragma unroll
      for (int t = 0; t < HT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[t][4 * j] += sc[t][kk] * kv[j].x;
          acc[t][4 * j + 1] += sc[t][kk] * kv[j].y;
          acc[t][4 * j + 2] += sc[t][kk] * kv[j].z;
          acc[t][4 * j + 3] += sc[t][kk] * kv[j].w;
        }
    }
    __syncthreads();  // ks / s_* are rewritten by the next tile
  }

#pragma unroll
  for (int t = 0; t < HT; ++t) {
    const int h = hb * HB + grp * HT + t;
    if (h >= p.h) continue;
    if (p.num_splits == 1) {
      float mf = m[t];
      float sink2 = 0.0f;
      if (p.sink != nullptr) {
        sink2 = p.sink[h] * kLog2e;
        mf = fmaxf(mf, sink2);
      }
      const float a = exp2f(m[t] - mf);
      float lf = l[t] * a;
      if (p.sink != nullptr) lf += exp2f(sink2 - mf);
      const float inv = lf > 0.0f ? a / lf : 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          store_kind(p.out, p.out_kind, qi * p.o_s0 + h * p.o_s1 + 128 * j + 4 * lane + c,
                       acc[t][4 * j + c] * inv);
    } else {
      float* row = p.part + ((static_cast<int64_t>(qi) * p.num_splits + split) * p.h + h) *
                                kPartStride;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        reinterpret_cast<float4*>(row)[32 * j + lane] =
            make_float4(acc[t][4 * j], acc[t][4 * j + 1], acc[t][4 * j + 2], acc[t][4 * j + 3]);
      if (lane == 0) { row[512] = m[t]; row[513] = l[t]; }
    }
  }
}

constexpr int kReduceThreads = 128;

__global__ void __launch_bounds__(kReduceThreads)
sparse_mla_reduce_kernel(const SparseMlaParams p) {
  const int h = blockIdx.x, qi = blockIdx.y, tid = threadIdx.x;
  const float* rows = p.part + (static_cast<int64_t>(qi) * p.num_splits * p.h + h) * kPartStride;
  const int64_t step = static_cast<int64_t>(p.h) * kPartStride;
  float mf = kNegLarge, sink2 = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) mf = fmaxf(mf, rows[s * step + 512]);
  if (p.sink != nullptr) { sink2 = p.sink[h] * kLog2e; mf = fmaxf(mf, sink2); }
  float lf = p.sink != nullptr ? exp2f(sink2 - mf) : 0.0f;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < p.num_splits; ++s) {
    const float* r = rows + s * step;
    const float w = exp2f(r[512] - mf);
    lf += w * r[513];
    const float4 v = reinterpret_cast<const float4*>(r)[tid];
    a[0] += w * v.x; a[1] += w * v.y; a[2] += w * v.z; a[3] += w * v.w;
  }
  const float inv = lf > 0.0f ? 1.0f / lf : 0.0f;
#pragma unroll
  for (int c = 0; c < 4; ++c)
    store_kind(p.out, p.out_kind, qi * p.o_s0 + h * p.o_s1 + 4 * tid + c, a[c] * inv);
}

template <int HT>
void launch_ht(const SparseMlaParams& p, bool vec, gfx936Stream_t st) {
  const dim3 grid(p.num_splits, (p.h + kGroups * HT - 1) / (kGroups * HT), p.b);
  if (vec) sparse_mla_decode_kernel<HT, true><<<grid, kThreads, 0, st>>>(p);
  else sparse_mla_decode_kernel<HT, false><<<grid, kThreads, 0, st>>>(p);
}

bool aligned16(const SparseMlaSource& s) {
  return (reinterpret_cast<uintptr_t>(s.cache) % 16 == 0) && (s.stride0 % 16 == 0);
}

}  // namespace

int sparse_mla_decode_launch(const SparseMlaParams& p, void* stream, const char** msg) {
  gfx936Stream_t st = static_cast<gfx936Stream_t>(stream);
  *msg = "ok";
  if (p.b == 0 || p.h == 0) return 0;
  const bool vec = aligned16(p.main) && (!p.has_extra || aligned16(p.extra));
  if (p.h <= kGroups) launch_ht<1>(p, vec, st);
  else if (p.h <= 2 * kGroups) launch_ht<2>(p, vec, st);
  else launch_ht<4>(p, vec, st);
  if (p.num_splits > 1)
    sparse_mla_reduce_kernel<<<dim3(p.h, p.b), kReduceThreads, 0, st>>>(p);
  const gfx936Error_t err = gfx936GetLastError();
  if (err != gfx936Success) {
    *msg = gfx936GetErrorString(err);
    return static_cast<int>(err);
  }
  return 0;
}

}  // namespace gfx936
