# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ray launcher: pure command/env builders, and a real head-only Ray cluster
on loopback (CPU) started and stopped by the test."""

import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from dcu_kit import ray_cluster as rc


def test_head_and_worker_commands_pass_explicit_gpu_counts():
    head = rc.head_start_cmd(num_gpus=8, port=6380, node_ip="10.0.0.1")
    assert head[:3] == ["ray", "start", "--head"]
    assert "--num-gpus=8" in head and "--port=6380" in head
    assert "--node-ip-address=10.0.0.1" in head and head[-1] == "--block"
    w = rc.worker_start_cmd(address="10.0.0.1:6380", num_gpus=8, block=False)
    assert "--address=10.0.0.1:6380" in w and "--num-gpus=8" in w
    assert "--block" not in w
    with pytest.raises(ValueError, match="HOST:PORT"):
        rc.worker_start_cmd(address="10.0.0.1", num_gpus=8)


def test_serve_command_uses_ray_backend_tp_in_node_pp_across_nodes():
    tp, pp = rc.parallel_layout(nodes=2, gpus_per_node=8)
    assert (tp, pp) == (8, 2)
    cmd = rc.serve_cmd(model="/m", tp=tp, pp=pp, port=8001)
    s = " ".join(cmd)
    assert cmd[:3] == ["vllm", "serve", "/m"]
    assert "--distributed-executor-backend ray" in s
    assert "--tensor-parallel-size 8" in s and "--pipeline-parallel-size 2" in s
    assert "--port 8001" in s
    # issue #17: the bare command unless the job was asked for more
    for flag in ("--kv-cache-dtype", "--enforce-eager", "--trust-remote-code", "--max-model-len"):
        assert flag not in s, flag
    s = " ".join(rc.serve_cmd(model="/m", tp=8, pp=1, kv_cache_dtype="fp8", max_model_len=8192,
                              extra=["--enforce-eager"]))
    assert "--kv-cache-dtype fp8" in s and "--max-model-len 8192" in s and "--enforce-eager" in s
    with pytest.raises(ValueError, match="TP must stay inside a node"):
        rc.parallel_layout(nodes=2, gpus_per_node=8, tp=16)


def test_node_wide_hip_visible_devices_moves_to_cuda_for_ray():
    """vLLM on ROCm raises when HIP_ and CUDA_VISIBLE_DEVICES disagree; Ray
    sets CUDA_VISIBLE_DEVICES per actor, so a node-wide HIP value must go."""
    d = rc.ray_device_env({"HIP_VISIBLE_DEVICES": "4,5,6,7"})
    assert d.set == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert d.unset == ("HIP_VISIBLE_DEVICES",) and d.num_visible == 4
    assert rc.ray_device_env({"ROCR_VISIBLE_DEVICES": "0,1"}).set == {}
    assert rc.ray_device_env({}).num_visible is None
    with pytest.raises(ValueError, match="disagree"):
        rc.ray_device_env({"HIP_VISIBLE_DEVICES": "0,1",
                           "CUDA_VISIBLE_DEVICES": "2,3"})
    assert rc.resolve_num_gpus(None, {"HIP_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert rc.resolve_num_gpus(8, {}) == 8
    with pytest.raises(ValueError, match="--num-gpus"):
        rc.resolve_num_gpus(None, {})


def test_cli_reports_a_bad_device_env_or_layout_without_a_traceback(
        monkeypatch, capsys):
    """The head/worker steps run in the background of the multi-node job: a
    clash must read as one RAY_CLUSTER_ERROR line (rc 2), not a traceback."""
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert rc.main(["head", "--num-gpus", "2", "--dry-run"]) == 2
    assert "RAY_CLUSTER_ERROR: HIP_VISIBLE_DEVICES='0,1'" in capsys.readouterr().err
    assert rc.main(["serve", "--model", "/m", "--gpus-per-node", "8", "--tp", "16",
                    "--dry-run"]) == 2
    assert "TP must stay inside a node" in capsys.readouterr().err


def test_plan_prints_all_commands(capsys):
    assert rc.main(["plan", "--model", "/m", "--nodes", "2",
                    "--head-ip", "10.1.1.1"]) == 0
    out = capsys.readouterr().out
    assert "ray start --head" in out and "--address=10.1.1.1:6379" in out
    assert "--pipeline-parallel-size 2" in out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_head_on_loopback_reports_explicit_gpus_and_waits(tmp_path):
    """A CPU-only head started with --num-gpus=2 (Ray detects no GPU here,
    like a DCU node) must advertise 2 GPUs; wait_for_nodes sees 1 node."""
    ray = pytest.importorskip("ray", reason="ray not installed")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(ray_bin):
        pytest.skip(f"ray CLI not found next to {sys.executable}")
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # short: socket paths
    cmd = rc.head_start_cmd(num_gpus=2, num_cpus=1, port=port,
                            node_ip="127.0.0.1", temp_dir=tmp, ray=ray_bin)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "head.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        st = rc.wait_for_nodes(f"127.0.0.1:{port}", nodes=1, gpus=2,
                               timeout=120, poll=1)
        assert st.alive_nodes == 1 and st.total_gpus == 2.0
        with pytest.raises(TimeoutError, match="did not reach 2 nodes"):
            rc.wait_for_nodes(f"127.0.0.1:{port}", nodes=2, timeout=2, poll=1)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        # Stop only what this test started: SIGTERM the `ray start --block`
        # process (it drains the node and stops its GCS/raylet children),
        # then SIGKILL whatever is left in its own session/process group.
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
