// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Runs csrc_gfx936/lowp_decode.h's decoders (the functions the kernels call, compiled
// by hipcc for the host) over every code and prints the float32 bits, one value per line:
//   e4m3 <code> <byte position> <bits of decode_e4m3x4>        (256 x 4 lines)
//   e4m3nan <code> <byte position> <bits of decode_e4m3x4_nan> (256 x 4)
//   mla <code> <ue8m0> <bits>   Sparse MLA's path: e4m3_scaled(decode_e4m3x4_nan(code),
//                               e4m3_block_scale(ue8m0))       (256 x 256)
//   ue8m0 <code> <extra> <bits of ue8m0_pow2(code, extra)>     (256 x each extra the kernels use)
//   e2m1 <code> <nibble position> <bits of decode_e2m1x8>      (16 x 8)
// tests/kernels/test_lowp_decode_host.py builds it and compares with PyTorch's decoders.
#include <stdio.h>

#include "lowp_decode.h"

using namespace gfx936;

int main() {
  for (uint32_t c = 0; c < 256; ++c)
    for (int pos = 0; pos < 4; ++pos) {
      // the other three bytes hold other codes, so a decoder reading the wrong byte shows
      const uint32_t q = (((c + 0x35u) * 0x01010101u) & ~(0xffu << (8 * pos))) | (c << (8 * pos));
      float w[4], n[4];
      decode_e4m3x4(q, w);
      decode_e4m3x4_nan(q, n);
      printf("e4m3 %u %d %08x\n", c, pos, float_to_bits(w[pos]));
      printf("e4m3nan %u %d %08x\n", c, pos, float_to_bits(n[pos]));
    }
  for (uint32_t c = 0; c < 256; ++c)
    for (uint32_t u = 0; u < 256; ++u) {
      float n[4];
      decode_e4m3x4_nan(c, n);
      printf("mla %u %u %08x\n", c, u, float_to_bits(e4m3_scaled(n[0], e4m3_block_scale(u))));
    }
  const int extras[] = {0, 56, 62, 120};  // fp8/mxfp4 dequant, W8A16 GEMV, MoE GEMV, Sparse MLA
  for (int x : extras)
    for (uint32_t u = 0; u < 256; ++u) printf("ue8m0 %u %d %08x\n", u, x, float_to_bits(ue8m0_pow2(u, x)));
  for (uint32_t c = 0; c < 16; ++c)
    for (int pos = 0; pos < 8; ++pos) {
      const uint32_t q = ((((c + 5u) & 15u) * 0x11111111u) & ~(0xfu << (4 * pos))) | (c << (4 * pos));
      float w[8];
      decode_e2m1x8(q, w);
      printf("e2m1 %u %d %08x\n", c, pos, float_to_bits(w[pos]));
    }
  return 0;
}
