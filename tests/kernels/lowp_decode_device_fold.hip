// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// lowp_decode.h's E2M1 decode on the device path (HIP: byte planes + __builtin_amdgcn_perm,
// i.e. v_perm_b32) with constant inputs: every code at every nibble position, the same
// patterns as lowp_decode_host.hip's. hipcc -O3 folds the permutes and shifts, so the device
// IR holds the 128 decoded floats as constants of volatile stores, in this order;
// tests/kernels/test_lowp_decode_host.py reads them and compares with the OCP table (the
// host test runs the C fallback of the permute, this one the compiler's model of the
// instruction).
#include "lowp_decode.h"

using namespace gfx936;

__global__ void e2m1_fold(uint32_t* o) {
#pragma unroll
  for (uint32_t c = 0; c < 16; ++c)
#pragma unroll
    for (int pos = 0; pos < 8; ++pos) {
      const uint32_t q = ((((c + 5u) & 15u) * 0x11111111u) & ~(0xfu << (4 * pos))) | (c << (4 * pos));
      float w[8];
      decode_e2m1x8(q, w);
      static_cast<volatile uint32_t*>(o)[c * 8 + pos] = float_to_bits(w[pos]);
    }
}
