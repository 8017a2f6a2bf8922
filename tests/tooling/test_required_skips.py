"""No silent skips (issue 16, item 6): under CI (CI=true, as .ci/run runs) or `make test`
(--require-all) a test that skips fails the run and names what was missing; a test marked
may_skip(reason=...) skips, and the run counts and prints it.

Each case runs a real pytest in a subprocess on a small test tree whose conftest loads
tests/required_skips.py the way tests/conftest.py does, with the switches of the outer run
removed from its environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SWITCHES = ("CI", "VLLM_GFX936_REQUIRE_ALL")

CONFTEST = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from required_skips import (pytest_addoption, pytest_configure, pytest_make_collect_report,
                            pytest_runtest_makereport, pytest_sessionfinish,
                            pytest_terminal_summary)
import pytest

@pytest.fixture
def cpu_wheel():
    pytest.skip("the pinned vLLM CPU ops wheel is not available: offline")
"""

REQUIRED = """
import pytest

def test_oracle():
    pytest.importorskip("no_such_module_transformers_16", reason="transformers missing")

def test_runs():
    assert True
"""

ALLOWED = """
import pytest

@pytest.mark.may_skip(reason="needs the real model on DCU nodes")
def test_cluster():
    pytest.skip("no --model-path")

@pytest.mark.xfail(strict=True, reason="documented disagreement")
def test_known_disagreement():
    assert False

def test_runs():
    assert True
"""


def _run(tmp_path: Path, files: dict[str, str], *args: str, env: dict | None = None):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-rs", *args, str(tmp_path)], cwd=tmp_path,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=300)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("switch", [{"CI": "true"}, {"VLLM_GFX936_REQUIRE_ALL": "1"}, "--require-all"])
def test_required_test_that_skips_fails_the_run_and_names_what_was_missing(tmp_path, switch):
    env, args = (switch, ()) if isinstance(switch, dict) else (None, (switch,))
    proc, out = _run(tmp_path, {"test_required.py": REQUIRED}, *args, env=env)
    assert proc.returncode == 1, out
    assert "required test skipped: transformers missing" in out, out
    assert "1 failed, 1 passed" in out or "1 passed, 1 failed" in out, out


def test_without_ci_or_require_all_a_skip_stays_a_skip(tmp_path):
    proc, out = _run(tmp_path, {"test_required.py": REQUIRED}, env={"CI": "false"})
    assert proc.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out


def test_a_fixture_that_skips_fails_a_required_test(tmp_path):
    """The CPU-wheel fixture of tests/conftest.py skips when the ops wheel cannot be had."""
    proc, out = _run(tmp_path, {"test_fixture.py": "def test_serve(cpu_wheel):\n    pass\n"},
                     env={"CI": "true"})
    assert proc.returncode == 1, out
    assert "required test skipped: the pinned vLLM CPU ops wheel is not available" in out, out


def test_a_module_that_skips_while_collected_fails_the_run(tmp_path):
    """A module-level importorskip (tests/serve's openai) leaves no test to turn red."""
    mod = 'import pytest\nopenai = pytest.importorskip("no_such_module_openai_16")\n\n' \
          'def test_served():\n    pass\n'
    proc, out = _run(tmp_path, {"test_module.py": mod, "test_ok.py": "def test_ok():\n    pass\n"},
                     env={"CI": "true"})
    assert proc.returncode == 1, out
    assert "required tests skipped: FAILED" in out and "no_such_module_openai_16" in out, out


def test_allowed_skip_and_strict_xfail_pass_under_ci_and_are_counted(tmp_path):
    proc, out = _run(tmp_path, {"test_allowed.py": ALLOWED}, env={"CI": "true"})
    assert proc.returncode == 0, out
    assert "1 allowed skips (may_skip)" in out, out
    assert "1 x needs the real model on DCU nodes" in out, out
    assert "1 passed, 1 skipped, 1 xfailed" in out, out


def test_may_skip_without_a_reason_fails(tmp_path):
    mod = "import pytest\n\n@pytest.mark.may_skip\ndef test_x():\n    pytest.skip('why not')\n"
    proc, out = _run(tmp_path, {"test_noreason.py": mod}, env={"CI": "true"})
    assert proc.returncode == 1, out
    assert "gives no reason" in out, out


def test_the_cluster_matrix_is_an_allowed_skip_under_ci():
    """tests/cluster needs the real model and DCU nodes: under CI it skips, counted, exit 0."""
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES + ("DCU_KIT_MODEL_PATH",)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/cluster"], cwd=REPO, env={**base, "CI": "true"},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "allowed skips (may_skip)" in out and "cluster matrix: needs the real" in out, out
    assert "passed" not in out and "failed" not in out, out
