// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Stand-in for csrc_gfx936/gfx936_compat.h that lets g++ run a csrc_gfx936 kernel source on
// the CPU (tests/kernels/test_moe_mxfp4_cpu_emu.py): the HIP/CUDA subset the MoE kernels use,
// emulated. One block at a time; its threads are ucontext fibers run in rounds: a round runs
// every live thread up to its next __syncthreads or shuffle (both are barriers here), so
// LDS written before a barrier is seen after it, and a write that a missing barrier leaves
// racing with another thread's read lands in the wrong round and shows in the result.
// __shared__ is `static` (blocks run one after another); dynamic LDS is g_dyn_shmem. A
// shuffle is a block-wide exchange, valid for the kernels' uniform shuffles (every thread
// of the block calls it). Not a model of timing, caches, memory order or the wave size, and
// blocks run one after another in grid order (or, with g_emu_reverse_grid set, in reverse grid
// order): a last-block protocol between blocks (moe_mxfp4 down's folded sum, the Sparse MLA
// split-K merge) is exercised in those two orders only (a missing counter reset shows, and a
// merge whose result depends on which block is last shows between the two orders; a wrong
// last-block test under real concurrency may not: the device tier checks it).
// The kernel launch `k<<<grid, block, shmem, stream>>>(args)` is rewritten by the test into
// emu_launch([&] { k(args); }, grid, block, shmem, stream).
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <functional>

using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

extern dim3 threadIdx, blockIdx, blockDim, gridDim;
extern unsigned char g_dyn_shmem[65536];
extern bool g_emu_reverse_grid;
void emu_sync();
float emu_shfl_xor(float v, int o);
void emu_launch(const std::function<void()>& fn, dim3 grid, dim3 block, size_t shmem = 0,
                void* stream = nullptr);
// threads of a block never run at the same time: plain read-modify-write
template <class T> inline T atomicAdd(T* a, T v) { const T o = *a; *a += v; return o; }
template <class T> inline T atomicExch(T* a, T v) { const T o = *a; *a = v; return o; }
inline void __syncthreads() { emu_sync(); }
inline void __threadfence() {}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define GFX936_HIP 1
#define GFX936_WARP_SIZE 64
#define GFX936_SHFL_XOR(v, o) emu_shfl_xor((v), (o))
#define GFX936_LDG(p) (*(p))
#define GFX936_TRAP() __builtin_trap()
#define GFX936_HD inline
typedef void* gfx936Stream_t;
typedef int gfx936Error_t;
#define gfx936Success 0
#define gfx936GetLastError() 0
#define gfx936GetErrorString(e) "cpu emulation"
