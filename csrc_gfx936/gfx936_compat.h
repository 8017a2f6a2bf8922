// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Portability header of csrc_gfx936 (in the style of vLLM's csrc/cuda_compat.h):
// one kernel source for DTK hipcc (gfx936, wave64), upstream hipcc/clang (e.g.
// gfx90a, the CI compile check) and nvcc (sm_90, the H200 numerics/speed twin).
//
// Rules it encodes: the wave size comes from the target (GFX936_WARP_SIZE), never
// a 32/64 literal, and kernels only use it in static_asserts so that correctness
// does not depend on it; no FP8/FP4 types or conversion instructions; nothing
// here may pull in matrix-core intrinsics (v_mfma faults on gfx936).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM)
  #include <hip/hip_runtime.h>
  #define GFX936_HIP 1
  #if defined(__AMDGCN_WAVEFRONT_SIZE)
    #define GFX936_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
  #else
    #define GFX936_WARP_SIZE 64  // host pass: every gfx9 target is wave64
  #endif
  // xor offsets below the group width stay inside an aligned group of lanes,
  // on wave32 and wave64 alike.
  #define GFX936_SHFL_XOR(v, o) __shfl_xor((v), (o))
  typedef hipStream_t gfx936Stream_t;
  typedef hipError_t gfx936Error_t;
  #define gfx936Success hipSuccess
  #define gfx936GetLastError hipGetLastError
  #define gfx936GetErrorString hipGetErrorString
  #define GFX936_TRAP() __builtin_trap()
#else
  #include <cuda_runtime.h>
  #define GFX936_WARP_SIZE 32
  #define GFX936_SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))
  typedef cudaStream_t gfx936Stream_t;
  typedef cudaError_t gfx936Error_t;
  #define gfx936Success cudaSuccess
  #define gfx936GetLastError cudaGetLastError
  #define gfx936GetErrorString cudaGetErrorString
  #define GFX936_TRAP() __trap()
#endif


// The compiler may no longer assume it knows the value of v (a 4 x 32-bit vector): work that
// depends on it stays where it is written, e.g. inside a loop instead of hoisted out of it
// where the hoisted results would not fit in the VGPRs. The asm itself is empty, but v must
// sit in VGPRs there, which can cost a few v_mov_b32 copies.
#if defined(GFX936_HIP) && defined(__HIP_DEVICE_COMPILE__)
  #define GFX936_OPAQUE_U4(v) __asm__ volatile("" : "+v"((v).x), "+v"((v).y), "+v"((v).z), "+v"((v).w))
#else
  #define GFX936_OPAQUE_U4(v) ((void)0)
#endif

// Read-only, cache-friendly load of a 16-byte vector (global memory).
#define GFX936_LDG(p) (*(p))

// Host and device: the register decoders (lowp_decode.h) and the bit casts under them, so
// that the host side of a hipcc/nvcc build can run the kernels' own decode for tests
// (tests/kernels/lowp_decode_host.hip).
#define GFX936_HD __host__ __device__ __forceinline__
#if defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__)
  #define GFX936_DEVICE_PASS 1
#endif

namespace gfx936 {

GFX936_HD float bits_to_float(uint32_t u) {
#if defined(GFX936_DEVICE_PASS)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}
GFX936_HD uint32_t float_to_bits(float f) {
#if defined(GFX936_DEVICE_PASS)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// a * b rounded once, never contracted into an FMA with a following add (sums that must
// give the same bits as a product stored to memory and added later). HIP's __fmul_rn is a
// plain multiply that hipcc's default -ffp-contract=fast fuses with the add (v_fmac_f32);
// an empty asm that takes the product as a register operand keeps it a v_mul_f32
// (make kernel-check greps the assembly for it: tests/kernels/test_kernel_resources.py).
__device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(GFX936_DEVICE_PASS) && defined(GFX936_HIP)
  float r = a * b;
  __asm__ volatile("" : "+v"(r));
  return r;
#elif defined(GFX936_DEVICE_PASS)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// bf16 <-> float by bits (no hip_bf16.h: upstream HIP 5.2 lacks it).
__device__ __forceinline__ float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint16_t float_to_bf16_rne(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// IEEE half <-> float by bits, round to nearest even on the way down.
__device__ __forceinline__ float f16_to_float(uint16_t h) {
  uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) {  // zero / subnormal: m * 2^-24, exact in float
    float v = static_cast<float>(m) * 5.9604644775390625e-08f;
    return s ? -v : v;
  }
  if (e == 31) return bits_to_float(s | 0x7f800000u | (m << 13));
  return bits_to_float(s | ((e + 112) << 23) | (m << 13));
}
__device__ __forceinline__ uint16_t float_to_f16_rne(float f) {
  uint32_t u = float_to_bits(f), s = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(s | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(s | 0x7c00u);  // overflow -> inf
  if (a < 0x38800000u) {  // half subnormal: round(|f| * 2^24)
    float v = bits_to_float(a) * 16777216.0f;
    return static_cast<uint16_t>(s | static_cast<uint32_t>(rintf(v)));
  }
  a += 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(s | ((a - 0x38000000u) >> 13));
}

}  // namespace gfx936
