// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
// Host interface of the fp8_ds_mla Sparse MLA decode kernel (torch-free, so the
// kernel file compiles alone for the AMD compile check).
#pragma once

#include <stdint.h>

namespace gfx936 {

enum ScalarKind : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

struct SparseMlaSource {
  const uint8_t* cache;  // element [0, 0, 0] (storage offset already applied)
  int64_t stride0;       // bytes between blocks (cache.stride(0))
  int64_t num_rows;      // num_blocks * block_size: slots >= this are skipped
  int block_size;
  const int32_t* idx;     // ragged [nnz] or dense [b, width]
  const int32_t* indptr;  // ragged [b + 1], or nullptr (dense)
  const int32_t* lens;    // dense prefix lengths [b], or nullptr
  int width;              // dense width (0 for ragged)
};

struct SparseMlaParams {
  const void* q; int q_kind; int64_t q_s0, q_s1;
  void* out; int out_kind; int64_t o_s0, o_s1;
  const float* sink;  // [h] float32 or nullptr
  float* part;        // [b, splits, h, 516] float32 when splits > 1 (acc, m, l, pad)
  SparseMlaSource main, extra;
  int has_extra;
  float scale;
  int b, h;
  int num_cus;        // compute units of the device: split-K only below it
  int avg_keys;       // main + extra keys per query (dense width, or nnz / b): sizes the splits
  int num_splits;     // set by sparse_mla_decode_launch from the plan (callers leave it)
};

// Split-K count sparse_mla_decode_launch picks for p (1: no split; from shapes only).
int sparse_mla_decode_splits(const SparseMlaParams& p);
// Heads per block of that plan (8 or 16; the CPU emulation test checks the rule).
int sparse_mla_decode_heads_per_block(const SparseMlaParams& p);
// float32 elements of the split-K workspace p.part must hold (0: none).
int64_t sparse_mla_decode_workspace_floats(const SparseMlaParams& p);
// 0 on success, else the runtime's error code (-1: no workspace); *msg names it.
// One kernel launch; its split-K merge uses device-side tile counters, so two
// launches must not run concurrently on two streams.
int sparse_mla_decode_launch(const SparseMlaParams& p, void* stream, const char** msg);

}  // namespace gfx936
