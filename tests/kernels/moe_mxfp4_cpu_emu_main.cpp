// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Runs csrc_gfx936/moe_mxfp4.cu's decode path (moe_route_launch, then moe_mxfp4_gemv_launch:
// gate/up, down, per-token sum) on the CPU under cpu_emu_compat.h, with the launcher's own
// template and tile choices. Input: DIR/meta.txt
//   M H I E topk x_kind weight_on_input w13_row_stride w2_row_stride alpha limit
// and DIR/{x,w13,s13,w2,s2,ids,wts}.bin (x [M, H] of x_kind, w13 [E, 2I, w13_row_stride],
// s13 [E, 2I, H/32], w2 [E, H, w2_row_stride], s2 [E, H, I/32] uint8, ids [M, topk] int32,
// wts [M, topk] float32). Output: DIR/out.bin, float32 [M, H]; exit 5 when a second call
// differs in any bit, 7 when a third with 3 blocks running at once does. Where
// moe_direct_supported, the direct path (moe_mxfp4_direct_launch) runs twice after: exit 6
// when its output differs from out.bin in any bit; DIR/direct.txt says whether it ran.
// `moe_mxfp4_emu supported IN OUT`: for each line "M topk H I" of IN, a line 0/1 of
// moe_direct_supported in OUT (the front end's direct_ok is tied to it over a grid).
// `moe_mxfp4_emu dequant DIR`: mxfp4_dequant_experts_launch (the prefill path's decode) on
// DIR/dq_meta.txt "E N K slot0 slots out_kind w_row_stride" and DIR/{w,s,active}.bin (w [E, N,
// w_row_stride], s [E, N, K/32] uint8, active int32); output DIR/dq_out.bin [slots, N, K] of
// out_kind, poisoned (0xff bytes) first: a slot whose expert is -1 keeps the poison.
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_emu_io.h"
#include "cpu_emu_schedule.h"
#include "moe_mxfp4.h"

using namespace gfx936;

static int supported_table(const char* in, const char* out) {
  FILE* fi = fopen(in, "r");
  FILE* fo = fopen(out, "w");
  if (fi == nullptr || fo == nullptr) return 2;
  int m, topk, h, inter;
  while (fscanf(fi, "%d %d %d %d", &m, &topk, &h, &inter) == 4)
    fprintf(fo, "%d\n", moe_direct_supported(m, topk, h, inter) ? 1 : 0);
  fclose(fi);
  fclose(fo);
  return 0;
}

static int dequant(const std::string& d) {
  int e, n, k, slot0, slots, ok;
  long ws1;
  FILE* f = fopen((d + "/dq_meta.txt").c_str(), "r");
  if (f == nullptr || fscanf(f, "%d %d %d %d %d %d %ld", &e, &n, &k, &slot0, &slots, &ok,
                             &ws1) != 7)
    return 2;
  fclose(f);
  const size_t bytes = static_cast<size_t>(slots) * n * k * (ok == kF32 ? 4 : 2);
  std::vector<unsigned char> out(bytes, 0xff);
  Mxfp4DequantParams p{};
  p.w = read_all(d + "/w.bin"); p.s = read_all(d + "/s.bin");
  p.w_s1 = ws1; p.w_s0 = ws1 * n; p.s_s1 = k / 32; p.s_s0 = static_cast<int64_t>(n) * (k / 32);
  p.active = reinterpret_cast<const int32_t*>(read_all(d + "/active.bin"));
  p.slot0 = slot0; p.slots = slots; p.n = n; p.k = k;
  p.out = out.data(); p.out_kind = ok;
  const char* msg = nullptr;
  if (mxfp4_dequant_experts_launch(p, nullptr, &msg) != 0) {
    fprintf(stderr, "dequant launch refused: %s\n", msg);
    return 4;
  }
  FILE* o = fopen((d + "/dq_out.bin").c_str(), "wb");
  fwrite(out.data(), 1, out.size(), o);
  fclose(o);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 4 && strcmp(argv[1], "supported") == 0) return supported_table(argv[2], argv[3]);
  if (argc == 3 && strcmp(argv[1], "dequant") == 0) return dequant(argv[2]);
  if (argc != 2) return 2;
  const std::string d = argv[1];
  int m, h, inter, e, topk, xk, woi;
  long w13s1, w2s1;
  float alpha, limit;
  FILE* f = fopen((d + "/meta.txt").c_str(), "r");
  if (f == nullptr || fscanf(f, "%d %d %d %d %d %d %d %ld %ld %f %f", &m, &h, &inter, &e, &topk,
                             &xk, &woi, &w13s1, &w2s1, &alpha, &limit) != 11)
    return 2;
  fclose(f);
  const int pairs = m * topk, slots = pairs < e ? pairs : e;
  std::vector<int32_t> pair_expert(pairs), sorted_pairs(pairs), expert_start(e + 1), active(slots);
  std::vector<float> act(static_cast<size_t>(pairs) * inter, NAN);
  std::vector<float> y(static_cast<size_t>(pairs) * h, NAN), out(static_cast<size_t>(m) * h, NAN);
  MoeRoute r{};
  r.topk_ids = read_all(d + "/ids.bin");
  r.pair_expert = pair_expert.data();
  r.sorted_pairs = sorted_pairs.data();
  r.expert_start = expert_start.data();
  r.active = active.data();
  r.m = m;
  r.topk = topk;
  r.num_experts = e;
  const char* msg = nullptr;
  if (moe_route_launch(r, nullptr, &msg) != 0) return 3;
  MoeMxfp4Params p{};
  p.x = read_all(d + "/x.bin"); p.x_kind = xk; p.x_s0 = h;
  p.w13 = read_all(d + "/w13.bin"); p.s13 = read_all(d + "/s13.bin");
  p.w2 = read_all(d + "/w2.bin"); p.s2 = read_all(d + "/s2.bin");
  p.w13_s1 = w13s1; p.w13_s0 = w13s1 * 2 * inter;
  p.s13_s1 = h / 32; p.s13_s0 = static_cast<int64_t>(2) * inter * (h / 32);
  p.w2_s1 = w2s1; p.w2_s0 = w2s1 * h;
  p.s2_s1 = inter / 32; p.s2_s0 = static_cast<int64_t>(h) * (inter / 32);
  p.topk_weights = reinterpret_cast<const float*>(read_all(d + "/wts.bin"));
  p.pair_expert = pair_expert.data(); p.sorted_pairs = sorted_pairs.data();
  p.expert_start = expert_start.data(); p.active = active.data();
  p.act = act.data(); p.y = y.data();
  p.out = out.data(); p.out_kind = kF32; p.o_s0 = h;
  p.m = m; p.topk = topk; p.hidden = h; p.inter = inter; p.num_slots = slots;
  p.alpha = alpha; p.limit = limit; p.weight_on_input = woi;
  if (moe_mxfp4_gemv_launch(p, nullptr, &msg) != 0) return 4;
  // the same bits again (the folded sum's tile counters are back at zero) and with blocks at
  // once (cpu_emu_schedule.h: a block counted in before its y is written is summed unwritten);
  // act and y poisoned first: every routed pair's rows are written again
  const std::vector<float> first = out;
  const int rc = emu_rerun({kEmuInOrder, kEmuAtOnce}, first, out, [&] {
    std::fill(out.begin(), out.end(), NAN);
    std::fill(act.begin(), act.end(), NAN);
    std::fill(y.begin(), y.end(), NAN);
    return moe_mxfp4_gemv_launch(p, nullptr, &msg);
  });
  if (rc != 0) return rc;
  FILE* o = fopen((d + "/out.bin").c_str(), "wb");
  fwrite(out.data(), sizeof(float), out.size(), o);
  fclose(o);
  // the direct path where it applies: two calls, each the grouped path's bits (act poisoned
  // in between: every routed pair's row is rewritten); the second with a CU count so large
  // that gate/up splits H over two lane groups wherever H has all four tiles
  const bool direct = moe_direct_supported(m, topk, h, inter);
  FILE* dt = fopen((d + "/direct.txt").c_str(), "w");
  fprintf(dt, "%d\n", direct ? 1 : 0);
  fclose(dt);
  if (!direct) return 0;
  p.topk_ids = r.topk_ids; p.ids_is_64 = 0; p.expert_map = nullptr; p.map_len = 0;
  p.num_experts = e;
  p.y = nullptr;  // the direct path has no y workspace
  for (int call = 0; call < 2; ++call) {
    p.num_cus = call == 0 ? 0 : 1 << 20;
    std::fill(act.begin(), act.end(), NAN);
    std::fill(out.begin(), out.end(), NAN);
    if (moe_mxfp4_direct_launch(p, nullptr, &msg) != 0) {
      fprintf(stderr, "direct launch refused: %s\n", msg);
      return 4;
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (memcmp(&first[i], &out[i], sizeof(float)) != 0) {
        fprintf(stderr, "direct call %d differs from the grouped path at %zu: %.9g vs %.9g\n",
                call, i, out[i], first[i]);
        return 6;
      }
    }
  }
  return 0;
}
