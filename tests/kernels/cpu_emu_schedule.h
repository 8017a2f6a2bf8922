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

enum EmuSchedule { kEmuInOrder = 0, kEmuReverse = 1, kEmuAtOnce = 2 };

void emu_schedule(EmuSchedule s);
