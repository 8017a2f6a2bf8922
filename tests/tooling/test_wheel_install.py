"""The fork's wheel, built from pinned upstream + patches/series, installs into a clean venv and
reports what it is: fork version, upstream pin and the applied patch list (which must equal the
series, file for file). Needs the real upstream in vllm/ (`make upstream`) and build tools
(setuptools-scm, setuptools-rust), as `make test` provides."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.stack import changelog, pin as pin_mod, series  # noqa: E402

pytestmark = pytest.mark.skipif(not (REPO / "vllm" / ".git").exists(),
                                reason="vllm/ holds no upstream: run `make upstream`")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "tools.stack", "wheel", "--out", str(tmp / "dist")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = Path(proc.stdout.strip().splitlines()[-1])
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # vLLM's runtime deps (torch, transformers, ...) come from this test environment through a .pth
    # file appended *after* the clean venv's own site-packages, so `vllm` itself is the new install.
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _run(py: Path, *code: str) -> str:
    proc = subprocess.run([py, *code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_wheel_version_carries_fork_and_series_revision(installed):
    pin = pin_mod.load()
    want = f"{pin.version}+gfx936.s{changelog.series_revision()}"
    out = _run(installed, "-c", "import importlib.metadata as m, vllm, os; "
               "print(m.version('vllm')); print(vllm.__version__); print(os.path.dirname(vllm.__file__))")
    dist_version, module_version, location = out.split()
    assert dist_version == module_version == want
    assert str(installed.parent.parent) in location  # the clean venv's copy, not the test env's


def test_installed_fork_lists_exactly_the_series_patches(installed):
    info = json.loads(_run(installed, "-m", "vllm.gfx936", "info", "--json"))
    s = series.read()
    assert [p["name"] for p in info["patches"]] == s.names
    for entry, path in zip(info["patches"], s.paths):
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    pin = pin_mod.load()
    assert info["upstream"] == {"version": pin.version, "commit": pin.commit,
                                "sdist_sha256": pin.sdist_sha256}
    text = _run(installed, "-m", "vllm.gfx936", "info")
    assert info["fork_version"] in text and all(n in text for n in s.names)


def test_installed_fork_contains_each_patch_effect(installed):
    """Not just metadata: a line each patch adds is present in the installed files."""
    out = _run(installed, "-c", "import vllm.envs as e; print(e.VLLM_GFX936_SPARSE_DECODE)")
    assert out.strip() == "auto"


def test_rocm_build_refuses_an_arch_the_patched_cmake_does_not_list(tmp_path):
    """The ROCm flavour checks the exported tree: gfx936 must be a HIP_SUPPORTED_ARCHS entry (the
    build-cmake patch), and an unknown arch is refused rather than silently dropped by CMake."""
    from tools.stack import errors, wheel

    pin = pin_mod.load()
    tree = tmp_path / "tree"
    wheel.export_tree(pin, tree, {"patches": []})
    wheel.require_hip_arch(tree, "gfx936")
    with pytest.raises(errors.StackError, match="gfx9999 not in HIP_SUPPORTED_ARCHS"):
        wheel.require_hip_arch(tree, "gfx936;gfx9999")
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "CMakeLists.txt").write_text(subprocess.run(
        ["git", "show", f"{pin.tag}:CMakeLists.txt"], cwd=REPO / "vllm", check=True,
        capture_output=True, text=True).stdout)
    with pytest.raises(errors.StackError, match="gfx936 not in HIP_SUPPORTED_ARCHS"):
        wheel.require_hip_arch(pristine, "gfx936")  # upstream alone would drop gfx936
