// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Runs csrc_gfx936/w8a16_fp8.cu (w8a16_gemv_launch: the launcher's own plan, template and
// k split; fp8_block_dequant_launch) on the CPU under cpu_emu_compat.h. Input: DIR/meta.txt
//   m n k bn bk groups x_kind scale_kind num_cus w_s0 s_s0 deq_kind
// and DIR/{x,w,scale}.bin (x [m, groups * k] of x_kind, contiguous; w [n, w_s0] uint8 e4m3fn,
// of which [:, :k] is the weight; scale [ceil(n / bn), s_s0] uint8 UE8M0 or float32, of which
// [:, :ceil(k / bk)] is read). Output: DIR/out.bin float32 [m, n] (the GEMV), DIR/deq.bin
// [n, k] of deq_kind (the dequant), DIR/plan.txt (the k splits, 0 when the plan has none);
// exit 5 when a second GEMV call differs in any bit (the split-K tile counters reset), 6 when
// a call with the blocks in reverse grid order does, 7 when a call with 3 blocks running at
// once (the first block to count itself in held at its next barrier) does.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#include "cpu_emu_io.h"
#include "cpu_emu_schedule.h"
#include "w8a16_fp8.h"

using namespace gfx936;

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string d = argv[1];
  W8A16Params p{};
  int deq_kind;
  FILE* f = fopen((d + "/meta.txt").c_str(), "r");
  if (f == nullptr ||
      fscanf(f, "%d %d %d %d %d %d %d %d %d %ld %ld %d", &p.m, &p.n, &p.k, &p.bn, &p.bk,
             &p.groups, &p.x_kind, &p.scale_kind, &p.num_cus, &p.w_s0, &p.s_s0,
             &deq_kind) != 12)
    return 2;
  fclose(f);
  p.x = read_all(d + "/x.bin");
  p.x_s0 = static_cast<int64_t>(p.groups) * p.k;
  p.w = read_all(d + "/w.bin");
  p.scale = read_all(d + "/scale.bin");
  p.bk_shift = 0;
  while ((1 << p.bk_shift) < p.bk) ++p.bk_shift;
  std::vector<float> out(static_cast<size_t>(p.m) * p.n, NAN);
  p.out = out.data();
  p.out_kind = kF32;
  p.o_s0 = p.n;
  std::vector<float> ws(static_cast<size_t>(w8a16_gemv_workspace_floats(p)), NAN);
  p.ws = ws.empty() ? nullptr : ws.data();
  const char* msg = nullptr;
  if (w8a16_gemv_launch(p, nullptr, &msg) != 0) {
    fprintf(stderr, "launch: %s\n", msg);
    return 4;
  }
  const std::vector<float> first = out;
  // a call again (fresh NaN partials and output) in every schedule (cpu_emu_schedule.h): the
  // same bits each time
  const int rc = emu_rerun({kEmuInOrder, kEmuReverse, kEmuAtOnce}, first, out, [&] {
    std::fill(out.begin(), out.end(), NAN);
    std::fill(ws.begin(), ws.end(), NAN);
    return w8a16_gemv_launch(p, nullptr, &msg);
  });
  if (rc != 0) return rc;
  FILE* o = fopen((d + "/out.bin").c_str(), "wb");
  fwrite(out.data(), sizeof(float), out.size(), o);
  fclose(o);
  FILE* pl = fopen((d + "/plan.txt").c_str(), "w");
  fprintf(pl, "%ld\n", ws.empty() ? 0L : static_cast<long>(ws.size() / out.size()));
  fclose(pl);
  // the dequant: [n, k] of deq_kind, contiguous
  const size_t esize = deq_kind == kF32 ? 4 : 2;
  std::vector<unsigned char> deq(static_cast<size_t>(p.n) * p.k * esize, 0xcd);
  p.out = deq.data();
  p.out_kind = deq_kind;
  p.o_s0 = p.k;
  if (fp8_block_dequant_launch(p, nullptr, &msg) != 0) {
    fprintf(stderr, "dequant launch: %s\n", msg);
    return 4;
  }
  FILE* q = fopen((d + "/deq.bin").c_str(), "wb");
  fwrite(deq.data(), 1, deq.size(), q);
  fclose(q);
  return 0;
}
