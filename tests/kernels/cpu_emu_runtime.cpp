// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// The block scheduler of cpu_emu_compat.h: fibers in rounds between barriers; blocks one after
// another, or on worker OS threads at once (each worker's fibers, LDS and indices are
// its own: thread_local).
#include <sched.h>
#include <ucontext.h>

#include <atomic>
#include <thread>
#include <vector>

#include "cpu_emu_schedule.h"
#include "gfx936_compat.h"

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local unsigned char g_dyn_shmem[65536];

namespace {
bool g_reverse_grid = false;  // run blocks in reverse grid order
int g_workers = 1;            // blocks running at once (OS threads)
bool g_hold = false;          // park the first block to do an atomic (cpu_emu_schedule.h)
thread_local ucontext_t g_sched;
thread_local std::vector<ucontext_t> g_ctx;
thread_local std::vector<char> g_stacks;
thread_local std::vector<int> g_done;
thread_local int g_cur;
thread_local float g_shfl[1024];
const std::function<void()>* g_fn;
std::atomic<unsigned> g_next{0};  // the next block to dispatch
std::atomic<int> g_busy{0};       // workers inside a block
std::atomic<bool> g_hold_taken{false};  // a block of this launch has been held
thread_local bool g_hold_me = false;    // this worker's block is to be held
constexpr size_t kStack = 256 << 10;

void fiber_main() {
  (*g_fn)();
  g_done[g_cur] = 1;
}

// one round: every live thread of the worker's block up to its next barrier; the live count
int round(const dim3& block) {
  const int nt = block.x * block.y * block.z;
  int live = 0;
  for (int t = 0; t < nt; ++t) {
    if (g_done[t]) continue;
    g_cur = t;
    threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    swapcontext(&g_sched, &g_ctx[t]);
    live += !g_done[t];
  }
  return live;
}

void run_block(unsigned i, unsigned nblocks, dim3 grid, dim3 block) {
  const int nt = block.x * block.y * block.z;
  g_ctx.resize(nt);
  g_done.resize(nt);
  if (g_stacks.size() < nt * kStack) g_stacks.resize(nt * kStack);
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
  g_hold_me = false;
  for (int live = round(block); live > 0; live = round(block)) {
    // held (at the barrier after its first atomic): until no other block is left to run
    while (g_hold_me && !(g_next.load() >= nblocks && g_busy.load() == 1)) sched_yield();
    g_hold_me = false;
  }
}

void worker(unsigned nblocks, dim3 grid, dim3 block) {
  for (;;) {
    g_busy.fetch_add(1);
    const unsigned n = g_next.fetch_add(1);
    if (n >= nblocks) {
      g_busy.fetch_sub(1);
      return;
    }
    run_block(g_reverse_grid ? nblocks - 1 - n : n, nblocks, grid, block);
    g_busy.fetch_sub(1);
  }
}
}  // namespace

void emu_schedule(EmuSchedule s) {
  g_reverse_grid = s == kEmuReverse;
  g_workers = s == kEmuAtOnce ? 3 : 1;
  g_hold = s == kEmuAtOnce;
}

void emu_after_atomic() {
  bool no = false;
  if (g_hold && g_workers > 1 && !g_hold_me &&
      g_hold_taken.compare_exchange_strong(no, true))
    g_hold_me = true;
}

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
  g_fn = &fn;
  gridDim = grid;
  blockDim = block;
  const unsigned nblocks = grid.x * grid.y * grid.z;
  g_next = 0;
  g_busy = 0;
  g_hold_taken = false;
  if (g_workers <= 1) {
    worker(nblocks, grid, block);
    return;
  }
  std::vector<std::thread> ws;
  for (int w = 0; w < g_workers; ++w) ws.emplace_back(worker, nblocks, grid, block);
  for (auto& w : ws) w.join();
}
