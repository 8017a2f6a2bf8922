#!/usr/bin/env bash
# Build the vllm-gfx936 wheel: pinned upstream + patches/series (+ csrc_gfx936 kernels once they exist).
#
#   ./build.sh                      # on a DTK machine: ROCm build for gfx936 (the default)
#   ./build.sh --flavour python     # anywhere: pure-Python wheel (what CI builds)
#   ./build.sh --flavour cpu        # anywhere x86_64/aarch64: upstream's CPU ops + the fork's Python
#   ./build.sh --check              # only check the prerequisites of the chosen flavour
#
# Options: --dtk <digits> (e.g. 2604; default from $DTK_VERSION or the DTK install),
#          --arch <gfx> (default gfx936), --python <interpreter> (default: python3 on PATH).
# It checks every prerequisite first and stops with a message naming what is missing; it never
# falls back to building another flavour.
set -euo pipefail
cd "$(dirname "$0")"

flavour=rocm check_only=0 arch=${PYTORCH_ROCM_ARCH:-gfx936} dtk=${DTK_VERSION:-} py=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --flavour) flavour=$2; shift 2 ;;
    --dtk) dtk=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --check) check_only=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "build.sh: $*" >&2; exit 1; }
ok() { echo "build.sh: ok: $*"; }

command -v git >/dev/null || die "git not found"
command -v "$py" >/dev/null || die "python '$py' not found (use --python)"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$py is older than 3.10"
ok "$("$py" --version) at $(command -v "$py")"

case "$flavour" in
  python|cpu)
    "$py" -c 'import torch' 2>/dev/null || die "torch is not importable by $py (pip install torch)"
    ;;
  rocm)
    [[ "$arch" == gfx936* ]] || die "--arch $arch: this fork's ROCm build targets gfx936 only"
    hipcc=$(command -v hipcc || true)
    [[ -z "$hipcc" && -n "${ROCM_PATH:-}" && -x "$ROCM_PATH/bin/hipcc" ]] && hipcc=$ROCM_PATH/bin/hipcc
    [[ -n "$hipcc" ]] || die "hipcc not found: load DTK first (e.g. 'module load compiler/dtk/26.04') or set ROCM_PATH"
    ok "hipcc at $hipcc"
    if [[ -z "$dtk" ]]; then
      root=${ROCM_PATH:-$(dirname "$(dirname "$hipcc")")}
      for f in "$root/.info/version-dev" "$root/.info/version"; do
        [[ -r "$f" ]] && dtk=$(head -1 "$f" | sed -E 's/^([0-9]+)\.([0-9]+).*/\1\2/') && break
      done
    fi
    [[ "$dtk" =~ ^[0-9]+$ ]] || die "cannot tell the DTK version (got '${dtk}'): pass --dtk 2604 or set DTK_VERSION"
    ok "DTK $dtk"
    hip=$("$py" -c 'import torch; print(torch.version.hip or "")' 2>/dev/null) \
      || die "torch is not importable by $py: install the DTK (ROCm) torch wheel into this environment"
    [[ -n "$hip" ]] || die "torch in $py is not a ROCm build (torch.version.hip is None): install DTK's torch, not a CUDA/CPU one"
    ok "torch $("$py" -c 'import torch; print(torch.__version__)') for HIP $hip"
    dev=$("$py" -c 'import torch
print(torch.cuda.get_device_properties(0).gcnArchName if torch.cuda.is_available() else "")' 2>/dev/null || true)
    if [[ -n "$dev" && "$dev" != gfx936* ]]; then
      die "the visible device is $dev, not gfx936: build on a gfx936 node or hide the device"
    fi
    [[ -n "$dev" ]] && ok "device $dev" || echo "build.sh: note: no device visible; building for $arch anyway"
    for tool in cmake ninja; do command -v $tool >/dev/null || "$py" -c "import $tool" 2>/dev/null \
      || die "$tool not found (pip install $tool)"; done
    export PYTORCH_ROCM_ARCH=$arch
    ;;
  *) die "--flavour $flavour: choose rocm, python or cpu" ;;
esac
for mod in setuptools_scm setuptools_rust wheel; do
  "$py" -c "import $mod" 2>/dev/null || die "python module $mod missing (pip install ${mod//_/-})"
done
ok "build tools present"
[[ $check_only == 1 ]] && { echo "build.sh: prerequisites for flavour '$flavour' OK"; exit 0; }

"$py" -m tools.stack upstream
if [[ $flavour == rocm ]]; then
  # csrc_gfx936: torch.ops._gfx936_C, built with DTK's hipcc for $arch into build/kernels;
  # `tools.stack wheel --flavour rocm` grafts it into the wheel as vllm/_gfx936_C.so (where
  # vllm.gfx936.kernels loads it), then every shipped shared object must carry $arch code.
  [[ -f vllm/vllm/v1/attention/ops/gfx936_sparse_mla_reference.py ]] || "$py" -m tools.stack apply
  "$py" csrc_gfx936/build.py --out build/kernels \
    || die "csrc_gfx936 kernels failed to build (see above)"
  "$py" csrc_gfx936/check_offload.py --want "${arch%%:*}" build/kernels/_gfx936_C.so \
    || die "build/kernels/_gfx936_C.so has no ${arch} code"
fi
whl=$("$py" -m tools.stack wheel --flavour "$flavour" ${dtk:+--dtk "$dtk"} | tail -1)
echo "$whl"
if [[ $flavour == rocm ]]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$py" -m zipfile -e "$whl" "$tmp"
  mapfile -t sos < <(find "$tmp" -name '*.so')
  [[ ${#sos[@]} -gt 0 ]] || die "$whl ships no shared object"
  ls "$tmp"/vllm/_gfx936_C*.so >/dev/null 2>&1 || die "$whl lacks vllm/_gfx936_C.so"
  "$py" csrc_gfx936/check_offload.py --want "${arch%%:*}" "${sos[@]}" \
    || die "a shared object in $whl has no ${arch} code (listed above)"
fi
