"""Thin wrapper over the git CLI with settings pinned so output does not depend on user config."""
from __future__ import annotations

import os
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


def run(repo: Path, *args: str, check: bool = True, input: str | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("GIT_DIR", None)
    full_env.pop("GIT_WORK_TREE", None)
    full_env["LC_ALL"] = "C"
    if env:
        full_env.update(env)
    proc = subprocess.run(
        ["git", *_PINNED, *args], cwd=repo, input=input, env=full_env,
        capture_output=True, text=True,
    )
    if check and proc.returncode != 0:
        raise StackError(
            f"git {' '.join(args)} failed in {repo} (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def out(repo: Path, *args: str, **kw) -> str:
    return run(repo, *args, **kw).stdout.strip()


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
