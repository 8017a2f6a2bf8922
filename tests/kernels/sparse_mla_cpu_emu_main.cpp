// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Runs csrc_gfx936/sparse_mla_decode.cu (sparse_mla_decode_launch: the launcher's own plan,
// template and split choice) on the CPU under cpu_emu_compat.h. Input: DIR/meta.txt
//   b h q_kind scale has_sink num_cus
//   main:  blocks block_size stride0 ragged width has_lens
//   extra: has_extra blocks block_size stride0 ragged width has_lens
// and DIR/{q, mcache, midx, mptr, mlens, ecache, eidx, eptr, elens, sink}.bin (q [b, h, 512]
// of q_kind, contiguous; a cache from element [0, 0, 0]: (blocks - 1) * stride0 + bs * 584
// bytes; indices int32 dense [b, width] or ragged [nnz] + indptr [b + 1]; lens int32 [b];
// sink float32 [h]). Output: DIR/out.bin float32 [b, h, 512], DIR/splits.txt (the split
// count the plan took); exit 5 when a second call differs in any bit (the split-K tile
// counters reset), exit 6 when a call with the blocks in reverse grid order does (the merge
// does not depend on which block is last), exit 7 when a call with 3 blocks running at once
// does.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "cpu_emu_io.h"
#include "cpu_emu_schedule.h"
#include "sparse_mla_decode.h"

using namespace gfx936;


static SparseMlaSource source(FILE* f, const std::string& d, const char* pre, int b) {
  long blocks, bs, stride0;
  int ragged, width, has_lens;
  if (fscanf(f, "%ld %ld %ld %d %d %d", &blocks, &bs, &stride0, &ragged, &width, &has_lens) != 6)
    exit(2);
  SparseMlaSource s{};
  s.cache = read_all(d + "/" + pre + "cache.bin");
  s.stride0 = stride0;
  s.num_rows = blocks * bs;
  s.block_size = static_cast<int>(bs);
  s.idx = reinterpret_cast<const int32_t*>(read_all(d + "/" + pre + "idx.bin"));
  if (ragged) s.indptr = reinterpret_cast<const int32_t*>(read_all(d + "/" + pre + "ptr.bin"));
  else s.width = width;
  if (has_lens) s.lens = reinterpret_cast<const int32_t*>(read_all(d + "/" + pre + "lens.bin"));
  (void)b;
  return s;
}

static int keys_per_query(const SparseMlaSource& s, const std::string& path, int b) {
  if (s.indptr == nullptr) return s.width;
  long n = 0;
  free(read_all(path, &n));
  return static_cast<int>((n / 4 + b - 1) / b);
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string d = argv[1];
  int b, h, qk, has_sink, num_cus, has_extra;
  float scale;
  FILE* f = fopen((d + "/meta.txt").c_str(), "r");
  if (f == nullptr || fscanf(f, "%d %d %d %f %d %d", &b, &h, &qk, &scale, &has_sink, &num_cus) != 6)
    return 2;
  SparseMlaParams p{};
  p.main = source(f, d, "m", b);
  if (fscanf(f, "%d", &has_extra) != 1) return 2;
  if (has_extra) p.extra = source(f, d, "e", b);
  fclose(f);
  p.q = read_all(d + "/q.bin");
  p.q_kind = qk;
  p.q_s0 = static_cast<int64_t>(h) * 512;
  p.q_s1 = 512;
  std::vector<float> out(static_cast<size_t>(b) * h * 512, NAN);
  p.out = out.data();
  p.out_kind = kF32;
  p.o_s0 = static_cast<int64_t>(h) * 512;
  p.o_s1 = 512;
  if (has_sink) p.sink = reinterpret_cast<const float*>(read_all(d + "/sink.bin"));
  p.has_extra = has_extra;
  p.scale = scale;
  p.b = b;
  p.h = h;
  p.num_cus = num_cus;
  p.avg_keys = keys_per_query(p.main, d + "/midx.bin", b) +
               (has_extra ? keys_per_query(p.extra, d + "/eidx.bin", b) : 0);
  // the workspace as the binding sizes it, filled with NaN: a row the merge reads
  // before any split wrote it shows
  std::vector<float> part(static_cast<size_t>(sparse_mla_decode_workspace_floats(p)), NAN);
  p.part = part.empty() ? nullptr : part.data();
  const char* msg = nullptr;
  if (sparse_mla_decode_launch(p, nullptr, &msg) != 0) {
    fprintf(stderr, "launch: %s\n", msg);
    return 4;
  }
  // the same bits in every schedule (cpu_emu_schedule.h): again (the split-K tile counters
  // are back at zero), in reverse grid order (split 0's block is the last of each tile, not
  // split S-1's), with blocks at once (a block counted in before its rows are written shows)
  const std::vector<float> first = out;
  const int rc = emu_rerun({kEmuInOrder, kEmuReverse, kEmuAtOnce}, first, out, [&] {
    std::fill(out.begin(), out.end(), NAN);
    std::fill(part.begin(), part.end(), NAN);
    return sparse_mla_decode_launch(p, nullptr, &msg);
  });
  if (rc != 0) return rc;
  FILE* o = fopen((d + "/out.bin").c_str(), "wb");
  fwrite(out.data(), sizeof(float), out.size(), o);
  fclose(o);
  FILE* sp = fopen((d + "/splits.txt").c_str(), "w");
  fprintf(sp, "%d %d\n", sparse_mla_decode_splits(p), sparse_mla_decode_heads_per_block(p));
  fclose(sp);
  return 0;
}
