// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// File input of the CPU emulation mains (tests/kernels/*_cpu_emu_main.cpp).
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <string>

// The whole file, 64-byte aligned (as the launchers' checks require of device tensors: 16 at
// least); its size in *size when given. Exits 2 when it cannot be read.
static unsigned char* read_all(const std::string& path, long* size = nullptr) {
  FILE* f = fopen(path.c_str(), "rb");
  if (f == nullptr) { perror(path.c_str()); exit(2); }
  fseek(f, 0, SEEK_END);
  const long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char* p = static_cast<unsigned char*>(aligned_alloc(64, (n + 64) / 64 * 64));
  if (n > 0 && fread(p, 1, n, f) != static_cast<size_t>(n)) exit(2);
  fclose(f);
  if (size != nullptr) *size = n;
  return p;
}
