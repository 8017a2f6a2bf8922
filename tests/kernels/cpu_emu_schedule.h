// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// How the CPU emulation (cpu_emu_runtime.cpp) runs a launch's blocks; a main reruns a launch
// in each schedule after its first call and compares the bits (a last-block sum must not
// depend on the schedule):
//   kEmuInOrder  one block at a time in grid order (the first call's; again: counters reset)
//   kEmuReverse  one block at a time in reverse grid order (another block is a tile's last)
//   kEmuAtOnce   3 blocks at once on worker threads (real atomics), the first block to do an
//                atomicAdd held at its next barrier until every other block is done: a block
//                that counts itself in before its writes is then summed unwritten
#pragma once

#include <stdio.h>
#include <string.h>

#include <functional>
#include <initializer_list>
#include <vector>

enum EmuSchedule { kEmuInOrder = 0, kEmuReverse = 1, kEmuAtOnce = 2 };

void emu_schedule(EmuSchedule s);

// `launch` (poison its outputs and workspaces, launch; 0 = launched) run again in each of
// `schedules`, every output compared with `first` bit for bit: 0, 4 when a launch is refused,
// or 5 + the schedule whose output differs (named on stderr). Back in order after.
inline int emu_rerun(std::initializer_list<EmuSchedule> schedules, const std::vector<float>& first,
                     const std::vector<float>& out, const std::function<int()>& launch) {
  static const char* const what[] = {"a second call",
                                     "a call with the blocks in reverse grid order",
                                     "a call with blocks running at once"};
  for (EmuSchedule s : schedules) {
    emu_schedule(s);
    const int rc = launch();
    emu_schedule(kEmuInOrder);
    if (rc != 0) return 4;
    if (memcmp(first.data(), out.data(), out.size() * sizeof(float)) != 0) {
      fprintf(stderr, "%s differs\n", what[s]);
      return 5 + s;
    }
  }
  return 0;
}
