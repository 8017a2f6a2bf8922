"""The fork's switches are registered vLLM env vars (documented, validated), default to the stable
behaviour, and parse the way their docs say."""
from __future__ import annotations

import pytest

import vllm.envs as envs  # an import failure of the product is a failure, not a skip

SWITCHES = {
    "VLLM_GFX936_SPARSE_DECODE": "auto",
    "VLLM_GFX936_SPARSE_VALIDATE": False,
    "VLLM_GFX936_FP8_WEIGHT_CACHE": False,
    "VLLM_GFX936_FUSED_OPS": "auto",
    "VLLM_GFX936_W8A16_GEMV_MAX_M": None,  # unset: decided from the graph mode
    "VLLM_GFX936_MOE_DIRECT_MAX_M": None,  # unset: the kernels' limit, 64
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


@pytest.mark.parametrize("name,default", SWITCHES.items())
def test_switch_is_registered_with_its_stable_default(name, default):
    assert name in envs.environment_variables
    assert getattr(envs, name) == default
    assert not envs.is_set(name)


@pytest.mark.parametrize("name", ["VLLM_GFX936_SPARSE_VALIDATE", "VLLM_GFX936_FP8_WEIGHT_CACHE"])
def test_boolean_switches_turn_on_with_1(monkeypatch, name):
    monkeypatch.setenv(name, "1")
    assert getattr(envs, name) is True and envs.is_set(name)
    monkeypatch.setenv(name, "0")
    assert getattr(envs, name) is False


def test_sparse_decode_rejects_an_unknown_choice_naming_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "fast")
    with pytest.raises(ValueError, match="VLLM_GFX936_SPARSE_DECODE"):
        _ = envs.VLLM_GFX936_SPARSE_DECODE
    monkeypatch.setenv("VLLM_GFX936_SPARSE_DECODE", "reference")
    assert envs.VLLM_GFX936_SPARSE_DECODE == "reference"


def test_unknown_vllm_variable_is_still_reported_by_upstream_validation(monkeypatch):
    monkeypatch.setenv("VLLM_GFX936_SPARSE_VALIDAT", "1")  # a typo must not pass silently
    with pytest.raises(ValueError, match="VLLM_GFX936_SPARSE_VALIDAT"):
        envs.validate_environ(hard_fail=True)


def test_gemv_token_limit_parses_as_an_integer(monkeypatch):
    monkeypatch.setenv("VLLM_GFX936_W8A16_GEMV_MAX_M", "8")
    assert envs.VLLM_GFX936_W8A16_GEMV_MAX_M == 8 and envs.is_set("VLLM_GFX936_W8A16_GEMV_MAX_M")


def test_moe_direct_token_limit_parses_as_an_integer(monkeypatch):
    monkeypatch.setenv("VLLM_GFX936_MOE_DIRECT_MAX_M", "16")
    assert envs.VLLM_GFX936_MOE_DIRECT_MAX_M == 16 and envs.is_set("VLLM_GFX936_MOE_DIRECT_MAX_M")
