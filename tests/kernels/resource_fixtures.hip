// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Small kernels with known resource use, for tests/kernels/test_kernel_resources.py: the AMD
// compile check (csrc_gfx936/compile_check.sh + resource_report.py) must pass the first two and
// fail the last two, naming them and their numbers.
#include <hip/hip_runtime.h>

// a handful of VGPRs, no LDS, no scratch, no AGPRs: full occupancy
__global__ void __launch_bounds__(256) fixture_clean(const float* a, float* o) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  o[i] = a[i] * 2.0f + 1.0f;
}

// 300 floats of static LDS: exactly 1200 bytes per block
__global__ void __launch_bounds__(256) fixture_lds(const float* a, float* o) {
  __shared__ float tile[300];
  const int i = threadIdx.x;
  tile[i] = a[i];
  if (i < 44) tile[256 + i] = a[256 + i];
  __syncthreads();
  o[i] = tile[299 - i] + tile[(i * 7) % 300];
}

// a per-lane array of 512 floats read at an index known only at run time cannot live in
// registers: it goes to the private segment (scratch), at least 512 * 4 = 2048 bytes per lane
__global__ void __launch_bounds__(256) fixture_scratch(const float* a, const int* idx, float* o) {
  float buf[512];
  float acc = 1.0f;
  for (int j = 0; j < 512; ++j) {
    acc = acc * a[j] + 1.0f;
    buf[j] = acc;
  }
  o[threadIdx.x] = buf[idx[threadIdx.x] & 511];
}

// one MFMA (the matrix-core instruction gfx936 does not have)
typedef float fixture_v4f __attribute__((ext_vector_type(4)));
__global__ void __launch_bounds__(256) fixture_mfma(const float* a, float* o) {
  const int i = threadIdx.x;
  fixture_v4f c = {0.0f, 0.0f, 0.0f, 0.0f};
  c = __builtin_amdgcn_mfma_f32_4x4x1f32(a[i], a[i + 1], c, 0, 0, 0);
  o[4 * i] = c.x; o[4 * i + 1] = c.y; o[4 * i + 2] = c.z; o[4 * i + 3] = c.w;
}
