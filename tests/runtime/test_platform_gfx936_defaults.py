# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""gfx936 stable defaults (patch platform-gfx936-stable-defaults).

The out-of-tree gfx936 port only ran correctly with a fixed switch set (its
field report's stable switch set). These tests prove that set is what gfx936
gets with nothing set, that explicit settings win, that other archs are
untouched, and that the table in docs/gfx936-defaults.md is the one the code
applies. CPU only, torch.cuda mocked.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import fake_rocm
import pytest

import vllm.envs as envs
from torch._inductor import config as inductor_config
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.platforms import gfx936_defaults

# Seed section 0.4, verbatim: the port's stable switch set.
SEED_STABLE_SWITCHES = """
DSV4_USE_TRITON_SPARSE=1
DSV4_MOE_ROUTING_Q1=1
DSV4_FP8_WEIGHT_CACHE=0
DSV4_FP8_TRITON_GEMM=0
DSV4_ROCM_SHARED_EXPERTS_STREAM=0
DSV4_GREEDY_LOCAL_ARGMAX=0
DSV4_MOE_Q1_PREPARE=0
VLLM_ROCM_USE_SKINNY_GEMM=0
DSV4_MOE_BACKEND=emulation
""".split()

MANAGED_ENV = (
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
    "VLLM_ROCM_USE_SKINNY_GEMM",
    "VLLM_GFX936_FP8_WEIGHT_CACHE",
    "VLLM_GFX936_SPARSE_DECODE",
    "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture
def env(monkeypatch):
    """Start with none of the managed variables set; restore them afterwards.

    apply_gfx936_defaults writes os.environ itself (so workers inherit it),
    which monkeypatch does not track, hence the explicit restore.
    """
    saved = {name: os.environ.get(name) for name in MANAGED_ENV}
    # apply_gfx936_defaults also sets inductor's config in this process
    # (monkeypatch would delete the attribute, which hides a ConfigModule entry).
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


@pytest.fixture
def infos(monkeypatch):
    """Collect info_once messages of the defaults module."""
    import vllm.logger

    seen: list[str] = []
    real_init_logger = vllm.logger.init_logger

    def init_logger(name):
        if name == gfx936_defaults.__name__:
            return SimpleNamespace(
                info_once=lambda msg, *args, **kw: seen.append(msg % args)
            )
        return real_init_logger(name)

    monkeypatch.setattr(vllm.logger, "init_logger", init_logger)
    return seen


def make_config(quantization="deepseek_v4_fp8", expert_dtype="fp4", moe="auto"):
    hf_config = SimpleNamespace(model_type="deepseek_v4")
    if expert_dtype is not None:
        hf_config.expert_dtype = expert_dtype
    return SimpleNamespace(
        model_config=SimpleNamespace(
            quantization=quantization, hf_config=hf_config, enforce_eager=False
        ),
        kernel_config=SimpleNamespace(moe_backend=moe),
        # As VllmConfig resolved it (graph mode: test_platform_gfx936_graph_mode).
        compilation_config=SimpleNamespace(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
            max_cudagraph_capture_size=8, cudagraph_capture_sizes=[1, 2, 4, 8],
        ),
    )


# ------------------------------------------------------------- the table


def test_every_seed_stable_switch_is_accounted_for():
    """Each switch of the seed's stable set is a default row or explained."""
    covered = [row.port_switch for row in gfx936_defaults.GFX936_DEFAULTS]
    covered += [s for s, _ in gfx936_defaults.PORT_SWITCHES_WITHOUT_DEFAULT]
    for switch in SEED_STABLE_SWITCHES:
        assert any(c.split(" ")[0] == switch for c in covered), switch


def test_default_rows_name_registered_switches_and_an_override():
    for row in gfx936_defaults.GFX936_DEFAULTS:
        assert row.reason and row.default and row.override
        name = row.name
        if name.startswith("VLLM_"):
            assert name in envs.environment_variables, name
            assert row.override.startswith(name + "="), row


def test_docs_table_is_generated_from_the_code():
    doc = Path(__file__).resolve().parents[2] / gfx936_defaults.DOC_PATH
    if not doc.is_file():
        pytest.skip(f"{doc} not present in this checkout")
    assert doc.read_text() == gfx936_defaults.defaults_markdown(), (
        f"regenerate {gfx936_defaults.DOC_PATH} from defaults_markdown()"
    )


# ------------------------------------------------------ applying defaults


@pytest.mark.parametrize(
    "quantization,expert_dtype",
    [("deepseek_v4_fp8", "fp4"), ("deepseek_v4_fp8", None), ("mxfp4", None)],
)
def test_mxfp4_experts_get_emulation_moe_backend_when_auto(
    env, quantization, expert_dtype
):
    config = make_config(quantization, expert_dtype)
    applied = gfx936_defaults.apply_gfx936_defaults(config)
    assert config.kernel_config.moe_backend == "emulation"
    assert "moe_backend=emulation" in applied


@pytest.mark.parametrize(
    "quantization,expert_dtype",
    [("deepseek_v4_fp8", "fp8"), ("fp8", None), (None, None)],
)
def test_non_mxfp4_experts_keep_auto_moe_backend(env, quantization, expert_dtype):
    """FP8/unquantized MoE oracles have no 'emulation'; forcing it would fail."""
    config = make_config(quantization, expert_dtype)
    gfx936_defaults.apply_gfx936_defaults(config)
    assert config.kernel_config.moe_backend == "auto"


@pytest.mark.parametrize("explicit", ["triton_unfused", "aiter", "marlin"])
def test_explicit_moe_backend_wins(env, explicit):
    config = make_config(moe=explicit)
    applied = gfx936_defaults.apply_gfx936_defaults(config)
    assert config.kernel_config.moe_backend == explicit
    assert not any(a.startswith("moe_backend") for a in applied)


def test_shared_experts_stream_is_disabled_for_workers_by_default(env):
    assert envs.VLLM_DISABLE_SHARED_EXPERTS_STREAM is False
    gfx936_defaults.apply_gfx936_defaults(make_config())
    # Set in os.environ so spawned/forked workers inherit it.
    assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1"
    assert envs.VLLM_DISABLE_SHARED_EXPERTS_STREAM is True


def test_explicit_shared_experts_stream_setting_wins(env):
    os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "0"
    applied = gfx936_defaults.apply_gfx936_defaults(make_config())
    assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "0"
    assert envs.VLLM_DISABLE_SHARED_EXPERTS_STREAM is False
    assert not any("SHARED_EXPERTS" in a for a in applied)


def test_fp8_weight_cache_is_off_by_default_and_can_be_enabled(env):
    assert envs.VLLM_GFX936_FP8_WEIGHT_CACHE is False
    os.environ["VLLM_GFX936_FP8_WEIGHT_CACHE"] = "1"
    assert envs.VLLM_GFX936_FP8_WEIGHT_CACHE is True
    applied = gfx936_defaults.apply_gfx936_defaults(make_config())
    assert "VLLM_GFX936_FP8_WEIGHT_CACHE=0" not in applied


def test_inductor_static_launcher_is_off_by_default(env):
    """The port ran with TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 (its field report)."""
    inductor_config.use_static_cuda_launcher = True
    applied = gfx936_defaults.apply_gfx936_defaults(make_config())
    # This process (config already imported) and the workers (environment).
    assert inductor_config.use_static_cuda_launcher is False
    assert os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] == "0"
    assert "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0" in applied


def test_inductor_static_launcher_default_is_what_torch_reads():
    """torch's own default function gives False for the value set."""
    saved = os.environ.get("TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER")
    try:
        os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] = "0"
        assert inductor_config.static_cuda_launcher_default() is False
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER", None)
        else:
            os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] = saved


@pytest.mark.parametrize("explicit", ["0", "1"])
def test_explicit_inductor_static_launcher_setting_wins(env, explicit):
    os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] = explicit
    inductor_config.use_static_cuda_launcher = explicit == "1"
    applied = gfx936_defaults.apply_gfx936_defaults(make_config())
    assert os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] == explicit
    assert inductor_config.use_static_cuda_launcher is (explicit == "1")
    assert not any("STATIC_CUDA_LAUNCHER" in a for a in applied)


def test_defaults_are_logged_once_with_what_was_applied(env, infos):
    gfx936_defaults.apply_gfx936_defaults(make_config())
    assert len(infos) == 1
    message = infos[0]
    for part in (
        "moe_backend=emulation",
        "VLLM_DISABLE_SHARED_EXPERTS_STREAM=1",
        "skinny GEMM off",
        "VLLM_GFX936_FP8_WEIGHT_CACHE=0",
        "sparse decode=auto",
        "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0",
        gfx936_defaults.DOC_PATH,
    ):
        assert part in message, part


# ------------------------------------------------- the RocmPlatform hook


@pytest.fixture
def rocm_arch(env, tmp_path):
    """The env fixture has cleared the managed variables (visibility ones too)."""
    yield from fake_rocm.rocm_arch(env, tmp_path)


def platform_config():
    config = make_config()
    config.parallel_config = SimpleNamespace(worker_cls="auto")
    return config


@pytest.mark.parametrize("arch", ["gfx936", "gfx936:sramecc+:xnack-"])
def test_rocm_platform_applies_defaults_on_gfx936(rocm_arch, arch):
    rocm = rocm_arch(arch)
    config = platform_config()
    rocm.RocmPlatform.check_and_update_config(config)
    assert config.kernel_config.moe_backend == "emulation"
    assert os.environ.get("VLLM_DISABLE_SHARED_EXPERTS_STREAM") == "1"
    assert os.environ.get("TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER") == "0"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a:sramecc+:xnack-"])
def test_rocm_platform_leaves_other_archs_alone(rocm_arch, arch):
    rocm = rocm_arch(arch)
    config = platform_config()
    rocm.RocmPlatform.check_and_update_config(config)
    assert config.kernel_config.moe_backend == "auto"
    assert "VLLM_DISABLE_SHARED_EXPERTS_STREAM" not in os.environ
    assert "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER" not in os.environ
    assert config.parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker"
