# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Multi-node launcher: Ray head + workers, then ``vllm serve`` over Ray.

Pure command builders (testable anywhere) plus a small runner CLI used by
``ci/slurm/dsv4_multinode_ray.sbatch``:

  python -m dcu_kit.ray_cluster head   --port P --num-gpus 8 [--node-ip IP]
  python -m dcu_kit.ray_cluster worker --address IP:P --num-gpus 8
  python -m dcu_kit.ray_cluster wait   --address IP:P --nodes N --gpus G
  python -m dcu_kit.ray_cluster serve  --model M --tp 8 --pp N [...]
  python -m dcu_kit.ray_cluster plan   ... (prints every command, runs none)

Device visibility on DCU nodes:
  * Ray may not detect Hygon DCUs (no NVML, no amdsmi), so every
    ``ray start`` passes ``--num-gpus`` explicitly.
  * vLLM on ROCm raises if ``HIP_VISIBLE_DEVICES`` and
    ``CUDA_VISIBLE_DEVICES`` disagree (vllm/platforms/rocm.py
    ``_sync_hip_cuda_env_vars``). Ray gives each actor a
    ``CUDA_VISIBLE_DEVICES`` subset of the node's ids, so a node-wide
    ``HIP_VISIBLE_DEVICES`` (often set by Slurm's gres plugin) would clash.
    ``ray_device_env`` therefore moves a node-wide ``HIP_VISIBLE_DEVICES``
    into ``CUDA_VISIBLE_DEVICES`` (same ids, so Ray hands out the physical
    ids Slurm granted) and unsets ``HIP_VISIBLE_DEVICES`` before
    ``ray start``; vLLM then mirrors the actor's value back into
    ``HIP_VISIBLE_DEVICES``. ``ROCR_VISIBLE_DEVICES`` is left alone (it
    renumbers below HIP; ids are then 0..n-1).
  * The number of GPUs defaults to the number of visible ids.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_PORT = 6379


def _ids(value: str | None) -> list[str] | None:
    if value is None or value.strip() == "":
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


@dataclass(frozen=True)
class DeviceEnv:
    set: dict[str, str]
    unset: tuple[str, ...]
    num_visible: int | None
    note: str


def ray_device_env(env: Mapping[str, str]) -> DeviceEnv:
    """Env changes to apply before ``ray start`` on a DCU node (see module
    docstring). Pure."""
    hip = _ids(env.get("HIP_VISIBLE_DEVICES"))
    cuda = _ids(env.get("CUDA_VISIBLE_DEVICES"))
    rocr = _ids(env.get("ROCR_VISIBLE_DEVICES"))
    if hip is not None and cuda is not None and hip != cuda:
        raise ValueError(
            "HIP_VISIBLE_DEVICES={!r} and CUDA_VISIBLE_DEVICES={!r} disagree; "
            "vLLM on ROCm refuses this. Set only HIP_VISIBLE_DEVICES.".format(
                env.get("HIP_VISIBLE_DEVICES"), env.get("CUDA_VISIBLE_DEVICES")))
    if hip is not None:
        return DeviceEnv({"CUDA_VISIBLE_DEVICES": ",".join(hip)},
                         ("HIP_VISIBLE_DEVICES",), len(hip),
                         "moved HIP_VISIBLE_DEVICES to CUDA_VISIBLE_DEVICES "
                         "for Ray's per-actor assignment")
    if cuda is not None:
        return DeviceEnv({}, (), len(cuda), "CUDA_VISIBLE_DEVICES kept")
    if rocr is not None:
        return DeviceEnv({}, (), len(rocr),
                         "ROCR_VISIBLE_DEVICES kept (ids renumbered 0..n-1)")
    return DeviceEnv({}, (), None, "no visibility variable set")


def resolve_num_gpus(explicit: int | None, env: Mapping[str, str]) -> int:
    if explicit is not None:
        if explicit < 0:
            raise ValueError(f"--num-gpus must be >= 0, got {explicit}")
        return explicit
    n = ray_device_env(env).num_visible
    if n is None:
        raise ValueError(
            "cannot tell how many DCUs this node has: pass --num-gpus "
            "(Ray may not detect DCUs) or set HIP_VISIBLE_DEVICES")
    return n


def _common_start_args(num_gpus: int, num_cpus: int | None,
                       temp_dir: str | None, block: bool,
                       node_ip: str | None) -> list[str]:
    args = [f"--num-gpus={num_gpus}"]
    if num_cpus is not None:
        args.append(f"--num-cpus={num_cpus}")
    if node_ip:
        args.append(f"--node-ip-address={node_ip}")
    if temp_dir:
        args.append(f"--temp-dir={temp_dir}")
    args.append("--disable-usage-stats")
    if block:
        args.append("--block")
    return args


def head_start_cmd(*, num_gpus: int, port: int = DEFAULT_PORT,
                   node_ip: str | None = None, num_cpus: int | None = None,
                   temp_dir: str | None = None, block: bool = True,
                   ray: str = "ray") -> list[str]:
    """``ray start --head`` with an explicit GPU count."""
    return ([ray, "start", "--head", f"--port={port}",
             "--include-dashboard=false"]
            + _common_start_args(num_gpus, num_cpus, temp_dir, block, node_ip))


def worker_start_cmd(*, address: str, num_gpus: int,
                     node_ip: str | None = None, num_cpus: int | None = None,
                     temp_dir: str | None = None, block: bool = True,
                     ray: str = "ray") -> list[str]:
    """``ray start --address=HEAD:PORT`` with an explicit GPU count."""
    if ":" not in address:
        raise ValueError(f"worker address {address!r} must be HOST:PORT")
    return ([ray, "start", f"--address={address}"]
            + _common_start_args(num_gpus, num_cpus, None, block, node_ip))


def serve_cmd(*, model: str, tp: int, pp: int, host: str = "0.0.0.0",
              port: int = 8000, max_model_len: int | None = None,
              kv_cache_dtype: str | None = None, served_model_name: str | None = None,
              extra: Sequence[str] = (), vllm: str = "vllm") -> list[str]:
    """``vllm serve`` over Ray: TP inside a node, PP across nodes."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1 (tp={tp}, pp={pp})")
    cmd = [vllm, "serve", model,
           "--distributed-executor-backend", "ray",
           "--tensor-parallel-size", str(tp),
           "--pipeline-parallel-size", str(pp),
           "--host", host, "--port", str(port)]
    # Nothing else unless asked for: the bare command a user runs (issue #17).
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_cache_dtype is not None:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    return cmd + list(extra)


def parallel_layout(nodes: int, gpus_per_node: int, tp: int | None = None
                    ) -> tuple[int, int]:
    """(tp, pp) for TP within a node and PP across nodes."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} "
                         "must be >= 1")
    tp = tp or gpus_per_node
    if tp > gpus_per_node:
        raise ValueError(f"tp={tp} > gpus_per_node={gpus_per_node}: TP must "
                         "stay inside a node (PP goes across nodes)")
    return tp, nodes


@dataclass
class ClusterState:
    alive_nodes: int
    total_gpus: float
    total_cpus: float


def cluster_state(address: str) -> ClusterState:
    """Connect to the Ray cluster at ``address`` and count alive nodes/GPUs."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus = sum(n.get("Resources", {}).get("GPU", 0.0) for n in nodes)
        cpus = sum(n.get("Resources", {}).get("CPU", 0.0) for n in nodes)
        return ClusterState(len(nodes), gpus, cpus)
    finally:
        ray.shutdown()


def wait_for_nodes(address: str, nodes: int, gpus: float | None = None,
                   timeout: float = 600.0, poll: float = 5.0,
                   out=None) -> ClusterState:
    """Block until ``nodes`` alive nodes (and ``gpus`` GPUs) joined."""
    out = out or sys.stdout
    deadline = time.monotonic() + timeout
    last: ClusterState | None = None
    last_err = ""
    while True:
        try:
            last = cluster_state(address)
            print(f"RAY_CLUSTER: nodes={last.alive_nodes}/{nodes} "
                  f"gpus={last.total_gpus:g}/{gpus if gpus is not None else '-'}",
                  file=out, flush=True)
            if last.alive_nodes >= nodes and (gpus is None
                                              or last.total_gpus >= gpus):
                return last
        except Exception as e:  # head not up yet
            last_err = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"Ray cluster at {address} did not reach {nodes} nodes/"
                f"{gpus} GPUs in {timeout:.0f}s (last: {last}, {last_err})")
        time.sleep(poll)


def _run(cmd: list[str], env_changes: DeviceEnv | None) -> int:
    env = dict(os.environ)
    if env_changes:
        for k in env_changes.unset:
            env.pop(k, None)
        env.update(env_changes.set)
        print(f"RAY_DEVICE_ENV: {env_changes.note}: set={env_changes.set} "
              f"unset={list(env_changes.unset)}", flush=True)
    print("RUN: " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcu_kit.ray_cluster")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("head", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--num-gpus", type=int, default=None)
        s.add_argument("--num-cpus", type=int, default=None)
        s.add_argument("--node-ip", default=None)
        s.add_argument("--no-block", action="store_true")
        s.add_argument("--dry-run", action="store_true")
        if name == "head":
            s.add_argument("--port", type=int, default=DEFAULT_PORT)
            s.add_argument("--temp-dir", default=None)
        else:
            s.add_argument("--address", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=float, default=None)
    w.add_argument("--timeout", type=float, default=600)
    for name in ("serve", "plan"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--nodes", type=int, default=1)
        s.add_argument("--gpus-per-node", type=int, default=8)
        s.add_argument("--tp", type=int, default=None)
        s.add_argument("--port", type=int, default=8000)
        s.add_argument("--max-model-len", type=int, default=None)
        s.add_argument("--kv-cache-dtype", default=None)
        s.add_argument("--served-model-name", default=None)
        s.add_argument("--dry-run", action="store_true")
        if name == "plan":
            s.add_argument("--head-ip", default="<HEAD_IP>")
            s.add_argument("--ray-port", type=int, default=DEFAULT_PORT)
    a, extra = p.parse_known_args(argv)
    if extra and a.cmd != "serve":
        p.error(f"unrecognized arguments: {extra}")
    try:
        return _dispatch(a, extra)
    except ValueError as e:  # a bad layout or device env: say so, no traceback
        print(f"RAY_CLUSTER_ERROR: {e}", file=sys.stderr, flush=True)
        return 2


def _dispatch(a: argparse.Namespace, extra: list[str]) -> int:
    if a.cmd in ("head", "worker"):
        denv = ray_device_env(os.environ)
        n = resolve_num_gpus(a.num_gpus, os.environ)
        if a.cmd == "head":
            cmd = head_start_cmd(num_gpus=n, port=a.port, node_ip=a.node_ip,
                                 num_cpus=a.num_cpus, temp_dir=a.temp_dir,
                                 block=not a.no_block)
        else:
            cmd = worker_start_cmd(address=a.address, num_gpus=n,
                                   node_ip=a.node_ip, num_cpus=a.num_cpus,
                                   block=not a.no_block)
        if a.dry_run:
            print(shlex.join(cmd))
            return 0
        return _run(cmd, denv)
    if a.cmd == "wait":
        try:
            st = wait_for_nodes(a.address, a.nodes, a.gpus, a.timeout)
        except TimeoutError as e:
            print(f"RAY_WAIT_FAILED: {e}", flush=True)
            return 3
        print(f"RAY_READY: nodes={st.alive_nodes} gpus={st.total_gpus:g}",
              flush=True)
        return 0
    tp, pp = parallel_layout(a.nodes, a.gpus_per_node, a.tp)
    scmd = serve_cmd(model=a.model, tp=tp, pp=pp, port=a.port,
                     max_model_len=a.max_model_len,
                     kv_cache_dtype=a.kv_cache_dtype,
                     served_model_name=a.served_model_name, extra=extra)
    if a.cmd == "plan":
        addr = f"{a.head_ip}:{a.ray_port}"
        print("# head node")
        print(shlex.join(head_start_cmd(num_gpus=a.gpus_per_node,
                                        port=a.ray_port, node_ip=a.head_ip)))
        print(f"# each of the {a.nodes - 1} worker node(s)")
        print(shlex.join(worker_start_cmd(address=addr,
                                          num_gpus=a.gpus_per_node)))
        print("# wait, then serve (on the head node)")
        print(shlex.join(["python", "-m", "dcu_kit.ray_cluster", "wait",
                          "--address", addr, "--nodes", str(a.nodes),
                          "--gpus", str(a.nodes * a.gpus_per_node)]))
        print(shlex.join(scmd))
        return 0
    if a.dry_run:
        print(shlex.join(scmd))
        return 0
    print(f"SERVE_LAYOUT: tp={tp} (within node) pp={pp} (across nodes)",
          flush=True)
    return _run(scmd, None)


if __name__ == "__main__":
    sys.exit(main())
