"""Thin wrapper over the git CLI with settings pinned so output does not depend on user config."""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from .errors import StackError

IDENTITY = ("vllm-gfx936 maintainers", "vllm-gfx936@users.noreply.github.com")

# Settings that change what format-patch/apply print; pinned so refresh is reproducible anywhere.
_PINNED = [
    "-c", "core.quotePath=true",
    "-c", "diff.noprefix=false",
    "-c", "diff.mnemonicPrefix=false",
    "-c", "diff.relative=false",
    "-c", "format.signature=",
    "-c", "format.coverLetter=false",
    "-c", "format.numbered=false",
    "-c", "format.thread=false",
    "-c", "format.signOff=false",
    "-c", "am.threeWay=false",
    "-c", "am.keepcr=true",
    "-c", "apply.whitespace=nowarn",
    "-c", "commit.gpgSign=false",
    "-c", "tag.gpgSign=false",
    "-c", "advice.detachedHead=false",
    "-c", "init.defaultBranch=gfx936",
    "-c", f"user.name={IDENTITY[0]}",
    "-c", f"user.email={IDENTITY[1]}",
]


MIN_VERSION = (2, 28)  # `git init -b`, format-patch --no-add-header, am --no-3way


@functools.cache
def require_version() -> None:
    try:
        text = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise StackError("git is not installed") from None
    m = re.search(r"(\d+)\.(\d+)", text)
    if m and (int(m.group(1)), int(m.group(2))) < MIN_VERSION:
        raise StackError(f"{text.strip()} is too old: the patch stack needs git >= "
                         f"{'.'.join(map(str, MIN_VERSION))} (e.g. `conda install git`)")


def run(repo: Path, *args: str, check: bool = True, input: str | None = None,
        env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    require_version()
    full_env = dict(os.environ)
    full_env.pop("GIT_DIR", None)
    full_env.pop("GIT_WORK_TREE", None)
    full_env["LC_ALL"] = "C"
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(
            ["git", *_PINNED, *args], cwd=repo, input=input, env=full_env,
            capture_output=True, text=True, timeout=timeout,
        )
    except FileNotFoundError:
        if shutil.which("git") is None:
            raise StackError("git is not installed") from None
        raise
    if check and proc.returncode != 0:
        raise StackError(
            f"git {' '.join(args)} failed in {repo} (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def out(repo: Path, *args: str, **kw) -> str:
    return run(repo, *args, **kw).stdout.strip()


def remote(repo: Path, *args: str, timeout: float) -> subprocess.CompletedProcess | None:
    """A git command that talks to a remote (ls-remote, fetch): never prompts for credentials;
    None when it runs past `timeout` seconds. Never raises on failure: check returncode."""
    try:
        return run(repo, *args, check=False, timeout=timeout, env={"GIT_TERMINAL_PROMPT": "0"})
    except subprocess.TimeoutExpired:
        return None


def has_ref(repo: Path, ref: str) -> bool:
    return run(repo, "rev-parse", "-q", "--verify", ref, check=False).returncode == 0


def clone_at(repo: Path, dest: Path, rev: str, branch: str = "gfx936") -> Path:
    """dest <- a clone of repo sharing its objects, on a new `branch` at rev."""
    run(dest.parent, "clone", "-q", "--shared", "--no-checkout", str(repo), str(dest))
    run(dest, "checkout", "-q", "-B", branch, rev)
    return dest


def is_repo_root(path: Path) -> bool:
    if not (path / ".git").exists():
        return False
    proc = run(path, "rev-parse", "--show-toplevel", check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()


def dirty_paths(repo: Path) -> list[str]:
    """Uncommitted edits: modified, staged or untracked (not ignored) files."""
    text = run(repo, "status", "--porcelain", "--untracked-files=all").stdout
    return [line[3:] for line in text.splitlines() if line]


def operation_in_progress(repo: Path) -> str | None:
    gitdir = Path(out(repo, "rev-parse", "--absolute-git-dir"))
    for marker, name in (("rebase-apply", "am/rebase"), ("rebase-merge", "rebase"),
                         ("MERGE_HEAD", "merge"), ("CHERRY_PICK_HEAD", "cherry-pick")):
        if (gitdir / marker).exists():
            return name
    return None


def fixed_date_env(date: str | None) -> dict:
    if not date:
        return {}
    return {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
