"""A synthetic fork repo (tools/ copied, a tiny fake upstream sdist) for patch-stack tests.

Each test gets its own fork repo in tmp_path and drives the real CLI (`python -m tools.stack`),
so what is tested is what `make` runs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PIN_COMMIT = "1" * 40
UPSTREAM_FILES = {
    "README.md": "fake upstream\n",
    "pkg/__init__.py": "".join(f"LINE_{i} = {i}\n" for i in range(40)),
    "pkg/platform.py": "def arch():\n    return 'gfx942'\n\n\ndef fp8():\n    return True\n",
    "pkg/data.bin": bytes(range(256)).decode("latin-1"),
    ".gitignore": "PKG-INFO\n*.egg-info/\n",
    "PKG-INFO": "Name: fakeup\n",
}


def make_sdist(dest: Path, version: str = "1.0", files: dict | None = None) -> Path:
    files = UPSTREAM_FILES if files is None else files
    path = dest / f"fakeup-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(f"fakeup-{version}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root except .git: the byte-for-byte identity of a tree."""
    out = {}
    for p in sorted(root.rglob("*")):
        if ".git" in p.relative_to(root).parts or not p.is_file():
            continue
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class Fork:
    def __init__(self, root: Path, sdist: Path):
        self.root = root
        self.sdist = sdist
        self.vllm = root / "vllm"
        self.patches = root / "patches"

    def run(self, *args: str, ok: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        full_env = {**os.environ, "UPSTREAM_SDIST": str(self.sdist), "UPSTREAM_SOURCE": "sdist",
                    **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "tools.stack", *args], cwd=self.root,
                              env=full_env, capture_output=True, text=True)
        if ok and proc.returncode != 0:
            raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def git(self, *args: str, cwd: Path | None = None) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd or self.vllm,
            check=True, capture_output=True, text=True).stdout.strip()

    def add_patch(self, name: str, edits: dict[str, str], subject: str | None = None,
                  tests: str = "tests/test_fake.py", body: str | None = None) -> Path:
        """Create a patch the way a maintainer does: make new, edit, amend, refresh."""
        self.run("new", name)
        for rel, text in edits.items():
            (self.vllm / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.vllm / rel).write_text(text)
        msg = (f"{subject or 'pkg: ' + name}\n\n{body or 'Why: gfx936 needs ' + name + '.'}\n\n"
               f"Upstream-Status: pending\nRemove-When: upstream does {name}\nTests: {tests}\n")
        self.git("add", "-A")
        self.git("commit", "-q", "--amend", "--date=2026-12-02T00:00:00+00:00", "-m", msg)
        self.run("refresh")
        return self.patches / f"{name}.patch"


@pytest.fixture
def fork(tmp_path: Path) -> Fork:
    root = tmp_path / "fork"
    root.mkdir()
    shutil.copytree(REPO / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    sdist = make_sdist(tmp_path)
    (root / "upstream.toml").write_text(
        '[upstream]\nversion = "1.0"\n'
        f'commit = "{PIN_COMMIT}"\nrepository = "https://example.invalid/fakeup.git"\n'
        f'sdist = "fakeup-1.0.tar.gz"\nsdist_sha256 = "{sha256(sdist)}"\n')
    (root / "CHANGELOG.md").write_text("# Changelog\n\n## s3 — 2026-12-02 — upstream v1.0\n\nx\n")
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("# test series\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_fake.py").write_text("")
    (root / ".gitignore").write_text("/.cache/\n/build/\n/dist/\n")
    (root / ".gitmodules").write_text(
        '[submodule "vllm"]\n\tpath = vllm\n\turl = https://example.invalid/fakeup.git\n\tignore = all\n')
    f = Fork(root, sdist)
    f.git("init", "-q", "-b", "main", cwd=root)
    f.git("add", "-A", cwd=root)
    f.git("update-index", "--add", "--cacheinfo", f"160000,{PIN_COMMIT},vllm", cwd=root)
    f.git("commit", "-q", "-m", "fork", cwd=root)
    return f


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
