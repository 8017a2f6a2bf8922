# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slurm job scripts: syntax, shellcheck, dry run, and exit-code honesty.

Regression for seed 2.2/6.5: a job must not say COMPLETED when the Python
workload failed or produced a degenerate verdict. Each job is run with
``bash`` (not sbatch) and a fake ``PYTHON`` injected through the environment.
"""

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

SLURM = REPO_ROOT / "ci" / "slurm"
JOBS = ["dsv4_tp8.sbatch", "dsv4_tp4.sbatch", "dsv4_multinode_ray.sbatch",
        "dsv4_serve.sbatch", "dsv4_bench_serve.sbatch", "dsv4_tiny_smoke.sbatch"]
SINGLE = {"dsv4_tp8.sbatch": "8", "dsv4_tp4.sbatch": "4"}


def _model(tmp_path):
    """A folder the jobs accept as a model: config.json and a weights file."""
    m = tmp_path / "DeepSeek-V4-Flash"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text('{"model_type": "deepseek_v4"}')
    (m / "model-00001-of-00001.safetensors").write_bytes(b"")
    return m


# What the jobs exported before issue #17; a bare `vllm serve` has none of them.
SEED_RUN_SWITCHES = ("VLLM_WORKER_MULTIPROC_METHOD", "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER",
                     "VLLM_ROCM_USE_SKINNY_GEMM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                     "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in SEED_RUN_SWITCHES}
    env.update(KIT_ROOT=str(REPO_ROOT), LOG_DIR=str(tmp_path / "logs"),
               MODEL_PATH=str(_model(tmp_path)), DTK_MODULES="",
               KIT_PYTHON=sys.executable)
    env.pop("DRY_RUN", None)
    env.update(extra)
    return env


def _run(job, env):
    return subprocess.run(["bash", str(SLURM / job)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def _fake_python(tmp_path, body):
    p = tmp_path / "fakepython"
    p.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    p.chmod(0o755)
    return str(p)


@pytest.mark.parametrize("job", JOBS + ["common.sh"])
def test_scripts_parse_with_bash_n(job):
    r = subprocess.run(["bash", "-n", str(SLURM / job)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    r = subprocess.run(["shellcheck", "-x", *(f"ci/slurm/{j}" for j in JOBS),
                        "ci/slurm/common.sh"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("job", list(SINGLE))
def test_single_node_dry_run_prints_module_loads_and_probe(job, tmp_path):
    env = _env(tmp_path, DRY_RUN="1",
               DTK_MODULES="compiler/gcc/12.2.0 compiler/dtk/26.04")
    r = _run(job, env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "DRY_RUN: module load compiler/gcc/12.2.0 compiler/dtk/26.04" in out
    probe = [ln for ln in out.splitlines() if "dcu_kit.probe" in ln]
    assert len(probe) == 1
    assert f"--tp {SINGLE[job]}" in probe[0]
    assert f"--model {tmp_path}/DeepSeek-V4-Flash" in probe[0]
    # the bare command: no engine flag the user did not set
    for flag in ("--kv-cache-dtype", "--enforce-eager", "--trust-remote-code",
                 "--max-model-len", "--gpu-memory-utilization"):
        assert flag not in probe[0], flag
    assert "result=DRY_RUN" in out
    assert not (tmp_path / "logs").exists()  # nothing ran


def test_multinode_dry_run_prints_ray_head_workers_serve_and_smoke(tmp_path):
    env = _env(tmp_path, DRY_RUN="1", NODELIST="n01,n02,n03", HEAD_IP="10.0.0.1")
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = [ln for ln in lines if "ray_cluster head" in ln]
    workers = [ln for ln in lines if "ray_cluster worker" in ln]
    assert len(head) == 1 and "-w n01" in head[0] and "--num-gpus 8" in head[0]
    assert len(workers) == 2 and {w.split("-w ")[1].split()[0]
                                  for w in workers} == {"n02", "n03"}
    assert all("--address 10.0.0.1:6379" in w for w in workers)
    assert any("ray_cluster wait" in ln and "--nodes 3 --gpus 24" in ln
               for ln in lines)
    assert any("ray_cluster serve" in ln and "--nodes 3" in ln for ln in lines)
    assert any("dcu_kit.serve_smoke" in ln for ln in lines)


@pytest.mark.parametrize("job", list(SINGLE))
def test_fake_python_exit_2_makes_the_job_exit_2(job, tmp_path):
    fake = _fake_python(tmp_path, """\
        echo "### STAGE: generate"
        echo "TOKEN_IDS: [32, 0, 0]"
        echo "DSV4_VERDICT: DEGENERATE (no_special_tokens)"
        exit 2
        """)
    r = _run(job, _env(tmp_path, PYTHON=fake))
    assert r.returncode == 2, r.stdout + r.stderr
    summary = [ln for ln in r.stdout.splitlines()
               if ln.startswith("DCU_KIT_SUMMARY")]
    assert len(summary) == 1
    assert "rc=2" in summary[0] and "result=FAIL" in summary[0]
    assert "verdict=DEGENERATE" in summary[0]
    raw = next((tmp_path / "logs").glob("*.raw.log")).read_text()
    assert "PY_EXIT=2" in raw and "TOKEN_IDS: [32, 0, 0]" in raw


J17 = ("[223, 30594, 9790, 303, 70037, 12203, 10706, 804, 1175, 10539, 637, "
       "53897, 96240, 2996, 84998, 666, 3118, 637, 58368, 621, 666, 1158, "
       "53091, 4374, 1465, 223, 1959, 17585, 42108, 303, 56463, 10162]")
J08 = "[32" + ", 0" * 31 + "]"
VIN = '{"eos_ids": [1], "requested_max_tokens": 32, "special_ids": [0, 1]}'


def _probe_body(ids, word, rc=0, extra=""):
    return f"""\
        echo "### STAGE: generate"
        echo "ENGINE_READY in 228.9s"
        echo "TOKEN_IDS: {ids}"
        echo 'VERDICT_INPUT: {VIN}'
        echo "DSV4_VERDICT: {word}"
        {extra}
        exit {rc}
        """


def _summary(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("DCU_KIT_SUMMARY")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_exit_zero_with_degenerate_verdict_still_fails_the_job(tmp_path):
    """The J08 false green at job level: Python exits 0, verdict is not
    COHERENT -> the job must not COMPLETE."""
    fake = _fake_python(tmp_path, _probe_body(J17, "DEGENERATE (identical_run)"))
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 3
    assert "rc=3" in r.stdout and "result=FAIL" in r.stdout


def test_exit_zero_without_any_verdict_fails_the_job(tmp_path):
    fake = _fake_python(tmp_path, "echo hello\nexit 0\n")
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 4 and "verdict=MISSING" in r.stdout


def test_coherent_run_exits_zero_and_reports_engine_ready(tmp_path):
    fake = _fake_python(tmp_path, _probe_body(J17, "COHERENT"))
    r = _run("dsv4_tp4.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engine_ready=228.9s" in r.stdout and "result=PASS" in r.stdout


def test_missing_model_path_is_a_clear_error(tmp_path):
    env = _env(tmp_path)
    env.pop("MODEL_PATH")
    r = _run("dsv4_tp8.sbatch", env)
    assert r.returncode == 64 and "MODEL_PATH is not set" in r.stderr


def test_multinode_without_a_head_ip_stops_before_starting_ray(tmp_path):
    """`srun ... hostname -I` printing nothing must stop the job at once: the
    workers would otherwise dial ':6379' until RAY_WAIT_TIMEOUT ran out."""
    srun = tmp_path / "fakesrun"
    srun.write_text("#!/bin/bash\necho \"$*\" >>\"$(dirname \"$0\")/srun.calls\"\n")
    srun.chmod(0o755)
    fake = _fake_python(tmp_path, "echo \"python $*\" >>\"$(dirname \"$0\")/py.calls\"\n")
    env = _env(tmp_path, NODELIST="n01,n02", SRUN=str(srun), PYTHON=fake)
    env.pop("HEAD_IP", None)
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert r.returncode == 68, r.stdout + r.stderr
    assert "cannot tell the IP of head node n01" in r.stderr
    calls = (tmp_path / "srun.calls").read_text().splitlines()
    assert len(calls) == 1 and "hostname -I" in calls[0]  # no ray start
    assert not (tmp_path / "py.calls").exists()


# ---------------------------------------------------------------------------
# Issue #11: never a false green, one meaning per exit code.

def test_coherent_word_beside_degenerate_ids_fails_the_job(tmp_path):
    """kit_reconcile re-judges TOKEN_IDS: a COHERENT line next to J08's ids
    (a stale judge, a hand-edited log) is rc 3, not a PASS."""
    fake = _fake_python(tmp_path, _probe_body(J08, "COHERENT"))
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 3, r.stdout + r.stderr
    raw = next((tmp_path / "logs").glob("*.raw.log")).read_text()
    assert "REJUDGE_RESULT: DEGENERATE" in raw
    assert "FIRST_BLOCKER:" in r.stdout and "FIRST_BLOCKER: none" not in r.stdout


def test_a_kit_python_that_is_not_the_kit_cannot_pass(tmp_path):
    fake = _fake_python(tmp_path, _probe_body(J17, "COHERENT"))
    stub = tmp_path / "stub"
    stub.write_text("#!/bin/bash\nexit 0\n")
    stub.chmod(0o755)
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake, KIT_PYTHON=str(stub)))
    assert r.returncode == 5, r.stdout + r.stderr


@pytest.mark.parametrize("body,want", [
    ("echo 'usage: python -m dcu_kit.probe'; exit 2", 64),   # argparse, no verdict
    ("echo '### STAGE: generate'; exit 137", 76),            # SIGKILL / OOM
    ("echo '### STAGE: generate'; exit 7", 72),
    ("exit 1", 1),
])
def test_workload_codes_map_to_one_meaning_each(tmp_path, body, want):
    fake = _fake_python(tmp_path, body + "\n")
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == want, r.stdout + r.stderr
    assert f"rc={want} " in _summary(r.stdout)
    assert "FIRST_BLOCKER: none" not in r.stdout
    assert "FIRST_BLOCKER:" in r.stdout


def test_empty_workload_log_is_named_by_first_blocker(tmp_path):
    fake = _fake_python(tmp_path, "exit 1\n")
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    raw = next((tmp_path / "logs").glob("*.raw.log")).read_text()
    assert raw.startswith("PY_EXIT=1")
    assert "FIRST_BLOCKER: nonzero_exit" in r.stdout
    assert "before any probe stage" in r.stdout


def _argv_recorder(tmp_path):
    """A fake python that writes its argv (NUL separated) and env, then
    prints a coherent run, so the job passes."""
    return _fake_python(tmp_path, f"""\\
        printf '%s\\0' "$@" >"$(dirname "$0")/argv"
        echo "SPARSE=${{VLLM_GFX936_SPARSE_VALIDATE:-unset}}" >"$(dirname "$0")/env"
        """ + textwrap.dedent(_probe_body(J17, "COHERENT")))


def _venv(tmp_path, name):
    """A folder whose bin/activate marks the environment with its own path."""
    v = tmp_path / name
    (v / "bin").mkdir(parents=True)
    (v / "bin" / "activate").write_text(f"export KIT_TEST_ACTIVATED={v}\n")
    return str(v)


@pytest.mark.parametrize("given,want", [
    ({"KIT_VENV": "a"}, "a"),
    ({"VLLM_ENV": "a"}, "a"),                  # the deprecated name still works
    ({"KIT_VENV": "a", "VLLM_ENV": "b"}, "a"),  # the new name wins
])
def test_kit_venv_is_activated_and_vllm_env_never_reaches_vllm(tmp_path, given, want):
    """The venv setting is KIT_VENV: VLLM_ENV (its old name) sits in vLLM's reserved VLLM_
    prefix, so `vllm serve` warned "Unknown vLLM environment variable" and refused it with
    --fail-on-environ-validation. The old name is read once and unset before the workload."""
    fake = _fake_python(tmp_path, """\
        echo "ACT=${KIT_TEST_ACTIVATED:-none} OLD=${VLLM_ENV-unset}" >"$(dirname "$0")/env"
        """ + textwrap.dedent(_probe_body(J17, "COHERENT")))
    venvs = {name: _venv(tmp_path, name) for name in ("a", "b")}
    env = _env(tmp_path, PYTHON=fake, **{k: venvs[v] for k, v in given.items()})
    r = _run("dsv4_tp8.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "env").read_text().split() == [f"ACT={venvs[want]}", "OLD=unset"]
    assert ("VLLM_ENV is deprecated" in r.stderr) == ("VLLM_ENV" in given), r.stderr


def test_no_job_or_guide_tells_users_to_set_vllm_env():
    texts = {p.name: p.read_text() for p in SLURM.iterdir() if p.suffix in (".sh", ".sbatch")}
    for doc in ("README.md", "docs/validate-on-cluster.md"):
        texts[doc] = (REPO_ROOT / doc).read_text()
    for name, t in texts.items():
        assert not re.search(r"\bVLLM_ENV=", t), name


def test_jobs_keep_loopback_off_the_site_proxy(tmp_path):
    """Regression (issue #17 review, item 12): a site http_proxy sent the jobs' local checks
    (serve_smoke, vllm bench serve against 127.0.0.1) to the proxy. kit_init adds 127.0.0.1 and
    localhost to NO_PROXY/no_proxy, keeping what the site had."""
    fake = _fake_python(tmp_path, """\
        echo "NP=$NO_PROXY np=$no_proxy" >"$(dirname "$0")/env"
        """ + textwrap.dedent(_probe_body(J17, "COHERENT")))
    env = _env(tmp_path, PYTHON=fake, http_proxy="http://proxy.site:3128",
               NO_PROXY="intranet.site")
    env.pop("no_proxy", None)
    r = _run("dsv4_tp8.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    got = (tmp_path / "env").read_text().split()
    assert got[0] == "NP=127.0.0.1,localhost,intranet.site", got
    assert got[1] == "np=127.0.0.1,localhost", got


def test_probe_args_and_prompt_keep_spaces_and_non_ascii(tmp_path):
    fake = _argv_recorder(tmp_path)
    env = _env(tmp_path, PYTHON=fake, PROMPT="你好，请 介绍一下 你自己。",
               PROBE_ARGS="--history '[{\"role\": \"user\", \"content\": \"第一 轮\"}]'"
                          " --engine-arg 'max_num_seqs=4' --moe-backend emulation",
               SPARSE_VALIDATE="1")
    r = _run("dsv4_tp8.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = (tmp_path / "argv").read_bytes().decode().split("\0")[:-1]
    assert argv[argv.index("--prompt") + 1] == "你好，请 介绍一下 你自己。"
    assert argv[argv.index("--history") + 1] == \
        '[{"role": "user", "content": "第一 轮"}]'
    assert argv[argv.index("--engine-arg") + 1] == "max_num_seqs=4"
    assert argv[-2:] == ["--moe-backend", "emulation"]
    assert (tmp_path / "env").read_text().strip() == "SPARSE=1"


def test_unbalanced_probe_args_are_a_usage_error(tmp_path):
    fake = _argv_recorder(tmp_path)
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake,
                                     PROBE_ARGS="--prompt 'unterminated"))
    assert r.returncode == 64 and "PROBE_ARGS" in r.stderr
    assert not (tmp_path / "argv").exists()


def test_sigterm_stops_the_probe_and_still_writes_the_summary(tmp_path):
    """Slurm's time limit (--signal=B:TERM@120) or scancel: the trap stops
    the workload, appends PY_EXIT, runs first_blocker and exits 75."""
    fake = _fake_python(tmp_path, """\
        echo "### STAGE: engine init (the real test)"
        exec sleep 60
        """)
    env = _env(tmp_path, PYTHON=fake, KILL_GRACE="2")
    p = subprocess.Popen(["bash", str(SLURM / "dsv4_tp8.sbatch")], env=env,
                         cwd=REPO_ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "logs"
    deadline = time.time() + 30
    while time.time() < deadline:
        raws = list(logs.glob("*.raw.log")) if logs.exists() else []
        if raws and "STAGE" in raws[0].read_text():
            break
        time.sleep(0.1)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert time.time() - t0 < 15  # not the 60 s of the workload
    assert p.returncode == 75, out + err
    raw = raws[0].read_text()
    assert "KIT_SIGNAL=TERM" in raw and "PY_EXIT=75" in raw
    assert "FIRST_BLOCKER: signal" in out
    assert "'engine init (the real test)'" in out
    assert "rc=75 " in _summary(out)


def test_single_node_jobs_ask_slurm_for_a_signal_before_the_time_limit():
    for job in SINGLE:
        text = (SLURM / job).read_text()
        assert re.search(r"^#SBATCH --signal=B:TERM@\d+", text, re.M), job
    for job in JOBS:
        assert re.search(r"^#SBATCH --signal=B:TERM@\d+", (SLURM / job).read_text(), re.M), job


# ------------------------------------------------------------ multi-node

def _bin(tmp_path, name, body):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    p.chmod(0o755)
    return p


def _multinode_env(tmp_path, srun_body, python_body, with_ray=True):
    srun = _bin(tmp_path, "srun", srun_body)
    py = _bin(tmp_path, "python", python_body)
    if with_ray:
        _bin(tmp_path, "ray", "exit 0\n")
    env = _env(tmp_path, NODELIST="n01,n02", HEAD_IP="10.0.0.1",
               SRUN=str(srun), PYTHON=str(py), RAY_START_WAIT="0",
               WATCH_INTERVAL="0.2")
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    return env


SMOKE_OK = f"""\
    echo "CHAT_TOKEN_IDS: {J17}"
    echo 'CHAT_VERDICT_INPUT: {VIN}'
    echo "SERVE_SMOKE_VERDICT: COHERENT"
    exit 0
"""


def _py_dispatch(wait="exit 0", serve="exec sleep 30", smoke=SMOKE_OK):
    return f"""\
        case "$*" in
          *"ray_cluster wait"*) {wait} ;;
          *"ray_cluster serve"*) {serve} ;;
          *serve_smoke*)
{textwrap.indent(textwrap.dedent(smoke), "            ")}
            ;;
        esac
        """


def test_multinode_passes_and_gives_steps_gres_and_cpus(tmp_path):
    env = _multinode_env(tmp_path, """\
        echo "$*" >>"$(dirname "$0")/srun.calls"
        echo "ray start: node up"
        exec sleep 30
        """, _py_dispatch())
    env["CPUS_PER_TASK"] = "32"
    env["GRES_NAME"] = "gpu"
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "srun.calls").read_text().splitlines()
    assert len(calls) == 2
    assert all("--gres=gpu:8" in c and "--cpus-per-task=32" in c for c in calls)
    raw = next((tmp_path / "logs").glob("*.raw.log")).read_text()
    assert "ray start: node up" in raw  # srun output kept in the raw log
    assert "REJUDGE_RESULT: COHERENT" in raw


def test_multinode_notices_a_failed_srun_step_at_once(tmp_path):
    env = _multinode_env(tmp_path, """\
        case "$*" in
          *" worker "*) echo "worker: ray start failed: connection refused" >&2
                        exit 1 ;;
          *) exec sleep 30 ;;
        esac
        """, _py_dispatch(wait="exec sleep 30"))
    t0 = time.time()
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert time.time() - t0 < 20
    assert r.returncode == 69, r.stdout + r.stderr
    raw = next((tmp_path / "logs").glob("*.raw.log")).read_text()
    assert "connection refused" in raw
    assert "RAY_STEP_EXITED: the srun step on n02 rc=1" in raw
    assert "FIRST_BLOCKER:" in r.stdout and "FIRST_BLOCKER: none" not in r.stdout
    assert "rc=69 " in _summary(r.stdout)


def test_multinode_without_ray_stops_before_any_step(tmp_path):
    env = _multinode_env(tmp_path, 'echo "$*" >>"$(dirname "$0")/srun.calls"\n',
                         _py_dispatch(), with_ray=False)
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert r.returncode == 67 and "no 'ray' command" in r.stderr
    assert not (tmp_path / "bin" / "srun.calls").exists()


@pytest.mark.parametrize("wait,smoke,want", [
    ("echo 'RAY_CLUSTER_ERROR: 1/2 nodes'; exit 2", SMOKE_OK, 70),
    ("exit 0", "echo 'SERVE_SMOKE_ERROR: vllm serve exited (rc 1)'; exit 3", 71),
    ("exit 0", f"""\
        echo "CHAT_TOKEN_IDS: {J08}"
        echo 'CHAT_VERDICT_INPUT: {VIN}'
        echo "SERVE_SMOKE_VERDICT: COHERENT"
        exit 0
     """, 3),
])
def test_multinode_failures_have_distinct_codes(tmp_path, wait, smoke, want):
    env = _multinode_env(tmp_path, "exec sleep 30\n",
                         _py_dispatch(wait=wait, smoke=smoke))
    r = _run("dsv4_multinode_ray.sbatch", env)
    assert r.returncode == want, r.stdout + r.stderr
    assert f"rc={want} " in _summary(r.stdout)


# ----------------------------------------------- the guide's exit-code table

def _code_table():
    text = (SLURM / "common.sh").read_text()
    return {int(v): (k, why) for k, v, why in re.findall(
        r"^(KIT_RC_\w+)=(\d+)\s+# (.*)$", text, re.M)}


def test_exit_codes_have_one_meaning_each():
    text = (SLURM / "common.sh").read_text()
    names = re.findall(r"^(KIT_RC_\w+)=(\d+)", text, re.M)
    codes = [int(v) for _, v in names]
    assert len(codes) == len(set(codes)), names
    assert len(_code_table()) == len(names)


def test_guide_exit_code_table_matches_the_code():
    guide = (REPO_ROOT / "docs" / "validate-on-cluster.md").read_text()
    section = guide.split("<!-- exit-codes:begin -->")[1].split(
        "<!-- exit-codes:end -->")[0]
    rows = re.findall(r"^\| `(\d+)` \| `(KIT_RC_\w+)` \|", section, re.M)
    assert rows, "no exit-code table in the guide"
    assert {int(c): n for c, n in rows} == {
        c: n for c, (n, _) in _code_table().items()}


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("layout,want", [
    ("missing", "no such directory"), ("no-config", "has no config.json"),
    ("no-weights", "has no *.safetensors weights")])
def test_dry_run_names_what_the_model_folder_lacks(job, tmp_path, layout, want):
    """Issue #17: DRY_RUN=1 passed with a model path that does not exist."""
    env = _env(tmp_path, DRY_RUN="1", NODELIST="n01,n02", HEAD_IP="10.0.0.1")
    var = "TINY_MODEL_PATH" if job == "dsv4_tiny_smoke.sbatch" else "MODEL_PATH"
    env[var] = env["MODEL_PATH"]
    m = pathlib.Path(env[var])
    if layout == "missing":
        m = tmp_path / "nope"
        env[var] = str(m)
    elif layout == "no-config":
        (m / "config.json").unlink()
    else:
        (m / "model-00001-of-00001.safetensors").unlink()
    r = _run(job, env)
    assert r.returncode == 64 and f"{var}={m}" in r.stderr and want in r.stderr
    good = tmp_path / "good"
    good.mkdir()
    ok = _run(job, _env(good, DRY_RUN="1", NODELIST="n01,n02", HEAD_IP="10.0.0.1"))
    assert ok.returncode == 0, ok.stderr


def test_single_node_job_runs_the_workload_with_no_run_switches(tmp_path):
    """Issue #17: the jobs exported 7 variables the bare command does not have, so a green
    job did not prove the bare command. The workload's environment is dumped and read."""
    dump = tmp_path / "env.txt"
    fake = _fake_python(tmp_path, f"""
        env > {dump}
        printf '%s\\n' "$*" >> {dump}.args
        exit 1
        """)
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 1, r.stdout + r.stderr
    names = {ln.split("=", 1)[0] for ln in dump.read_text().splitlines() if "=" in ln}
    assert not names & set(SEED_RUN_SWITCHES), names & set(SEED_RUN_SWITCHES)
    args = (tmp_path / "env.txt.args").read_text()
    assert "--kv-cache-dtype" not in args and "--enforce-eager" not in args
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake, KV_CACHE_DTYPE="fp8",
                                     ENFORCE_EAGER="1", MAX_MODEL_LEN="8192"))
    args = (tmp_path / "env.txt.args").read_text().splitlines()[-1]
    assert "--kv-cache-dtype fp8" in args and "--enforce-eager" in args
    assert "--max-model-len 8192" in args


# ------------------------------------- single-node `vllm serve` jobs (issue #17)
# A fake `vllm` on PATH stands in for the server and the benchmark; a fake PYTHON for the
# smoke test; KIT_PYTHON is the real interpreter, so dcu_kit.speed and the re-judge run for real.

def _bench_json(failed=0):
    """What `vllm bench serve --save-result` writes (the keys of vLLM 0.27.1's serve.py)."""
    import json
    r = {"duration": 10.0, "completed": 8 - failed, "failed": failed,
         "total_input_tokens": 8 * 64, "total_output_tokens": (8 - failed) * 16,
         "request_throughput": 0.8, "output_throughput": 12.8, "total_token_throughput": 64.0,
         "errors": [""] * (8 - failed) + ["boom"] * failed}
    for m, base in (("ttft", 200.0), ("tpot", 20.0), ("itl", 21.0), ("e2el", 500.0)):
        r.update({f"mean_{m}_ms": base, f"median_{m}_ms": base, f"std_{m}_ms": 1.0,
                  f"p50_{m}_ms": base, f"p90_{m}_ms": base * 1.5, f"p99_{m}_ms": base * 2})
    return json.dumps(r)


def _serve_env(tmp_path, smoke=SMOKE_OK, bench_failed=0, serve="exec sleep 30", bench_rc=0):
    """PATH with a fake `vllm` (serve: records argv and the GFX936 switches, then runs
    `serve`; bench serve: writes a result JSON that is 1.5x slower under the kernels-off
    switches) and a fake python for dcu_kit.serve_smoke."""
    d = tmp_path / "bin"
    _bin(tmp_path, "vllm", f"""\
        here="$(dirname "$0")"
        if [[ "$1" == serve ]]; then
            echo "$* W8A16=${{VLLM_GFX936_W8A16_IMPL:-unset}} MOE=${{VLLM_GFX936_MXFP4_MOE_IMPL:-unset}} SPARSE=${{VLLM_GFX936_SPARSE_DECODE:-unset}} GRAPH=${{VLLM_GFX936_GRAPH_MODE:-unset}} GEMV=${{VLLM_GFX936_W8A16_GEMV_MAX_M:-unset}} MOE_DIRECT=${{VLLM_GFX936_MOE_DIRECT_MAX_M:-unset}}" >>"$here/serve.calls"
            if [[ "${{VLLM_GFX936_GRAPH_MODE:-}}" == full_decode && -z "${{FAKE_NO_GRAPH:-}}" ]]; then
                echo "INFO gfx936: stable defaults applied: graph mode full_decode (decode steps as one graph, no torch.compile)"
            fi
            {serve}
        fi
        echo "$*" >>"$here/bench.calls"
        args=("$@")
        for ((i = 0; i < $#; i++)); do
            case "${{args[$i]}}" in
                --result-dir) dir="${{args[$((i + 1))]}}" ;;
                --result-filename) file="${{args[$((i + 1))]}}" ;;
            esac
        done
        mkdir -p "$dir"
        if [[ "$file" == *kernels-off* ]]; then
            sed -e 's/"output_throughput": 12.8/"output_throughput": 8.0/' \\
                -e 's/"p50_tpot_ms": 20.0/"p50_tpot_ms": 30.0/' "$here/bench.json" >"$dir/$file"
        elif [[ "$file" == *kernels-graph* ]]; then
            sed -e 's/"output_throughput": 12.8/"output_throughput": 19.2/' \\
                -e 's/"p50_tpot_ms": 20.0/"p50_tpot_ms": 12.5/' "$here/bench.json" >"$dir/$file"
        elif [[ "$file" == *kernels-gemv* ]]; then
            sed -e 's/"output_throughput": 12.8/"output_throughput": 16.0/' \\
                -e 's/"p50_tpot_ms": 20.0/"p50_tpot_ms": 16.0/' "$here/bench.json" >"$dir/$file"
        elif [[ "$file" == *kernels-moe-direct* ]]; then
            sed -e 's/"output_throughput": 12.8/"output_throughput": 10.24/' \\
                -e 's/"p50_tpot_ms": 20.0/"p50_tpot_ms": 25.0/' "$here/bench.json" >"$dir/$file"
        elif [[ "$file" == *kernels-mtp* ]]; then
            sed -e 's/"output_throughput": 12.8/"output_throughput": 25.6/' \\
                -e 's/"p50_tpot_ms": 20.0/"p50_tpot_ms": 10.0/' "$here/bench.json" >"$dir/$file"
        else
            cp "$here/bench.json" "$dir/$file"
        fi
        exit {bench_rc}
        """)
    (d / "bench.json").write_text(_bench_json(bench_failed))
    py = _bin(tmp_path, "python", f"""\
        case "$*" in
          *serve_smoke*)
{textwrap.indent(textwrap.dedent(smoke), "            ")}
            ;;
        esac
        exit 9
        """)
    env = _env(tmp_path, PYTHON=str(py), KILL_GRACE="2")
    env["PATH"] = f"{d}:/usr/bin:/bin"
    return env


def test_serve_job_runs_the_bare_vllm_serve_and_passes_on_a_coherent_smoke(tmp_path):
    r = _run("dsv4_serve.sbatch", _serve_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert len(calls) == 1
    assert calls[0].startswith(f"serve {tmp_path}/DeepSeek-V4-Flash --tensor-parallel-size 8 ")
    for flag in ("--kv-cache-dtype", "--enforce-eager", "--trust-remote-code", "--max-model-len"):
        assert flag not in calls[0]
    raw = next((tmp_path / "logs").glob("dsv4-serve-*.raw.log")).read_text()
    assert "REJUDGE_RESULT: COHERENT" in raw
    assert "result=PASS" in _summary(r.stdout)


@pytest.mark.parametrize("serve,smoke,want", [
    ("exec sleep 30", f"""\
        echo "CHAT_TOKEN_IDS: {J08}"
        echo 'CHAT_VERDICT_INPUT: {VIN}'
        echo "SERVE_SMOKE_VERDICT: COHERENT"
        exit 0
     """, 3),                                                           # degenerate ids re-judged
    ("echo 'Traceback: engine died' >&2; exit 1",
     "echo 'SERVE_SMOKE_ERROR: the server process exited'; exit 3", 71),  # server gone
])
def test_serve_job_fails_on_a_bad_server(tmp_path, serve, smoke, want):
    r = _run("dsv4_serve.sbatch", _serve_env(tmp_path, smoke=smoke, serve=serve))
    assert r.returncode == want, r.stdout + r.stderr
    assert f"rc={want} " in _summary(r.stdout)


def test_serve_job_stops_the_server_it_started(tmp_path):
    env = _serve_env(tmp_path, serve='echo $$ >"$here/serve.pid"; exec sleep 300')
    r = _run("dsv4_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = int((tmp_path / "bin" / "serve.pid").read_text())
    time.sleep(0.2)
    assert not pathlib.Path(f"/proc/{pid}").exists() or \
        pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_bench_job_writes_the_summary_from_vllm_bench_serve(tmp_path):
    env = _serve_env(tmp_path)
    env.update(BENCH_INPUT_LEN="64", BENCH_OUTPUT_LEN="16", BENCH_NUM_PROMPTS="8",
               BENCH_CONCURRENCY="2", TP="4")
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    bench = (tmp_path / "bin" / "bench.calls").read_text().splitlines()
    assert len(bench) == 1
    for part in ("bench serve --backend vllm", "--dataset-name random", "--random-input-len 64",
                 "--random-output-len 16", "--num-prompts 8", "--max-concurrency 2",
                 "--seed 0", "--ignore-eos", "--percentile-metrics ttft,tpot,itl,e2el",
                 "--metric-percentiles 50,90,99", "--save-result", "--model dsv4",
                 f"--tokenizer {tmp_path}/DeepSeek-V4-Flash"):
        assert part in bench[0], part
    serve = (tmp_path / "bin" / "serve.calls").read_text()
    # The kernels forced, not auto: a _gfx936_C that does not load fails the job.
    assert "--tensor-parallel-size 4" in serve and "W8A16=kernel MOE=kernel SPARSE=kernel" in serve
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("SPEED_SUMMARY")]
    assert len(line) == 1 and "label=kernels" in line[0] and "out_tok_s=12.8" in line[0]
    assert "tpot_ms_p50=20.0" in line[0] and "ttft_ms_p99=400.0" in line[0]
    speed = next((tmp_path / "logs").glob("*-kernels.speed.json"))
    assert '"out_tok_s": 12.8' in speed.read_text()
    assert "verdict=OK" in _summary(r.stdout) and "result=PASS" in _summary(r.stdout)


def test_bench_job_ab_mode_forces_the_kernels_off_and_reports_the_ratio(tmp_path):
    env = _serve_env(tmp_path)
    env["AB"] = "1"
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert len(calls) == 2
    assert "W8A16=kernel MOE=kernel SPARSE=kernel" in calls[0]
    assert "W8A16=torch MOE=emulation SPARSE=reference" in calls[1]
    ab = [ln for ln in r.stdout.splitlines() if ln.startswith("SPEED_AB")]
    assert len(ab) == 1 and "out_tok_s_a_over_b=1.600" in ab[0]
    assert "tpot_ms_p50_b_over_a=1.500" in ab[0]
    assert next((tmp_path / "logs").glob("*.ab.json")).is_file()


@pytest.mark.parametrize("kw,want", [({"bench_failed": 2}, 74), ({"bench_rc": 1}, 74)])
def test_bench_job_fails_when_the_benchmark_is_no_measurement(tmp_path, kw, want):
    r = _run("dsv4_bench_serve.sbatch", _serve_env(tmp_path, **kw))
    assert r.returncode == want, r.stdout + r.stderr
    assert "SPEED_VERDICT: INVALID" in r.stdout
    assert f"rc={want} " in _summary(r.stdout) and "result=FAIL" in _summary(r.stdout)


def test_bench_job_does_not_benchmark_a_degenerate_server(tmp_path):
    smoke = f"""\
        echo "CHAT_TOKEN_IDS: {J08}"
        echo "SERVE_SMOKE_VERDICT: DEGENERATE (identical_run)"
        exit 2
     """
    r = _run("dsv4_bench_serve.sbatch", _serve_env(tmp_path, smoke=smoke))
    assert r.returncode == 2, r.stdout + r.stderr
    assert not (tmp_path / "bin" / "bench.calls").exists()


# ------------------------------------------------------------------ tiny smoke job

def _tiny_env(tmp_path, body):
    # MODEL_PATH stays the big model (_env), as after the guide's `export MODEL_PATH=...`
    return _env(tmp_path, PYTHON=_fake_python(tmp_path, body))


def _tiny_log(mutate=None):
    """What a matching run prints: the corpus continuation of each default prompt."""
    from dcu_kit import tiny_smoke as T
    todo = T.cases(T.load_corpus(REPO_ROOT / "models" / "dsv4-tiny-gpl3"),
                   [int(x) for x in T.DEFAULT_PARAS.split(",")], T.DEFAULT_PREFIX_LEN,
                   T.DEFAULT_MAX_TOKENS)
    lines = []
    for p, _, want in todo:
        got = list(want)
        if mutate == p:
            got[5] = (got[5] + 1) % 1024
        lines.append(f"echo 'TINY_GOT p={p} ids={got}'")
    return "\n".join(lines)


def test_tiny_job_defaults_to_the_checked_in_model_and_forces_the_kernels(tmp_path):
    """Regression (issue #17 review, item 3): the guide exports MODEL_PATH for the 155 GiB model
    before submitting the tiny job, which then ran the big model on one DCU. The tiny job reads
    only TINY_MODEL_PATH (default: the checkout's tiny model)."""
    env = _env(tmp_path, DRY_RUN="1")   # MODEL_PATH = a big-model folder
    r = _run("dsv4_tiny_smoke.sbatch", env)
    assert r.returncode == 0, r.stderr
    cmd = [ln for ln in r.stdout.splitlines() if "dcu_kit.tiny_smoke" in ln]
    assert len(cmd) == 1
    assert f"--model {REPO_ROOT}/models/dsv4-tiny-gpl3 " in cmd[0] and "--kernels force" in cmd[0]
    assert env["MODEL_PATH"] not in cmd[0]
    assert "--engine-arg" not in cmd[0]   # no engine setting exported: the bare engine
    assert re.search(r"^#SBATCH --gres=dcu:1$", (SLURM / "dsv4_tiny_smoke.sbatch").read_text(), re.M)


def test_tiny_job_passes_the_kits_engine_settings(tmp_path):
    """Regression (issue #17 review, item 5): ENFORCE_EAGER/MAX_MODEL_LEN/GPU_MEM_UTIL/
    KV_CACHE_DTYPE, which the guide lists as job settings, were ignored by the tiny job."""
    env = _env(tmp_path, DRY_RUN="1", ENFORCE_EAGER="1", MAX_MODEL_LEN="1024",
               GPU_MEM_UTIL="0.5", KV_CACHE_DTYPE="fp8")
    r = _run("dsv4_tiny_smoke.sbatch", env)
    assert r.returncode == 0, r.stderr
    cmd = next(ln for ln in r.stdout.splitlines() if "dcu_kit.tiny_smoke" in ln)
    for arg in ("max_model_len=1024", "gpu_memory_utilization=0.5", "kv_cache_dtype=fp8",
                "enforce_eager=true"):
        assert f"--engine-arg {arg}" in cmd, cmd
    from dcu_kit import tiny_smoke as T   # and tiny_smoke turns them into LLM(...) arguments
    a = argparse.Namespace(model=REPO_ROOT / "models" / "dsv4-tiny-gpl3", engine_arg=[
        "max_model_len=1024", "gpu_memory_utilization=0.5", "kv_cache_dtype=fp8",
        "enforce_eager=true"])
    kw = T._engine_kwargs(a, on_gpu=True)
    assert (kw["max_model_len"], kw["gpu_memory_utilization"], kw["kv_cache_dtype"],
            kw["enforce_eager"]) == (1024, 0.5, "fp8", True)


def test_tiny_job_without_a_corpus_is_a_usage_error(tmp_path):
    """A TINY_MODEL_PATH that is a model folder but not the tiny model (no corpus.json) stops
    the job with KIT_RC_USAGE naming corpus.json, and tiny_smoke itself says so (exit 64)."""
    big = _model(tmp_path)
    env = _env(tmp_path, DRY_RUN="1", TINY_MODEL_PATH=str(big))
    r = _run("dsv4_tiny_smoke.sbatch", env)
    assert r.returncode == 64 and "corpus.json" in r.stderr, r.stdout + r.stderr
    p = subprocess.run([sys.executable, "-m", "dcu_kit.tiny_smoke", "run", "--model", str(big)],
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "ci")},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 64, p.stdout + p.stderr
    assert "TINY_SMOKE_ERROR:" in p.stdout and "corpus.json not found" in p.stdout
    assert "Traceback" not in p.stderr


def test_tiny_job_passes_only_when_the_rejudged_ids_match_the_corpus(tmp_path):
    ok = _tiny_log() + "\necho 'TINY_SMOKE_VERDICT: MATCH'\nexit 0\n"
    r = _run("dsv4_tiny_smoke.sbatch", _tiny_env(tmp_path, ok))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TINY_REJUDGE_RESULT: MATCH" in r.stdout and "verdict=MATCH" in _summary(r.stdout)


@pytest.mark.parametrize("body,want", [
    # a MATCH word beside one wrong id: the re-judge of the log catches it
    (_tiny_log(mutate=24) + "\necho 'TINY_SMOKE_VERDICT: MATCH'\nexit 0\n", 6),
    ("echo 'TINY_MISMATCH p=8 at=3 want=5 got=6'\n"
     "echo 'TINY_SMOKE_VERDICT: MISMATCH (1/16 prompts differ from the corpus)'\nexit 2\n", 6),
    ("echo 'TINY_SMOKE_VERDICT: MATCH'\nexit 0\n", 4),            # a word, no ids behind it
    ("echo 'ValueError: VLLM_GFX936_W8A16_IMPL=kernel but the csrc_gfx936 kernels cannot run'"
     "\nexit 1\n", 1),                                             # a missing kernel library
    ("echo 'usage: python -m dcu_kit.tiny_smoke'\nexit 2\n", 64),
    ("exit 139\n", 76),
    ("echo 'TINY_SMOKE_ERROR: m/corpus.json not found'\nexit 64\n", 64),
])
def test_tiny_job_failures_have_distinct_codes(tmp_path, body, want):
    r = _run("dsv4_tiny_smoke.sbatch", _tiny_env(tmp_path, body))
    assert r.returncode == want, r.stdout + r.stderr
    assert f"rc={want} " in _summary(r.stdout)


def _second_run(tmp_path, name, value):
    """The speed job with one option (``name=value``) that adds a second kernels run: the two
    recorded serve calls and the one SPEED_AB line (the job must succeed)."""
    env = _serve_env(tmp_path)
    env[name] = value
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert len(calls) == 2 and "W8A16=kernel MOE=kernel SPARSE=kernel" in calls[1], calls
    ab = [ln for ln in r.stdout.splitlines() if ln.startswith("SPEED_AB")]
    assert len(ab) == 1, ab
    return calls, ab[0]


def test_bench_job_mtp_mode_serves_with_the_mtp_drafter_and_reports_the_ratio(tmp_path):
    """MTP=K: the kernels run again with `--speculative-config` method mtp and K draft tokens,
    then SPEED_AB of that run (A) against the plain kernels run (B)."""
    calls, ab = _second_run(tmp_path, "MTP", "2")
    assert "--speculative-config" not in calls[0]
    assert '--speculative-config {"method": "mtp", "num_speculative_tokens": 2}' in calls[1]
    assert "out_tok_s_a_over_b=2.000" in ab and "tpot_ms_p50_b_over_a=2.000" in ab
    assert next((tmp_path / "logs").glob("*.mtp.json")).is_file()
    (tmp_path / "bad").mkdir()
    bad = _serve_env(tmp_path / "bad")
    bad["MTP"] = "two"
    r = _run("dsv4_bench_serve.sbatch", bad)
    assert r.returncode == 64 and "MTP=two" in r.stdout + r.stderr


def test_bench_job_graph_mode_replays_decode_as_a_graph_and_reports_the_ratio(tmp_path):
    """GRAPH=1: the kernels run again with VLLM_GFX936_GRAPH_MODE=full_decode (the plain run
    keeps gfx936's eager default), then SPEED_AB of the graph run (A) against it (B)."""
    calls, ab = _second_run(tmp_path, "GRAPH", "1")
    assert "GRAPH=eager" in calls[0] and "GRAPH=full_decode" in calls[1]
    assert all("--enforce-eager" not in c for c in calls)
    assert "out_tok_s_a_over_b=1.500" in ab and "tpot_ms_p50_b_over_a=1.600" in ab
    assert next((tmp_path / "logs").glob("*.graph.json")).is_file()
    (tmp_path / "bad").mkdir()
    bad = _serve_env(tmp_path / "bad")
    bad["GRAPH"] = "yes"
    r = _run("dsv4_bench_serve.sbatch", bad)
    assert r.returncode == 64 and "GRAPH=yes" in r.stdout + r.stderr


def test_bench_job_graph_mode_pins_each_run_and_refuses_what_would_not_be_graphs(tmp_path):
    """An exported VLLM_GFX936_GRAPH_MODE does not leak into the eager baseline; ENFORCE_EAGER=1
    with GRAPH=1 is refused (enforce-eager wins); a graph server that does not log graph mode
    makes the result INVALID (rc 74) instead of a ratio of eager against eager."""
    env = _serve_env(tmp_path)
    env.update(GRAPH="1", VLLM_GFX936_GRAPH_MODE="full_decode")
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert "GRAPH=eager" in calls[0] and "GRAPH=full_decode" in calls[1]
    for name, extra, want, text in (("eager", {"ENFORCE_EAGER": "1"}, 64, "ENFORCE_EAGER=1"),
                                    ("nograph", {"FAKE_NO_GRAPH": "1"}, 74, "not a graph run")):
        (tmp_path / name).mkdir()
        env = _serve_env(tmp_path / name)
        env.update(GRAPH="1", **extra)
        r = _run("dsv4_bench_serve.sbatch", env)
        raw = "".join(p.read_text() for p in (tmp_path / name / "logs").glob("*.raw.log")) \
            if (tmp_path / name / "logs").is_dir() else ""
        assert r.returncode == want, r.stdout + r.stderr
        assert text in r.stdout + r.stderr + raw


def test_bench_job_gemv_limit_run_reports_the_crossover_ratio(tmp_path):
    """GEMV=N: the kernels run again with VLLM_GFX936_W8A16_GEMV_MAX_M=N (the plain run keeps
    the engine's default, unset), then SPEED_AB of that run (A) against it (B); a bad N, or an
    exported limit that would change the baseline, is refused before any server starts."""
    calls, ab = _second_run(tmp_path, "GEMV", "4")
    assert "GEMV=unset" in calls[0] and "GEMV=4" in calls[1] and "GRAPH=eager" in calls[1]
    assert "out_tok_s_a_over_b=1.250" in ab
    assert next((tmp_path / "logs").glob("*.gemv.json")).is_file()
    for name, extra, text in (("bad", {"GEMV": "all"}, "GEMV=all"),
                              ("leak", {"GEMV": "4", "VLLM_GFX936_W8A16_GEMV_MAX_M": "8"},
                               "baseline would not be the default"),
                              ("leak-alone", {"VLLM_GFX936_W8A16_GEMV_MAX_M": "8"},
                               "baseline would not be the default")):
        (tmp_path / name).mkdir()
        bad = _serve_env(tmp_path / name)
        bad.update(extra)
        r = _run("dsv4_bench_serve.sbatch", bad)
        assert r.returncode == 64 and text in r.stdout + r.stderr
        assert not (tmp_path / name / "bin" / "serve.calls").exists()


def test_bench_job_gemv_limit_with_graph_mode_is_measured_under_graphs(tmp_path):
    """GEMV=N with GRAPH=1: the GEMV run replays graphs too (the limit under graphs is what it
    measures) and its SPEED_AB is against the graph run, not the eager one."""
    env = _serve_env(tmp_path)
    env.update(GEMV="8", GRAPH="1")
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert len(calls) == 3 and "GRAPH=eager GEMV=unset" in calls[0]
    assert "GRAPH=full_decode GEMV=unset" in calls[1] and "GRAPH=full_decode GEMV=8" in calls[2]
    ab = [ln for ln in r.stdout.splitlines() if ln.startswith("SPEED_AB")]
    assert len(ab) == 2 and "out_tok_s_a_over_b=0.833" in ab[1], ab  # 16.0 / 19.2
    gemv = next((tmp_path / "logs").glob("*.gemv.json")).read_text()
    assert "kernels-graph" in gemv and "kernels-gemv" in gemv


def test_bench_job_moe_direct_limit_run_reports_the_crossover_ratio(tmp_path):
    """MOE_DIRECT=N: the kernels run again with VLLM_GFX936_MOE_DIRECT_MAX_M=N (the plain run
    keeps the engine's default, unset), then SPEED_AB of that run (A) against it (B); N outside
    0..64, or an exported limit that would change the baseline, is refused before any server
    starts."""
    calls, ab = _second_run(tmp_path, "MOE_DIRECT", "8")
    assert "MOE_DIRECT=unset" in calls[0] and "MOE_DIRECT=8" in calls[1]
    assert "GRAPH=eager" in calls[1] and "GEMV=unset" in calls[1]
    assert "out_tok_s_a_over_b=0.800" in ab  # 10.24 / 12.8: the fake's slower direct limit
    assert next((tmp_path / "logs").glob("*.moe-direct.json")).is_file()
    for name, extra, text in (("bad", {"MOE_DIRECT": "all"}, "MOE_DIRECT=all"),
                              ("big", {"MOE_DIRECT": "65"}, "from 0 to 64"),
                              ("wraps", {"MOE_DIRECT": "18446744073709551616"}, "from 0 to 64"),
                              ("leak", {"MOE_DIRECT": "4", "VLLM_GFX936_MOE_DIRECT_MAX_M": "8"},
                               "baseline would not be the default"),
                              ("leak-alone", {"VLLM_GFX936_MOE_DIRECT_MAX_M": "0"},
                               "baseline would not be the default")):
        (tmp_path / name).mkdir()
        bad = _serve_env(tmp_path / name)
        bad.update(extra)
        r = _run("dsv4_bench_serve.sbatch", bad)
        assert r.returncode == 64 and text in r.stdout + r.stderr, (name, r.stdout + r.stderr)
        assert not (tmp_path / name / "bin" / "serve.calls").exists()


def test_bench_job_warns_when_the_moe_limit_run_cannot_differ(tmp_path):
    """MOE_DIRECT=N at BENCH_CONCURRENCY <= N (no MTP): no decode step passes N tokens, so both
    runs decode on the direct path; the job says so (and still runs)."""
    for name, conc, warned in (("same", "8", True), ("apart", "32", False)):
        (tmp_path / name).mkdir()
        env = _serve_env(tmp_path / name)
        env.update(MOE_DIRECT="8", BENCH_CONCURRENCY=conc)
        r = _run("dsv4_bench_serve.sbatch", env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("WARNING: MOE_DIRECT=8 with BENCH_CONCURRENCY=8" in r.stdout) == warned, r.stdout


def test_bench_job_both_limit_runs_with_graph_mode_compare_with_the_graph_run(tmp_path):
    """GEMV=N and MOE_DIRECT=N with GRAPH=1: each limit run replays graphs, sets only its own
    limit, and its SPEED_AB is against the graph run."""
    env = _serve_env(tmp_path)
    env.update(GEMV="8", MOE_DIRECT="0", GRAPH="1")
    r = _run("dsv4_bench_serve.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "bin" / "serve.calls").read_text().splitlines()
    assert len(calls) == 4, calls
    assert "GRAPH=full_decode GEMV=8 MOE_DIRECT=unset" in calls[2]
    assert "GRAPH=full_decode GEMV=unset MOE_DIRECT=0" in calls[3]
    ab = [ln for ln in r.stdout.splitlines() if ln.startswith("SPEED_AB")]
    assert len(ab) == 3 and "out_tok_s_a_over_b=0.533" in ab[2], ab  # 10.24 / 19.2
    moe = next((tmp_path / "logs").glob("*.moe-direct.json")).read_text()
    assert "kernels-graph" in moe and "kernels-moe-direct" in moe
