// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Last-block protocols of csrc_gfx936 (the W8A16 and Sparse MLA split-K merges, the MoE's
// folded sum): each tile's blocks count themselves in a device counter (zero at load), the
// block that brings it to `blocks` does the merge and resets it to 0. A count outside
// [0, blocks) on arrival, or other than `blocks` at the reset, means two launches used the
// counters at once (two streams) or one stopped mid-way: the kernel stops with a device
// trap (the launch fails, the error names the kernel) instead of merging partial sums into a
// silent wrong answer or leaving an output unwritten. The trap is a net, not the guarantee:
// two overlapping launches can interleave so that every count stays in range (one launch's
// block completing the other's tile) and merge another launch's partials without trapping.
// What keeps the counts right is that the kernels that use them run on one stream: on
// gfx936 the engine runs them on the current stream (vLLM's shared-expert aux stream is
// CUDA-only, fused_moe/runner/shared_experts.py; DeepSeek V4's attention aux streams are off
// on ROCm, models/deepseek_v4/amd/model.py). Needs atomicAdd, atomicExch and
// GFX936_TRAP from gfx936_compat.h (or the CPU emulation's stand-in).
#pragma once

#define GFX936_ARRIVE(counter, blocks, last)                                       \
  do {                                                                             \
    const unsigned int gfx936_done_ = atomicAdd((counter), 1u);                    \
    if (gfx936_done_ >= static_cast<unsigned int>(blocks)) GFX936_TRAP();          \
    (last) = gfx936_done_ == static_cast<unsigned int>(blocks) - 1u;               \
  } while (0)

#define GFX936_RESET(counter, blocks)                                              \
  do {                                                                             \
    if (atomicExch((counter), 0u) != static_cast<unsigned int>(blocks)) GFX936_TRAP(); \
  } while (0)
