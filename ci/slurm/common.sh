#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Shared helpers for the vllm-gfx936 Slurm jobs (sourced, not run).
#
# Contract (field report 2.2, 5, 6.5, 12): the job's exit code is the probe's
# exit code, so `sacct` State/ExitCode, the raw log, PY_EXIT and DSV4_VERDICT
# agree. A probe that exits 0 without a COHERENT verdict is turned into a
# failure (rc 3), and one without any verdict into rc 4.
#
# Knobs (environment, all optional except MODEL_PATH):
#   MODEL_PATH    model directory (required)
#   PYTHON        python to run (default: python); tests inject a fake one
#   DRY_RUN=1     print the commands instead of running them
#   DTK_MODULES   modules to load (default seed 12.2:
#                 "compiler/gcc/12.2.0 compiler/dtk/26.04"); "" = none
#   DTK_ROOT      DTK install root: prepends gcvm/lib lib lib64 comgr/lib64
#                 to LD_LIBRARY_PATH (seed 12.2)
#   VLLM_ENV      virtualenv to activate (built from ./build.sh wheel)
#   LOG_DIR       where raw logs go (default: $KIT_ROOT/logs)
#   MAX_MODEL_LEN (512) KV_CACHE_DTYPE (fp8) GPU_MEM_UTIL (0.90)
#   MAX_TOKENS (32) PROMPT PROBE_ARGS (extra probe args, word-split)

kit_log() { printf '%s\n' "$*"; }

# Print (DRY_RUN=1) or run a command.
kit_run() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        printf 'DRY_RUN:'
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    "$@"
}

kit_init() {
    KIT_ROOT="${KIT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
    if [[ ! -d "$KIT_ROOT/ci/dcu_kit" ]]; then
        kit_log "ERROR: KIT_ROOT=$KIT_ROOT has no ci/dcu_kit; submit from the" \
            "vllm-gfx936 checkout or export KIT_ROOT" >&2
        return 64
    fi
    PYTHON="${PYTHON:-python}"
    JOB_ID="${SLURM_JOB_ID:-local$$}"
    LOG_DIR="${LOG_DIR:-$KIT_ROOT/logs}"
    export PYTHONPATH="$KIT_ROOT/ci${PYTHONPATH:+:$PYTHONPATH}"
    return 0
}

kit_load_env() {
    local modules="${DTK_MODULES-compiler/gcc/12.2.0 compiler/dtk/26.04}"
    if [[ -n "$modules" ]]; then
        if [[ "${DRY_RUN:-0}" == "1" ]]; then
            kit_log "DRY_RUN: module purge"
            kit_log "DRY_RUN: module load $modules"
        elif command -v module >/dev/null 2>&1 || declare -F module >/dev/null; then
            module purge
            # shellcheck disable=SC2086  # a list of module names
            module load $modules || return 65
        else
            kit_log "WARNING: 'module' not available; skipping: module load $modules"
        fi
    fi
    if [[ -n "${VLLM_ENV:-}" ]]; then
        if [[ "${DRY_RUN:-0}" == "1" ]]; then
            kit_log "DRY_RUN: source $VLLM_ENV/bin/activate"
        else
            # shellcheck disable=SC1091  # site path, not in the repo
            source "$VLLM_ENV/bin/activate" || return 66
        fi
    fi
    if [[ -n "${DTK_ROOT:-}" ]]; then
        export LD_LIBRARY_PATH="$DTK_ROOT/gcvm/lib:$DTK_ROOT/lib:$DTK_ROOT/lib64:$DTK_ROOT/comgr/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    # Seed 0.4 / 3.3 run switches (override by exporting before sbatch).
    export VLLM_WORKER_MULTIPROC_METHOD="${VLLM_WORKER_MULTIPROC_METHOD:-spawn}"
    export TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER="${TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER:-0}"
    export VLLM_ROCM_USE_SKINNY_GEMM="${VLLM_ROCM_USE_SKINNY_GEMM:-0}"
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
    export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
    # No usage-report thread: its JSONDecodeError was log noise (seed 11.1).
    export VLLM_NO_USAGE_STATS="${VLLM_NO_USAGE_STATS:-1}"
    export DO_NOT_TRACK="${DO_NOT_TRACK:-1}"
    return 0
}

# kit_verdict RAW -> the last verdict word in the raw log (COHERENT,
# DEGENERATE, ...), empty when there is none or RAW is missing.
kit_verdict() {
    grep -a -E '^(DSV4|SERVE_SMOKE)_VERDICT:' "$1" 2>/dev/null | tail -n 1 | cut -d' ' -f2
}

# kit_summary NAME RC RAW  -> one machine-greppable line for the job.
kit_summary() {
    local name="$1" rc="$2" raw="$3" verdict="MISSING" ready="-" result
    if [[ -f "$raw" ]]; then
        verdict="$(kit_verdict "$raw")"
        verdict="${verdict:-MISSING}"
        ready="$(grep -a -o 'ENGINE_READY in [0-9.]*s' "$raw" | tail -n 1 | awk '{print $3}')"
        ready="${ready:--}"
    fi
    if [[ "$rc" == "0" ]]; then result=PASS; else result=FAIL; fi
    kit_log "DCU_KIT_SUMMARY job=$JOB_ID name=$name rc=$rc verdict=$verdict engine_ready=$ready result=$result log=$raw"
}

# kit_reconcile RC RAW -> echo the final rc (verdict and exit code must agree).
kit_reconcile() {
    local rc="$1" raw="$2" verdict
    verdict="$(kit_verdict "$raw")"
    if [[ "$rc" == "0" && -z "$verdict" ]]; then
        echo 4
    elif [[ "$rc" == "0" && "$verdict" != "COHERENT" ]]; then
        echo 3
    else
        echo "$rc"
    fi
}

# kit_single_node_job NAME TP : run the probe, save the raw log, summarize.
kit_single_node_job() {
    local name="$1" tp="$2" raw rc
    if [[ -z "${MODEL_PATH:-}" ]]; then
        kit_log "ERROR: MODEL_PATH is not set (export MODEL_PATH=/path/to/DeepSeek-V4-Flash)" >&2
        return 64
    fi
    kit_load_env || return $?
    raw="$LOG_DIR/${name}-${JOB_ID}.raw.log"
    local -a probe=("$PYTHON" -m dcu_kit.probe
        --model "$MODEL_PATH" --tp "$tp"
        --max-model-len "${MAX_MODEL_LEN:-512}"
        --kv-cache-dtype "${KV_CACHE_DTYPE:-fp8}"
        --gpu-memory-utilization "${GPU_MEM_UTIL:-0.90}"
        --max-tokens "${MAX_TOKENS:-32}"
        --json-out "${raw%.raw.log}.json")
    if [[ -n "${PROMPT:-}" ]]; then probe+=(--prompt "$PROMPT"); fi
    if [[ -n "${PROBE_ARGS:-}" ]]; then
        local -a extra
        read -r -a extra <<<"$PROBE_ARGS"
        probe+=("${extra[@]}")
    fi
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        kit_run "${probe[@]}"
        kit_log "DRY_RUN: raw log would be $raw"
        kit_log "DCU_KIT_SUMMARY job=$JOB_ID name=$name rc=0 verdict=DRY_RUN engine_ready=- result=DRY_RUN log=$raw"
        return 0
    fi
    mkdir -p "$LOG_DIR" || return 73
    kit_log "RAW_LOG=$raw"
    "${probe[@]}" >"$raw" 2>&1
    rc=$?
    echo "PY_EXIT=$rc" >>"$raw"
    kit_log "PY_EXIT=$rc"
    rc="$(kit_reconcile "$rc" "$raw")"
    grep -a -E '^(### STAGE|ENGINE_READY|TOKEN_IDS|FINISH_REASON|OUTPUT_REPR|DSV4_VERDICT|PROBE_FAILED_STAGE)' "$raw"
    if [[ "$rc" != "0" ]]; then
        "$PYTHON" -m dcu_kit.first_blocker "$raw" || true
    fi
    kit_summary "$name" "$rc" "$raw"
    return "$rc"
}
