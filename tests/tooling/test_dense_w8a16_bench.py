# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench/dense_w8a16.py on CPU-only CI: the previous kernel it stages for the
same-run comparison must not share a C++ namespace (or an op namespace) with
the product's library, or loading both in one process would bind one's
launches to the other's kernels."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import load_bench

REPO = Path(__file__).resolve().parents[2]


def test_stage_old_renames_every_namespace(tmp_path, monkeypatch):
    if subprocess.run(["git", "cat-file", "-e", "HEAD:csrc_gfx936/w8a16_fp8.cu"], cwd=REPO,
                      capture_output=True).returncode:
        pytest.skip("no git history of csrc_gfx936 here")
    b = load_bench("dense_w8a16")
    monkeypatch.setattr(b, "OLD_DIR", tmp_path / "old")
    b.stage_old("HEAD")
    staged = {p.name: p.read_text() for p in (tmp_path / "old").iterdir()}
    assert set(b.OLD_FILES) | {"bind_old.cpp", "REV"} == set(staged)
    for name in b.OLD_FILES:
        text = staged[name]
        assert not re.search(r"\bnamespace gfx936\b", text), name
        assert "gfx936::" not in text, name
    assert "namespace gfx936_old" in staged["w8a16_fp8.cu"]
    # the op library of the old copy has its own name, and it is what the bench loads
    assert "TORCH_LIBRARY(_gfx936_C_w8old" in staged["bind_old.cpp"]
    assert not re.search(r"TORCH_LIBRARY(_IMPL)?\(_gfx936_C\b", staged["bind_old.cpp"])
