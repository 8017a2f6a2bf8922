# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Startup validation of the gfx936 switches (patch
startup-validate-gfx936-switches).

Issue #11: ``VLLM_GFX936_SPARSE_VALIDATE=true`` passed engine start and
failed later inside a worker with a bare ``ValueError: invalid literal for
int()``. Each bad value must stop ``EngineArgs`` with the variable's name.
"""

from __future__ import annotations

import pytest

import fake_rocm
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.gfx936_switch_validation import switch_errors

INT_SWITCHES = ["VLLM_GFX936_SPARSE_VALIDATE", "VLLM_GFX936_FP8_WEIGHT_CACHE",
                "VLLM_DISABLE_SHARED_EXPERTS_STREAM"]


@pytest.fixture
def rocm_arch(monkeypatch, tmp_path):
    yield from fake_rocm.rocm_arch(monkeypatch, tmp_path / "kfd",
                                   clear_env=fake_rocm.VISIBILITY_VARS)


@pytest.fixture
def clean(monkeypatch):
    for name in INT_SWITCHES + ["VLLM_ROCM_USE_SKINNY_GEMM",
                                "VLLM_GFX936_SPARSE_DECODE"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", INT_SWITCHES)
@pytest.mark.parametrize("value", ["true", "on", "yes", "1.0", ""])
def test_engine_args_name_an_unreadable_integer_switch(clean, tmp_path, name,
                                                       value):
    clean.setenv(name, value)
    with pytest.raises(ValueError) as e:
        EngineArgs(model=str(tmp_path))
    msg = str(e.value)
    assert f"{name}={value!r}" in msg and "use 1 (on) or 0 (off)" in msg
    # the product's own parser would have failed later, without the name
    import vllm.envs as envs
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    with pytest.raises(ValueError) as late:
        getattr(envs, name)
    assert name not in str(late.value)


@pytest.mark.parametrize("value", ["0", "1", " 1 "])
def test_valid_values_pass(clean, tmp_path, value):
    for name in INT_SWITCHES:
        clean.setenv(name, value)
    clean.setenv("VLLM_ROCM_USE_SKINNY_GEMM", "false")
    clean.setenv("VLLM_GFX936_SPARSE_DECODE", "reference")
    EngineArgs(model=str(tmp_path))


def test_all_bad_switches_are_listed_at_once():
    errors = switch_errors({"VLLM_GFX936_SPARSE_VALIDATE": "true",
                            "VLLM_ROCM_USE_SKINNY_GEMM": "yes",
                            "VLLM_GFX936_SPARSE_DECODE": "fast",
                            "VLLM_GFX936_FP8_WEIGHT_CACHE": "0"})
    assert len(errors) == 3
    assert any("VLLM_ROCM_USE_SKINNY_GEMM='yes'" in e and "silently" in e
               for e in errors)
    assert any("VLLM_GFX936_SPARSE_DECODE='fast'" in e
               and "auto, kernel, triton, reference" in e for e in errors)


@pytest.mark.parametrize("value", ["auto", "kernel", "triton", "reference"])
def test_every_sparse_decode_path_envs_accepts_passes_startup(clean, value):
    """Regression: the fast-decode tiers were accepted by envs.py and documented, but the startup
    check still allowed only auto/reference, so `=triton` / `=kernel` stopped the engine."""
    import vllm.envs as envs

    clean.setenv("VLLM_GFX936_SPARSE_DECODE", value)
    assert envs.VLLM_GFX936_SPARSE_DECODE == value  # envs.py's own choices accept it
    assert switch_errors({"VLLM_GFX936_SPARSE_DECODE": value}) == []


def _every_choice():
    import vllm.envs as envs

    return [(name, value) for name, values in envs.GFX936_SWITCH_CHOICES.items()
            for value in values]


@pytest.mark.parametrize("name,value", _every_choice())
def test_every_value_envs_lists_passes_startup_and_the_selectors(clean, name, value):
    """The values are listed once (vllm/envs.py): envs, the startup check and the selector that
    resolves the switch all accept each of them (they drifted when each kept its own list)."""
    import vllm.envs as envs
    from vllm.platforms import gfx936_kernel_select as sel

    clean.setenv(name, value)
    assert getattr(envs, name) == value
    assert switch_errors({name: value}) == []
    op = {env: op for op, (env, _) in sel.OPS.items()}[name]
    everything = {t: (True, "test") for t in sel.OPS[op][1]}
    assert sel.resolve(op, value, everything)[0] in sel.OPS[op][1]
    clean.setenv(name, value + "x")
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)
    assert any(name in e for e in switch_errors({name: value + "x"}))


def test_skinny_gemm_on_gfx936_is_refused_at_startup(clean, rocm_arch,
                                                     tmp_path):
    rocm_arch("gfx936:sramecc+:xnack-")
    clean.setenv("VLLM_ROCM_USE_SKINNY_GEMM", "1")
    with pytest.raises(ValueError, match="not supported on gfx936"):
        EngineArgs(model=str(tmp_path))
    clean.setenv("VLLM_ROCM_USE_SKINNY_GEMM", "0")
    EngineArgs(model=str(tmp_path))
