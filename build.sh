#!/usr/bin/env bash
# Build the vllm-gfx936 wheel: pinned upstream + patches/series + the csrc_gfx936 kernels.
#
#   ./build.sh                      # on a DTK machine: ROCm build for gfx936 (the default)
#   ./build.sh --flavour python     # anywhere: pure-Python wheel (what CI builds)
#   ./build.sh --flavour cpu        # anywhere x86_64/aarch64: upstream's CPU ops + the fork's Python
#   ./build.sh --check              # only check the prerequisites of the chosen flavour
#
# Options: --dtk <digits> (e.g. 2604; default from $DTK_VERSION or the DTK install),
#          --any-dtk (build with a DTK other than 26.04, which is the one this fork targets),
#          --any-torch (build against a torch older than 2.13, the ROCm minimum of vLLM 0.27.1),
#          --arch <gfx> (default gfx936, or the gfx936 entry of a PYTORCH_ROCM_ARCH list),
#          --python <interpreter> (default: python3 on PATH).
# It checks every prerequisite first and stops with a message naming what is missing; it never
# falls back to building another flavour. The compiler output goes to the terminal and to
# build/build-<flavour>.log. The ROCm build compiles vLLM's kernels with MAX_JOBS parallel jobs
# (default: all cores; each job can take several GiB, so lower it on a small build node); expect
# tens of minutes to about an hour. An unchanged tree (same pin and patches) is reused, so a
# second run continues the CMake build instead of starting over. Offline build node: copy the
# pinned upstream sdist (upstream.toml) there and set UPSTREAM_SDIST=/path/to/vllm-<ver>.tar.gz;
# vLLM's CMake configure also git-clones ROCm/triton for triton_kernels: copy that folder there
# too and set TRITON_KERNELS_SRC_DIR (--check says what to copy when GitHub is unreachable).
set -euo pipefail
cd "$(dirname "$0")"

# vLLM 0.27.1's ROCm torch minimum (vllm/CMakeLists.txt TORCH_SUPPORTED_VERSION_ROCM) and the
# triton_kernels source its CMake configure fetches (cmake/external_projects/triton_kernels.cmake);
# tests/tooling/test_real_upstream.py keeps both in step with the pinned upstream.
TORCH_MIN=2.13.0
TRITON_KERNELS_GIT=https://github.com/ROCm/triton.git
TRITON_KERNELS_TAG=0f380657dbf3ee86eb57558ff71df24f03b5d4e7
flavour=rocm check_only=0 any_dtk=0 any_torch=0 arch='' dtk=${DTK_VERSION:-} py=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --flavour) flavour=$2; shift 2 ;;
    --dtk) dtk=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --any-dtk) any_dtk=1; shift ;;
    --any-torch) any_torch=1; shift ;;
    --check) check_only=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "build.sh: $*" >&2; exit 1; }
ok() { echo "build.sh: ok: $*"; }

# The arch: --arch, else PYTORCH_ROCM_ARCH (a DTK module may export a list such as
# "gfx906;gfx926;gfx936": its gfx936 entry is taken), else gfx936.
arch_from="--arch $arch"
if [[ -z "$arch" ]]; then
  arch=gfx936 arch_from="the default gfx936"
  if [[ -n "${PYTORCH_ROCM_ARCH:-}" ]]; then
    arch=${PYTORCH_ROCM_ARCH} arch_from="PYTORCH_ROCM_ARCH=$PYTORCH_ROCM_ARCH (from the environment; unset it or pass --arch gfx936)"
    for a in ${PYTORCH_ROCM_ARCH//[;,]/ }; do
      if [[ "$a" == gfx936* ]]; then arch=$a arch_from="--arch $a"; break; fi
    done
    if [[ "$arch" != "$PYTORCH_ROCM_ARCH" ]]; then
      echo "build.sh: note: PYTORCH_ROCM_ARCH=$PYTORCH_ROCM_ARCH lists several archs; building for $arch only"
    fi
  fi
fi

command -v git >/dev/null || die "git not found"
gitv=$(git --version | grep -oE '[0-9]+\.[0-9]+' | head -1)
[[ "$(printf '%s\n2.28\n' "$gitv" | sort -V | head -1)" == 2.28 ]] \
  || die "git $gitv is too old: the patch stack needs git >= 2.28 (e.g. 'module load git' or 'conda install git')"
command -v "$py" >/dev/null || die "python '$py' not found (use --python)"
"$py" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] < (3, 15)))' \
  || die "$("$py" --version 2>&1) at $(command -v "$py"): vLLM 0.27.1 needs Python >= 3.10 and < 3.15"
ok "$("$py" --version) at $(command -v "$py"), git $gitv"

case "$flavour" in
  python|cpu)
    "$py" -c 'import torch' 2>/dev/null || die "torch is not importable by $py (pip install torch)"
    ;;
  rocm)
    [[ "$arch" == gfx936* && "$arch" != *[\;,\ ]* ]] || die "$arch_from: this fork's ROCm build targets gfx936 only"
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
    [[ "$dtk" == 2604 || $any_dtk == 1 ]] \
      || die "DTK $dtk: this fork targets DTK 26.04 ('module load compiler/dtk/26.04'); --any-dtk builds anyway"
    ok "DTK $dtk"
    if ! err=$("$py" -c 'import torch' 2>&1); then
      last=$(printf '%s\n' "$err" | tail -1)
      case "$last" in
        *"No module named 'torch'"*)
          die "torch is not installed for $py: install DTK's torch wheel (torch-*das*/*dtk*) into this environment" ;;
        *.so*|*"cannot open shared object"*|*"undefined symbol"*)
          die "torch is installed but cannot load a library ($last): load the DTK module it was built for ('module load compiler/dtk/26.04') or add DTK's lib folders to LD_LIBRARY_PATH" ;;
        *) die "import torch failed for $py: $last" ;;
      esac
    fi
    hip=$("$py" -c 'import torch; print(torch.version.hip or "")')
    [[ -n "$hip" ]] || die "torch in $py is not a ROCm build (torch.version.hip is None): install DTK's torch, not a CUDA/CPU one"
    tv=$("$py" -c 'import torch; print(torch.__version__)')
    tbase=$(printf '%s' "$tv" | grep -oE '^[0-9]+(\.[0-9]+)*' || true)
    if [[ -z "$tbase" || "$(printf '%s\n%s\n' "$TORCH_MIN" "$tbase" | sort -V | head -1)" != "$TORCH_MIN" ]]; then
      [[ $any_torch == 1 ]] || die "torch $tv in $py is older than $TORCH_MIN, the ROCm torch vLLM 0.27.1 is built against (vllm/CMakeLists.txt): install DTK's torch >= $TORCH_MIN; --any-torch builds anyway"
      echo "build.sh: warning: torch $tv < $TORCH_MIN, building anyway (--any-torch)"
    fi
    ok "torch $tv for HIP $hip"
    dev=$("$py" -c 'import torch
print(torch.cuda.get_device_properties(0).gcnArchName if torch.cuda.is_available() else "")' 2>/dev/null || true)
    if [[ -n "$dev" && "$dev" != gfx936* ]]; then
      die "the visible device is $dev, not gfx936: build on a gfx936 node or hide the device"
    fi
    if [[ -n "$dev" ]]; then ok "device $dev"; else echo "build.sh: note: no device visible; building for $arch anyway"; fi
    tarch=$("$py" -c 'import torch; print(" ".join(torch.cuda.get_arch_list()))' 2>/dev/null || true)
    if [[ -n "$tarch" && " $tarch " != *" ${arch%%:*}"* ]]; then
      echo "build.sh: warning: this torch lists no ${arch%%:*} kernels (arch list: $tarch); is it DTK's torch for gfx936?"
    fi
    jobs=${MAX_JOBS:-$(nproc 2>/dev/null || echo 1)}
    ok "MAX_JOBS=$jobs parallel compile jobs (set MAX_JOBS to change; ~2-4 GiB of memory each)"
    for tool in cmake ninja; do command -v $tool >/dev/null || "$py" -c "import $tool" 2>/dev/null \
      || die "$tool not found (pip install $tool)"; done
    # vLLM's CMake configure (triton_kernels.cmake) git-clones ROCm/triton unless
    # TRITON_KERNELS_SRC_DIR names a local copy of its python/triton_kernels/triton_kernels.
    if [[ -n "${TRITON_KERNELS_SRC_DIR:-}" ]]; then
      [[ -f "$TRITON_KERNELS_SRC_DIR/__init__.py" ]] \
        || die "TRITON_KERNELS_SRC_DIR=$TRITON_KERNELS_SRC_DIR has no __init__.py: it must be triton's python/triton_kernels/triton_kernels folder"
      ok "triton_kernels from TRITON_KERNELS_SRC_DIR=$TRITON_KERNELS_SRC_DIR (no GitHub clone)"
    elif GIT_TERMINAL_PROMPT=0 timeout 60 git ls-remote "$TRITON_KERNELS_GIT" HEAD >/dev/null 2>&1; then
      ok "$TRITON_KERNELS_GIT reachable (the CMake configure clones triton_kernels from it)"
    else
      die "$TRITON_KERNELS_GIT is unreachable, and vLLM's CMake configure clones it for triton_kernels. Offline: on a machine with access run 'git clone $TRITON_KERNELS_GIT && git -C triton checkout $TRITON_KERNELS_TAG', copy triton/python/triton_kernels/triton_kernels to this node and set TRITON_KERNELS_SRC_DIR=/path/to/triton_kernels"
    fi
    export PYTORCH_ROCM_ARCH=$arch
    ;;
  *) die "--flavour $flavour: choose rocm, python or cpu" ;;
esac
for mod in setuptools_scm setuptools_rust wheel; do
  "$py" -c "import $mod" 2>/dev/null || die "python module $mod missing (pip install ${mod//_/-})"
done
ok "build tools present"
[[ $check_only == 1 ]] && { echo "build.sh: prerequisites for flavour '$flavour' OK"; exit 0; }

mkdir -p build
log=build/build-$flavour.log
: >"$log"
echo "build.sh: full output in $log"
"$py" -m tools.stack upstream 2>&1 | tee -a "$log" \
  || die "cannot get upstream (see above; offline: set UPSTREAM_SDIST=/path/to/the sdist named in upstream.toml)"
if [[ $flavour == rocm ]]; then
  # csrc_gfx936: torch.ops._gfx936_C, built with DTK's hipcc for $arch into build/kernels;
  # `tools.stack wheel --flavour rocm` grafts it into the wheel as vllm/_gfx936_C.so (where
  # vllm.gfx936.kernels loads it); every shared object that carries device code must carry $arch.
  # (No `tools.stack apply` here: the wheel is exported from pristine upstream + the series.)
  echo "build.sh: [1/3] csrc_gfx936 kernels for $arch"
  "$py" csrc_gfx936/build.py --out build/kernels 2>&1 | tee -a "$log" \
    || die "csrc_gfx936 kernels failed to build (see $log)"
  "$py" csrc_gfx936/check_offload.py --want "${arch%%:*}" build/kernels/_gfx936_C.so | tee -a "$log" \
    || die "build/kernels/_gfx936_C.so has no ${arch} code"
  echo "build.sh: [2/3] vLLM wheel (the long step: CMake + hipcc over vLLM's kernels)"
fi
"$py" -m tools.stack wheel --flavour "$flavour" ${dtk:+--dtk "$dtk"} -v 2>&1 | tee -a "$log" \
  || die "the wheel build failed (see $log)"
whl=$(tail -1 "$log")
[[ -f "$whl" ]] || die "the wheel build printed no wheel path (see $log)"
if [[ $flavour == rocm ]]; then
  echo "build.sh: [3/3] device code of every shared object in the wheel"
  "$py" csrc_gfx936/check_offload.py --want "${arch%%:*}" --wheel "$whl" | tee -a "$log" \
    || die "$whl: a shared object with device code has no ${arch} code, or the kernel library is missing (listed above)"
fi
echo "build.sh: built $whl"
echo "build.sh: install it without touching this environment's torch/Triton: $py -m tools.site_install $whl"
echo "$whl"
