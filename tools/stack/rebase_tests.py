"""`make rebase --run-tests`: is a patch obsolete? Run its own tests on the new upstream without it.

For each patch whose `Tests:` header names engine-free tests (tests/runtime/: they import a vLLM
source tree with a faked ROCm platform), the tests run against a scratch tree
(build/rebase-X/tests-tree, a worktree of the rebase's clone):

  baseline    the carried tree (branch `rebased`: new upstream + every carried patch), all the
              eligible test files in one pytest run;
  without P   for a carried patch P: the carried tree with P's commit reverted; for a patch that
              was not carried the carried tree already lacks it, so its baseline outcome is the
              answer.

A carried patch's tests count against the baseline: M = its tests that pass on the carried tree,
N = of those, the ones that do not pass without it (fail, error, or no longer import). A test that
already fails with the patch proves nothing and is left out. For a patch that was not carried there
is no tree with it to compare: M = its tests collected there. The verdict per patch:

  pass      "probably obsolete (its tests pass without it)"
  fail      "still needed (N of M tests fail without it)"
  not-run   why: engine tests only, the tree does not import, a module of an uncarried patch is
            missing, reverting it conflicts with later patches, timeout, torch mismatch.

Tests run with the test Python (`--test-python`, default .venv/bin/python), niced, each pytest run
bounded by `--tests-timeout`; tests/runtime/conftest.py puts the tree first on sys.path through
GFX936_TEST_VLLM_TREE.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from . import git
from .pin import ROOT

RUNNABLE = ("tests/runtime/",)  # engine-free: import the tree with a faked ROCm platform
ENGINE = ("tests/e2e/", "tests/serve/")
TREE_ENV = "GFX936_TEST_VLLM_TREE"
GOOD = ("passed", "xfailed")


@dataclasses.dataclass
class TestVerdict:
    state: str  # "pass" | "fail" | "not-run"
    text: str  # one line for the report
    detail: list[str] = dataclasses.field(default_factory=list)
    failed: int = 0
    total: int = 0


def split_tests(tests: list[str]) -> tuple[list[str], list[str]]:
    """(runnable test files, the others with why) of a patch's Tests: header."""
    run, other = [], []
    for t in tests:
        t = t.strip().strip(",")
        if not t:
            continue
        if t.startswith(RUNNABLE) and t.endswith(".py"):
            run.append(t)
        elif t.startswith(ENGINE):
            other.append(f"{t} (starts the engine)")
        elif t.startswith("tests/tooling/"):
            other.append(f"{t} (tests the fork's tools and wheels, not the vLLM tree)")
        else:
            other.append(f"{t} (not an engine-free runtime test)")
    return list(dict.fromkeys(run)), other


def default_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def torch_of(python: str) -> str | None:
    proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().split("+")[0] if proc.returncode == 0 else None


def torch_mismatch(python: str, torch_build: str | None) -> str | None:
    """Why the tests cannot run with `python` on an upstream built against torch_build, or None."""
    m = re.search(r"(\d+\.\d+)", torch_build or "")
    if not m:
        return None
    have = torch_of(python)
    if have is None:
        return f"the test Python ({python}) cannot import torch"
    if not have.startswith(m.group(1) + ".") and have != m.group(1):
        return (f"this upstream builds against torch {torch_build.lstrip('=')} and the test Python "
                f"({python}) has torch {have}: its tests were not run (run them in a venv with "
                f"torch {m.group(1)}: `--test-python`)")
    return None


@dataclasses.dataclass
class Run:
    outcomes: dict[str, str]  # test id -> passed/failed/error/skipped/xfailed
    errors: dict[str, str]  # test id or file -> first lines of the error
    problem: str | None = None  # the run itself failed (timeout, pytest crash)


def _tid(tc) -> str:
    cls, name = tc.get("classname", ""), tc.get("name", "")
    return f"{cls}::{name}" if cls else name


def pytest_run(python: str, tree: Path, files: list[str], junit: Path, timeout: int) -> Run:
    env = {**os.environ, TREE_ENV: str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    junit.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1", f"--rootdir={ROOT}", "--continue-on-collection-errors", *files]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=lambda: os.nice(10))
    except subprocess.TimeoutExpired:
        return Run({}, {}, f"timed out after {timeout} s (--tests-timeout)")
    if not junit.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return Run({}, {}, f"pytest exit {proc.returncode}: {' / '.join(tail)}")
    outcomes, errors = {}, {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        tid = _tid(tc)
        kids = {k.tag: k for k in tc}
        if "error" in kids or "failure" in kids:
            k = kids.get("error", kids.get("failure"))
            outcomes[tid] = "error" if "error" in kids else "failed"
            errors[tid] = ((k.get("message") or "") + "\n" + (k.text or "")).replace(f"{ROOT}/", "")
        elif "skipped" in kids:
            outcomes[tid] = "xfailed" if kids["skipped"].get("type") == "pytest.xfail" else "skipped"
        else:
            outcomes[tid] = "passed"
    return Run(outcomes, errors)


def _in(tid: str, mods: set[str]) -> bool:
    """Is the junit test id (classname::name, classname = module[.Class]) one of mods' tests?"""
    return any(tid == m or tid.startswith((m + "::", m + ".")) for m in mods)


def _files_mod(files: list[str]) -> set[str]:
    return {f[:-3].replace("/", ".") for f in files}


def _mine(run: Run, files: list[str]) -> dict[str, str]:
    mods = _files_mod(files)
    return {t: o for t, o in run.outcomes.items() if _in(t, mods)}


MISSING = re.compile(r"No module named '(vllm[\w.]*)'")
MISSING_NAME = re.compile(r"cannot import name '(\w+)' from '(vllm[\w.]*)'")


def _missing_modules(run: Run, files: list[str]) -> list[str]:
    mods = _files_mod(files)
    out = []
    for t, e in run.errors.items():
        if _in(t, mods):
            out += MISSING.findall(e) + [f"{m}.{n}" for n, m in MISSING_NAME.findall(e)]
    return list(dict.fromkeys(out))


def _creator(mod: str, creators: dict[str, str]) -> str | None:
    base = mod.replace(".", "/")
    return creators.get(base + ".py") or creators.get(base + "/__init__.py")


def _first_error(run: Run, files: list[str]) -> str:
    mods = _files_mod(files)
    for t, e in run.errors.items():
        if _in(t, mods):
            lines = [l.strip() for l in e.splitlines() if l.strip()]
            last = next((l for l in reversed(lines) if re.match(r"^E?\s*\w*(Error|Exception)\b", l.lstrip("E "))),
                        lines[0] if lines else "?")
            return f"{t.split('::')[-1]}: {last[:200]}"
    return "?"


def _foreign(name: str, files: list[str], run: Run, creators: dict[str, str],
             carried: set[str]) -> TestVerdict | None:
    """not-run when the tests import a module that a patch other than `name`, not carried, creates."""
    for m in _missing_modules(run, files):
        c = _creator(m, creators)
        if c and c != name and c not in carried:
            return TestVerdict("not-run", f"not run: its tests import {m}, created by {c}, which was "
                               "not carried (port that first)")
    return None


def judge_uncarried(name: str, files: list[str], base: Run, creators: dict[str, str],
                    carried: set[str]) -> TestVerdict:
    """A patch that was not carried: the carried tree already lacks it."""
    if base.problem:
        return TestVerdict("not-run", f"not run: the run on the carried tree {base.problem}")
    mine = _mine(base, files)
    missing = _missing_modules(base, files)
    foreign = _foreign(name, files, base, creators, carried)
    if foreign:
        return foreign
    counted = {t: o for t, o in mine.items() if o != "skipped"}
    if not counted:
        why = _first_error(base, files) if base.errors else "no test collected"
        return TestVerdict("not-run", f"not run: {why}")
    bad = [t for t, o in counted.items() if o not in GOOD]
    own = [m for m in missing if _creator(m, creators) == name]
    if not bad:
        return TestVerdict("pass", f"probably obsolete (its tests pass without it: {len(counted)} of "
                           f"{len(counted)} on the carried tree)", total=len(counted))
    if len(bad) == len(counted) and not own and all(o == "error" for t, o in counted.items()):
        return TestVerdict("not-run", f"not run: its tests do not import on the carried tree "
                           f"({_first_error(base, files)})")
    return TestVerdict("fail", f"still needed ({len(bad)} of {len(counted)} tests fail without it; "
                       "not carried, so no tree with it to compare)"
                       + (f"; they import {', '.join(own)}, which it creates" if own else ""),
                       [_first_error(base, files)], len(bad), len(counted))


def judge_carried(name: str, files: list[str], base: Run, without: Run | None,
                  creators: dict[str, str], carried: set[str]) -> TestVerdict | None:
    """None (with without=None): the baseline allows a run without it."""
    if base.problem:
        return TestVerdict("not-run", f"not run: the run on the carried tree {base.problem}")
    ok = [t for t, o in _mine(base, files).items() if o in GOOD]
    if not ok:
        foreign = _foreign(name, files, base, creators, carried)
        if foreign:
            return foreign
        mine = _mine(base, files)
        why = _first_error(base, files) if base.errors else "no test passes or none collected"
        return TestVerdict("not-run", f"not run: its tests fail on the carried tree with it too "
                           f"({sum(o not in GOOD and o != 'skipped' for o in mine.values())} of {len(mine)}; {why})")
    if without is None:
        return None
    if without.problem:
        return TestVerdict("not-run", f"not run: the run without it {without.problem}")
    wo = _mine(without, files)
    bad = [t for t in ok if wo.get(t) not in GOOD]
    left = len(_mine(base, files)) - len(ok)
    note = f"; {left} that do not pass with it either are not counted" if left else ""
    if not bad and left:
        # The tests that could tell may be exactly the ones that do not run: no verdict.
        return TestVerdict("not-run", f"not run to a verdict: the {len(ok)} of its tests that pass "
                           f"with it also pass without it, but {left} fail on the carried tree even "
                           f"with it ({_first_error(base, files)})")
    if not bad:
        return TestVerdict("pass", f"probably obsolete (its tests pass without it: {len(ok)} of "
                           f"{len(ok)})", total=len(ok))
    return TestVerdict("fail", f"still needed ({len(bad)} of {len(ok)} tests fail without it{note})",
                       [_first_error(without, files) if without.errors else bad[0]], len(bad), len(ok))


def run_patch_tests(work: Path, final_rev: str, results, commits: dict[str, str],
                    creators: dict[str, str], python: str, timeout: int, torch_build: str | None,
                    log=print) -> dict[str, TestVerdict]:
    """results: PatchResults (name, tests); commits: name -> its commit on branch `rebased` (carried
    or import-blocked patches). Returns name -> verdict for every patch."""
    out: dict[str, TestVerdict] = {}
    files_of: dict[str, list[str]] = {}
    for r in results:
        run, other = split_tests(r.tests)
        missing = [f for f in run if not (ROOT / f).is_file()]
        run = [f for f in run if f not in missing]
        if not run:
            why = "; ".join(other + [f"{m} (missing in this repo)" for m in missing]) or "no Tests: header"
            out[r.name] = TestVerdict("not-run", f"not run: no engine-free test ({why})")
        else:
            files_of[r.name] = run
    if not files_of:
        return out
    bad_torch = torch_mismatch(python, torch_build)
    if bad_torch:
        for n in files_of:
            out[n] = TestVerdict("not-run", f"not run: {bad_torch}")
        return out
    tree = work.parent / "tests-tree"
    if tree.exists():
        git.run(work, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(tree, ignore_errors=True)
    git.run(work, "worktree", "prune")
    git.run(work, "worktree", "add", "-q", "--detach", str(tree), final_rev)
    junit = work.parent / "tests-junit.xml"
    union = sorted({f for fs in files_of.values() for f in fs})
    log(f"rebase: tests on the carried tree ({len(union)} file(s)) ...")
    base = pytest_run(python, tree, union, junit, timeout * max(1, len(union)))
    carried = set(commits)
    for r in results:
        files = files_of.get(r.name)
        if not files:
            continue
        sha = commits.get(r.name)
        if not sha:
            out[r.name] = judge_uncarried(r.name, files, base, creators, carried)
            continue
        early = judge_carried(r.name, files, base, None, creators, carried)
        if early is not None:  # nothing to compare against: no need to run without it
            out[r.name] = early
            continue
        git.run(tree, "reset", "-q", "--hard", final_rev)
        git.run(tree, "clean", "-qfdx")
        rv = git.run(tree, "revert", "--no-commit", sha, check=False)
        if rv.returncode != 0:
            unmerged = git.out(tree, "diff", "--name-only", "--diff-filter=U").split()
            git.run(tree, "revert", "--abort", check=False)
            by_sha = {v: k for k, v in commits.items()}
            later = [by_sha[c] for c in git.out(tree, "rev-list", "--reverse", f"{sha}..{final_rev}",
                                                "--", *unmerged).split() if c in by_sha] if unmerged else []
            out[r.name] = TestVerdict("not-run", "not run: reverting it on the carried tree conflicts "
                                      f"in {', '.join(unmerged) or rv.stderr.strip()[:200]}"
                                      + (f" (later patches build on it: {', '.join(later)})" if later else ""))
            continue
        log(f"rebase: tests without {r.name} ...")
        without = pytest_run(python, tree, files, junit, timeout)
        out[r.name] = judge_carried(r.name, files, base, without, creators, carried)
    git.run(tree, "reset", "-q", "--hard", final_rev)
    return out
