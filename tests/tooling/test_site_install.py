# SPDX-License-Identifier: Apache-2.0
"""tools/site_install.py keeps DTK's torch: the resolver is not allowed to replace it (issue #17).

A fresh venv gets a "DTK torch" (torch 2.5.1+das.dtk2604) and a DAS triton; a local index
(--no-index --find-links, nothing leaves the machine) offers a PyPI-like torch 2.9.0 and two
torchvisions, each pinning its torch exactly as the real ones do. The control shows that a plain
`pip install` of a wheel that wants torchvision replaces DTK's torch; site_install must not.
"""
from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def make_wheel(dest: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) with one module."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}_pkg/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    rows = []
    for arc, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(f"{arc},sha256={digest.decode()},{len(text.encode())}\n")
    rows.append(f"{dist}.dist-info/RECORD,,\n")
    files[f"{dist}.dist-info/RECORD"] = "".join(rows)
    whl = dest / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return whl


def versions(py: Path) -> dict[str, str]:
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print('\\n'.join("
                          "f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions()))"],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("==", 1) for line in out.split())


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("site")
    idx, local = tmp / "index", tmp / "local"
    idx.mkdir()
    local.mkdir()
    make_wheel(idx, "torch", "2.9.0")
    make_wheel(idx, "torchvision", "0.24.0", ("torch==2.9.0",))
    make_wheel(idx, "torchvision", "0.20.1", ("torch==2.5.1",))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index",
                    make_wheel(local, "torch", "2.5.1+das.opt1.dtk2604"),
                    make_wheel(local, "triton", "3.1.0+das.opt1.dtk2604")], check=True)
    return py, idx, local, tmp


def site_install(py: Path, whl: Path, idx: Path, constraints: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-m", "tools.site_install", str(whl), "--constraints",
                           str(constraints), "--", "--no-index", "--find-links", str(idx)],
                          capture_output=True, text=True, cwd=REPO)


def test_constraints_pin_the_installed_dtk_builds_exactly(site, tmp_path):
    py, _idx, _local, _ = site
    out = tmp_path / "c.txt"
    r = subprocess.run([str(py), "-m", "tools.site_install", str(REPO / "upstream.toml"),
                        "--constraints", str(out), "--print"], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in out.read_text().splitlines() if not ln.startswith("#")]
    assert lines == ["torch==2.5.1+das.opt1.dtk2604", "triton==3.1.0+das.opt1.dtk2604"]


def test_wheel_needing_torchvision_keeps_dtk_torch_and_names_the_new_torchvision(site, tmp_path):
    """DTK's torch stays; the PyPI torchvision the resolver could still add (it pins the same
    torch version, but is built against PyPI's torch) is a new torch-stack name: an error."""
    py, idx, local, _ = site
    fork = make_wheel(local, "vllm", "0.27.1+gfx936.dtk2604.s3", ("torchvision",))
    r = site_install(py, fork, idx, tmp_path / "c.txt")
    got = versions(py)
    assert got["torch"] == "2.5.1+das.opt1.dtk2604" and got["torchvision"] == "0.20.1"
    assert r.returncode == 1, r.stdout + r.stderr
    assert "torchvision 0.20.1 was installed beside the site's torch stack" in r.stderr
    assert "pip uninstall torchvision" in r.stderr
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "vllm", "torchvision"], check=True)


def test_wheel_with_only_allowed_new_deps_passes(site, tmp_path):
    py, idx, local, _ = site
    make_wheel(idx, "regexlike", "1.0")
    fork = make_wheel(local, "vllm", "0.27.1+gfx936.dtk2604.s6", ("regexlike",))
    r = site_install(py, fork, idx, tmp_path / "c.txt")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "untouched" in r.stdout
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "vllm", "regexlike"], check=True)


def test_wheel_needing_a_newer_torch_fails_and_leaves_it(site, tmp_path):
    py, idx, local, _ = site
    fork = make_wheel(local, "vllm", "0.27.1+gfx936.dtk2604.s4", ("torch>=2.9",))
    r = site_install(py, fork, idx, tmp_path / "c.txt")
    assert r.returncode == 1
    assert "ResolutionImpossible" in r.stderr or "conflict" in r.stderr.lower(), r.stderr
    assert "pinned set is unchanged" in r.stderr
    assert versions(py)["torch"] == "2.5.1+das.opt1.dtk2604" and "vllm" not in versions(py)


def test_control_plain_pip_install_would_replace_dtk_torch(site, tmp_path):
    """Without the constraints the same install swaps DTK's torch for the index one: the case
    above is a real risk, not a property of the fake index."""
    py, idx, local, tmp = site
    clone = tmp / "venv-control"
    subprocess.run([sys.executable, "-m", "venv", str(clone)], check=True)
    cpy = clone / "bin" / "python"
    subprocess.run([str(cpy), "-m", "pip", "install", "-q", "--no-index",
                    *sorted(local.glob("torch-2.5.1*.whl"))], check=True)
    fork = make_wheel(tmp_path, "vllm", "0.27.1+gfx936.dtk2604.s5", ("torchvision",))
    subprocess.run([str(cpy), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(idx),
                    str(fork)], check=True)
    assert versions(cpy)["torch"] == "2.9.0"


def test_no_torch_and_missing_wheel_are_named(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.site_install", str(tmp_path / "nope.whl")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "nope.whl: no such wheel" in r.stderr
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "tools.site_install",
                        str(REPO / "upstream.toml"), "--constraints", str(tmp_path / "c.txt")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "has no torch" in r.stderr


@pytest.fixture(scope="module")
def renamed_site(tmp_path_factory):
    """A site whose DAS Triton is installed under another name (pytorch-triton-rocm) and which
    has numpy 1.26.4; the index offers PyPI triton and numpy 2."""
    tmp = tmp_path_factory.mktemp("renamed")
    idx, local = tmp / "index", tmp / "local"
    idx.mkdir()
    local.mkdir()
    make_wheel(idx, "triton", "3.5.0")
    make_wheel(idx, "numpy", "2.2.0")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index",
                    make_wheel(local, "torch", "2.13.0+das.opt1.dtk2604"),
                    make_wheel(local, "pytorch-triton-rocm", "3.5.0+das.opt1.dtk2604"),
                    make_wheel(local, "numpy", "1.26.4")], check=True)
    return py, idx, local


def test_a_pypi_triton_beside_das_triton_under_another_name_fails(renamed_site, tmp_path):
    """Regression (issue #17 review, item 10): the constraints pin only names the site has, so
    a requirement on `triton` installed PyPI Triton beside DAS Triton (pytorch-triton-rocm) and
    site_install said every pinned package was untouched."""
    py, idx, local = renamed_site
    fork = make_wheel(local, "vllm", "0.27.1+gfx936.dtk2604.s7", ("triton",))
    r = site_install(py, fork, idx, tmp_path / "c.txt")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "triton 3.5.0 was installed beside the site's torch stack" in r.stderr
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "vllm", "triton"], check=True)


def test_numpy_is_pinned_as_installed(renamed_site, tmp_path):
    """Regression (issue #17 review, item 10): DTK's torch is built against the site's numpy; a
    requirement on numpy 2 must fail, not upgrade it."""
    py, idx, local = renamed_site
    fork = make_wheel(local, "vllm", "0.27.1+gfx936.dtk2604.s8", ("numpy>=2",))
    r = site_install(py, fork, idx, tmp_path / "c.txt")
    assert "numpy==1.26.4" in (tmp_path / "c.txt").read_text().splitlines()
    assert r.returncode == 1 and versions(py)["numpy"] == "1.26.4", r.stdout + r.stderr


def _series():
    sys.path.insert(0, str(REPO))
    from tools.stack import changelog
    return changelog.series_revision()


def test_a_glob_of_several_wheels_installs_the_newest_of_this_series(renamed_site, tmp_path):
    """Regression (issue #17 review, item 11): the guide's `dist/...s*-*.whl` glob expands to
    every build in dist/, and argparse refused the extra arguments. The newest wheel of this
    checkout's series is chosen; none of it is an error naming them."""
    import os

    py, _idx, _local = renamed_site
    n = _series()
    old = make_wheel(tmp_path, "vllm", f"0.27.1+gfx936.dtk2604.s{n - 1}")
    mine = make_wheel(tmp_path, "vllm", f"0.27.1+gfx936.dtk2604.s{n}")
    python_flavour = make_wheel(tmp_path, "vllm", f"0.27.1+gfx936.s{n + 10}")
    os.utime(old, (2e9, 2e9))   # the newest file is not of this series: not chosen
    args = [str(py), "-m", "tools.site_install", "--constraints", str(tmp_path / "c.txt"),
            "--print"]
    r = subprocess.run(args + [str(old), str(mine), str(python_flavour)], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"installing {mine.name}, the newest of series s{n}" in r.stdout
    r = subprocess.run(args + [str(old), str(python_flavour)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 1 and old.name in r.stderr and python_flavour.name in r.stderr
    assert f"series s{n}" in r.stderr
