# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DAS Triton compatibility: detection, no effect on upstream Triton, and the
``reduce_or`` helper.

Kernels run on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` is set
before Triton is imported). On a machine without a GPU driver vLLM reports no
Triton, so kernel modules are imported with the real ``triton`` patched into
``vllm.triton_utils``.
"""

import importlib

import pytest
import torch
from triton_interp import import_with_real_triton as _import_with_real_triton
from triton_interp import tl, triton

import vllm.triton_utils as vllm_triton_utils
from vllm.triton_utils import das_compat


@pytest.fixture(autouse=True)
def _fresh_detection():
    das_compat.reset_cache()
    yield
    das_compat.reset_cache()


@pytest.mark.parametrize(
    "version_str, backends, expected",
    [
        ("3.0.0+das.opt1.dtk2604", ["amd"], True),
        ("3.1.0+das1.2.git8a1b2c3", [], True),
        ("3.0.0+DAS.opt4.dtk2504", ["nvidia", "amd"], True),
        ("3.0.0+dtk2604", [], True),
        ("3.0.0", ["hcu"], True),
        (None, ["HCU"], True),
        ("3.9.0", ["amd", "nvidia"], False),
        ("3.9.0+git5f3a1b2", ["amd", "nvidia"], False),
        ("3.4.0+rocm6.4.1.git7bb3ea3", ["amd"], False),
        ("3.5.0+gitdasf00d", ["amd"], False),  # "das" inside a hash
        ("das.3.0", ["amd"], False),  # no local segment
        (None, [], False),
    ],
)
def test_das_detector_on_fake_versions_and_backends(version_str, backends, expected):
    assert das_compat.is_das_triton(version_str, backends) is expected


def test_installed_upstream_triton_is_not_detected_as_das():
    assert das_compat.on_das_triton() is False
    assert das_compat.triton_knobs_hooks_available() is True


def _snapshot(module) -> dict[str, int]:
    return {name: id(value) for name, value in vars(module).items()}


def test_compat_layer_changes_nothing_on_upstream_triton(monkeypatch):
    """With upstream Triton, importing vllm.triton_utils (as on a GPU host,
    HAS_TRITON=True) and calling every compat entry point leaves triton,
    triton.language and triton.knobs exactly as they were (no global
    mutation, unlike the seed's sitecustomize shim), and vLLM exports the
    real gluon/aggregate/libdevice, not placeholders."""
    import triton.knobs as knobs
    import triton.language.extra.libdevice as libdevice
    from triton.experimental import gluon
    from triton.language.core import _aggregate

    from vllm.triton_utils import importing

    before = (_snapshot(triton), _snapshot(tl), _snapshot(knobs))
    hook_before = knobs.runtime.jit_post_compile_hook
    monkeypatch.setattr(importing, "HAS_TRITON", True)
    try:
        importlib.reload(vllm_triton_utils)
        assert vllm_triton_utils.HAS_TRITON
        assert vllm_triton_utils.gluon is gluon
        assert vllm_triton_utils.aggregate is _aggregate
        assert vllm_triton_utils.tldevice is libdevice
        das_compat.on_das_triton()
        das_compat.triton_knobs_hooks_available()
        after = (_snapshot(triton), _snapshot(tl), _snapshot(knobs))
    finally:
        monkeypatch.undo()
        importlib.reload(vllm_triton_utils)
    assert before == after
    assert knobs.runtime.jit_post_compile_hook is hook_before


def test_language_extras_fall_back_to_placeholders_only_when_missing(monkeypatch):
    from vllm.triton_utils.importing import TritonLanguagePlaceholder

    real_import = importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name.startswith("triton.experimental"):
            raise ImportError(f"No module named {name!r} (fake old DAS Triton)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(das_compat.importlib, "import_module", fake_import)
    tl_before = _snapshot(tl)
    tldevice, gluon, gl, aggregate = das_compat.import_language_extras()
    assert isinstance(gluon, TritonLanguagePlaceholder)
    assert isinstance(gl, TritonLanguagePlaceholder)
    import triton.language.extra.libdevice as libdevice
    from triton.language.core import _aggregate

    assert tldevice is libdevice
    assert aggregate is _aggregate
    assert _snapshot(tl) == tl_before


def test_jit_monitor_skips_triton_hooks_on_das_without_knobs(monkeypatch):
    """Seed 9.1 (knobs runtime hooks): jit_monitor is activated after every
    warmup and imports triton.knobs; a Triton without it must not fail the
    worker, and nothing may be installed."""
    import triton.knobs as knobs

    from vllm.utils import jit_monitor

    monkeypatch.setattr(jit_monitor, "HAS_TRITON", True)
    monkeypatch.setattr(das_compat, "on_das_triton", lambda: True)
    real_import = importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name == "triton.knobs":
            raise ImportError("No module named 'triton.knobs' (fake DAS)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(das_compat.importlib, "import_module", fake_import)
    hook_before = knobs.runtime.jit_post_compile_hook
    jit_monitor._setup_triton_jit_hook()
    jit_monitor._setup_triton_autotuning_print()
    assert knobs.runtime.jit_post_compile_hook is hook_before


def test_jit_monitor_still_hooks_upstream_triton(monkeypatch):
    import triton.knobs as knobs

    from vllm.utils import jit_monitor

    monkeypatch.setattr(jit_monitor, "HAS_TRITON", True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    jit = importlib.import_module("triton.runtime.jit")
    monkeypatch.setattr(
        jit, "serialize_specialization_data", jit.serialize_specialization_data
    )
    jit_monitor._setup_triton_jit_hook()
    assert knobs.runtime.jit_post_compile_hook is not None


# ---------------------------------------------------------------- reduce_or

_reductions = _import_with_real_triton("vllm.triton_utils.reductions")
reduce_or = _reductions.reduce_or


@triton.jit
def _reduce_or_kernel(
    x_ptr,
    helper_out_ptr,
    upstream_out_ptr,
    M: tl.constexpr,
    N: tl.constexpr,
    AXIS: tl.constexpr,
):
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :])
    y = reduce_or(x, axis=AXIS)
    if AXIS == 0:
        out_offs = cols
    else:
        out_offs = rows
    tl.store(helper_out_ptr + out_offs, y)
    tl.store(upstream_out_ptr + out_offs, tl.reduce_or(x, axis=AXIS))


def _run_reduce_or(x: torch.Tensor, axis: int):
    m, n = x.shape
    size = n if axis == 0 else m
    helper = torch.empty(size, dtype=x.dtype)
    upstream = torch.empty(size, dtype=x.dtype)
    _reduce_or_kernel[(1,)](x, helper, upstream, M=m, N=n, AXIS=axis)
    return helper, upstream


@pytest.mark.parametrize("shape", [(4, 8), (16, 32)])
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_or_equals_torch_any_on_zero_one_input(shape, axis):
    g = torch.Generator().manual_seed(shape[0] + 10 * axis)
    x = (torch.rand(shape, generator=g) < 0.1).to(torch.int32)
    helper, upstream = _run_reduce_or(x, axis)
    expected = torch.any(x.bool(), dim=axis).to(torch.int32)
    assert torch.equal(helper, expected)
    assert torch.equal(helper, upstream)


@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_or_is_bitwise_or_like_upstream(axis):
    g = torch.Generator().manual_seed(3 + axis)
    bits = torch.randint(0, 31, (8, 16), generator=g)
    x = torch.where(torch.rand(8, 16, generator=g) < 0.3, 1 << bits, 0).int()
    x[0, 0] = -(1 << 31)  # bit 31 (sign) must survive, as for expert id 31
    helper, upstream = _run_reduce_or(x, axis)
    ref = torch.zeros_like(x.select(axis, 0))
    for part in x.unbind(axis):
        ref |= part
    assert torch.equal(helper, ref)
    assert torch.equal(helper, upstream)


def test_gpt_oss_pack_bitmatrix_uses_the_helper_and_matches_reference():
    """The only vLLM caller of tl.reduce_or (gpt-oss triton_kernels MoE
    routing) runs on the helper: its bitmatrix equals a torch bit-packing of
    the top-k expert ids (-1 ids ignored)."""
    moe = _import_with_real_triton(
        "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
    )
    import inspect

    assert "tl.reduce_or(" not in inspect.getsource(moe.pack_bitmatrix.fn)
    n_rows, topk, n_experts = 8, 4, 64
    bm_cols = n_experts // 32
    g = torch.Generator().manual_seed(11)
    topk_ids = torch.stack(
        [torch.randperm(n_experts, generator=g)[:topk] for _ in range(n_rows)]
    ).to(torch.int16)
    topk_ids[2, 1] = -1
    bitmatrix = torch.zeros(n_rows, bm_cols, dtype=torch.int32)
    moe.pack_bitmatrix[(1,)](
        bitmatrix,
        topk_ids,
        n_rows,
        bm_cols,
        topk,
        BLOCK_SIZE_M=8,
        BLOCK_SIZE_K=32,
    )
    ref = torch.zeros(n_rows, bm_cols, dtype=torch.int64)
    for r in range(n_rows):
        for e in topk_ids[r].tolist():
            if e >= 0:
                ref[r, e // 32] |= 1 << (e % 32)
    ref = torch.where(ref >= 2**31, ref - 2**32, ref).to(torch.int32)
    assert torch.equal(bitmatrix, ref)
