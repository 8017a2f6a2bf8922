# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The no-FP8 DeepSeek V4 attention is a subclass, chosen once.

* The amd/ decoder layer builds whatever ``attention_cls()`` returns (a layer
  that builds ``DeepseekV4ROCMAiterMLAAttention`` directly skips the choice).
* ``attention_cls()`` asks ``lacks_fp8_conversion()`` once per process and
  returns ``DeepseekV4Gfx936Attention`` on the CPU and on gfx936, upstream's
  ROCm class on an MI300-family device (platforms from the product's
  platform classes; gfx936 faked at torch's device properties).
* The subclass and its metadata builders are what the no-FP8 path runs: its
  backend builds the gfx936 C128A builder, the SWA cache backend builds the
  gfx936 SWA builder, which has no FlashMLA tile scheduler.
* The integer-only Triton kernels run where a device runs Triton (gfx936);
  the CPU runs their twins.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import fake_rocm
from vllm.models.deepseek_v4.amd import gfx936_attention as g
from vllm.models.deepseek_v4.amd import gfx936_attention_torch as attn_torch
from vllm.models.deepseek_v4.amd import model as amd_model
from vllm.platforms import gfx936_capability as cap
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.mla import sparse_swa


# Upstream's ROCm classes and kernels are read from gfx936_attention's own
# namespace: other tests reload amd/rocm.py (Triton interpreter), which makes
# new class objects under the same names.


@pytest.fixture(autouse=True)
def _fresh_choice():
    forget = getattr(g.attention_cls, "cache_clear", lambda: None)
    forget()
    yield
    forget()


@pytest.fixture
def rocm_arch(monkeypatch, tmp_path):
    yield from fake_rocm.rocm_arch(monkeypatch, tmp_path, clear_env=fake_rocm.VISIBILITY_VARS)


def _use(monkeypatch, platform_cls):
    monkeypatch.setattr(cap, "current_platform", platform_cls())


class _Built(Exception):
    """Raised by the stand-in attention class: the layer constructed it."""


def test_decoder_layer_builds_the_chosen_class(monkeypatch):
    seen = {}

    class StandIn:
        def __init__(self, vllm_config, prefix, **kwargs):
            seen["prefix"] = prefix
            raise _Built

    monkeypatch.setattr(g, "DeepseekV4Gfx936Attention", StandIn)
    _use(monkeypatch, CpuPlatform)
    hf = SimpleNamespace(hidden_size=8, rms_norm_eps=1e-6)
    cfg = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf))
    with pytest.raises(_Built):
        amd_model.DeepseekV4DecoderLayer(cfg, "model.layers.3")
    assert seen["prefix"] == "model.layers.3.attn"


def test_choice_is_made_once_and_logged_once(monkeypatch):
    calls = []
    logs = []

    def no_fp8() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(g, "lacks_fp8_conversion", no_fp8)
    monkeypatch.setattr(g.logger, "info", lambda *a: logs.append(a))
    picks = {g.attention_cls() for _ in range(3)}
    assert picks == {g.DeepseekV4Gfx936Attention}
    assert len(calls) == 1
    assert len(logs) == 1 and "DeepseekV4Gfx936Attention" in logs[0]


def test_cpu_builds_the_no_fp8_subclass_and_its_builders(monkeypatch):
    _use(monkeypatch, CpuPlatform)
    cls = g.attention_cls()
    assert cls is g.DeepseekV4Gfx936Attention
    assert issubclass(cls, g.DeepseekV4ROCMAiterMLAAttention)
    assert cls.backend_cls.get_builder_cls() is g.DeepseekV4Gfx936MLASparseMetadataBuilder
    swa_builder = sparse_swa.DeepseekSparseSWABackend.get_builder_cls()
    assert swa_builder is g.DeepseekV4Gfx936SparseSWAMetadataBuilder
    # The layer reads the ragged fields of the ROCm metadata.
    assert issubclass(swa_builder, g.DeepseekV4ROCMAiterSparseSWAMetadataBuilder)
    # No FlashMLA decode on this path: every layer type gets no tile scheduler.
    sched = swa_builder.build_tile_scheduler(SimpleNamespace(), num_decode_tokens=4)
    assert sched == {"swaonly": None, "c4a": None, "c128a": None}
    # The overridden steps are the subclass's own, not the FP8 Triton ones.
    for name in ("_o_proj", "_forward_prefill", "_forward_decode", "forward_mqa"):
        assert getattr(cls, name) is not getattr(g.DeepseekV4ROCMAiterMLAAttention, name)


def test_cpu_runs_the_twins_of_the_integer_triton_kernels(monkeypatch):
    _use(monkeypatch, CpuPlatform)
    assert (g._integer_op(g.combine_topk_swa_indices, attn_torch.combine_topk_swa_indices)
            is attn_torch.combine_topk_swa_indices)


def test_gfx936_builds_the_subclass_and_keeps_integer_triton(monkeypatch, rocm_arch):
    platform = rocm_arch("gfx936")
    _use(monkeypatch, platform.RocmPlatform)
    assert g.attention_cls() is g.DeepseekV4Gfx936Attention
    assert (g._integer_op(g.combine_topk_swa_indices, attn_torch.combine_topk_swa_indices)
            is g.combine_topk_swa_indices)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_mi300_family_keeps_upstream_rocm_attention(monkeypatch, rocm_arch, arch):
    platform = rocm_arch(arch)
    _use(monkeypatch, platform.RocmPlatform)
    assert g.attention_cls() is g.DeepseekV4ROCMAiterMLAAttention
