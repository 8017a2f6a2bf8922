# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regression matrix on the real model (seed 15.1). Cluster only.

Run on a DCU node (see docs/validate-on-cluster.md):
    PYTHONPATH=ci python -m pytest tests/cluster -m cluster \
        --model-path /path/to/DeepSeek-V4-Flash --tp 8
With ``-m cluster`` the run is refused (pytest exits 4, "usage error",
with the reason) when no --model-path is given (or DCU_KIT_MODEL_PATH), the
installed vLLM is not importable (the checkout's ``vllm/`` folder does not
count) or fewer devices than --tp are visible: 26 skips and exit 0 would be
a false green. Without ``-m cluster`` (the CPU suite) the tests skip.
"""

import json
import os
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "ci") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "ci"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers_cluster import installed_vllm  # noqa: E402


def pytest_addoption(parser):
    g = parser.getgroup("cluster", "vllm-gfx936 cluster regression matrix")
    g.addoption("--model-path", default=None, help="DeepSeek V4 Flash directory")
    g.addoption("--tp", type=int, default=8, help="tensor parallel size")
    g.addoption("--max-model-len", type=int, default=512)
    g.addoption("--kv-cache-dtype", default="fp8")
    g.addoption("--nan-repeats", type=int, default=50)
    g.addoption("--graph-mode", default="eager", choices=["eager", "full_decode"],
                help="eager (gfx936's default) or full_decode: decode steps replayed "
                     "as one HIP graph (VLLM_GFX936_GRAPH_MODE)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: needs the real model on DCU/GPU nodes "
        "(--model-path); skipped elsewhere")


MAY_SKIP = ("cluster matrix: needs the real DeepSeek V4 Flash (155 GiB) on DCU/GPU nodes "
            "(pytest tests/cluster -m cluster --model-path DIR; docs/validate-on-cluster.md)")


def _opt(config, name, default=None):
    try:
        return config.getoption(name)
    except ValueError:  # conftest not loaded at startup (run from elsewhere)
        return default


def _skip_reason(config):
    path = _opt(config, "--model-path") or os.environ.get("DCU_KIT_MODEL_PATH")
    if not path:
        return ("cluster matrix: no --model-path (or DCU_KIT_MODEL_PATH); run "
                "`pytest tests/cluster --model-path DIR` on a DCU node")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"cluster matrix: {path}/config.json not found"
    ok, where = installed_vllm(repo_root=str(REPO_ROOT))
    if not ok:
        return f"cluster matrix: vLLM not installed: {where}"
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return f"cluster matrix: vLLM not importable ({type(e).__name__}: {e})"
    tp = _opt(config, "--tp", 8)
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:
        return f"cluster matrix: torch unusable ({e})"
    if n < tp:
        return (f"cluster matrix: torch sees {n} GPU/DCU devices, --tp {tp} "
                "needs that many (allocate the node with --gres)")
    return None


def _cluster_selected(config):
    """True when the user asked for the cluster matrix (-m cluster)."""
    expr = config.getoption("markexpr", "") or ""
    return "cluster" in expr and "not cluster" not in expr


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "tests/cluster" not in str(item.fspath).replace(os.sep, "/"):
            continue
        item.add_marker(pytest.mark.cluster)
        # Not run by the CPU suite, even under CI (tests/required_skips.py): counted and printed.
        item.add_marker(pytest.mark.may_skip(reason=MAY_SKIP))
        if reason is None:
            reason = _skip_reason(config) or ""
            if reason and _cluster_selected(config):
                raise pytest.UsageError(
                    f"{reason}\n-m cluster asks for the real run; refusing to "
                    "report skips as a pass (docs/validate-on-cluster.md, 5)")
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cluster_opts(pytestconfig):
    path = _opt(pytestconfig, "--model-path") or os.environ["DCU_KIT_MODEL_PATH"]
    return {
        "model": path,
        "tp": _opt(pytestconfig, "--tp", 8),
        "max_model_len": _opt(pytestconfig, "--max-model-len", 512),
        "kv_cache_dtype": _opt(pytestconfig, "--kv-cache-dtype", "fp8"),
        "nan_repeats": _opt(pytestconfig, "--nan-repeats", 50),
        "graph_mode": _opt(pytestconfig, "--graph-mode", "eager"),
    }


@pytest.fixture(scope="session")
def model_config(cluster_opts):
    with open(os.path.join(cluster_opts["model"], "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def llm(cluster_opts):
    """One engine for the whole session (engine init costs minutes). The
    prefix-caching A/B test runs its own engines in subprocesses and must run
    first (test_a_*.py sorts first) while the GPUs are still free."""
    from helpers_cluster import graph_mode_engine, graph_mode_error
    from vllm import LLM

    mode = cluster_opts["graph_mode"]
    kwargs, env = graph_mode_engine(mode)
    os.environ.update(env)
    llm = LLM(model=cluster_opts["model"], tensor_parallel_size=cluster_opts["tp"],
              max_model_len=cluster_opts["max_model_len"],
              kv_cache_dtype=cluster_opts["kv_cache_dtype"],
              gpu_memory_utilization=0.90, trust_remote_code=True, max_num_seqs=16,
              **kwargs)
    cc = llm.llm_engine.vllm_config.compilation_config
    error = graph_mode_error(mode, cc.cudagraph_mode.name)
    if error:
        pytest.fail(error)
    return llm
