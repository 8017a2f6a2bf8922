# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps the GPU benches (bench/: Sparse MLA decode, dense W8A16 + MXFP4 MoE)
from rotting on CPU-only CI.

The stager's source slicing is tested on a synthetic module (no vLLM needed).
The smoke runs stage the real leaf files from the applied tree (vllm/ in this
repo, else the installed fork) and run both scripts with ``--smoke`` on the
CPU: the reference decode, the float64 oracle and the Triton gather kernel
under TRITON_INTERPRET (its checksum must equal torch's). Upstream's launcher
refuses CPU tensors, so the smoke does not run it; on a GPU ``make
device-check`` does.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _stage_module():
    spec = importlib.util.spec_from_file_location("bench_stage", BENCH / "stage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SYNTHETIC = textwrap.dedent('''\
    import torch
    import triton
    import triton.language as tl
    from vllm.platforms import current_platform
    from vllm.somewhere import not_needed

    _WIDTH = 448
    _UNUSED = not_needed()


    @triton.jit
    def _helper(x):
        return x * _WIDTH


    @triton.jit
    def _kernel(p):
        tl.store(p, _helper(tl.load(p)))


    def _unrelated():
        return not_needed()


    def _rocm_sparse_attn_decode_ragged_triton(t):
        if _ON_GFX950 or current_platform.is_fp8_fnuz():
            pass
        _kernel[(1,)](t)
        return t
''')


def test_stager_slices_the_launcher_and_its_transitive_helpers_only():
    stage = _stage_module()
    body, names = stage.slice_upstream(SYNTHETIC)
    assert names == ["_WIDTH", "_helper", "_kernel", "_rocm_sparse_attn_decode_ragged_triton"]
    assert "@triton.jit\ndef _helper" in body  # decorators travel with their function
    assert "_unrelated" not in body and "not_needed" not in body
    compile(stage.PRELUDE + body, "<sliced>", "exec")


def test_stager_names_a_dependency_it_cannot_provide():
    stage = _stage_module()
    src = SYNTHETIC.replace("return t\n", "return not_needed(t)\n")
    with pytest.raises(stage.StageError, match=r"not_needed \(in \['_rocm_sparse"):
        stage.slice_upstream(src)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    stage = _stage_module()
    pkg = stage.find_vllm_package()
    if pkg is None:
        pytest.skip("no applied vllm tree (make apply) or installed fork to stage from")
    dest = tmp_path_factory.mktemp("stage")
    info = stage.stage(pkg, dest)
    assert "_sparse_attn_decode_ragged_kernel" in info["sliced"]
    return dest


def _run(script, *args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )


def test_bench_smoke_times_reference_and_verified_gather(staged, tmp_path):
    out = tmp_path / "bench.md"
    p = _run("sparse_mla_decode.py", "--stage-dir", str(staged), "--out", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    text = out.read_text()
    for layer in ("c4 b=2", "c128 b=2", "swa b=2"):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {layer}"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        # ref eager, ref-dense eager and gather eager were measured (gather only
        # after its checksum matched torch's, else the script exits non-zero)
        assert all(float(cells[i]) > 0 for i in (2, 3, 9)), row
    # the back-to-back table ran its sets eagerly (no graph on the CPU): triton
    # and gather seq measured, the floor computed
    seq = text[text.index("## Back-to-back"):]
    for layer in ("c4 b=2", "c128 b=2", "swa b=2"):
        row = next(ln for ln in seq.splitlines() if ln.startswith(f"| {layer}"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2" and all(float(cells[i]) > 0 for i in (4, 6, 8)), row


def test_device_check_smoke_passes_against_float64_oracle(staged):
    p = _run("device_check.py", "--stage-dir", str(staged))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "DEVICE-CHECK PASS" in p.stdout
    assert p.stdout.count("gather checksum exact: True") == 6


def test_stager_refuses_a_dense_moe_module_that_imports_more_of_vllm(tmp_path):
    stage = _stage_module()
    assert stage.module_imports(f"import torch\nfrom {stage.CODECS_MODULE} import x\n") \
        == {"torch", stage.CODECS_MODULE}
    pkg = tmp_path / "vllm"
    for name, rel in stage.DENSE_MOE_FILES.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("import torch\n")
    bad = pkg / stage.DENSE_MOE_FILES["clamped_swiglu.py"]
    bad.write_text("import torch\nfrom vllm.logger import init_logger\n")
    with pytest.raises(stage.StageError, match=r"clamped_swiglu.py imports \['vllm.logger'\]"):
        stage.stage_dense_moe(pkg, tmp_path / "out")


@pytest.fixture(scope="module")
def staged_dense_moe(tmp_path_factory):
    pytest.importorskip("torch")
    stage = _stage_module()
    pkg = stage.find_vllm_package()
    if pkg is None:
        pytest.skip("no applied vllm tree (make apply) or installed fork to stage from")
    dest = tmp_path_factory.mktemp("stage_dm")
    info = stage.stage_dense_moe(pkg, dest)
    for name in info["files"]:  # byte for byte
        assert (dest / name).read_bytes() == (pkg / stage.DENSE_MOE_FILES[name]).read_bytes()
    return dest


def test_dense_moe_smoke_checks_against_float64_and_times_every_path(staged_dense_moe, tmp_path):
    out = tmp_path / "dm.md"
    p = _run("dense_moe.py", "--stage-dir", str(staged_dense_moe), "--out", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "DENSE-MOE CHECK PASS" in p.stdout
    text = out.read_text()
    assert text.count("bitwise: True") == 4  # 2 dense shapes + MoE w13 and w2
    dense = [ln for ln in text.splitlines() if ln.startswith("| 256x384 |")]
    moe = [ln for ln in text.splitlines() if ln.startswith("| 6 |")]
    assert len(dense) == 2 and len(moe) == 1, text
    for row in dense + moe:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # eager timings of w8a16 / cache / bf16 (dense) or full / experts (MoE)
        idx = (2, 3, 4) if row in dense else (2, 4)
        assert all(float(cells[i]) > 0 for i in idx), row


# ---- the decode-step bench (bench/layer_step.py) ------------------------------------------
def test_layer_stager_follows_imports_and_names_one_it_cannot_stage(tmp_path):
    """stage_layer copies the entry modules and every vllm module they import (followed, not
    listed); an import of a non-leaf vllm module stops it, naming the module and the importer."""
    stage = _stage_module()
    pkg = tmp_path / "vllm"
    for rel, text in {
        stage.LAYER_ENTRIES[0]: "import torch\nfrom vllm.a.b import x\n",
        stage.LAYER_ENTRIES[1]: "import torch\n",
        stage.LAYER_ENTRIES[2]: "import triton\n",
        **{rel: "import torch\n" for rel in stage.LAYER_ENTRIES[3:]},
        "a/b.py": "import math\n\ndef x():\n    from vllm.platforms.gfx936_kernel_select import path\n"
                  "    from vllm.platforms import current_platform\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    info = stage.stage_layer(pkg, tmp_path / "out")
    assert sorted(info["files"]) == sorted([*stage.LAYER_ENTRIES, "a/b.py"])
    assert (tmp_path / "out" / "vllm" / "a" / "b.py").read_text() == (pkg / "a/b.py").read_text()
    assert "return TIER.get(op, \"kernel\")" in (tmp_path / "out" / "vllm" / "platforms" /
                                                  "gfx936_kernel_select.py").read_text()
    # a package import resolves to its stand-in __init__.py, kept over the empty ones
    assert (tmp_path / "out" / "vllm" / "platforms" / "__init__.py").read_text() == \
        stage.LAYER_STANDINS["platforms/__init__.py"]
    assert "platforms/__init__.py" in info["standins"]
    (pkg / "a/b.py").write_text("from vllm.config import VllmConfig\n")
    with pytest.raises(stage.StageError, match=r"a/b.py imports 'vllm.config'"):
        stage.stage_layer(pkg, tmp_path / "out2")


def test_layer_step_smoke_runs_every_layer_kind_at_both_tp_shapes(tmp_path):
    """The staged layer step of every kind (SWA, C128, C4: real attention, compressor and
    indexer ops on their twins, mHC chain, W8A16 torch path, MXFP4 emulation, reference decode)
    runs on the CPU at TP8 and TP4 shapes (tiny hidden sizes) through the same measure/report
    code as the GPU run, with finite outputs; the C4 indexer's top-k reaches the decode, and the
    C4 top-k packing (the fork's one-launch kernel, which the kernels path times, and upstream's
    sliced out of amd/rocm.py; Triton, interpreted) equals its twin, and the
    C128/C4 decode arguments pass the kernel launcher's checks and give the reference's output
    through the Triton decode twin (same contract, interpreted); the one-launch ops plugged in
    for issue 19 (shared SwiGLU, q/kv RMSNorm, and the stand-ins for _C.rms_norm and
    _moe_C.topk_softplus_sqrt) match their twins on the kernels path with their launches
    counted. The GPU run
    (kernels, graph capture, timings) is the H200 tier's (make bench-layer)."""
    stage = _stage_module()
    pkg = stage.find_vllm_package()
    if pkg is None:
        pytest.skip("no applied vllm tree (make apply) or installed fork to stage from")
    stage.stage(pkg, tmp_path / "sparse_mla")
    stage.stage_dense_moe(pkg, tmp_path / "dense_moe")
    stage.stage_mhc(pkg, tmp_path / "mhc")
    info = stage.stage_layer(pkg, tmp_path / "layer")
    assert "compute_global_topk_ragged_indices_and_indptr" in info["sliced"]
    out = tmp_path / "layer.md"
    p = _run("layer_step.py", "--device-dir", str(tmp_path), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    for tp, b in ((8, 1), (4, 2)):
        for kind in ("swa", "c128", "c4"):
            assert f"smoke TP{tp} {kind} b={b}: finite=True" in p.stdout, p.stdout
    assert "smoke C4 indexer -> decode: 64 distinct of 256 compressed keys per token: True" \
        in p.stdout
    assert "smoke C4 top-k packing (fused op Triton, interpreted) == twin: True" in p.stdout
    assert "smoke C4 top-k packing (rocm.py Triton, interpreted) == twin: True" in p.stdout
    assert "smoke c128 decode arguments: launcher widths 128+8," in p.stdout
    assert "smoke c4 decode arguments: launcher widths 128+64," in p.stdout
    assert p.stdout.count(" vs reference max diff ") == 2 and ": False" not in p.stdout
    # the one-launch ops of issue 19 item 6 on their kernels path (Triton, interpreted) vs
    # their twins, one launch each (the router: gate GEMM + one); three rows (two ops) are
    # labelled stand-ins
    for name, launches in (("attn_norm (STAND-IN)", 1), ("ffn_norm (STAND-IN)", 1),
                           ("q_kv_norm", 1), ("router (STAND-IN)", 2), ("swiglu", 1)):
        line = next((ln for ln in p.stdout.splitlines()
                     if ln.startswith(f"smoke one-launch {name}: ")), None)
        assert line is not None and line.endswith(f"(want {launches}): True"), (name, p.stdout)
        assert f"launches {launches} [" in line, line
    assert "smoke one-launch router (STAND-IN) at 256 experts: same experts and weights: True" \
        in p.stdout
    text = out.read_text()
    for tp in (8, 4):
        for kind in ("SWA", "C128", "C4"):
            assert f"## {kind} layer, TP{tp} per-rank shapes" in text
    assert "Triton STAND-IN for _C.rms_norm" in text and \
        "Triton STAND-IN for _moe_C.topk_softplus_sqrt" in text
    mix = [ln for ln in text.splitlines()
           if ln.startswith(("| 8 | 1 | pytorch", "| 4 | 2 | pytorch"))]
    assert len(mix) == 2 and all(float(ln.split("|")[5]) > 0 for ln in mix), text


def test_layer_step_standins_name_bad_input():
    """The layer-step bench's stand-ins (bench/layer_standins.py) refuse what their kernels
    cannot read, naming the tensor, before any launch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("vllm.models.deepseek_v4.common.ops.gfx936_kv_insert_triton")
    spec = importlib.util.spec_from_file_location("layer_standins", BENCH / "layer_standins.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x torch.bfloat16 and weight torch.float32"):
        st.rms_norm_standin(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"weight \(4,\) \[H\]"):
        st.rms_norm_standin(x, torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match=r"bias \(8,\) torch.bfloat16 \[E\] float32"):
        st.topk_softplus_sqrt_standin(x, torch.zeros(8, dtype=torch.bfloat16), 6, 1.5)
    with pytest.raises(ValueError, match=r"top-k 9 of 8"):
        st.topk_softplus_sqrt_standin(x, torch.zeros(8), 9, 1.5)
