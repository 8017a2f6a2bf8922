# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936 detection and the ROCm arch helpers (patch platform-rocm-detect-gfx936).

Everything runs on CPU: the KFD topology is a temporary directory and
``torch.cuda`` is mocked, so no test needs (or touches) a GPU.
"""

from __future__ import annotations

import importlib
import sys

import fake_rocm
import pytest
import torch
from fake_rocm import VISIBILITY_VARS, fake_rocm_torch

from vllm.platforms import gfx936

# Non-gfx936 arch strings as torch / amdsmi report them, with and without the
# feature suffixes, and gfx936 the way DTK spells it.
OTHER_ARCHS = ["gfx942", "gfx942:sramecc+:xnack-", "gfx950", "gfx90a:sramecc+:xnack-"]
GFX936_SPELLINGS = ["gfx936", "gfx936:sramecc+:xnack-", "gfx936:xnack-"]


def write_kfd_topology(root, target_versions):
    """One KFD node directory per entry, like /sys/class/kfd/kfd/topology/nodes."""
    root.mkdir(parents=True, exist_ok=True)
    for node, version in enumerate(target_versions):
        node_dir = root / str(node)
        node_dir.mkdir()
        (node_dir / "properties").write_text(
            f"cpu_cores_count 0\nsimd_count 256\n"
            f"gfx_target_version {version}\nvendor_id 7424\n"
        )
    return root


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No visibility vars, an empty KFD topology, a fresh detection cache."""
    for name in VISIBILITY_VARS:
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "no_kfd"
    empty.mkdir()
    monkeypatch.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(empty))
    gfx936.reset_cache()
    yield monkeypatch
    gfx936.reset_cache()


@pytest.fixture
def load_rocm(clean_env):
    """Import vllm.platforms.rocm afresh with a faked arch; restore afterwards."""
    monkeypatch = clean_env
    saved = sys.modules.get(fake_rocm.ROCM_MODULE)

    def _load(gcn_arch):
        calls = fake_rocm_torch(monkeypatch, gcn_arch)
        module = fake_rocm.import_rocm_afresh()
        return module, calls

    yield _load
    fake_rocm.restore_rocm_module(saved)


def upstream_flags(arch: str) -> dict:
    """vLLM v0.27.1's arch predicates, written out from its substring rules."""
    return {
        "on_gfx9": any(a in arch for a in ["gfx90a", "gfx942", "gfx950"]),
        "on_mi3xx": any(a in arch for a in ["gfx942", "gfx950"]),
        "on_gfx942": "gfx942" in arch,
        "on_gfx950": "gfx950" in arch,
        "on_gfx90a": "gfx90a" in arch,
        "on_cdna": any(a in arch for a in ["gfx9", "gfx1250"]),
        "is_fp8_fnuz": "gfx94" in arch,
        "use_custom_allreduce": any(a in arch for a in ["gfx94", "gfx95"]),
        "supports_mx": any(a in arch for a in ["gfx95", "gfx1250"]),
        "cdna_version": (
            2
            if "gfx90a" in arch
            else 3
            if "gfx942" in arch
            else 4
            if "gfx950" in arch
            else 0
        ),
    }


def patched_flags(rocm) -> dict:
    platform = rocm.RocmPlatform
    return {
        "on_gfx9": rocm.on_gfx9(),
        "on_mi3xx": rocm.on_mi3xx(),
        "on_gfx942": rocm.on_gfx942(),
        "on_gfx950": rocm.on_gfx950(),
        "on_gfx90a": rocm.on_gfx90a(),
        "on_cdna": rocm.on_cdna(),
        "is_fp8_fnuz": platform.is_fp8_fnuz(),
        "use_custom_allreduce": platform.use_custom_allreduce(),
        "supports_mx": platform.supports_mx(),
        "cdna_version": rocm.get_cdna_version(),
    }


CUSTOM_PA_ARGS = dict(
    qtype=torch.bfloat16,
    head_size=128,
    block_size=16,
    gqa_ratio=8,
    max_seq_len=4096,
    sliding_window=0,
    kv_cache_dtype="auto",
)


# --------------------------------------------------------------------- KFD


@pytest.mark.parametrize(
    "version,arch",
    [
        (90306, "gfx936"),
        (90010, "gfx90a"),
        (90402, "gfx942"),
        (90500, "gfx950"),
        (110000, "gfx1100"),
        (120001, "gfx1201"),
    ],
)
def test_gfx_target_version_decodes_major_minor_hex_stepping(version, arch):
    """v = major*10000 + minor*100 + stepping, named gfx{major}{minor:x}{step:x}.

    Values are the ones amdkfd publishes (kfd_device.c); 90010 is the case
    that shows the stepping is printed in hex (10 -> 'a').
    """
    assert gfx936.arch_from_gfx_target_version(version) == arch


def test_gfx_target_version_zero_is_a_cpu_node():
    assert gfx936.arch_from_gfx_target_version(0) is None


def test_kfd_topology_skips_cpu_nodes_and_keeps_node_order(clean_env, tmp_path):
    root = write_kfd_topology(tmp_path / "nodes", [0, 90306, 90402])
    assert gfx936.kfd_gpu_archs(str(root)) == ["gfx936", "gfx942"]


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"HIP_VISIBLE_DEVICES": "1"}, ["gfx936"]),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, ["gfx936", "gfx90a"]),
        ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}, ["gfx936"]),
        ({"HIP_VISIBLE_DEVICES": "GPU-1234abcd"}, ["gfx90a", "gfx936"]),
    ],
)
def test_kfd_topology_respects_device_visibility(clean_env, tmp_path, env, expected):
    root = write_kfd_topology(tmp_path / "nodes", [0, 90010, 90306])
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert gfx936.kfd_gpu_archs(str(root)) == expected


def test_kfd_detection_does_not_initialise_the_device(clean_env, tmp_path):
    """The KFD answer wins before torch: get_device_properties is never called."""
    root = write_kfd_topology(tmp_path / "nodes", [0, 90306])
    clean_env.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(root))
    calls = fake_rocm_torch(clean_env, None)
    assert gfx936.on_gfx936()
    assert gfx936.gfx936_arch_name() == "gfx936"
    assert calls == []


def test_missing_kfd_topology_falls_back_to_torch(clean_env):
    fake_rocm_torch(clean_env, "gfx936:sramecc+:xnack-")
    assert gfx936.gfx936_arch_name() == "gfx936:sramecc+:xnack-"
    assert gfx936.on_gfx936()


def test_cpu_torch_without_kfd_is_not_gfx936(clean_env):
    clean_env.setattr(torch.version, "hip", None, raising=False)
    assert not gfx936.on_gfx936()


def test_detection_is_cached_until_reset(clean_env):
    calls = fake_rocm_torch(clean_env, "gfx936")
    assert gfx936.on_gfx936() and gfx936.on_gfx936()
    assert len(calls) == 1
    gfx936.reset_cache()
    fake_rocm_torch(clean_env, "gfx942")
    assert not gfx936.on_gfx936()


@pytest.mark.parametrize("arch", OTHER_ARCHS + ["gfx9360", "gfx1036"])
def test_other_archs_are_not_gfx936(clean_env, arch):
    fake_rocm_torch(clean_env, arch)
    assert not gfx936.on_gfx936()


# ------------------------------------------------------------- rocm.py hook


@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_rocm_helpers_of_other_archs_match_upstream(load_rocm, arch):
    rocm, _ = load_rocm(arch)
    assert rocm._GCN_ARCH == arch
    assert patched_flags(rocm) == upstream_flags(arch)
    assert rocm.gfx936.on_gfx936() is False
    # Upstream's CDNA rule for the custom paged attention still applies.
    assert rocm.use_rocm_custom_paged_attention(**CUSTOM_PA_ARGS) is True


@pytest.mark.parametrize("arch", GFX936_SPELLINGS)
def test_rocm_helpers_treat_gfx936_as_not_mi300(load_rocm, arch):
    rocm, _ = load_rocm(arch)
    assert rocm.gfx936.on_gfx936() is True
    flags = patched_flags(rocm)
    # Not gfx9/MI300-capable: no AITER (cdna_version 0), no MFMA/FP8 paths.
    assert flags["on_gfx9"] is False
    assert flags["on_mi3xx"] is False
    assert flags["cdna_version"] == 0
    assert flags["is_fp8_fnuz"] is False
    assert rocm.RocmPlatform.fp8_dtype() is torch.float8_e4m3fn
    assert flags["use_custom_allreduce"] is False
    assert flags["supports_mx"] is False
    cap = rocm.RocmPlatform.get_device_capability()
    assert (cap.major, cap.minor) == (9, 3)


def test_rocm_custom_paged_attention_is_never_chosen_on_gfx936(load_rocm):
    """attention.cu is built without __HIP__GFX9__ for gfx936: stub kernels only."""
    rocm, _ = load_rocm("gfx936:sramecc+:xnack-")
    assert rocm.use_rocm_custom_paged_attention(**CUSTOM_PA_ARGS) is False


def test_rocm_arch_comes_from_kfd_without_device_init_on_gfx936(
    load_rocm, clean_env, tmp_path
):
    """amdsmi is absent under DTK: the KFD topology must name gfx936 at import."""
    root = write_kfd_topology(tmp_path / "nodes", [0, 90306])
    clean_env.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(root))
    rocm, calls = load_rocm(None)  # torch would raise if asked
    assert rocm._GCN_ARCH == "gfx936"
    assert rocm.gfx936.on_gfx936()
    assert calls == []


def test_rocm_arch_of_other_archs_still_comes_from_torch(
    load_rocm, clean_env, tmp_path
):
    """Only a gfx936 KFD answer is taken; gfx942 keeps upstream's torch path."""
    root = write_kfd_topology(tmp_path / "nodes", [0, 90402])
    clean_env.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(root))
    rocm, calls = load_rocm("gfx942:sramecc+:xnack-")
    assert rocm._GCN_ARCH == "gfx942:sramecc+:xnack-"
    assert calls == ["cuda"]


# ----------------------------------------------------- platform plugin hook


def test_rocm_platform_plugin_finds_gfx936_without_amdsmi(clean_env, tmp_path):
    import vllm.platforms as platforms

    if importlib.util.find_spec("amdsmi") is not None:
        pytest.skip("amdsmi is installed here; the fallback is not reached")
    root = write_kfd_topology(tmp_path / "nodes", [0, 90306])
    clean_env.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(root))
    clean_env.setattr(torch.version, "hip", "6.3.0-test", raising=False)
    assert platforms.rocm_platform_plugin() == "vllm.platforms.rocm.RocmPlatform"


@pytest.mark.parametrize("versions", [[0, 90402], []])
def test_rocm_platform_plugin_unchanged_for_other_archs(clean_env, tmp_path, versions):
    import vllm.platforms as platforms

    if importlib.util.find_spec("amdsmi") is not None:
        pytest.skip("amdsmi is installed here; upstream detection decides")
    root = write_kfd_topology(tmp_path / "nodes", versions)
    clean_env.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(root))
    clean_env.setattr(torch.version, "hip", "6.3.0-test", raising=False)
    assert platforms.rocm_platform_plugin() is None
