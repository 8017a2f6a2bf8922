# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cluster matrix must not pass where it cannot run (issue #11): with
``-m cluster`` and no model or no device pytest fails, and its "vLLM
importable" guard sees the installed wheel, not the checkout's ``vllm/``."""

import importlib.util
import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _helpers():
    spec = importlib.util.spec_from_file_location(
        "helpers_cluster", REPO_ROOT / "tests" / "cluster" / "helpers_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pytest(*args):
    env = {k: v for k, v in os.environ.items() if k != "DCU_KIT_MODEL_PATH"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p",
                           "no:cacheprovider", "tests/cluster", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cluster_run_without_model_is_refused_not_skipped():
    r = _pytest("-m", "cluster")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no --model-path" in r.stdout + r.stderr
    assert "skipped" not in r.stdout


def test_cluster_run_without_devices_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = _pytest("-m", "cluster", "--model-path", str(tmp_path), "--tp", "8")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "devices" in out or "vLLM not installed" in out


def test_without_the_cluster_marker_the_cpu_suite_skips():
    r = _pytest()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "skipped" in r.stdout and "passed" not in r.stdout


def test_vllm_guard_rejects_the_submodule_folder(tmp_path):
    """The checkout's vllm/ (no __init__.py) imports as a namespace package."""
    (tmp_path / "vllm" / "vllm").mkdir(parents=True)
    (tmp_path / "vllm" / "vllm" / "__init__.py").write_text("")
    ok, why = _helpers().installed_vllm([str(tmp_path)])
    assert not ok and "without __init__.py" in why


def test_vllm_guard_rejects_the_checkout_source_tree_and_accepts_a_package(
        tmp_path):
    h = _helpers()
    src = tmp_path / "repo" / "vllm"
    (src / "vllm").mkdir(parents=True)
    (src / "vllm" / "__init__.py").write_text("")
    ok, why = h.installed_vllm([str(src)], repo_root=str(tmp_path / "repo"))
    assert not ok and "source tree" in why
    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    ok, where = h.installed_vllm([str(tmp_path / "repo"), str(site)],
                                 repo_root=str(tmp_path / "repo"))
    assert ok and where == str(site / "vllm")
    ok, _ = h.installed_vllm([str(tmp_path / "empty")])
    assert not ok


def test_graph_mode_full_decode_does_not_pass_enforce_eager():
    """--enforce-eager always wins over VLLM_GFX936_GRAPH_MODE: a graph run that passed it
    would check eager mode and pass whatever HIP graphs do."""
    h = _helpers()
    kwargs, env = h.graph_mode_engine("full_decode")
    assert kwargs == {"enforce_eager": False} and env == {"VLLM_GFX936_GRAPH_MODE": "full_decode"}
    assert h.graph_mode_engine("eager") == ({"enforce_eager": True}, {})
    assert h.graph_mode_error("full_decode", "FULL_DECODE_ONLY") is None
    assert h.graph_mode_error("eager", "NONE") is None
    # vLLM lowered the mode on its own (or enforce_eager won): the run must not count
    assert "not FULL_DECODE_ONLY" in h.graph_mode_error("full_decode", "NONE")
    assert "not NONE" in h.graph_mode_error("eager", "FULL_DECODE_ONLY")


def test_graph_mode_option_refuses_other_values(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = _pytest("-m", "cluster", "--model-path", str(tmp_path), "--graph-mode", "graphs")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--graph-mode" in r.stdout + r.stderr and "full_decode" in r.stdout + r.stderr
