"""Every source mutation the e2e suites apply still finds its `old` text exactly once in the
installed fork (fast: no engine run).

The mutation suites (tests/e2e/mutations.toml, the MTP layer and MTP identity breaks) edit the
installed package's source by exact text. A refactor that moves or rewrites that text makes the
mutation fail to apply; this test says so in a second instead of at the end of a 30-minute run,
and names the mutation, file and text to update.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e import dsv4_mutations as M


def _all_mutations() -> list[M.Mutation]:
    from tests.e2e import test_dsv4_mtp_identical as ident
    from tests.e2e import test_dsv4_mtp_layer as layer

    verify = M.Mutation(id="mtp-verify-accepts-every-draft", component="spec-decode", bug="",
                        caught_by=(), **ident.ACCEPT_ALL)
    return [*M.load(), *layer.BREAKS, verify]


@pytest.fixture(scope="module")
def installed(venv_bin) -> Path:
    """The venv's installed `vllm` package directory (what the mutation overlays copy)."""
    out = subprocess.run([str(venv_bin / "python"), "-c",
                          "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""}).stdout.strip()
    return Path(out)


@pytest.mark.parametrize("m", _all_mutations(), ids=lambda m: m.id)
def test_mutation_anchor_occurs_once(installed, m):
    path = installed / m.file
    assert path.is_file(), f"mutation {m.id}: vllm/{m.file} is not in the installed fork"
    n = path.read_text().count(m.old)
    assert n == 1, f"mutation {m.id}: `old` occurs {n} times in vllm/{m.file} (want 1): {m.old!r}"
    assert m.new != m.old, f"mutation {m.id}: `new` equals `old` (the mutation changes nothing)"
