// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Stand-in for csrc_gfx936/gfx936_compat.h that lets g++ run a csrc_gfx936 kernel source on
// the CPU (tests/kernels/test_moe_mxfp4_cpu_emu.py): the HIP/CUDA subset the MoE kernels use,
// emulated. A block's threads are ucontext fibers run in rounds: a round runs every live
// thread up to its next __syncthreads or shuffle (both are barriers here), so LDS written
// before a barrier is seen after it, and a write that a missing barrier leaves racing with
// another thread's read lands in the wrong round and shows in the result. __shared__ is
// `static thread_local` (one copy per worker below); dynamic LDS is g_dyn_shmem. A shuffle is
// a block-wide exchange, valid for the kernels' uniform shuffles (every thread of the block
// calls it). Not a model of timing, caches or the wave size.
// Blocks: one after another in grid order or in reverse, or 3 at once on OS threads (taken in
// dispatch order, as resident blocks: atomics are real atomics, __threadfence a full fence)
// with the first block to do an atomicAdd held back: cpu_emu_schedule.h. The last-block sums
// (the MoE folded sum, the Sparse MLA and W8A16 split-K) run in all three.
// The kernel launch `k<<<grid, block, shmem, stream>>>(args)` is rewritten by the test into
// emu_launch([&] { k(args); }, grid, block, shmem, stream).
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
extern thread_local unsigned char g_dyn_shmem[65536];
void emu_after_atomic();
void emu_sync();
float emu_shfl_xor(float v, int o);
void emu_launch(const std::function<void()>& fn, dim3 grid, dim3 block, size_t shmem = 0,
                void* stream = nullptr);
// blocks of different workers run at the same time: real atomics (float: a CAS loop)
template <class T> inline T atomicAdd(T* a, T v) {
  if constexpr (std::is_integral_v<T>) {
    const T o = __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
    emu_after_atomic();
    return o;
  } else {
    T o = *a, n;
    do n = o + v; while (!__atomic_compare_exchange(a, &o, &n, false, __ATOMIC_SEQ_CST,
                                                      __ATOMIC_SEQ_CST));
    emu_after_atomic();
    return o;
  }
}
template <class T> inline T atomicExch(T* a, T v) {
  T o;
  __atomic_exchange(a, &v, &o, __ATOMIC_SEQ_CST);
  return o;
}
inline void __syncthreads() { emu_sync(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define GFX936_HIP 1
#define GFX936_WARP_SIZE 64
#define GFX936_SHFL_XOR(v, o) emu_shfl_xor((v), (o))
#define GFX936_LDG(p) (*(p))
#define GFX936_OPAQUE_U4(v) ((void)0)
#define GFX936_TRAP() __builtin_trap()
#define GFX936_HD inline
typedef void* gfx936Stream_t;
typedef int gfx936Error_t;
#define gfx936Success 0
#define gfx936GetLastError() 0
#define gfx936GetErrorString(e) "cpu emulation"
