// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// The block scheduler of cpu_emu_compat.h: fibers in rounds between barriers.
#include <ucontext.h>

#include <vector>

#include "gfx936_compat.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;
unsigned char g_dyn_shmem[65536];
bool g_emu_reverse_grid = false;  // run blocks in reverse grid order (a test's second order)

namespace {
ucontext_t g_sched;
std::vector<ucontext_t> g_ctx;
std::vector<char> g_stacks;
std::vector<int> g_done;
int g_cur;
const std::function<void()>* g_fn;
float g_shfl[1024];
constexpr size_t kStack = 256 << 10;

void fiber_main() {
  (*g_fn)();
  g_done[g_cur] = 1;
}
}  // namespace

void emu_sync() { swapcontext(&g_ctx[g_cur], &g_sched); }

float emu_shfl_xor(float v, int o) {
  const int t = threadIdx.x;
  g_shfl[t] = v;
  emu_sync();
  const float r = g_shfl[t ^ o];
  emu_sync();
  return r;
}

void emu_launch(const std::function<void()>& fn, dim3 grid, dim3 block, size_t, void*) {
  const int nt = block.x * block.y * block.z;
  g_ctx.resize(nt);
  g_done.resize(nt);
  if (g_stacks.size() < nt * kStack) g_stacks.resize(nt * kStack);
  g_fn = &fn;
  gridDim = grid;
  blockDim = block;
  const unsigned nblocks = grid.x * grid.y * grid.z;
  for (unsigned n = 0; n < nblocks; ++n) {
    const unsigned i = g_emu_reverse_grid ? nblocks - 1 - n : n;
    blockIdx = dim3(i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y));
    memset(g_dyn_shmem, 0xcd, sizeof g_dyn_shmem);  // LDS starts as garbage
    for (int t = 0; t < nt; ++t) {
      getcontext(&g_ctx[t]);
      g_ctx[t].uc_stack.ss_sp = &g_stacks[t * kStack];
      g_ctx[t].uc_stack.ss_size = kStack;
      g_ctx[t].uc_link = &g_sched;
      makecontext(&g_ctx[t], fiber_main, 0);
      g_done[t] = 0;
    }
    for (int live = nt; live > 0;) {  // one round per barrier
      live = 0;
      for (int t = 0; t < nt; ++t) {
        if (g_done[t]) continue;
        g_cur = t;
        threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        swapcontext(&g_sched, &g_ctx[t]);
        live += !g_done[t];
      }
    }
  }
}
