# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ROCm platform without amdsmi (patch platform-rocm-detect-gfx936).

DTK may ship no ``amdsmi`` Python package. Upstream then only logs the failed
import, and every ``@with_amdsmi_context`` method dies with ``NameError: name
'amdsmi_init' is not defined``. ``get_device_name`` (Triton MoE config lookup,
fp8_utils, triton_attn) and ``get_device_uuid`` must answer from torch; the
other amdsmi-only queries must raise an error naming amdsmi.
"""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace

import fake_rocm
import pytest
import torch

DEVICES = {
    0: SimpleNamespace(
        gcnArchName="gfx936:sramecc+:xnack-",
        name="Hygon DCU K100_AI (test)",
        uuid=uuid.UUID("11111111-2222-3333-4444-555555555555"),
        total_memory=64 << 30,
    ),
    1: SimpleNamespace(
        gcnArchName="gfx936:sramecc+:xnack-",
        name="Hygon DCU BW1000 (test)",
        uuid=uuid.UUID("66666666-7777-8888-9999-000000000000"),
        total_memory=64 << 30,
    ),
}


@pytest.fixture
def rocm_without_amdsmi(monkeypatch, tmp_path):
    """vllm.platforms.rocm imported afresh with ``import amdsmi`` failing."""
    # None in sys.modules makes `from amdsmi import ...` raise ImportError,
    # whether or not amdsmi is installed here.
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    gen = fake_rocm.rocm_arch(monkeypatch, tmp_path, fake_rocm.VISIBILITY_VARS)
    set_arch = next(gen)
    rocm = set_arch("gfx936:sramecc+:xnack-")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: DEVICES[device]
    )
    yield rocm
    gen.close()


def test_amdsmi_import_really_failed(rocm_without_amdsmi):
    assert "amdsmi_init" not in vars(rocm_without_amdsmi)


@pytest.mark.parametrize("device_id", [0, 1])
def test_device_name_falls_back_to_torch(rocm_without_amdsmi, device_id):
    platform = rocm_without_amdsmi.RocmPlatform
    assert platform.get_device_name(device_id) == DEVICES[device_id].name
    assert platform.get_device_name(device_id=device_id) == DEVICES[device_id].name


def test_device_name_default_is_device_0(rocm_without_amdsmi):
    assert rocm_without_amdsmi.RocmPlatform.get_device_name() == DEVICES[0].name


@pytest.mark.parametrize("device_id", [0, 1])
def test_device_uuid_falls_back_to_torch(rocm_without_amdsmi, device_id):
    got = rocm_without_amdsmi.RocmPlatform.get_device_uuid(device_id)
    assert got == str(DEVICES[device_id].uuid)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.is_fully_connected([0, 1]),
        lambda p: p.get_all_device_numa_nodes(),
    ],
    ids=["is_fully_connected", "get_all_device_numa_nodes"],
)
def test_other_amdsmi_queries_name_amdsmi(rocm_without_amdsmi, call):
    with pytest.raises(RuntimeError, match="needs the amdsmi Python package"):
        call(rocm_without_amdsmi.RocmPlatform)


def test_total_memory_still_falls_back(rocm_without_amdsmi):
    # Upstream's own torch fallback catches the amdsmi error as before.
    got = rocm_without_amdsmi.RocmPlatform.get_device_total_memory(1)
    assert got == DEVICES[1].total_memory
