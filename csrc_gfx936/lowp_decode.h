// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Register decoders of the low-precision formats gfx936 cannot convert in
// hardware (no FP8/FP4 instructions): the one place csrc_gfx936's kernels
// (sparse_mla_decode.cu, w8a16_fp8.cu, moe_mxfp4.cu) turn E4M3, E2M1 and UE8M0
// bits into float32. Integer shifts and masks only; no lookup tables, no FP8
// types. Host and device (GFX936_HD): tests/kernels/test_lowp_decode_host.py
// runs these very functions on the CPU against PyTorch's float8 decoders.
//
// Both element decoders move the code's bits into a float32 without touching
// the exponent bias, so every value (normal or subnormal alike) comes out
// scaled by one power of two that the caller folds into its block scale:
//
//   E4M3 (fn) byte  s eeee mmm  -> bits s 0000 eeee mmm 0... = x * 2^-120
//     (byte moved to the top, arithmetic >> 4, mask 0x87f00000)
//   E2M1 nibble     s ee m      -> bits s 000000 ee m 0...  = x * 2^-126
//     (byte planes of 4 elements, then one byte permute per element: see decode_e2m1x8)
//
// A subnormal code (e == 0) lands on a float32 denormal of the same scaled
// value, so kernels that use these must not flush denormals to zero (HIP:
// -fno-gpu-flush-denormals-to-zero; nvcc keeps them unless --use_fast_math).
// E4M3's NaN codes (0x7f, 0xff): decode_e4m3x4 gives +-480 * 2^-120 (weights
// are checked for them once at load time, scaled_mm/gfx936.py, not per
// element); decode_e4m3x4_nan gives NaN, for data written at run time (the
// fp8_ds_mla KV cache). To keep products with activations far from the
// denormal range, the GEMVs pre-multiply activations by kXPrescale = 2^64
// (exact) and give the scale 2^(bias - 64) back.
#pragma once

#include "gfx936_compat.h"
#include "sparse_mla_decode.h"

namespace gfx936 {

constexpr float kXPrescale = 18446744073709551616.0f;  // 2^64

GFX936_HD float e4m3_top(uint32_t t) {  // t: the byte in bits 31..24
  return bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(t) >> 4) & 0x87f00000u);
}
// 4 E4M3 bytes of q (byte i = element i) -> w[i] = value * 2^-120
GFX936_HD void decode_e4m3x4(uint32_t q, float* w) {
  w[0] = e4m3_top(q << 24);
  w[1] = e4m3_top(q << 16);
  w[2] = e4m3_top(q << 8);
  w[3] = e4m3_top(q);
}
// the same with E4M3's NaN codes (s 1111 111) decoded as NaN
GFX936_HD void decode_e4m3x4_nan(uint32_t q, float* w) {
  decode_e4m3x4(q, w);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (((q >> (8 * i)) & 0x7fu) == 0x7fu) w[i] = bits_to_float(0x7fc00000u);
}

// Byte permute with AMD's v_perm_b32 selectors: byte k of the result is byte sel_k of the
// 8 bytes hi:lo (0..3 = lo, 4..7 = hi), or 0 where sel_k == 12 (the only selectors used
// here). HIP device code: one v_perm_b32; elsewhere the same bytes by shifts.
GFX936_HD uint32_t perm_b32(uint32_t hi, uint32_t lo, uint32_t sel) {
#if defined(GFX936_DEVICE_PASS) && defined(GFX936_HIP)
  return __builtin_amdgcn_perm(hi, lo, sel);
#else
  const uint64_t d = (static_cast<uint64_t>(hi) << 32) | lo;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t s = (sel >> (8 * k)) & 0xffu;
    if (s < 8) r |= static_cast<uint32_t>((d >> (8 * s)) & 0xffu) << (8 * k);
  }
  return r;
#endif
}

// 8 E2M1 nibbles of q (nibble i = element i: low nibble of byte j is element 2j)
// -> w[i] = value * 2^-126, i.e. bits s 000000 ee m 0... (nibble s ee m). The float's two
// non-zero bytes are made for 4 elements at a time (byte planes), then each element's float
// is picked out of its two planes by one byte permute: 2.6 VALU instructions per element
// on gfx90a instead of 4.1 for shifting each nibble into place (the MoE GEMVs' inner loop is
// mostly this decode; same bits):
//   lo_e byte k = bits 23..16 of element 2k's float = e0 m 000000
//   hi_e byte k = bits 31..24 of element 2k's float = s 000000 e1
//   lo_o, hi_o: the same of element 2k + 1 (the high nibble of byte k)
GFX936_HD void decode_e2m1x8(uint32_t q, float* w) {
  const uint32_t lo_e = (q << 6) & 0xc0c0c0c0u, lo_o = (q << 2) & 0xc0c0c0c0u;
  const uint32_t hi_e = ((q << 4) & 0x80808080u) | ((q >> 2) & 0x01010101u);
  const uint32_t hi_o = (q & 0x80808080u) | ((q >> 6) & 0x01010101u);
#if defined(GFX936_DEVICE_PASS) && !defined(GFX936_HIP)
  // CUDA: PRMT has no zero byte, so one permute gives two elements' top halves (a bf16
  // pair: bytes lo[2h], hi[2h], lo[2h + 1], hi[2h + 1]) and a shift or a mask each float
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t sel = h == 0 ? 0x5140u : 0x7362u;
    const uint32_t e = __byte_perm(lo_e, hi_e, sel), o = __byte_perm(lo_o, hi_o, sel);
    w[4 * h] = bits_to_float(e << 16);
    w[4 * h + 1] = bits_to_float(o << 16);
    w[4 * h + 2] = bits_to_float(e & 0xffff0000u);
    w[4 * h + 3] = bits_to_float(o & 0xffff0000u);
  }
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // bytes 0, 1 zero; 2 = lo[k]; 3 = hi[k]
    const uint32_t sel = 0x0c0cu | (static_cast<uint32_t>(k) << 16) | ((4u + k) << 24);
    w[2 * k] = bits_to_float(perm_b32(hi_e, lo_e, sel));
    w[2 * k + 1] = bits_to_float(perm_b32(hi_o, lo_o, sel));
  }
#endif
}

// UE8M0 byte u -> 2^(u - 127 + extra) as float32, for extra in [-126, 126]:
// NaN for u == 255, inf when the power overflows, 0 below float32's range.
GFX936_HD float ue8m0_pow2(uint32_t u, int extra) {
  if (u == 255u) return bits_to_float(0x7fc00000u);
  const int e = static_cast<int>(u) + extra;  // biased float32 exponent
  if (e >= 255) return bits_to_float(0x7f800000u);
  if (e >= 1) return bits_to_float(static_cast<uint32_t>(e) << 23);
  if (e >= -22) return bits_to_float(1u << (22 + e));  // denormal power of two
  return 0.0f;
}

// A UE8M0 block scale u for E4M3 values decoded above (x * 2^-120):
// e4m3_scaled(w, e4m3_block_scale(u)) = x * 2^(u - 127) rounded once, as PyTorch's
// float8_e4m3fn * float8_e8m0fnu in float32 (NaN for u == 255). The decoder's
// 2^120 is folded into the scale, one multiply, wherever 2^(u - 7) is a float32
// (u <= 134: exact, the product is a float32); a larger scale (>= 2^8) first
// multiplies by 2^120 (exact), then by 2^(u - 127): one rounding, no false inf.
struct E4m3Scale {
  float pre, scale;
};
GFX936_HD E4m3Scale e4m3_block_scale(uint32_t u) {
  if (u <= 134u) return {1.0f, ue8m0_pow2(u, 120)};
  return {1.329227995784916e36f, ue8m0_pow2(u, 0)};  // 2^120
}
GFX936_HD float e4m3_scaled(float w, E4m3Scale s) { return (w * s.pre) * s.scale; }

// 8 consecutive activations base[i .. i+8) (16-byte aligned) -> float32 * 2^64.
template <int XK, typename I>
__device__ __forceinline__ void load_x8(const void* base, I i, float* v) {
  if constexpr (XK == kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (XK == kBF16) {
        v[2 * j] = bits_to_float(w[j] << 16);
        v[2 * j + 1] = bits_to_float(w[j] & 0xffff0000u);
      } else {
        v[2 * j] = f16_to_float(static_cast<uint16_t>(w[j] & 0xffffu));
        v[2 * j + 1] = f16_to_float(static_cast<uint16_t>(w[j] >> 16));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] *= kXPrescale;
}

// The same 8 activations from bytes already loaded (run-time kind): bf16/f16 in lo
// (8 elements), f32 in lo then hi (4 + 4), -> float32 * 2^64. Lets a kernel issue
// the activation loads together with its weight loads and convert later.
__device__ __forceinline__ void x8_from_bits(int kind, uint4 lo, uint4 hi, float* v) {
  const uint32_t a[4] = {lo.x, lo.y, lo.z, lo.w}, b[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (kind == kBF16) {
      v[2 * j] = bits_to_float(a[j] << 16);
      v[2 * j + 1] = bits_to_float(a[j] & 0xffff0000u);
    } else if (kind == kF16) {
      v[2 * j] = f16_to_float(static_cast<uint16_t>(a[j] & 0xffffu));
      v[2 * j + 1] = f16_to_float(static_cast<uint16_t>(a[j] >> 16));
    } else {
      v[j] = bits_to_float(a[j]);
      v[4 + j] = bits_to_float(b[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] *= kXPrescale;
}

template <int OK>
__device__ __forceinline__ void store_out(void* p, int64_t i, float v) {
  if constexpr (OK == kBF16) static_cast<uint16_t*>(p)[i] = float_to_bf16_rne(v);
  else if constexpr (OK == kF16) static_cast<uint16_t*>(p)[i] = float_to_f16_rne(v);
  else static_cast<float*>(p)[i] = v;
}

// one output of a kind chosen at run time (per-output stores are rare: no template)
__device__ __forceinline__ void store_kind(void* p, int kind, int64_t i, float v) {
  if (kind == kBF16) static_cast<uint16_t*>(p)[i] = float_to_bf16_rne(v);
  else if (kind == kF16) static_cast<uint16_t*>(p)[i] = float_to_f16_rne(v);
  else static_cast<float*>(p)[i] = v;
}

// 8 consecutive outputs p[i .. i+8) in one 16-byte store (bf16/f16) or two (f32);
// p + i must be 16-byte aligned (callers: rows of multiples of 8 elements).
template <int OK>
__device__ __forceinline__ void store_out8(void* p, int64_t i, const float* v) {
  if constexpr (OK == kF32) {
    float4* d = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    d[0] = make_float4(v[0], v[1], v[2], v[3]);
    d[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t lo = OK == kBF16 ? float_to_bf16_rne(v[2 * j]) : float_to_f16_rne(v[2 * j]);
      const uint32_t hi =
          OK == kBF16 ? float_to_bf16_rne(v[2 * j + 1]) : float_to_f16_rne(v[2 * j + 1]);
      w[j] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Sum over an aligned group of G lanes (G a power of two, <= every wave size).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += GFX936_SHFL_XOR(v, o);
  return v;
}

// Reduce-scatter of V values over an aligned group of G lanes (G a power of two, <= every
// wave size): step o sends the half a lane does not keep to lane ^ o. Afterwards
// v[0 .. V/G) (or v[0] when V < G, then summed over the remaining lanes) hold the totals
// of the value indices base + i, base = (lane % G) / max(G / V, 1) * max(V / G, 1). Same
// adds in the same order on every lane: deterministic. Used by w8a16_fp8.cu (the GEMV's
// row sums) and sparse_mla_decode.cu (one score per lane).
// one butterfly step at lane offset O on the first CUR values (compile-time
// recursion: every index is a constant, nothing goes to scratch)
template <int V, int CUR, int O>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[V], int lane, int& base) {
  if constexpr (O > 0) {
    const bool up = (lane & O) != 0;
    if constexpr (CUR >= 2) {
      constexpr int h = CUR / 2;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        // values first, then the select: a select of two addresses would keep v in memory
        const float lo = v[i], hi = v[i + h];
        const float send = up ? lo : hi;
        v[i] = (up ? hi : lo) + GFX936_SHFL_XOR(send, O);
      }
      if (up) base += h;
      reduce_scatter_step<V, h, O / 2>(v, lane, base);
    } else {
      v[0] += GFX936_SHFL_XOR(v[0], O);
      reduce_scatter_step<V, 1, O / 2>(v, lane, base);
    }
  }
}
template <int G, int V>
__device__ __forceinline__ int reduce_scatter(float (&v)[V], int lane) {
  int base = 0;
  reduce_scatter_step<V, V, G / 2>(v, lane, base);
  return base;
}

}  // namespace gfx936
