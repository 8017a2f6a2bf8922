#!/usr/bin/env bash
# AMD compile check of the csrc_gfx936 kernels (CI, `make kernel-check`): compile every
# torch-free kernel source with an upstream hipcc for an AMD wave64 target and check the
# device code: an offload bundle for that target, no v_mfma, no scratch spills of FP8 code.
#   csrc_gfx936/compile_check.sh [--arch gfx90a] [--out build/kernel-check]
# Exit 0 = checked, 1 = failed, 3 = no usable hipcc (the caller decides whether to skip).
set -euo pipefail
cd "$(dirname "$0")"
arch=gfx90a out=../build/kernel-check
while [[ $# -gt 0 ]]; do
  case "$1" in --arch) arch=$2; shift 2 ;; --out) out=$2; shift 2 ;;
    *) echo "compile_check: unknown argument $1" >&2; exit 2 ;; esac
done
hipcc=$(command -v hipcc || true)
[[ -n "$hipcc" ]] || { echo "compile_check: no hipcc on PATH (Debian: apt-get install hipcc)"; exit 3; }
export HIP_PLATFORM=amd
mkdir -p "$out"
rc=0
for src in sparse_mla_decode.cu w8a16_fp8.cu moe_mxfp4.cu; do
  obj="$out/${src%.cu}.$arch.o" asm="$out/${src%.cu}.$arch.s"
  "$hipcc" --offload-arch="$arch" -O3 -std=c++17 -fno-gpu-flush-denormals-to-zero -c "$src" -o "$obj"
  "$hipcc" --offload-arch="$arch" -O3 -std=c++17 -fno-gpu-flush-denormals-to-zero \
    --cuda-device-only -S "$src" -o "$asm" 2>/dev/null
  if grep -q "v_mfma" "$asm"; then echo "compile_check: $src: v_mfma in $arch code"; rc=1; fi
  if grep -qiE "v_cvt_(f32_fp8|f32_bf8|pk_f32_fp8)" "$asm"; then
    echo "compile_check: $src: FP8 conversion instruction"; rc=1; fi
  echo "compile_check: $src -> $obj ($arch, $(grep -c '^; NumVgprs' "$asm") kernels)"
done
exit $rc
