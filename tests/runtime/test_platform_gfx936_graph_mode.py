# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936 graph mode (patch gfx936-graph-mode-default): eager with nothing set (the port's
enforce_eager=True), full_decode / vllm by VLLM_GFX936_GRAPH_MODE, --enforce-eager always wins,
a bad value names the variable; applied on gfx936 only, through RocmPlatform.check_and_update_config.
CPU only, torch.cuda mocked (fake_rocm)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import fake_rocm
import pytest

import vllm.envs as envs
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.platforms import gfx936_defaults, gfx936_graph_mode
from vllm.platforms.gfx936_switch_validation import switch_errors

MANAGED_ENV = ("VLLM_GFX936_GRAPH_MODE", "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
               "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER", "ROCR_VISIBLE_DEVICES",
               "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
SIZES = [1, 2, 4, 8, 16, 32]


@pytest.fixture
def env(monkeypatch):
    saved = {name: os.environ.get(name) for name in MANAGED_ENV}
    from torch._inductor import config as inductor_config

    saved_launcher = inductor_config.use_static_cuda_launcher
    for name in MANAGED_ENV:
        os.environ.pop(name, None)
    yield monkeypatch
    inductor_config.use_static_cuda_launcher = saved_launcher
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def resolved_config(enforce_eager: bool = False):
    """What VllmConfig.__post_init__ hands the platform hook with vLLM's defaults
    (VLLM_COMPILE, FULL_AND_PIECEWISE, capture sizes set) or after --enforce-eager."""
    if enforce_eager:
        cc = SimpleNamespace(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE,
                             max_cudagraph_capture_size=0, cudagraph_capture_sizes=[])
    else:
        cc = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE,
                             cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                             max_cudagraph_capture_size=SIZES[-1],
                             cudagraph_capture_sizes=list(SIZES))
    hf_config = SimpleNamespace(model_type="deepseek_v4", expert_dtype="fp4")
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization="deepseek_v4_fp8", hf_config=hf_config,
                                     enforce_eager=enforce_eager),
        kernel_config=SimpleNamespace(moe_backend="auto"),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=cc,
        parallel_config=SimpleNamespace(worker_cls="auto", decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))


def test_default_is_eager_as_enforce_eager(env):
    assert envs.VLLM_GFX936_GRAPH_MODE == "eager"
    cfg = resolved_config()
    applied = gfx936_defaults.apply_gfx936_defaults(cfg)
    cc = cfg.compilation_config
    assert cfg.model_config.enforce_eager is True
    assert cc.mode == CompilationMode.NONE and cc.cudagraph_mode == CUDAGraphMode.NONE
    assert cc.cudagraph_capture_sizes == [] and cc.max_cudagraph_capture_size == 0
    assert any(a.startswith("graph mode eager") for a in applied)


def test_full_decode_keeps_capture_sizes_and_drops_compile(env):
    os.environ["VLLM_GFX936_GRAPH_MODE"] = "full_decode"
    cfg = resolved_config()
    applied = gfx936_defaults.apply_gfx936_defaults(cfg)
    cc = cfg.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert cc.mode == CompilationMode.NONE
    assert cc.cudagraph_capture_sizes == SIZES and cfg.model_config.enforce_eager is False
    # Valid as vLLM sees it: FULL_DECODE_ONLY needs no piecewise compilation.
    assert not cc.cudagraph_mode.requires_piecewise_compilation()
    assert any("full_decode" in a for a in applied)


def test_vllm_leaves_the_config_alone(env):
    os.environ["VLLM_GFX936_GRAPH_MODE"] = "vllm"
    cfg = resolved_config()
    before = dict(vars(cfg.compilation_config))
    applied = gfx936_defaults.apply_gfx936_defaults(cfg)
    assert dict(vars(cfg.compilation_config)) == before
    assert cfg.model_config.enforce_eager is False
    assert not any("graph mode" in a for a in applied)


@pytest.mark.parametrize("mode", ["eager", "full_decode", "vllm"])
def test_enforce_eager_always_wins(env, mode):
    os.environ["VLLM_GFX936_GRAPH_MODE"] = mode
    cfg = resolved_config(enforce_eager=True)
    gfx936_graph_mode.apply_gfx936_graph_mode(cfg)
    cc = cfg.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.mode == CompilationMode.NONE


def test_bad_value_names_the_variable(env):
    os.environ["VLLM_GFX936_GRAPH_MODE"] = "graphs"
    with pytest.raises(ValueError, match="VLLM_GFX936_GRAPH_MODE"):
        gfx936_graph_mode.apply_gfx936_graph_mode(resolved_config())
    errors = switch_errors({"VLLM_GFX936_GRAPH_MODE": "graphs"})
    assert len(errors) == 1 and "VLLM_GFX936_GRAPH_MODE='graphs'" in errors[0]
    assert "full_decode" in errors[0]
    assert switch_errors({"VLLM_GFX936_GRAPH_MODE": "full_decode"}) == []


@pytest.fixture
def rocm_arch(env, tmp_path):
    yield from fake_rocm.rocm_arch(env, tmp_path)


@pytest.mark.parametrize("arch", ["gfx936", "gfx942"])
def test_platform_hook_applies_it_on_gfx936_only(rocm_arch, arch):
    rocm = rocm_arch(arch)
    cfg = resolved_config()
    rocm.RocmPlatform.check_and_update_config(cfg)
    cc = cfg.compilation_config
    if arch == "gfx936":
        assert cc.cudagraph_mode == CUDAGraphMode.NONE and cfg.model_config.enforce_eager
    else:
        assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
        assert cc.mode == CompilationMode.VLLM_COMPILE and not cfg.model_config.enforce_eager


@pytest.fixture
def warnings_seen(monkeypatch):
    import vllm.logger

    seen: list[str] = []
    real = vllm.logger.init_logger

    def init_logger(name):
        if name == gfx936_graph_mode.__name__:
            return SimpleNamespace(warning_once=lambda msg, *a, **k: seen.append(msg % a))
        return real(name)

    monkeypatch.setattr(vllm.logger, "init_logger", init_logger)
    return seen


def test_full_decode_without_capture_sizes_runs_eagerly_and_says_so(env, warnings_seen):
    """vLLM resolved graphs off before the hook (no capture sizes): FULL_DECODE_ONLY would
    capture nothing, so the engine runs eagerly and the log does not claim graphs."""
    os.environ["VLLM_GFX936_GRAPH_MODE"] = "full_decode"
    cfg = resolved_config(enforce_eager=True)
    cfg.model_config.enforce_eager = False  # -cc.cudagraph_mode=NONE, not --enforce-eager
    got = gfx936_graph_mode.apply_gfx936_graph_mode(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert got.startswith("graph mode eager") and "full_decode" not in got
    assert len(warnings_seen) == 1 and "no CUDA/HIP graph capture sizes" in warnings_seen[0]


@pytest.mark.parametrize("mode", ["eager", "full_decode"])
def test_an_explicit_cudagraph_mode_is_replaced_with_a_warning(env, warnings_seen, mode):
    os.environ["VLLM_GFX936_GRAPH_MODE"] = mode
    cfg = resolved_config()
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE  # -cc.cudagraph_mode=PIECEWISE
    gfx936_graph_mode.apply_gfx936_graph_mode(cfg)
    assert len(warnings_seen) == 1 and "VLLM_GFX936_GRAPH_MODE=vllm" in warnings_seen[0]
    # vLLM's own default is not "explicit": no warning on a bare serve
    warnings_seen.clear()
    gfx936_graph_mode.apply_gfx936_graph_mode(resolved_config())
    assert warnings_seen == []


# ---- the W8A16 GEMV / dequantize + BLAS switch follows the graph mode ---------------------------
@pytest.mark.parametrize("mode,enforce_eager,gemv_max_m", [
    ("eager", False, 16),        # the gfx936 default: one launch per dense linear up to 16 tokens
    ("full_decode", False, 4),   # graphs: the H200's device-time crossover
    ("vllm", False, 4),          # vLLM's own default: FULL_AND_PIECEWISE graphs
    ("full_decode", True, 16),   # --enforce-eager wins
])
def test_w8a16_gemv_max_m_follows_the_graph_mode_in_effect(env, mode, enforce_eager, gemv_max_m):
    """The dense linears' GEMV token limit is decided from the config the graph-mode hook left:
    16 when decode steps run eagerly (a launch saved), 4 when they replay from graphs."""
    import vllm.config as vllm_config_mod
    from vllm.platforms import gfx936_kernel_select as sel

    os.environ["VLLM_GFX936_GRAPH_MODE"] = mode
    env.delenv("VLLM_GFX936_W8A16_GEMV_MAX_M", raising=False)
    cfg = resolved_config(enforce_eager=enforce_eager)
    gfx936_graph_mode.apply_gfx936_graph_mode(cfg)
    env.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: cfg)
    sel.reset()
    try:
        assert sel.w8a16_gemv_max_m() == gemv_max_m
    finally:
        sel.reset()
