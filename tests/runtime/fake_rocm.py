# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A faked ROCm device for the gfx936 platform tests (test utility).

``torch.cuda`` is mocked to report an arch and ``vllm.platforms.rocm`` is
imported afresh over it, so the platform code runs on CPU. Not product code.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import torch

from vllm.platforms import gfx936

ROCM_MODULE = "vllm.platforms.rocm"

VISIBILITY_VARS = (
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
)


def fake_rocm_torch(monkeypatch, gcn_arch):
    """Make torch look like a ROCm build whose device 0 reports gcn_arch.

    Returns the list of device ids get_device_properties was called with, so a
    test can prove a path did not initialise the device.
    """
    calls = []

    def get_device_properties(device=None):
        calls.append(device)
        if gcn_arch is None:
            raise RuntimeError("no HIP device (test)")
        return SimpleNamespace(gcnArchName=gcn_arch, total_memory=64 << 30)

    monkeypatch.setattr(torch.version, "hip", "6.3.0-test", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    return calls


def import_rocm_afresh():
    """Import vllm.platforms.rocm again, so it reads the (faked) arch."""
    sys.modules.pop(ROCM_MODULE, None)
    return importlib.import_module(ROCM_MODULE)


def restore_rocm_module(saved):
    """Put back the vllm.platforms.rocm seen before the test (or none)."""
    if saved is not None:
        sys.modules[ROCM_MODULE] = saved
    else:
        sys.modules.pop(ROCM_MODULE, None)


def rocm_arch(monkeypatch, tmp_path, clear_env=()):
    """Body of a ``rocm_arch`` fixture: yields ``set(arch)`` -> rocm module.

    Unsets the variables in clear_env, points KFD detection at an absent
    directory and, per call, fakes torch for the arch, resets the gfx936
    cache and imports vllm.platforms.rocm afresh; restores it afterwards.
    Use as ``yield from fake_rocm.rocm_arch(monkeypatch, tmp_path)``.
    """
    for name in clear_env:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gfx936, "KFD_TOPOLOGY_NODES", str(tmp_path / "absent"))
    saved = sys.modules.get(ROCM_MODULE)

    def _set(arch):
        fake_rocm_torch(monkeypatch, arch)
        gfx936.reset_cache()
        return import_rocm_afresh()

    yield _set
    gfx936.reset_cache()
    restore_rocm_module(saved)
