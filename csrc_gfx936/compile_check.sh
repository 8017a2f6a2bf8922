#!/usr/bin/env bash
# AMD compile check of the csrc_gfx936 kernels (CI, `make kernel-check`): compile every
# torch-free kernel source with an upstream hipcc for an AMD wave64 target (one compile per
# source: the object, its device assembly by -save-temps, the compiler's resource remarks) and
# report per kernel VGPR / SGPR / AGPR, scratch, LDS and occupancy (resource_report.py:
# <out>/resources.<arch>.md and .json). Fails on what gfx936 cannot run: scratch, AGPRs (the
# gfx90a stand-in for gfx936's spills), v_mfma, FP8 conversions, unless the kernel is listed
# with its exact numbers in kernel_resources_allow.json (known debt, named with its issue).
#   csrc_gfx936/compile_check.sh [--arch gfx90a] [--out build/kernel-check]
#       [--allow FILE|none] [SOURCE.cu|.hip ...]   (default: the three kernel sources)
# Exit 0 = checked, 1 = failed, 2 = the report could not be read, 3 = no usable hipcc (the
# caller decides whether to skip).
set -euo pipefail
abs() { [[ "$1" = /* ]] && echo "$1" || echo "$PWD/$1"; }  # paths given are the caller's
arch=gfx90a out='' allow='' sources=()
while [[ $# -gt 0 ]]; do
  case "$1" in --arch) arch=$2; shift 2 ;; --out) out=$(abs "$2"); shift 2 ;;
    --allow) [[ "$2" = none ]] && allow=none || allow=$(abs "$2"); shift 2 ;;
    -*) echo "compile_check: unknown argument $1" >&2; exit 2 ;;
    *) sources+=("$(abs "$1")"); shift ;; esac
done
cd "$(dirname "$0")"
[[ -n "$out" ]] || out=$PWD/../build/kernel-check
[[ -n "$allow" ]] || allow=$PWD/kernel_resources_allow.json
[[ ${#sources[@]} -gt 0 ]] || sources=(sparse_mla_decode.cu w8a16_fp8.cu moe_mxfp4.cu)
hipcc=$(command -v hipcc || true)
[[ -n "$hipcc" ]] || { echo "compile_check: no hipcc on PATH (Debian: apt-get install hipcc)"; exit 3; }
export HIP_PLATFORM=amd
mkdir -p "$out"
inputs=()
for src in "${sources[@]}"; do
  name=$(basename "$src") && base=${name%.*} && tmp="$out/.temps-$base"
  rm -rf "$tmp" && mkdir -p "$tmp"
  "$hipcc" --offload-arch="$arch" -O3 -std=c++17 -fno-gpu-flush-denormals-to-zero \
    -save-temps=obj -Rpass-analysis=kernel-resource-usage -c "$src" -o "$tmp/$base.$arch.o" \
    2> "$out/$base.$arch.remarks" || { cat "$out/$base.$arch.remarks" >&2; exit 1; }
  mv "$tmp/$base.$arch.o" "$out/$base.$arch.o"
  mv "$tmp/$base-hip-amdgcn-amd-amdhsa-$arch.s" "$out/$base.$arch.s"
  rm -rf "$tmp"
  inputs+=("$out/$base.$arch.s:$out/$base.$arch.remarks:$name")
  echo "compile_check: $src -> $out/$base.$arch.o ($arch)"
done
allow_arg=(--allow "$allow") && [[ "$allow" != none ]] || allow_arg=()
python3 resource_report.py --arch "$arch" --out "$out" "${allow_arg[@]}" "${inputs[@]}"
