# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slurm job scripts: syntax, shellcheck, dry run, and exit-code honesty.

Regression for seed 2.2/6.5: a job must not say COMPLETED when the Python
workload failed or produced a degenerate verdict. Each job is run with
``bash`` (not sbatch) and a fake ``PYTHON`` injected through the environment.
"""

import os
import pathlib
import shutil
import subprocess
import textwrap

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

SLURM = REPO_ROOT / "ci" / "slurm"
JOBS = ["dsv4_tp8.sbatch", "dsv4_tp4.sbatch", "dsv4_multinode_ray.sbatch"]
SINGLE = {"dsv4_tp8.sbatch": "8", "dsv4_tp4.sbatch": "4"}


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(KIT_ROOT=str(REPO_ROOT), LOG_DIR=str(tmp_path / "logs"),
               MODEL_PATH="/models/DeepSeek-V4-Flash", DTK_MODULES="")
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
    assert "--model /models/DeepSeek-V4-Flash" in probe[0]
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


def test_exit_zero_with_degenerate_verdict_still_fails_the_job(tmp_path):
    """The J08 false green at job level: Python exits 0, verdict is not
    COHERENT -> the job must not COMPLETE."""
    fake = _fake_python(tmp_path, """\
        echo "DSV4_VERDICT: DEGENERATE (identical_run)"
        exit 0
        """)
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 3
    assert "rc=3" in r.stdout and "result=FAIL" in r.stdout


def test_exit_zero_without_any_verdict_fails_the_job(tmp_path):
    fake = _fake_python(tmp_path, "echo hello\nexit 0\n")
    r = _run("dsv4_tp8.sbatch", _env(tmp_path, PYTHON=fake))
    assert r.returncode == 4 and "verdict=MISSING" in r.stdout


def test_coherent_run_exits_zero_and_reports_engine_ready(tmp_path):
    fake = _fake_python(tmp_path, """\
        echo "ENGINE_READY in 228.9s"
        echo "DSV4_VERDICT: COHERENT"
        exit 0
        """)
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
