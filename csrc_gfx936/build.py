# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build the csrc_gfx936 torch extension (``torch.ops._gfx936_C``) with ninja.

``make kernels`` runs this with the environment's torch, as vLLM builds its own
ops (torch.utils.cpp_extension): on a ROCm torch (DTK) it compiles the sources
with hipcc for ``PYTORCH_ROCM_ARCH`` (gfx936 for the product), on a CUDA torch
with nvcc for ``TORCH_CUDA_ARCH_LIST`` (9.0 on the H200). The result is
``<out>/_gfx936_C.so``; ``--into DIR`` also copies it there (build.sh puts it
into the vllm package of the ROCm wheel, where ``vllm.gfx936.kernels`` finds it).

Flags live here so the device build and CI's AMD compile check
(``compile_check.sh``) read the same list of sources.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ["torch_bindings.cpp", "sparse_mla_decode.cu", "w8a16_fp8.cu", "moe_mxfp4.cu"]
# every op torch_bindings.cpp registers; the loader (vllm/gfx936/kernels.py) checks the same
OPS = ("sparse_mla_decode", "w8a16_gemv", "fp8_block_dequant", "moe_route", "moe_mxfp4_gemv",
       "moe_mxfp4_gemv_direct", "moe_reduce", "mxfp4_dequant_experts")
NAME = "_gfx936_C"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parent / "build" / "kernels"))
    ap.add_argument("--into", default=None, help="also copy the .so into this directory")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from torch.utils import cpp_extension

    if not (torch.version.cuda or torch.version.hip):
        print(f"kernels: torch {torch.__version__} is a CPU build: no CUDA/ROCm toolchain to "
              "build csrc_gfx936 with (the AMD compile check is `make kernel-check`)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hip = bool(torch.version.hip)
    cflags = ["-O3", "-std=c++17"]
    gpu = ["-O3", "-std=c++17"]
    if hip:  # keep float32 denormals: the E4M3 decoder forms them for subnormals
        gpu += ["-fno-gpu-flush-denormals-to-zero"]
    cpp_extension.load(
        name=NAME, sources=[str(HERE / s) for s in SOURCES], build_directory=str(out),
        extra_cflags=cflags, extra_cuda_cflags=gpu, extra_include_paths=[str(HERE)],
        is_python_module=False, verbose=args.verbose)
    so = out / f"{NAME}.so"
    if not so.is_file():
        print(f"kernels: build finished but {so} is missing", file=sys.stderr)
        return 1
    import torch  # noqa: F811 - loaded by cpp_extension.load
    missing = [op for op in OPS if not hasattr(torch.ops._gfx936_C, op)]
    if missing:
        print(f"kernels: {so} registers no {missing}", file=sys.stderr)
        return 1
    print(f"kernels: built {so} (torch {torch.__version__}, "
          f"{'HIP ' + torch.version.hip if hip else 'CUDA ' + str(torch.version.cuda)})")
    if args.into:
        dest = Path(args.into)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest / so.name)
        print(f"kernels: copied into {dest / so.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
