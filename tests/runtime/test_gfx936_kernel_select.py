# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""csrc_gfx936 part 2 on the CPU tier: which path runs (patch
gfx936-kernel-select) and the dispatch modules' own logic (patches
linear-fp8-w8a16-gfx936-kernel, moe-mxfp4-gfx936-kernel) with the extension
absent (the CPU wheel) and "present" (tests/runtime/fake_gfx936_ops.py, a
PyTorch stand-in written from the ops' contracts).

What the CPU cannot check, the kernels' own arithmetic, is checked against
float64 on the H200 tier by bench/gfx936_kernels.py (docs/bench/
w8a16-moe-kernels-h200.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import fake_gfx936_ops as fake
from vllm.platforms import gfx936_kernel_select as sel
from vllm.platforms.gfx936_switch_validation import switch_errors

AVAILABLE = (True, "loaded")
MISSING = (False, "the csrc_gfx936 extension is not in this build")
ORACLE = {"w8a16": "torch", "mxfp4_moe": "emulation", "sparse_mla_decode": "reference",
          "fused_ops": "torch"}


def on_gpu(op, kernel=AVAILABLE):
    return {"kernel": kernel, ORACLE[op]: (True, "always")}


def on_cpu(op):
    return {"kernel": (False, sel.NO_DEVICE), ORACLE[op]: (True, "always")}


# ---- selection (pure): one tier table for every op family ----------------------------
def test_one_table_lists_every_switch_once_with_its_tiers():
    """Every op family is a row of one table; its switch's values (vllm/envs.py) are auto
    plus its tiers, and the last tier is the PyTorch oracle."""
    import vllm.envs as envs

    assert set(sel.OPS) == {"sparse_mla_decode", "w8a16", "mxfp4_moe", "fused_ops"}
    assert set(envs.GFX936_SWITCH_CHOICES) == {env for env, _ in sel.OPS.values()}
    for op, (env, tiers) in sel.OPS.items():
        assert list(envs.GFX936_SWITCH_CHOICES[env]) == ["auto", *tiers]
        assert tiers[0] == ("triton" if op == "fused_ops" else "kernel")
        assert tiers[-1] == ORACLE[op]


@pytest.mark.parametrize("op,fallback", [("w8a16", "torch"), ("mxfp4_moe", "emulation")])
def test_auto_takes_kernels_on_a_gpu_with_the_extension(op, fallback):
    assert sel.resolve(op, "auto", on_gpu(op)) == ("kernel", [])
    path, notes = sel.resolve(op, "auto", on_gpu(op, MISSING))
    assert path == fallback
    env = sel.OPS[op][0]
    assert len(notes) == 1 and "not in this build" in notes[0] and f"{env}=kernel" in notes[0]


@pytest.mark.parametrize("op,fallback", [("w8a16", "torch"), ("mxfp4_moe", "emulation")])
def test_cpu_runs_the_pytorch_path_silently_and_forcing_kernels_fails_loudly(op, fallback):
    assert sel.resolve(op, "auto", on_cpu(op)) == (fallback, [])
    env = sel.OPS[op][0]
    with pytest.raises(ValueError, match=f"{env}=kernel.*no GPU device"):
        sel.resolve(op, "kernel", on_cpu(op))
    with pytest.raises(ValueError, match=f"{env}=kernel.*not in this build.*build.sh"):
        sel.resolve(op, "kernel", on_gpu(op, MISSING))
    assert sel.resolve(op, "kernel", on_gpu(op)) == ("kernel", [])
    # the forced PyTorch path wins even where the kernels could run
    assert sel.resolve(op, fallback, on_gpu(op)) == (fallback, [])


def test_bad_values_name_the_switch():
    with pytest.raises(ValueError, match="VLLM_GFX936_W8A16_IMPL='fast'"):
        sel.resolve("w8a16", "fast", on_gpu("w8a16"))
    errs = switch_errors({"VLLM_GFX936_W8A16_IMPL": "fast",
                          "VLLM_GFX936_MXFP4_MOE_IMPL": "torch"})
    assert len(errs) == 2
    assert "VLLM_GFX936_W8A16_IMPL='fast'" in errs[0] and "kernel" in errs[0]
    assert "VLLM_GFX936_MXFP4_MOE_IMPL='torch'" in errs[1] and "emulation" in errs[1]
    assert switch_errors({"VLLM_GFX936_W8A16_IMPL": "kernel",
                          "VLLM_GFX936_MXFP4_MOE_IMPL": "emulation"}) == []


def test_the_cpu_process_runs_the_pytorch_paths_decided_once(monkeypatch):
    for env in ("VLLM_GFX936_W8A16_IMPL", "VLLM_GFX936_MXFP4_MOE_IMPL",
                "VLLM_GFX936_SPARSE_DECODE", "VLLM_GFX936_FUSED_OPS"):
        monkeypatch.delenv(env, raising=False)
    sel.reset()
    try:
        assert sel.path("w8a16") == "torch"
        assert sel.path("mxfp4_moe") == "emulation"
        assert sel.path("sparse_mla_decode") == "reference"
        assert sel.path("fused_ops") == "torch"
        # decided once: the switch is not read again in this process
        monkeypatch.setenv("VLLM_GFX936_W8A16_IMPL", "kernel")
        assert sel.path("w8a16") == "torch"
        sel.reset()
        with pytest.raises(ValueError, match="VLLM_GFX936_W8A16_IMPL=kernel"):
            sel.path("w8a16")
    finally:
        sel.reset()


@pytest.mark.parametrize("chosen,runs", [("triton", "triton"), ("torch", "twin")])
def test_the_fused_ops_on_a_device_follow_the_fused_ops_row(monkeypatch, chosen, runs):
    """VLLM_GFX936_FUSED_OPS=torch is the way out on a device where a fused kernel does not
    lower: every gfx936_fused_* op then runs its PyTorch twin; otherwise its Triton kernel.
    A meta tensor stands in for a device tensor (is_cpu False); the implementations are
    replaced by recorders."""
    import vllm.model_executor.kernels.mhc.gfx936_fused as mhc
    import vllm.model_executor.kernels.mhc.gfx936_triton as mhc_tri
    import vllm.models.deepseek_v4.amd.gfx936_attention_torch as twins
    import vllm.models.deepseek_v4.common.ops.gfx936_inv_rope as inv
    import vllm.models.deepseek_v4.common.ops.gfx936_inv_rope_triton as inv_tri
    import vllm.models.deepseek_v4.common.ops.gfx936_kv_insert as kvi
    import vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton as kvi_tri

    monkeypatch.setattr(sel, "path", lambda op: chosen if op == "fused_ops" else "kernel")
    seen = []

    def rec(name):
        return lambda *a, **k: seen.append(name)

    monkeypatch.setattr(mhc_tri, "mhc_post_triton_fused", rec("triton"))
    monkeypatch.setattr(mhc, "mhc_post_torch", rec("twin"))
    monkeypatch.setattr(kvi_tri, "qnorm_rope_kv_insert_triton", rec("triton"))
    monkeypatch.setattr(twins, "qnorm_rope_kv_insert", rec("twin"))
    monkeypatch.setattr(inv_tri, "inv_rope_triton", rec("triton"))
    monkeypatch.setattr(twins, "rope_gptj",
                        lambda *a, **k: seen.append("twin") or torch.empty(1))
    meta = torch.empty(2, 4, 8, device="meta")
    mhc._post(meta, meta, meta, meta)
    kvi._insert(meta, meta, meta, meta, meta, meta, 8, 1e-6, 64)
    inv._inv_rope(meta, meta, meta, 64)
    assert seen == [runs] * 3, seen


# ---- the loader: absent, stale, present (fresh interpreters: ops cannot be unregistered)
def _loader(setup: str) -> str:
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(fake.__file__.rsplit('/', 1)[0])!r})
        {setup}
        from vllm.gfx936 import kernels
        print(kernels.load())
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def test_loader_absent_stale_and_present():
    assert _loader("pass").startswith("(False, 'the csrc_gfx936 extension is not in this build")
    stale = _loader('lib = torch.library.Library("_gfx936_C", "DEF"); '
                    'lib.define("sparse_mla_decode(Tensor q) -> ()")')
    assert stale.startswith("(False") and "w8a16_gemv" in stale and "moe_route" in stale
    assert _loader("import fake_gfx936_ops; fake_gfx936_ops.register()").startswith("(True")


_COMPILE_THROUGH_THE_OPS = """
    import fake_gfx936_ops
    fake_gfx936_ops.register()
    if {load}:
        from vllm.gfx936 import kernels
        assert kernels.load()[0]
    registry = torch._library.simple_registry.singleton
    print("fakes", [registry.find("_gfx936_C::" + op).fake_impl.kernel is not None
                    for op in fake_gfx936_ops.OPS])
    w = torch.randn(256, 384).to(torch.float8_e4m3fn).view(torch.uint8)
    s = torch.full((2, 3), 126, dtype=torch.uint8)

    def dequant(w, s):
        out = torch.empty(w.shape, dtype=torch.bfloat16)
        torch.ops._gfx936_C.fp8_block_dequant(w, s, 128, 128, out)
        return out * 2

    want = dequant(w, s)
    try:
        # dynamic shapes, as vLLM compiles (a static trace could run the real op instead)
        got = torch.compile(dequant, backend="eager", fullgraph=True, dynamic=True)(w, s)
        print("traced", bool(torch.equal(got, want)))
    except Exception as e:
        print("untraceable", type(e).__name__)
"""


def test_loaded_ops_have_fake_implementations_so_torch_compile_traces_them():
    """load() registers a fake for every op (not every torch derives one for an op without
    returns); a full graph with dynamic shapes through an op then compiles and gives the
    eager result."""
    def run(load: bool) -> list[str]:
        code = textwrap.dedent(f"""
            import sys, torch
            sys.path.insert(0, {str(fake.__file__.rsplit('/', 1)[0])!r})
        """) + textwrap.dedent(_COMPILE_THROUGH_THE_OPS).format(load=load)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-2:]

    assert run(True) == [f"fakes {[True] * len(fake.OPS)}", "traced True"]
    assert run(False)[0] == f"fakes {[False] * len(fake.OPS)}"  # nothing else registers them


# ---- dispatch modules on the fake extension ---------------------------------------------
@pytest.fixture(scope="module")
def ops():
    fake.register()
    return torch.ops._gfx936_C


def _fp8_dense(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    return w, s


def _rel(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("m", [1, 4, 5, 33])
@pytest.mark.parametrize("groups", [1, 2])
def test_w8a16_dispatch_matches_float64_on_both_paths(ops, m, groups):
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16_kernel as wk

    w, s = _fp8_dense(256, 384, seed=m + groups)
    x = torch.randn(m, groups * 384).to(torch.bfloat16)
    before = dict(fake.CALLS)
    out = wk.w8a16_block_mm_kernel(x, w, s, (128, 128), torch.bfloat16, groups)
    used = {k for k, v in fake.CALLS.items() if v != before.get(k, 0)}
    assert used == ({"w8a16_gemv"} if m <= wk.GEMV_MAX_M else {"fp8_block_dequant"})
    w64 = w.to(torch.float64) * torch.exp2(s.double() - 127).repeat_interleave(
        128, 0).repeat_interleave(128, 1)[:256, :384]
    g = 256 // groups
    ref = torch.cat([x[:, i * 384:(i + 1) * 384].double() @ w64[i * g:(i + 1) * g].t()
                     for i in range(groups)], 1)
    assert out.shape == (m, 256) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2


def test_w8a16_hook_declines_what_the_kernels_cannot_take(ops):
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16_kernel as wk

    w, s = _fp8_dense(256, 384, seed=0)
    x = torch.randn(2, 384).to(torch.bfloat16)
    assert "not a GPU" in wk.unsupported_reason(x, w, (128, 128))
    bad = w.view(torch.uint8).clone()
    bad[3, 5] = 0x7F
    bad[7, 9] = 0xFF
    assert wk.nan_code_count(bad) == 2 and wk.nan_code_count(w) == 0


def test_w8a16_kernel_class_is_chosen_once_and_runs_the_ops(ops, monkeypatch):
    """The csrc_gfx936 W8A16 linear is a kernel class in upstream's block-FP8 list: supported
    exactly when gfx936_kernel_select picks the kernels (and no BF16 copy is kept); its calls
    run the ops, and a call they cannot take runs the PyTorch path (an error when forced)."""
    import vllm.envs as envs
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936 as g
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16_kernel as wk
    from vllm.platforms import gfx936_kernel_select

    from vllm.platforms import current_platform

    kernel_cls = g.Gfx936W8A16KernelFp8BlockScaledMMKernel
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True, raising=False)
    monkeypatch.setattr(gfx936_kernel_select, "path", lambda op: "torch")
    assert kernel_cls.is_supported() == (False, "gfx936_kernel_select chose the PyTorch path")
    monkeypatch.setattr(gfx936_kernel_select, "path", lambda op: "kernel")
    assert kernel_cls.is_supported() == (True, None)  # the CPU stands in for gfx936 here
    monkeypatch.setenv("VLLM_GFX936_FP8_WEIGHT_CACHE", "1")
    assert not kernel_cls.is_supported()[0]
    monkeypatch.delenv("VLLM_GFX936_FP8_WEIGHT_CACHE")

    w, s = _fp8_dense(256, 384, seed=3)
    x = torch.randn(2, 384).to(torch.bfloat16)
    kernel = object.__new__(kernel_cls)
    kernel.weight_group_shape = (128, 128)
    kernel.config = type("Config", (), {"out_dtype": torch.bfloat16})()
    kernel.gemv_max_m = 4
    torch_path = g.Gfx936W8A16Fp8BlockScaledMMKernel._block_mm(kernel, x, w, s)
    monkeypatch.setattr(wk, "unsupported_reason", lambda *a: None)  # as on a GPU
    before = fake.CALLS.get("w8a16_gemv", 0)
    on_ops = kernel._block_mm(x, w, s)
    assert fake.CALLS["w8a16_gemv"] == before + 1
    torch.testing.assert_close(on_ops, torch_path, rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(wk, "unsupported_reason", lambda *a: "a test reason")
    assert torch.equal(kernel._block_mm(x, w, s), torch_path)
    monkeypatch.setattr(envs, "VLLM_GFX936_W8A16_IMPL", "kernel", raising=False)
    with pytest.raises(ValueError, match="VLLM_GFX936_W8A16_IMPL=kernel.*a test reason"):
        kernel._block_mm(x, w, s)


def _mxfp4_experts(e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(119, 124, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(113, 117, (e, h, i // 32), generator=g, dtype=torch.uint8)
    return w13, s13, w2, s2


def _moe64(x, w13, s13, w2, s2, tw, local, limit, on_input):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for m in range(x.shape[0]):
        for j, e in enumerate(local[m].tolist()):
            if e < 0:
                continue
            wt = float(tw[m, j])
            xe = x[m].double() * (wt if on_input else 1.0)
            h = fake.mxfp4_weight(w13[e], s13[e]).double() @ xe
            d = h.numel() // 2
            gate, up = h[:d].clamp(max=limit), h[d:].clamp(-limit, limit)
            y = fake.mxfp4_weight(w2[e], s2[e]).double() @ (gate * torch.sigmoid(gate) * up)
            out[m] += y * (1.0 if on_input else wt)
    return out


@pytest.mark.parametrize("kind", ["random", "repeat", "expert_map", "on_input"])
@pytest.mark.parametrize("force", ["gemv", "prefill-grouped", "prefill-bucketed", "direct",
                                   None, "limit2"])
def test_mxfp4_moe_dispatch_reads_only_routed_experts(ops, monkeypatch, kind, force):
    """None: the front end's own choice, the direct path at 3 tokens (direct_ok); limit2: the
    same with the direct path's limit at 2 tokens (VLLM_GFX936_MOE_DIRECT_MAX_M=2), grouped.
    The prefill's GEMMs both ways: torch._grouped_mm, and the bucketed torch.bmm that ROCm
    (gfx936) runs (experts in 1, 2, 4 and 8-row buckets here, split over chunks)."""
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_kernel as mk

    e, h, i, topk = 8, 64, 32, 3
    limit2 = force == "limit2"
    force = None if limit2 else force
    gemms = None
    if force is not None and force.startswith("prefill-"):
        force, gemms = "prefill", force.removeprefix("prefill-")
    m = 3 if force in ("direct", None) else 7
    w13, s13, w2, s2 = _mxfp4_experts(e, h, i, seed=len(kind))
    g = torch.Generator().manual_seed(11)
    e_glob = 2 * e if kind == "expert_map" else e
    tw, ids = torch.randn(m, e_glob, generator=g).softmax(-1).topk(topk, -1)
    ids[0] = torch.tensor([1, 2, 3])  # experts 0 and e-1 stay unrouted below
    ids = torch.where(ids == 0, 4, torch.where(ids == e_glob - 1, 5, ids))
    if kind == "repeat":
        ids[:, 1] = ids[:, 0]
    emap = None
    if kind == "expert_map":  # even global ids are local (id // 2), odd ones live elsewhere
        emap = torch.full((e_glob,), -1, dtype=torch.int32)
        emap[0::2] = torch.arange(e, dtype=torch.int32)
    local = ids if emap is None else emap.long()[ids]
    x = torch.randn(m, h).to(torch.bfloat16)
    # a workspace of two experts: the prefill path must walk the routed experts in chunks;
    # bmm calls of at most 4 padded rows: buckets of larger counts are cut into several
    monkeypatch.setattr(mk, "WORKSPACE_BYTES", 2 * 3 * i * h * 2)
    monkeypatch.setattr(mk, "BUCKET_ROWS", 4)
    dequantized = []
    real = fake._mxfp4_dequant_experts

    def spy(w, ws, active, slot0, out):
        dequantized.extend(active[slot0:slot0 + out.shape[0]].tolist())
        real(w, ws, active, slot0, out)

    monkeypatch.setattr(fake, "_mxfp4_dequant_experts", spy)  # the ops look it up per call
    out = torch.empty(m, h, dtype=torch.bfloat16)
    path = mk.mxfp4_moe_kernel(out, x, w13, s13, w2, s2, tw, ids.to(torch.int32), emap, 1.0,
                               10.0, kind == "on_input", force=force,
                               direct_max_m=2 if limit2 else mk.DIRECT_MAX_TOKENS,
                               prefill_gemms=gemms)
    assert path == (force or ("gemv" if limit2 else "direct"))
    ref = _moe64(x, w13, s13, w2, s2, tw, local, 10.0, kind == "on_input")
    assert _rel(out, ref) < 2e-2
    routed = sorted(set(local.flatten().tolist()) - {-1})
    assert len(routed) < e  # some local experts are not routed in this batch
    if force == "prefill":  # each routed expert decoded once (w13 and w2), no other
        assert sorted(dequantized) == sorted(routed * 2)


def test_prefill_gemms_refuses_an_unknown_form_and_grouped_where_it_cannot_run(ops,
                                                                            monkeypatch):
    """A wrong ``prefill_gemms`` is named in the error, and "grouped" is refused where
    torch._grouped_mm does not work (ROCm: it would fault gfx936) instead of running it."""
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_kernel as mk

    w13, s13, w2, s2 = _mxfp4_experts(4, 64, 32, seed=1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    tw, ids = torch.randn(5, 4).softmax(-1).topk(2, -1)
    out = torch.empty(5, 64, dtype=torch.bfloat16)

    def call(gemms):
        mk.mxfp4_moe_kernel(out, x, w13, s13, w2, s2, tw, ids.to(torch.int32), None, 1.0,
                            10.0, False, force="prefill", prefill_gemms=gemms)

    with pytest.raises(ValueError, match="prefill_gemms='bmm'"):
        call("bmm")
    monkeypatch.setattr(mk, "_grouped_mm_works", lambda device_type: False)
    with pytest.raises(ValueError, match="'grouped' only where torch._grouped_mm works"):
        call("grouped")
    call("bucketed")
    call(None)


def test_padded_buckets_cover_every_expert_once_with_under_2x_padding():
    """The bucketed prefill GEMMs' plan (padded_buckets): consecutive runs of the counts
    (largest first) that cover each expert once, each run padded to its largest count,
    which is under twice any of its counts; runs of equal power-of-two ceilings merge."""
    from vllm.model_executor.layers.fused_moe.experts.gfx936_mxfp4_moe_kernel import (
        padded_buckets)

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        top = int(torch.randint(1, 3000, (1,), generator=g))
        counts = sorted(torch.randint(1, top + 1, (n,), generator=g).tolist(), reverse=True)
        runs = padded_buckets(counts)
        assert [b for b, _, _ in runs] == [0] + [end for _, end, _ in runs[:-1]]
        assert runs[-1][1] == n
        for b0, b1, rows in runs:
            assert rows == max(counts[b0:b1])
            assert all(2 * c > rows for c in counts[b0:b1]), (counts[b0:b1], rows)
        ceil2 = [(c - 1).bit_length() for c in counts]
        assert len(runs) == len(set(ceil2))
    assert padded_buckets([]) == []


def test_moe_hook_declines_loudly_what_the_kernels_do_not_implement(monkeypatch):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.gfx936_mxfp4_emulation import (
        mxfp4_moe_on_kernels,
    )

    w13, s13, w2, s2 = _mxfp4_experts(2, 64, 32, seed=0)
    x = torch.randn(1, 64).to(torch.bfloat16)
    qc = SimpleNamespace(w1_bias=None, w2_bias=None, gemm1_beta=None, gemm1_clamp_limit=10.0)
    experts = SimpleNamespace(quant_config=qc, gemm1_alpha=1.0)
    args = (torch.empty_like(x), x, w13, w2, torch.ones(1, 1),
            torch.zeros(1, 1, dtype=torch.int32), MoEActivation.SILU, None, False, s13, s2)
    monkeypatch.delenv("VLLM_GFX936_MXFP4_MOE_IMPL", raising=False)
    assert mxfp4_moe_on_kernels(experts, *args) is False  # CPU tensors: the emulation runs
    monkeypatch.setenv("VLLM_GFX936_MXFP4_MOE_IMPL", "kernel")
    with pytest.raises(ValueError, match="hidden_states on cpu.*VLLM_GFX936_MXFP4_MOE_IMPL=kernel"):
        mxfp4_moe_on_kernels(experts, *args)


# ---- the W8A16 GEMV token limit ------------------------------------------------------------------
def _graph_config(enforce_eager, mode, sizes):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode),
                                           cudagraph_capture_sizes=sizes))


@pytest.fixture
def gemv_limit(monkeypatch):
    """w8a16_gemv_max_m with a settable current config; decisions forgotten before and after."""
    import vllm.config as vllm_config_mod
    from vllm.platforms import gfx936_kernel_select as sel

    current = {"cfg": None}
    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none",
                        lambda: current["cfg"])
    monkeypatch.delenv("VLLM_GFX936_W8A16_GEMV_MAX_M", raising=False)
    sel.reset()
    yield sel, current, monkeypatch
    sel.reset()


@pytest.mark.parametrize("enforce_eager,mode,sizes,expected", [
    (True, "FULL_AND_PIECEWISE", [1, 2, 4], 16),
    (False, "NONE", [], 16),
    (False, "FULL_AND_PIECEWISE", [], 16),   # no capture sizes (the CPU): nothing replays
    (False, "FULL_DECODE_ONLY", [1, 2, 4, 8, 16], 4),
    (False, "FULL_AND_PIECEWISE", [1, 2, 4, 8], 4),
])
def test_w8a16_gemv_max_m_is_16_eagerly_and_4_under_graphs(gemv_limit, enforce_eager, mode,
                                                           sizes, expected):
    sel, current, _ = gemv_limit
    current["cfg"] = _graph_config(enforce_eager, mode, sizes)
    assert sel.w8a16_gemv_max_m() == expected
    # decided once: the process keeps it whatever the config says later
    current["cfg"] = _graph_config(not enforce_eager, "FULL_DECODE_ONLY" if expected == 16
                                   else "NONE", [1, 2] if expected == 16 else [])
    assert sel.w8a16_gemv_max_m() == expected


def test_w8a16_gemv_max_m_without_a_config_is_not_remembered(gemv_limit):
    sel, current, _ = gemv_limit
    assert sel.w8a16_gemv_max_m() == sel.W8A16_GEMV_MAX_M_GRAPHS  # a kernel bench: no config
    current["cfg"] = _graph_config(True, "NONE", [])
    assert sel.w8a16_gemv_max_m() == sel.W8A16_GEMV_MAX_M_EAGER


def test_w8a16_gemv_max_m_switch_wins_and_bad_values_name_it(gemv_limit):
    from vllm.platforms.gfx936_switch_validation import switch_errors

    sel, current, monkeypatch = gemv_limit
    current["cfg"] = _graph_config(False, "FULL_DECODE_ONLY", [1, 2])
    monkeypatch.setenv("VLLM_GFX936_W8A16_GEMV_MAX_M", "8")
    assert sel.w8a16_gemv_max_m() == 8
    for bad in ("-1", "x", str(2**31), "\u00b2"):  # negative, not a number, too large, a superscript
        sel.reset()
        monkeypatch.setenv("VLLM_GFX936_W8A16_GEMV_MAX_M", bad)
        with pytest.raises(ValueError, match="VLLM_GFX936_W8A16_GEMV_MAX_M"):
            sel.w8a16_gemv_max_m()
        (err,) = switch_errors({"VLLM_GFX936_W8A16_GEMV_MAX_M": bad})
        assert "VLLM_GFX936_W8A16_GEMV_MAX_M" in err and "token count" in err
    assert switch_errors({"VLLM_GFX936_W8A16_GEMV_MAX_M": "0"}) == []


@pytest.mark.parametrize("m,gemv_max_m,op", [
    (16, 16, "w8a16_gemv"), (17, 16, "fp8_block_dequant"), (5, 4, "fp8_block_dequant"),
    (1, 0, "fp8_block_dequant"),   # 0: every call dequantizes
])
def test_w8a16_kernel_class_runs_the_gemv_up_to_its_limit(ops, monkeypatch, m, gemv_max_m, op):
    """The kernel class passes its build-time limit through the op to the kernels."""
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936 as g
    from vllm.model_executor.kernels.linear.scaled_mm import gfx936_w8a16_kernel as wk
    from vllm.platforms import gfx936_kernel_select

    monkeypatch.setattr(gfx936_kernel_select, "path", lambda op: "kernel")
    monkeypatch.setattr(wk, "unsupported_reason", lambda *a: None)  # as on a GPU
    w, s = _fp8_dense(256, 384, seed=m + 1)
    x = torch.randn(max(m, 1), 384).to(torch.bfloat16)[:m]
    kernel = object.__new__(g.Gfx936W8A16KernelFp8BlockScaledMMKernel)
    kernel.weight_group_shape = (128, 128)
    kernel.config = type("Config", (), {"out_dtype": torch.bfloat16})()
    kernel.gemv_max_m = gemv_max_m
    before = dict(fake.CALLS)
    out = kernel._block_mm(x, w, s)
    used = {k for k, v in fake.CALLS.items() if v != before.get(k, 0)}
    assert used == {op} and out.shape == (m, 256)


# ---- the MoE direct path's token limit -----------------------------------------------------------
@pytest.fixture
def direct_limit(monkeypatch):
    """moe_direct_max_m with decisions forgotten before and after."""
    from vllm.platforms import gfx936_kernel_select as sel

    monkeypatch.delenv("VLLM_GFX936_MOE_DIRECT_MAX_M", raising=False)
    sel.reset()
    yield sel, monkeypatch
    sel.reset()


def test_moe_direct_max_m_is_the_kernels_limit_and_decided_once(direct_limit):
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_kernel as mk

    sel, monkeypatch = direct_limit
    # the default is the largest M the direct kernels take (moe_mxfp4.cu kDirectTokens: the
    # front end's direct_ok, tied to moe_direct_supported in tests/kernels)
    assert sel.moe_direct_max_m() == sel.MOE_DIRECT_MAX_M_LIMIT == mk.DIRECT_MAX_TOKENS == 64
    assert mk.direct_ok(64, 6, 4096, 256) and not mk.direct_ok(65, 6, 4096, 256, 65)
    monkeypatch.setenv("VLLM_GFX936_MOE_DIRECT_MAX_M", "8")
    assert sel.moe_direct_max_m() == 64  # decided once: the process keeps it


@pytest.mark.parametrize("value", ["0", "8", "64", " 16 "])
def test_moe_direct_max_m_switch_wins(direct_limit, value):
    from vllm.platforms.gfx936_switch_validation import switch_errors

    sel, monkeypatch = direct_limit
    monkeypatch.setenv("VLLM_GFX936_MOE_DIRECT_MAX_M", value)
    assert sel.moe_direct_max_m() == int(value)
    assert switch_errors({"VLLM_GFX936_MOE_DIRECT_MAX_M": value}) == []


@pytest.mark.parametrize("bad", ["-1", "x", "65", str(2**31), "\u00b2", "9" * 5000])
def test_moe_direct_max_m_bad_values_name_the_switch_and_its_bound(direct_limit, bad):
    from vllm.platforms.gfx936_switch_validation import switch_errors

    sel, monkeypatch = direct_limit
    monkeypatch.setenv("VLLM_GFX936_MOE_DIRECT_MAX_M", bad)
    with pytest.raises(ValueError, match="VLLM_GFX936_MOE_DIRECT_MAX_M"):
        sel.moe_direct_max_m()
    (err,) = switch_errors({"VLLM_GFX936_MOE_DIRECT_MAX_M": bad})
    assert "VLLM_GFX936_MOE_DIRECT_MAX_M" in err and "from 0 to 64" in err


def test_the_experts_pass_their_limit_as_the_one_ops_last_argument(direct_limit, monkeypatch):
    """The CPU twin's call (Gfx936Mxfp4EmulationExperts._apply_torch, the path the step audit
    counts) hands the experts' decided limit to the op, whose last argument it is."""
    import inspect
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_emulation as em
    from vllm.model_executor.layers.fused_moe.experts import gfx936_mxfp4_moe_op as op

    params = list(inspect.signature(op._mxfp4_moe).parameters)
    assert params[-1] == "direct_max_m"
    assert list(inspect.signature(op._mxfp4_moe_fake).parameters) == params
    calls = []
    monkeypatch.setattr(op, "mxfp4_moe_gfx936", lambda *a: calls.append(a))
    experts = SimpleNamespace(quant_config=SimpleNamespace(gemm1_clamp_limit=10.0),
                              w1_scale_val="s13", w2_scale_val="s2", gemm1_alpha=1.0,
                              direct_max_m=5)
    x = torch.zeros(2, 64)
    em.Gfx936Mxfp4EmulationExperts._apply_torch(
        experts, torch.empty_like(x), x, "w13", "w2", "tw", "ids", MoEActivation.SILU, None,
        False)
    (args,) = calls
    assert len(args) == len(params) and args[-1] == 5
