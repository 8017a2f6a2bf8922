"""apply / unapply / status / refresh / new / edit / check over vllm/ (a git repo).

Model: vllm/ holds pristine upstream at tag `upstream/v<version>`; applying the series makes one
commit per patch on branch `gfx936`, in series order. The i-th commit after the tag *is* the
i-th patch: `refresh` writes `git format-patch` of each commit back to patches/, and a rebase can
3-way merge commits. No command runs over uncommitted edits in vllm/, and every command that
moves HEAD first saves the old commits under refs/stack/backup/.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
import time
from pathlib import Path

from . import git, patchfile, series as series_mod, upstream
from .errors import StackError
from .pin import ROOT, Pin

VLLM = ROOT / "vllm"
FORMAT_PATCH = ("format-patch", "--zero-commit", "--no-signature", "--no-stat", "-N",
                "--full-index", "--no-color", "--diff-algorithm=myers", "--no-to", "--no-cc",
                "--no-add-header", "--stdout")


@dataclasses.dataclass
class ApplyResult:
    name: str
    offsets: list[str]


# ---------------------------------------------------------------- helpers over vllm/


def require_upstream(pin: Pin, repo: Path = VLLM) -> None:
    if not git.is_repo_root(repo):
        raise StackError("vllm/ holds no upstream checkout yet: run `make upstream` first")
    if not git.has_ref(repo, f"refs/tags/{pin.tag}"):
        raise StackError(f"vllm/ lacks tag {pin.tag} (another upstream?): see `make status`")


def require_clean(repo: Path, action: str) -> None:
    op = git.operation_in_progress(repo)
    if op:
        raise StackError(f"vllm/ is in the middle of a {op}; finish or abort it before `{action}`")
    dirty = git.dirty_paths(repo)
    if dirty:
        listing = "\n  ".join(dirty[:10]) + ("\n  ..." if len(dirty) > 10 else "")
        raise StackError(
            f"refusing to {action}: vllm/ has uncommitted edits:\n  {listing}\n"
            "Commit them into a patch commit (`git -C vllm commit --amend` / `make edit`) and "
            "`make refresh`, or stash them; nothing was changed.")


def applied_commits(pin: Pin, repo: Path = VLLM) -> list[str]:
    text = git.out(repo, "rev-list", "--reverse", "--first-parent", f"{pin.tag}..HEAD")
    return text.split()


def format_commit(repo: Path, sha: str) -> str:
    text = git.run(repo, *FORMAT_PATCH, "-1", sha).stdout
    if not text:  # format-patch prints nothing for an empty commit (a patch just made by `new`)
        text = git.run(repo, "log", "-1", "--format=From 0000000000000000000000000000000000000000 "
                       "Mon Sep 17 00:00:00 2001%nFrom: %an <%ae>%nDate: %aD%nSubject: [PATCH] %s%n%n%b",
                       sha).stdout
    return text


def backup(repo: Path, reason: str) -> str:
    ref = f"refs/stack/backup/{time.strftime('%Y%m%d-%H%M%S')}-{reason}"
    git.run(repo, "update-ref", ref, "HEAD")
    return ref


def _sync_state(pin: Pin, s: series_mod.Series, repo: Path) -> tuple[list[str], list[str]]:
    """(applied commits, names of patches whose commit differs from the patch file)."""
    commits = applied_commits(pin, repo)
    diverged = []
    for i, sha in enumerate(commits):
        if i >= len(s.names):
            diverged.append(f"<extra commit {sha[:12]} not in series>")
            continue
        path = s.paths[i]
        if not path.is_file() or format_commit(repo, sha) != path.read_text():
            diverged.append(s.names[i])
    return commits, diverged


# ---------------------------------------------------------------- applying patches


def _apply_errors(repo: Path, p: patchfile.PatchFile, stderr: str) -> str:
    """Turn `git apply` complaints into 'patch X: hunk #N (@@ ...) of FILE does not apply'."""
    lines = []
    for m in re.finditer(r"error: patch failed: (.+):(\d+)", stderr):
        path, line = m.group(1), int(m.group(2))
        hit = p.hunk_at(path, line)
        if hit:
            f, h = hit
            lines.append(f"hunk #{h.number} of {f.path} ({h.header.split('@@')[1].strip()}) "
                         "does not apply: its context is not in the tree (zero fuzz)")
        else:
            lines.append(f"{path}:{line} does not apply")
    for m in re.finditer(r"error: (.+): (No such file or directory|does not exist in index)", stderr):
        lines.append(f"{m.group(1)}: the file it patches does not exist upstream (renamed or removed?)")
    for m in re.finditer(r"error: (.+): already exists in (index|working directory)", stderr):
        lines.append(f"{m.group(1)}: the file it creates already exists upstream")
    if not lines:
        lines.append(stderr.strip() or "git apply failed")
    return "\n  ".join(lines)


def offsets(apply_output: str) -> list[str]:
    """'FILE: hunk #N now at line L (+D)' for each hunk `git apply -v` placed at an offset."""
    moved, cur = [], "?"
    for line in apply_output.splitlines():
        if m := re.match(r"Checking patch (.+?)\.\.\.$", line):
            cur = m.group(1).split(" => ")[-1]
        elif m := re.match(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)", line):
            moved.append(f"{cur}: hunk #{m.group(1)} now at line {m.group(2)} ({int(m.group(3)):+d})")
    return moved


def am(repo: Path, path: Path) -> None:
    """Commit one patch file with `git am` (zero fuzz, no 3-way); on failure abort and raise."""
    proc = git.run(repo, "am", "--keep-cr", "--committer-date-is-author-date", "--no-3way",
                   str(path), check=False)
    if proc.returncode != 0:
        git.run(repo, "am", "--abort", check=False)
        raise StackError(f"patches/{path.name}: git am failed:\n{proc.stderr.strip() or proc.stdout.strip()}")


def apply_one(repo: Path, path: Path, strict_offsets: bool = False) -> ApplyResult:
    """Check then commit one patch (zero fuzz). Raises StackError naming the patch and hunk."""
    if not path.is_file():
        raise StackError(f"patches/{path.name}: listed in series but missing")
    p = patchfile.parse(path)
    if not p.files:
        raise StackError(f"patches/{path.name}: contains no diff")
    chk = git.run(repo, "apply", "--check", "-v", "--index", str(path), check=False)
    if chk.returncode != 0:
        raise StackError(f"patches/{path.name}: does not apply:\n  {_apply_errors(repo, p, chk.stderr)}")
    moved = offsets(chk.stderr + chk.stdout)
    if moved and strict_offsets:
        raise StackError(f"patches/{path.name}: applies only with offsets ({moved[0]} ...); "
                         "run `make apply && make refresh` to regenerate it")
    am(repo, path)
    return ApplyResult(path.name, moved)


def apply_series(repo: Path, s: series_mod.Series, start: int = 0,
                 strict_offsets: bool = False) -> list[ApplyResult]:
    """Apply s.names[start:] as commits; on any failure reset repo to where it started."""
    orig = git.out(repo, "rev-parse", "HEAD")
    results = []
    try:
        for path in s.paths[start:]:
            results.append(apply_one(repo, path, strict_offsets))
    except BaseException:
        git.run(repo, "am", "--abort", check=False)
        git.run(repo, "reset", "-q", "--hard", orig)
        raise
    return results


def apply(pin: Pin, repo: Path = VLLM) -> list[ApplyResult]:
    require_upstream(pin, repo)
    require_clean(repo, "apply")
    s = series_mod.read()
    commits, diverged = _sync_state(pin, s, repo)
    if diverged:
        raise StackError(
            f"vllm/ holds commits that differ from patches/ ({', '.join(diverged)}): "
            "`make refresh` to keep them, or `make unapply FORCE=1` to drop them (they stay in "
            "refs/stack/backup/).")
    if git.out(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False) != "gfx936":
        git.run(repo, "checkout", "-q", "-B", "gfx936", "HEAD")
    return apply_series(repo, s, start=len(commits))


def unapply(pin: Pin, force: bool = False, repo: Path = VLLM) -> str:
    require_upstream(pin, repo)
    require_clean(repo, "unapply")
    s = series_mod.read()
    commits, diverged = _sync_state(pin, s, repo)
    if diverged and not force:
        raise StackError(
            f"refusing to unapply: these commits in vllm/ have edits not exported to patches/: "
            f"{', '.join(diverged)}. Run `make refresh` first, or `make unapply FORCE=1` "
            "(the commits are kept under refs/stack/backup/).")
    note = ""
    if commits:
        note = f" (previous HEAD saved as {backup(repo, 'unapply')})"
    git.run(repo, "checkout", "-q", "-B", "gfx936", pin.tag)
    if git.run(repo, "diff", "--quiet", pin.tag, check=False).returncode:
        raise StackError("vllm/ does not match the upstream tag after unapply; see `git -C vllm status`")
    return f"unapplied {len(commits)} patch(es); vllm/ is pristine upstream v{pin.version}{note}"


def refresh(pin: Pin, repo: Path = VLLM) -> list[str]:
    """Write each patch commit back to patches/. Returns the names that changed."""
    require_upstream(pin, repo)
    require_clean(repo, "refresh")
    s = series_mod.read()
    commits = applied_commits(pin, repo)
    if len(commits) != len(s.names):
        raise StackError(
            f"vllm/ has {len(commits)} commit(s) after {pin.tag} but series lists {len(s.names)} "
            "patch(es). Each patch must be exactly one commit: `make apply` the rest, squash fixup "
            "commits (`git -C vllm rebase -i " + pin.tag + "`), or add one with `make new NAME=...`.")
    changed = []
    for sha, path in zip(commits, s.paths):
        text = format_commit(repo, sha)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path.name)
    return changed


TEMPLATE = """{area}: TODO one line saying what this patch does

TODO: why this patch exists (the Description): what breaks on gfx936 without it.

Upstream-Status: TODO pending | not-needed (why) | submitted <url> | backport <ref>
Remove-When: TODO the upstream change that makes this patch unnecessary
Tests: TODO tests/runtime/test_<area>.py
"""


def new(pin: Pin, name: str, repo: Path = VLLM) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name):
        raise StackError(f"NAME={name!r}: use a lowercase slug like 'platform-rocm-detect-gfx936'")
    fname = name if name.endswith(".patch") else f"{name}.patch"
    require_upstream(pin, repo)
    require_clean(repo, "new")
    s = series_mod.read()
    if fname in s.names or (s.dir / fname).exists():
        raise StackError(f"patches/{fname} already exists")
    commits, diverged = _sync_state(pin, s, repo)
    if diverged or len(commits) != len(s.names):
        raise StackError("`make new` adds on top of the full series: `make apply` (and `make refresh` "
                         "any edits) first")
    area = name.split("-", 1)[0]
    git.run(repo, "commit", "-q", "--allow-empty", "-F", "-", input=TEMPLATE.format(area=area))
    sha = git.out(repo, "rev-parse", "HEAD")
    (s.dir / fname).write_text(format_commit(repo, sha))
    series_mod.append(fname)
    return (f"created patches/{fname} (empty commit {sha[:12]} on top of the series).\n"
            "Edit files in vllm/, then `git -C vllm commit -a --amend` (write the header: why, "
            "Upstream-Status, Remove-When, Tests) and `make refresh`.")


def edit(pin: Pin, name: str, repo: Path = VLLM) -> str:
    require_upstream(pin, repo)
    require_clean(repo, "edit")
    s = series_mod.read()
    fname = name if name.endswith(".patch") else f"{name}.patch"
    if fname not in s.names:
        raise StackError(f"PATCH={name}: not in patches/series")
    commits, diverged = _sync_state(pin, s, repo)
    if diverged or len(commits) != len(s.names):
        raise StackError("`make edit` needs the full series applied and in sync: `make apply` first")
    i = s.names.index(fname)
    sha = commits[i]
    if i == len(commits) - 1:
        return (f"{fname} is the top patch: edit vllm/, `git -C vllm commit -a --amend`, then "
                "`make refresh`.")
    backup(repo, "edit")
    editor = f"sed -i 's/^pick {sha[:7]}[0-9a-f]* /edit {sha[:7]} /'"
    git.run(repo, "rebase", "-q", "-i", "--committer-date-is-author-date", pin.tag,
            env={"GIT_SEQUENCE_EDITOR": editor})
    return (f"vllm/ stopped at {fname} ({sha[:12]}). Edit files, then:\n"
            "  git -C vllm commit -a --amend && git -C vllm rebase --continue && make refresh")


# ---------------------------------------------------------------- check (lint, run in CI)


def scratch_clone(pin: Pin, repo: Path = VLLM) -> Path:
    """A throwaway clone of vllm/ at the upstream tag (shares objects; never touches vllm/)."""
    return git.clone_at(repo, Path(tempfile.mkdtemp(prefix="stack-", dir=ROOT / ".cache")), pin.tag)


def check_gitlink(pin: Pin) -> list[str]:
    problems = []
    staged = git.out(ROOT, "ls-files", "-s", "--", "vllm")
    if not staged.startswith("160000 "):
        problems.append("the outer repo has no `vllm` gitlink (submodule) in its index")
    elif staged.split()[1] != pin.commit:
        problems.append(f"the `vllm` gitlink in the index is {staged.split()[1]}, not the pin "
                        f"{pin.commit} (upstream.toml); an outer `git commit -a` moved it? "
                        f"Fix: git update-index --cacheinfo 160000,{pin.commit},vllm")
    head = git.run(ROOT, "ls-tree", "HEAD", "vllm", check=False).stdout.split()
    if head and head[2] != pin.commit:
        problems.append(f"the `vllm` gitlink in HEAD is {head[2]}, not the pin {pin.commit}")
    gm = ROOT / ".gitmodules"
    if not gm.exists() or pin.repository not in gm.read_text():
        problems.append(f".gitmodules does not point submodule vllm at {pin.repository}")
    return problems


def check(pin: Pin) -> list[str]:
    """All problems found; empty means the series is healthy."""
    problems = series_mod.lint()
    s = series_mod.read()
    for path in s.paths:
        if path.is_file():
            for msg in patchfile.lint(patchfile.parse(path), ROOT):
                problems.append(f"patches/{path.name}: {msg}")
    problems += check_gitlink(pin)
    from . import changelog  # local: changelog imports engine-free helpers only
    problems += changelog.lint(pin)
    from . import guards  # compat guards on the pinned upstream + dropped-patch ledger
    problems += guards.check_problems(pin)
    if problems:
        return problems  # do not try applying a series that is already known broken
    require_upstream(pin)
    tmp = scratch_clone(pin)
    try:
        apply_series(tmp, s, strict_offsets=True)
        for sha, path in zip(applied_commits(pin, tmp), s.paths):
            if format_commit(tmp, sha) != path.read_text():
                problems.append(f"patches/{path.name}: not in canonical form (`make apply && make "
                                "refresh` rewrites it)")
    except StackError as e:
        problems.append(str(e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return problems


def status(pin: Pin, repo: Path = VLLM) -> str:
    lines = [f"upstream: v{pin.version} ({pin.commit[:12]}), sdist sha256 {pin.sdist_sha256[:12]}..."]
    s = series_mod.read()
    if not git.is_repo_root(repo):
        lines.append("vllm/: no upstream yet (`make upstream`)")
        lines += [f"  [ ] {n}" for n in s.names]
        return "\n".join(lines)
    require_upstream(pin, repo)
    commits, diverged = _sync_state(pin, s, repo)
    op = git.operation_in_progress(repo)
    lines.append(f"vllm/: {len(commits)} of {len(s.names)} patch(es) applied"
                 + (f"; {op} in progress" if op else ""))
    for i, n in enumerate(s.names):
        mark = " "
        if i < len(commits):
            mark = "M" if n in diverged else "x"
        lines.append(f"  [{mark}] {n}")
    for d in diverged:
        if d.startswith("<extra"):
            lines.append(f"  [+] {d}")
    dirty = git.dirty_paths(repo)
    if dirty:
        lines.append(f"uncommitted edits in vllm/: {len(dirty)} path(s), e.g. {dirty[0]}")
    lines.append("legend: x applied and in sync, M commit differs from patch file (make refresh), "
                 "blank not applied")
    return "\n".join(lines)


def ensure_upstream(pin: Pin) -> str:
    return upstream.ensure(pin, VLLM)
