// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// MXFP4 (E2M1 + UE8M0 per 32) MoE kernels, torch-free launch API (moe_mxfp4.cu).
#pragma once

#include <stdint.h>

#include "sparse_mla_decode.h"  // kBF16 / kF16 / kF32

namespace gfx936 {

// Routing of M tokens x topk slots = P pairs (pair p = token * topk + slot) onto
// E local experts. Written by moe_route, read by the other kernels.
struct MoeRoute {
  const void* topk_ids;     // [M, topk] int32 or int64 (ids_is_64), global expert ids
  int ids_is_64;
  const int32_t* expert_map;  // [map_len] global -> local (-1: not on this rank) or nullptr
  int map_len;
  int32_t* pair_expert;    // [P] local expert of each pair, -1 = not routed here
  int32_t* sorted_pairs;   // [P] pairs grouped by local expert (routed ones first)
  int32_t* expert_start;   // [E + 1] exclusive prefix of per-expert pair counts
  int32_t* active;         // [S = min(P, E)] routed local experts in ascending order, then -1
  int m, topk, num_experts;
};

struct MoeMxfp4Params {
  const void* x; int x_kind; int64_t x_s0;        // [M, H]
  const uint8_t* w13; const uint8_t* s13;        // [E, 2I, H/2], [E, 2I, H/32]
  const uint8_t* w2; const uint8_t* s2;          // [E, H, I/2],  [E, H, I/32]
  int64_t w13_s0, w13_s1, s13_s0, s13_s1;        // expert / row strides (bytes)
  int64_t w2_s0, w2_s1, s2_s0, s2_s1;
  const float* topk_weights;                      // [M, topk] float32, contiguous
  const int32_t* pair_expert; const int32_t* sorted_pairs;
  const int32_t* expert_start; const int32_t* active;
  float* act;   // [P, I] float32 workspace (clamped SwiGLU output)
  float* y;     // [P, H] float32 workspace (weighted expert output per pair)
  void* out; int out_kind; int64_t o_s0;          // [M, H]
  int m, topk, hidden, inter, num_slots;
  float alpha, limit;  // limit <= 0: no clamp
  int weight_on_input;
  int num_cus;  // compute units of the device (the direct gate/up's grid); 0: unknown
  // the direct path only (moe_mxfp4_direct_launch): the routing as moe_route reads it
  const void* topk_ids; int ids_is_64;             // [M, topk] int32 / int64, contiguous
  const int32_t* expert_map; int map_len;          // global -> local or nullptr
  int num_experts;
};

int moe_route_launch(const MoeRoute& r, void* stream, const char** msg);
// gate/up GEMV + clamped SwiGLU, down GEMV, per-token weighted sum (3 launches; 2 at
// M <= 4, where down's last block per row tile sums; launches that use that sum's counters
// must not run concurrently on two streams)
int moe_mxfp4_gemv_launch(const MoeMxfp4Params& p, void* stream, const char** msg);
// out[m, h] = sum over the token's routed pairs of y[pair, h] (fixed slot order)
int moe_reduce_launch(const MoeMxfp4Params& p, void* stream, const char** msg);

// Few tokens (moe_direct_supported: M <= 64, topk <= 8, H <= 4096, I <= 512 in one down step):
// gate/up per (row tile, pair) and down per (row tile, token) read topk_ids themselves:
// no moe_route launch, no y workspace, no counters; down's block sums the token's slots in
// moe_reduce's order. 2 launches; the output has the grouped path's bits. Reads x, the
// weights, topk_ids / expert_map / topk_weights; writes act [M * topk, I] and out.
bool moe_direct_supported(int m, int topk, int hidden, int inter);
int moe_mxfp4_direct_launch(const MoeMxfp4Params& p, void* stream, const char** msg);

struct Mxfp4DequantParams {
  const uint8_t* w; const uint8_t* s;   // [E, N, K/2], [E, N, K/32]
  int64_t w_s0, w_s1, s_s0, s_s1;
  const int32_t* active;                // [>= slot0 + slots] local expert per slot, -1 = skip
  int slot0, slots, n, k;
  void* out; int out_kind;              // [slots, N, K] contiguous
};
int mxfp4_dequant_experts_launch(const Mxfp4DequantParams& p, void* stream, const char** msg);

}  // namespace gfx936
