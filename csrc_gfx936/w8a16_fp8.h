// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Block-FP8 (E4M3 + 128x128 block scales) W8A16 dense kernels, torch-free
// launch API (w8a16_fp8.cu). Layouts are drawn in the .cu file.
#pragma once

#include <stdint.h>

#include "sparse_mla_decode.h"  // kBF16 / kF16 / kF32

namespace gfx936 {

enum ScaleKind { kScaleUE8M0 = 0, kScaleF32 = 1 };

struct W8A16Params {
  const void* x;          // [m, groups * k] activations, x_kind, row stride x_s0
  int x_kind;
  int64_t x_s0;
  const uint8_t* w;       // [n, k] e4m3fn bytes, row stride w_s0 (bytes)
  int64_t w_s0;
  const void* scale;      // [ceil(n / bn), ceil(k / bk)], row stride s_s0 (elements)
  int scale_kind;
  int64_t s_s0;
  void* out;              // [m, n], out_kind, row stride o_s0
  int out_kind;
  int64_t o_s0;
  int m, n, k, bn, bk;
  int bk_shift;           // log2(bk): bk is a power of two (host check)
  int groups;             // output rows n split into `groups` equal slices; slice g reads x[:, g*k:(g+1)*k]
  int num_cus;            // compute units of the device (sizes the GEMV grid)
  float* ws;              // split-K partials, w8a16_gemv_workspace_floats(p) floats (or null if 0)
};

// float32 elements of the split-K workspace w8a16_gemv_launch needs for p (0: none)
int64_t w8a16_gemv_workspace_floats(const W8A16Params& p);

// out = x @ dequant(w).T, weights decoded in registers (M up to a few dozen).
int w8a16_gemv_launch(const W8A16Params& p, void* stream, const char** msg);

// out [n, k] (out_kind, row stride o_s0) = decode(w) * scale, rounded once.
int fp8_block_dequant_launch(const W8A16Params& p, void* stream, const char** msg);

}  // namespace gfx936
