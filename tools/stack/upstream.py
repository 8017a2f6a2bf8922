"""Get pristine upstream into vllm/ as a git repo whose tag upstream/v<version> is the base.

Two sources, same release:
  - the git submodule (the real upstream commit), when github.com can be reached;
  - the PyPI sdist, verified against the sha256 in upstream.toml, imported as one commit with a
    fixed author and date (so every machine gets the same commit id).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from . import git
from .errors import StackError
from .pin import ROOT, Pin

CACHE = ROOT / ".cache" / "upstream"
IMPORT_DATE = "2000-01-01T00:00:00+00:00"
# Files of an sdist that are build metadata, not source; left out of the pristine commit.
SDIST_METADATA = ("PKG-INFO", "*.egg-info/", "vllm/_version.py")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True)
        url = proc.stdout.strip() if proc.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def index_files(project: str) -> tuple[list[dict], str]:
    """(files, url): the release files of `project` as the PEP 691 JSON simple API of the
    configured index lists them."""
    url = f"{_index_url()}/{project}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["files"], url
    except Exception as e:  # noqa: BLE001 - any network/JSON failure is reported the same way
        raise StackError(f"cannot list {project} on {url}: {e}") from None


def download_from_index(project: str, filename: str, dest: Path) -> Path:
    """Fetch one release file through the PEP 691 JSON simple API of the configured index."""
    files, url = index_files(project)
    match = [f for f in files if f["filename"] == filename]
    if not match:
        raise StackError(f"{filename} is not on {url}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(dest.suffix + ".part")
    try:
        with urllib.request.urlopen(match[0]["url"], timeout=600) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f)
    except Exception as e:  # noqa: BLE001
        part.unlink(missing_ok=True)
        raise StackError(f"download of {filename} failed: {e}") from None
    part.rename(dest)
    return dest


def fetch_verified(project: str, filename: str, want_sha: str, env_override: str,
                   expected: str | None = None) -> Path:
    """A verified local copy of a release file. `$<env_override>` may name a file to use instead.
    `expected` says where want_sha comes from, for the error (default: the pin)."""
    given = os.environ.get(env_override)
    path = Path(given) if given else CACHE / filename
    if given and not path.is_file():
        raise StackError(f"{env_override}={given}: no such file")
    if not path.is_file():
        print(f"upstream: downloading {filename} from {_index_url()}", file=sys.stderr)
        try:
            download_from_index(project, filename, path)
        except StackError as e:
            raise StackError(
                f"{e}. Offline machine? Copy {filename} (sha256 {want_sha}) from a machine that "
                f"reaches {_index_url()} and run again with {env_override}=/path/to/{filename}, "
                f"or put it at {path}") from None
    got = sha256(path)
    if got != want_sha:
        where = f"{env_override}={given}" if given else str(path)
        raise StackError(
            f"{where}: sha256 {got} does not match {expected or f'the pin {want_sha} (upstream.toml)'}; "
            "refusing to use it" + ("" if given else f". Delete {path} to download again."))
    return path


def _check_members(tf: tarfile.TarFile, dest: Path) -> None:
    """What tarfile's "data" filter refuses, for Pythons without extraction filters (3.10 before
    3.10.12): paths and link targets outside dest, device files and FIFOs."""
    root = dest.resolve()
    for m in tf.getmembers():
        target = (root / m.name).resolve()
        bad = target != root and root not in target.parents
        if m.issym() or m.islnk():
            base = (root / m.name).parent if m.issym() else root
            link = (base / m.linkname).resolve()
            bad = bad or m.linkname.startswith("/") or (link != root and root not in link.parents)
        if bad or m.isdev():
            raise StackError(f"{tf.name}: member {m.name!r} escapes the extraction folder (by its "
                             "path or link target) or is a device file; refusing the archive")


def extract_sdist(sdist: Path, top: str, dest: Path) -> Path:
    """Unpack sdist into dest; returns its top-level folder dest/<top>."""
    try:
        with tarfile.open(sdist) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(dest, filter="data")
            else:
                _check_members(tf, dest)
                tf.extractall(dest)
    except tarfile.TarError as e:  # a corrupt archive, or a member the "data" filter refuses
        raise StackError(f"{sdist}: cannot unpack: {e}") from None
    src = Path(dest) / top
    if not src.is_dir():
        raise StackError(f"{sdist}: expected a top-level folder {top}/")
    return src


def sdist_pathspec() -> list[str]:
    """`git add` pathspec of an sdist import: everything, also what upstream's .gitignore would
    skip (e.g. a .gitkeep, test data), except SDIST_METADATA."""
    return [".", *(f":(exclude,glob){p}**" if p.endswith("/") else f":(exclude){p}"
                   for p in SDIST_METADATA)]


# Author, committer and date of an sdist import: every machine makes the same commit id.
IMPORT_ENV = {"GIT_AUTHOR_NAME": "upstream", "GIT_AUTHOR_EMAIL": "upstream@vllm",
              "GIT_COMMITTER_NAME": "upstream", "GIT_COMMITTER_EMAIL": "upstream@vllm",
              **git.fixed_date_env(IMPORT_DATE)}


def import_message(version: str) -> str:
    return f"upstream v{version}"


def _try_submodule(pin: Pin, vllm_dir: Path) -> bool:
    if os.environ.get("UPSTREAM_SOURCE", "auto") == "sdist":
        return False
    proc = git.remote(ROOT, "ls-remote", pin.repository, "HEAD", timeout=30)
    if proc is None or proc.returncode != 0:
        print(f"upstream: {pin.repository} unreachable, using the PyPI sdist", file=sys.stderr)
        return False
    git.run(ROOT, "submodule", "update", "--init", "vllm")
    tags = git.out(vllm_dir, "tag", "--points-at", pin.commit).split()
    if tags and f"v{pin.version}" not in tags:
        raise StackError(f"upstream.toml pins commit {pin.commit[:12]} as v{pin.version}, but upstream "
                         f"tags that commit {', '.join(tags)}: fix the pin before use")
    git.run(vllm_dir, "tag", "-f", pin.tag, pin.commit)
    git.run(vllm_dir, "checkout", "-q", "-B", "gfx936", pin.tag)
    return True


def import_sdist(pin: Pin, vllm_dir: Path) -> None:
    sdist = fetch_verified("vllm", pin.sdist, pin.sdist_sha256, "UPSTREAM_SDIST")
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp:
        src = extract_sdist(sdist, pin.sdist.removesuffix(".tar.gz"), Path(tmp))
        vllm_dir.mkdir(exist_ok=True)
        for child in src.iterdir():
            shutil.move(str(child), vllm_dir / child.name)
    git.run(vllm_dir, "init", "-q", "-b", "gfx936")
    git.run(vllm_dir, "add", "-A", "-f", "--", *sdist_pathspec())
    exclude = Path(git.out(vllm_dir, "rev-parse", "--absolute-git-dir")) / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    with open(exclude, "a") as f:
        f.write("# sdist packaging metadata (tools/stack/upstream.py)\n")
        f.write("".join(f"/{p}\n" for p in SDIST_METADATA))
    git.run(vllm_dir, "commit", "-q", "-m", import_message(pin.version), env=IMPORT_ENV)
    git.run(vllm_dir, "tag", pin.tag)


def protect_gitlink(vllm_dir: Path) -> None:
    """Keep the outer `vllm` gitlink on the pin while vllm/'s HEAD moves with the patch commits.

    .gitmodules' `ignore = all` hides the moved HEAD from `git status`, but `git add -A` and
    `git commit -a` would still record it; skip-worktree (a local index flag) stops that.
    """
    rel = vllm_dir.relative_to(ROOT).as_posix()
    if git.out(ROOT, "ls-files", "-s", "--", rel).startswith("160000 "):
        git.run(ROOT, "update-index", "--skip-worktree", "--", rel)


def ensure(pin: Pin, vllm_dir: Path) -> str:
    """Make vllm/ hold pristine upstream (tag pin.tag). Returns a one-line description."""
    protect_gitlink(vllm_dir)
    if git.is_repo_root(vllm_dir):
        if git.has_ref(vllm_dir, f"refs/tags/{pin.tag}"):
            return f"vllm/ already holds upstream v{pin.version} (tag {pin.tag})"
        dirty = git.dirty_paths(vllm_dir)
        if dirty:
            raise StackError(f"vllm/ has uncommitted edits ({dirty[0]} ...) and lacks tag {pin.tag}; "
                             "refusing to touch it")
        head = git.run(vllm_dir, "rev-parse", "-q", "--verify", "HEAD", check=False).stdout.strip()
        if head == pin.commit:
            # `git clone --recurse-submodules` checks out the pinned commit without the fork's
            # tag: that is pristine upstream, so tag it as _try_submodule does.
            git.run(vllm_dir, "tag", "-f", pin.tag, pin.commit)
            git.run(vllm_dir, "checkout", "-q", "-B", "gfx936", pin.tag)
            return f"vllm/ holds the pinned commit {pin.commit[:12]} (a submodule checkout): tagged {pin.tag}"
        raise StackError(f"vllm/ is a git repo without tag {pin.tag}: it holds another upstream. "
                         f"Move it away (or `make rebase`) before `make upstream`.")
    if vllm_dir.exists() and any(vllm_dir.iterdir()):
        raise StackError(f"vllm/ exists, is not a git repo, and is not empty; refusing to overwrite it")
    CACHE.mkdir(parents=True, exist_ok=True)
    if _try_submodule(pin, vllm_dir):
        return f"vllm/ checked out from the submodule at {pin.commit[:12]} (tag {pin.tag})"
    try:
        import_sdist(pin, vllm_dir)
    except BaseException:
        # Fail closed: leave vllm/ as empty as we found it.
        if vllm_dir.exists():
            shutil.rmtree(vllm_dir)
            vllm_dir.mkdir()
        raise
    return f"vllm/ imported from {pin.sdist} (sha256 verified, tag {pin.tag})"
