#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Shared helpers for the vllm-gfx936 Slurm jobs (sourced, not run).
#
# Contract (field report 2.2, 5, 6.5, 12): the job's exit code says what
# happened, with one meaning per code, so `sacct` State/ExitCode, the raw log,
# PY_EXIT and DSV4_VERDICT agree. The verdict word is never trusted alone:
# the token ids in the raw log are judged again (python -m dcu_kit.verdict
# rejudge).
#
# Exit codes (docs/validate-on-cluster.md has the same table; a test keeps
# them in step). Any code not listed is 128+N: the job shell was killed by
# signal N.
# shellcheck disable=SC2034  # the multi-node codes are used by its sbatch
{
KIT_RC_PASS=0          # workload exit 0, verdict COHERENT, token ids re-judged coherent
KIT_RC_WORKLOAD=1      # the workload raised (PROBE_FAILED_STAGE names the probe stage)
KIT_RC_DEGENERATE=2    # the probe / smoke test judged the output DEGENERATE
KIT_RC_REJUDGE=3       # exit 0, but the verdict word is not COHERENT or the re-judged token ids are degenerate
KIT_RC_NO_VERDICT=4    # exit 0, but the raw log has no verdict or no TOKEN_IDS behind it
KIT_RC_KIT_TOOL=5      # the kit's own re-judge could not run (KIT_PYTHON, PYTHONPATH)
KIT_RC_TOKENS=6        # tiny smoke: the greedy tokens differ from the corpus continuation (TINY_MISMATCH)
KIT_RC_USAGE=64        # a setting is missing or unusable: MODEL_PATH, TINY_MODEL_PATH (no corpus.json), KIT_ROOT, PROBE_ARGS quoting, a probe flag
KIT_RC_MODULE=65       # `module load $DTK_MODULES` failed
KIT_RC_VENV=66         # `source $KIT_VENV/bin/activate` failed
KIT_RC_NO_RAY=67       # multi-node: no `ray` command in the job's environment
KIT_RC_HEAD_IP=68      # multi-node: the head node's IP is empty (export HEAD_IP)
KIT_RC_SRUN=69         # multi-node: an srun step (Ray head or worker) exited while the job needed it
KIT_RC_RAY_WAIT=70     # multi-node: not all nodes/GPUs joined Ray before RAY_WAIT_TIMEOUT
KIT_RC_SERVE=71        # vllm serve exited or never answered (SERVE_SMOKE_ERROR)
KIT_RC_WORKLOAD_OTHER=72  # the workload exited with another code (< 128): PY_EXIT in the raw log has it
KIT_RC_LOG_DIR=73      # LOG_DIR cannot be created
KIT_RC_BENCH=74        # speed: vllm bench serve failed, or its result is no measurement (SPEED_VERDICT: INVALID)
KIT_RC_SIGNAL=75       # SIGTERM (time limit via --signal, or scancel): workload stopped, summary written
KIT_RC_KILLED=76       # the workload was killed by a signal (PY_EXIT >= 128: OOM killer, SIGKILL, segfault)
}
#
# Settings (environment, all optional except MODEL_PATH):
#   MODEL_PATH    model directory (required)
#   PYTHON        python that runs the workload (default: python); tests
#                 inject a fake one
#   KIT_PYTHON    python that runs the kit's own tools (rejudge,
#                 first_blocker, PROBE_ARGS parsing) (default: $PYTHON)
#   DRY_RUN=1     print the commands instead of running them
#   DTK_MODULES   modules to load (default seed 12.2:
#                 "compiler/gcc/12.2.0 compiler/dtk/26.04"); "" = none
#   DTK_ROOT      DTK install root: prepends gcvm/lib lib lib64 comgr/lib64
#                 to LD_LIBRARY_PATH (seed 12.2)
#   KIT_VENV      virtualenv to activate (the DTK torch venv the wheel was
#                 installed into); VLLM_ENV, its old name, is still read
#                 (deprecated) and unset: vLLM reserves the VLLM_ prefix
#   LOG_DIR       where raw logs go (default: $KIT_ROOT/logs)
#   MAX_MODEL_LEN KV_CACHE_DTYPE GPU_MEM_UTIL ENFORCE_EAGER=1: engine flags,
#                 passed only when set (default: the bare command's values)
#   MAX_TOKENS (32) PROMPT (any text, spaces and non-ASCII kept)
#   PROBE_ARGS    extra probe flags, split like a POSIX shell line
#                 (quotes keep spaces: PROBE_ARGS="--prompt '你好 世界'")
#   SPARSE_VALIDATE=1  export VLLM_GFX936_SPARSE_VALIDATE=1 (checks every
#                 Sparse MLA decode for non-finite values; slower)
#   KILL_GRACE    seconds between SIGTERM and SIGKILL of the workload (20)
# Site settings (the #SBATCH lines are defaults; override them on the sbatch
# command line, e.g. `sbatch --gres=gpu:8 --mem=500G --cpus-per-task=32`):
#   GRES_NAME (dcu) GPUS_PER_NODE (8): srun steps get --gres=GRES_NAME:GPUS_PER_NODE
#   CPUS_PER_TASK (SLURM_CPUS_PER_TASK, else 64): srun steps get --cpus-per-task
#   STEP_MEM      passed to srun steps as --mem when set (default: not passed)

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
        return "$KIT_RC_USAGE"
    fi
    # KIT_VENV was VLLM_ENV: vLLM reserves the VLLM_ prefix, and sbatch passes
    # the variable to the job, where `vllm serve` warns "Unknown vLLM
    # environment variable" (and --fail-on-environ-validation refuses it).
    # The old name is read once, then unset for everything the job starts.
    if [[ -n "${VLLM_ENV:-}" ]]; then
        KIT_VENV="${KIT_VENV:-$VLLM_ENV}"
        kit_log "WARNING: VLLM_ENV is deprecated (vLLM reserves VLLM_*); use" \
            "KIT_VENV. Taking KIT_VENV=$KIT_VENV" >&2
    fi
    unset VLLM_ENV
    PYTHON="${PYTHON:-python}"
    KIT_PYTHON="${KIT_PYTHON:-$PYTHON}"
    JOB_ID="${SLURM_JOB_ID:-local$$}"
    LOG_DIR="${LOG_DIR:-$KIT_ROOT/logs}"
    GRES_NAME="${GRES_NAME:-dcu}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
    CPUS_PER_TASK="${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-64}}"
    export PYTHONPATH="$KIT_ROOT/ci${PYTHONPATH:+:$PYTHONPATH}"
    # The server the jobs start listens on this node: a site http_proxy must
    # not carry 127.0.0.1 (serve_smoke, vllm bench serve) to the proxy host.
    NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
    no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
    export NO_PROXY no_proxy
    return 0
}

# kit_step_args -> the resource flags every srun step gets (bash array
# KIT_STEP_ARGS): Slurm >= 22.05 no longer hands --cpus-per-task to steps.
kit_step_args() {
    KIT_STEP_ARGS=(--gres="$GRES_NAME:$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_TASK")
    if [[ -n "${STEP_MEM:-}" ]]; then KIT_STEP_ARGS+=(--mem="$STEP_MEM"); fi
}

kit_load_env() {
    local modules="${DTK_MODULES-compiler/gcc/12.2.0 compiler/dtk/26.04}"
    if [[ -n "$modules" ]]; then
        # No `module purge`: it can unload the module that provides the
        # venv's Python (issue #17).
        if [[ "${DRY_RUN:-0}" == "1" ]]; then
            kit_log "DRY_RUN: module load $modules"
        elif command -v module >/dev/null 2>&1 || declare -F module >/dev/null; then
            # shellcheck disable=SC2086  # a list of module names
            module load $modules || return "$KIT_RC_MODULE"
        else
            kit_log "WARNING: 'module' not available; skipping: module load $modules"
        fi
    fi
    if [[ -n "${KIT_VENV:-}" ]]; then
        if [[ "${DRY_RUN:-0}" == "1" ]]; then
            kit_log "DRY_RUN: source $KIT_VENV/bin/activate"
        else
            # shellcheck disable=SC1091  # site path, not in the repo
            source "$KIT_VENV/bin/activate" || return "$KIT_RC_VENV"
        fi
    fi
    if [[ -n "${DTK_ROOT:-}" ]]; then
        export LD_LIBRARY_PATH="$DTK_ROOT/gcvm/lib:$DTK_ROOT/lib:$DTK_ROOT/lib64:$DTK_ROOT/comgr/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    # No run switches: the job runs what a user's bare `vllm serve` runs (the
    # gfx936 defaults live in the wheel). Export a variable before sbatch to
    # add one; sbatch passes the submitting environment on.
    if [[ "${SPARSE_VALIDATE:-0}" == "1" ]]; then
        export VLLM_GFX936_SPARSE_VALIDATE=1
    fi
    return 0
}

# kit_split_args STRING -> KIT_SPLIT (bash array), split like a POSIX shell
# line by Python's shlex (quotes keep spaces; nothing is executed).
kit_split_args() {
    KIT_SPLIT=()
    [[ -z "$1" ]] && return 0
    local tmp
    tmp="$(mktemp)" || return "$KIT_RC_LOG_DIR"
    if ! "$KIT_PYTHON" -c 'import shlex, sys
sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' "$1" >"$tmp"; then
        rm -f "$tmp"
        kit_log "ERROR: cannot split PROBE_ARGS=$1 (unbalanced quotes?)" >&2
        return "$KIT_RC_USAGE"
    fi
    mapfile -d '' -t KIT_SPLIT <"$tmp"
    rm -f "$tmp"
    return 0
}

# kit_verdict RAW -> the last verdict word in the raw log (COHERENT,
# DEGENERATE, ...), empty when there is none or RAW is missing.
kit_verdict() {
    grep -a -E '^(DSV4|SERVE_SMOKE|TINY_SMOKE|SPEED)_VERDICT:' "$1" 2>/dev/null | tail -n 1 | cut -d' ' -f2
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

# kit_reconcile RC RAW -> echo the job's exit code for a workload that exited
# with RC (see the table above): a 0 is re-judged from the token ids, a 2
# needs a DEGENERATE verdict in the log (else it was argparse: usage), other
# codes map to one meaning each.
kit_reconcile() {
    local rc="$1" raw="$2" verdict jrc out
    verdict="$(kit_verdict "$raw")"
    case "$rc" in
        0)
            out="$("$KIT_PYTHON" -m dcu_kit.verdict rejudge "$raw" 2>&1)"
            jrc=$?
            printf '%s\n' "$out" >>"$raw"
            # rc 0 alone is not enough: a python that is not the kit's
            # (a wrapper, a stub) must not turn into a PASS.
            if [[ "$jrc" == "0" && "$out" != *"REJUDGE_RESULT: COHERENT"* ]]; then
                jrc=5
            fi
            case "$jrc" in
                0) echo "$KIT_RC_PASS" ;;
                3) echo "$KIT_RC_REJUDGE" ;;
                4) echo "$KIT_RC_NO_VERDICT" ;;
                *) echo "$KIT_RC_KIT_TOOL" ;;
            esac ;;
        1) echo "$KIT_RC_WORKLOAD" ;;
        2)
            if [[ -n "$verdict" && "$verdict" != "COHERENT" ]]; then
                echo "$KIT_RC_DEGENERATE"
            else
                echo "$KIT_RC_USAGE"
            fi ;;
        *)
            if (( rc >= 128 )); then echo "$KIT_RC_KILLED"; else echo "$KIT_RC_WORKLOAD_OTHER"; fi ;;
    esac
}

# kit_finish NAME RC RAW [EXTRA_LOG] -> first_blocker on failure, summary.
kit_finish() {
    local name="$1" rc="$2" raw="$3" extra="${4:-}"
    grep -a -E '^(### STAGE|ENGINE_READY|TOKEN_IDS|FINISH_REASON|OUTPUT_REPR|DSV4_VERDICT|PROBE_FAILED_STAGE|REJUDGE|RAY_|SERVE_|CHAT_|STREAM_|KIT_|TINY_|SPEED_)' "$raw"
    if [[ "$rc" != "0" ]]; then
        kit_log "=== first_blocker $raw (job rc=$rc) ==="
        "$KIT_PYTHON" -m dcu_kit.first_blocker "$raw" --rc "$rc" ||
            true
        if [[ -n "$extra" && -f "$extra" ]]; then
            kit_log "=== first_blocker $extra ==="
            "$KIT_PYTHON" -m dcu_kit.first_blocker "$extra" --rc "$rc" || true
        fi
    fi
    kit_summary "$name" "$rc" "$raw"
}

# kit_watch_child PID -> wait for the workload; a SIGTERM to the job shell
# (time limit via --signal=B:TERM@..., scancel) runs kit_on_term at once.
KIT_CHILD=""
KIT_TERM_NAME=""
KIT_TERM_RAW=""
KIT_TERM_EXTRA=""
kit_on_term() {
    trap - TERM INT
    local raw="$KIT_TERM_RAW" pid="$KIT_CHILD"
    if [[ -n "$raw" ]]; then echo "KIT_SIGNAL=TERM" >>"$raw"; fi
    kit_log "KIT_SIGNAL=TERM: stopping the workload (time limit or scancel)"
    if [[ -n "$pid" ]]; then kit_stop_pid "$pid"; fi
    if declare -F kit_cleanup >/dev/null; then kit_cleanup; fi
    if [[ -n "$raw" ]]; then
        echo "PY_EXIT=$KIT_RC_SIGNAL" >>"$raw"
        kit_finish "$KIT_TERM_NAME" "$KIT_RC_SIGNAL" "$raw" "$KIT_TERM_EXTRA"
    fi
    exit "$KIT_RC_SIGNAL"
}
kit_trap_term() {  # NAME RAW [EXTRA_LOG]
    KIT_TERM_NAME="$1" KIT_TERM_RAW="$2" KIT_TERM_EXTRA="${3:-}"
    trap kit_on_term TERM INT
}

# kit_check_model [VAR] -> KIT_RC_USAGE naming what is missing unless $VAR
# (default MODEL_PATH) is a model folder (config.json and *.safetensors
# weights); dry runs too, so a typo shows before the job waits in the queue.
kit_check_model() {
    local var="${1:-MODEL_PATH}" m w
    m="${!var:-}"
    if [[ -z "$m" ]]; then
        kit_log "ERROR: $var is not set (export $var=/path/to/DeepSeek-V4-Flash)" >&2
        return "$KIT_RC_USAGE"
    fi
    if [[ ! -d "$m" ]]; then
        kit_log "ERROR: $var=$m: no such directory (on this node)" >&2
        return "$KIT_RC_USAGE"
    fi
    if [[ ! -f "$m/config.json" ]]; then
        kit_log "ERROR: $var=$m has no config.json: not a model folder" >&2
        return "$KIT_RC_USAGE"
    fi
    w="$(find "$m" -maxdepth 1 -name '*.safetensors' -print -quit 2>/dev/null)"
    if [[ -z "$w" ]]; then
        kit_log "ERROR: $var=$m has no *.safetensors weights (download incomplete?)" >&2
        return "$KIT_RC_USAGE"
    fi
    return 0
}

# kit_engine_args -> KIT_ENGINE_ARGS (bash array): the engine flags the user
# set (MAX_MODEL_LEN, KV_CACHE_DTYPE, GPU_MEM_UTIL, ENFORCE_EAGER=1); none by
# default, so the job runs the bare command.
kit_engine_args() {
    KIT_ENGINE_ARGS=()
    if [[ -n "${MAX_MODEL_LEN:-}" ]]; then KIT_ENGINE_ARGS+=(--max-model-len "$MAX_MODEL_LEN"); fi
    if [[ -n "${KV_CACHE_DTYPE:-}" ]]; then KIT_ENGINE_ARGS+=(--kv-cache-dtype "$KV_CACHE_DTYPE"); fi
    if [[ -n "${GPU_MEM_UTIL:-}" ]]; then KIT_ENGINE_ARGS+=(--gpu-memory-utilization "$GPU_MEM_UTIL"); fi
    if [[ "${ENFORCE_EAGER:-0}" == "1" ]]; then KIT_ENGINE_ARGS+=(--enforce-eager); fi
    return 0
}

# kit_single_node_job NAME TP : run the probe, save the raw log, summarize.
kit_single_node_job() {
    local name="$1" tp="$2" raw rc
    kit_check_model MODEL_PATH || return $?
    kit_load_env || return $?
    raw="$LOG_DIR/${name}-${JOB_ID}.raw.log"
    local -a probe=("$PYTHON" -m dcu_kit.probe
        --model "$MODEL_PATH" --tp "$tp"
        --max-tokens "${MAX_TOKENS:-32}"
        --json-out "${raw%.raw.log}.json")
    kit_engine_args
    probe+=("${KIT_ENGINE_ARGS[@]}")
    if [[ -n "${PROMPT:-}" ]]; then probe+=(--prompt "$PROMPT"); fi
    if [[ -n "${PROBE_ARGS:-}" ]]; then
        kit_split_args "$PROBE_ARGS" || return $?
        probe+=("${KIT_SPLIT[@]}")
    fi
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        kit_run "${probe[@]}"
        kit_log "DRY_RUN: raw log would be $raw"
        kit_log "DCU_KIT_SUMMARY job=$JOB_ID name=$name rc=0 verdict=DRY_RUN engine_ready=- result=DRY_RUN log=$raw"
        return 0
    fi
    mkdir -p "$LOG_DIR" || return "$KIT_RC_LOG_DIR"
    kit_log "RAW_LOG=$raw"
    : >"$raw" || return "$KIT_RC_LOG_DIR"
    kit_trap_term "$name" "$raw"
    "${probe[@]}" >>"$raw" 2>&1 &
    KIT_CHILD=$!
    wait "$KIT_CHILD"
    rc=$?
    trap - TERM INT
    echo "PY_EXIT=$rc" >>"$raw"
    kit_log "PY_EXIT=$rc"
    rc="$(kit_reconcile "$rc" "$raw")"
    kit_finish "$name" "$rc" "$raw"
    return "$rc"
}

# ------------------------------------------------------------ vllm serve jobs
# The real, bare `vllm serve` (single node: dsv4_serve, dsv4_bench_serve) and
# the OpenAI API smoke test against it (also used by dsv4_multinode_ray).

# kit_serve_cmd TP -> KIT_SERVE (bash array): `vllm serve MODEL_PATH
# --tensor-parallel-size TP` on SERVE_PORT as model "dsv4", plus only the
# engine flags the user set (kit_engine_args).
kit_serve_cmd() {
    SERVE_PORT="${SERVE_PORT:-8000}"
    KIT_SERVE=(vllm serve "$MODEL_PATH" --tensor-parallel-size "$1"
        --port "$SERVE_PORT" --served-model-name dsv4)
    kit_engine_args
    KIT_SERVE+=("${KIT_ENGINE_ARGS[@]}")
}

# kit_smoke_cmd -> KIT_SMOKE (bash array): dcu_kit.serve_smoke against
# SERVE_PORT (chat + streaming, judged by token ids). Add --serve-pid.
kit_smoke_cmd() {
    SERVE_PORT="${SERVE_PORT:-8000}"
    KIT_SMOKE=("$PYTHON" -m dcu_kit.serve_smoke
        --base-url "http://127.0.0.1:$SERVE_PORT" --model dsv4
        --max-tokens "${MAX_TOKENS:-32}" --wait "${SERVE_WAIT:-3600}")
    if [[ -n "${PROMPT:-}" ]]; then KIT_SMOKE+=(--prompt "$PROMPT"); fi
    if [[ -n "${EOS_IDS:-}" ]]; then KIT_SMOKE+=(--eos-ids "$EOS_IDS"); fi
    if [[ -n "${SPECIAL_IDS:-}" ]]; then
        KIT_SMOKE+=(--special-ids "$SPECIAL_IDS")
    else
        KIT_SMOKE+=(--tokenizer "$MODEL_PATH")
    fi
}

# kit_serve_start LOG [ENV=VALUE...] -> start KIT_SERVE in the background
# (through `env` with the given variables), output to LOG; KIT_SERVE_PID.
KIT_SERVE_PID=""
kit_serve_start() {
    local log="$1"
    shift
    env "$@" "${KIT_SERVE[@]}" >>"$log" 2>&1 &
    KIT_SERVE_PID=$!
}

# SIGTERM to pid, SIGKILL after KILL_GRACE seconds (default 20) if it is still alive.
kit_stop_pid() {
    local pid="$1" i
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < ${KILL_GRACE:-20}; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    kill -KILL "$pid" 2>/dev/null
}

# kit_serve_stop -> SIGTERM the server (vLLM shuts its engine processes
# down), SIGKILL after KILL_GRACE seconds.
kit_serve_stop() {
    local pid="$KIT_SERVE_PID"
    [[ -z "$pid" ]] && return 0
    kit_stop_pid "$pid"
    wait "$pid" 2>/dev/null
    KIT_SERVE_PID=""
    return 0
}

# kit_smoke_rc RC RAW -> the job's code for a serve_smoke exit: 3 (server
# gone or unreachable) is KIT_RC_SERVE, the rest as kit_reconcile.
kit_smoke_rc() {
    if [[ "$1" == "3" ]]; then echo "$KIT_RC_SERVE"; else kit_reconcile "$1" "$2"; fi
}
