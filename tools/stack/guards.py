"""Compat guards (patches/compat-guards.toml) and the dropped-patch ledger (patches/dropped.toml).

Guards name upstream interfaces the series relies on but does not patch (cache layout constants,
signatures it hooks, env names). They are checked against PRISTINE upstream at a tag, so a rebase
can tell "every patch applies, but the ground under them moved". The ledger lists patches dropped
from the series and why; a series patch whose name or Subject is in it is refused.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from . import git, patchfile, series as series_mod
from .errors import StackError
from .pin import load_toml

GUARDS_FILE = series_mod.PATCHES / "compat-guards.toml"
LEDGER_FILE = series_mod.PATCHES / "dropped.toml"


@dataclasses.dataclass
class Guard:
    id: str
    file: str
    pattern: str
    literal: bool
    count: int | None
    why: str
    used_by: str

    def describe(self) -> str:
        what = f"literal {self.pattern!r}" if self.literal else f"regex /{self.pattern}/"
        return what + (f" x{self.count}" if self.count is not None else "")


@dataclasses.dataclass
class GuardResult:
    guard: Guard
    ok: bool
    matches: int
    detail: str  # what was found, or why it failed
    lines: list[int]


def load_guards(path: Path = GUARDS_FILE) -> list[Guard]:
    if not path.exists():
        return []
    guards = []
    for i, g in enumerate(load_toml(path).get("guard", []), 1):
        gid = g.get("id", f"#{i}")
        if "file" not in g or ("regex" in g) == ("literal" in g):
            raise StackError(f"{path.name}: guard {gid} needs `file` and exactly one of `regex`/`literal`")
        if "regex" in g:
            try:
                re.compile(g["regex"], re.M)
            except re.error as e:
                raise StackError(f"{path.name}: guard {gid}: bad regex: {e}") from None
        count = g.get("count")
        if count is not None and not isinstance(count, int):
            raise StackError(f"{path.name}: guard {gid}: count must be an integer")
        guards.append(Guard(gid, g["file"], g.get("regex", g.get("literal")), "literal" in g,
                            count, g.get("why", ""), g.get("used-by", "")))
    ids = [g.id for g in guards]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise StackError(f"{path.name}: guard id(s) listed twice: {', '.join(dup)}")
    return guards


def read_at(repo: Path, rev: str, path: str) -> str | None:
    proc = git.run(repo, "show", f"{rev}:{path}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def check_guard(g: Guard, text: str | None) -> GuardResult:
    if text is None:
        return GuardResult(g, False, 0, f"{g.file} does not exist (removed or renamed upstream)", [])
    rx = re.compile(re.escape(g.pattern) if g.literal else g.pattern, re.M)
    found = list(rx.finditer(text))
    lines = [text.count("\n", 0, m.start()) + 1 for m in found]
    n = len(found)
    if g.count is not None and n != g.count:
        return GuardResult(g, False, n, f"expected {g.count} match(es), found {n}", lines)
    if g.count is None and n == 0:
        return GuardResult(g, False, 0, "no match", lines)
    return GuardResult(g, True, n, f"{n} match(es)", lines)


def check_guards(repo: Path, rev: str, guards: list[Guard]) -> list[GuardResult]:
    cache: dict[str, str | None] = {}
    out = []
    for g in guards:
        if g.file not in cache:
            cache[g.file] = read_at(repo, rev, g.file)
        out.append(check_guard(g, cache[g.file]))
    return out


# ---------------------------------------------------------------- the dropped-patch ledger


def load_ledger(path: Path = LEDGER_FILE) -> list[dict]:
    if not path.exists():
        return []
    entries = load_toml(path).get("dropped", [])
    for i, e in enumerate(entries, 1):
        if not e.get("name") or not e.get("reason"):
            raise StackError(f"{path.name}: entry #{i} needs at least `name` and `reason`")
    return entries


def ledger_entry_toml(name: str, subject: str, series: str, upstream: str, reason: str) -> str:
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return (f"\n[[dropped]]\nname = {q(name)}\nsubject = {q(subject)}\nseries = {q(series)}\n"
            f"upstream = {q(upstream)}\nreason = {q(reason)}\n")


def ledger_problems(patch_dir: Path = series_mod.PATCHES) -> list[str]:
    """Series patches that the ledger says were dropped (by file name or Subject)."""
    entries = load_ledger(patch_dir / "dropped.toml")
    if not entries:
        return []
    by_name = {e["name"]: e for e in entries}
    by_subject = {e["subject"].strip(): e for e in entries if e.get("subject")}
    problems = []
    s = series_mod.read(patch_dir)
    for name, path in zip(s.names, s.paths):
        e = by_name.get(name)
        how = "name"
        if e is None and path.is_file():
            e, how = by_subject.get(patchfile.parse(path).subject.strip()), "Subject"
        if e is not None:
            problems.append(
                f"patches/{name}: its {how} is in patches/dropped.toml (dropped in "
                f"{e.get('series', '?')}, upstream v{e.get('upstream', '?')}: {e['reason']}); "
                "remove it from the series, or delete the ledger entry if it is needed again")
    return problems


# ---------------------------------------------------------------- for engine.check


def check_problems(pin, repo: Path | None = None, patch_dir: Path = series_mod.PATCHES) -> list[str]:
    """Ledger violations + guards failing on the PINNED upstream (tag pin.tag in vllm/).

    Guards are skipped when vllm/ holds no upstream yet (check reports that itself)."""
    try:
        problems = ledger_problems(patch_dir)
        guards = load_guards(patch_dir / "compat-guards.toml")
    except StackError as e:
        return [str(e)]
    if repo is None:
        from .engine import VLLM
        repo = VLLM
    if guards and git.is_repo_root(repo) and git.has_ref(repo, f"refs/tags/{pin.tag}"):
        for r in check_guards(repo, pin.tag, guards):
            if not r.ok:
                problems.append(f"patches/compat-guards.toml: guard {r.guard.id} fails on the pinned "
                                f"upstream {pin.tag}: {r.guard.file}: {r.detail} ({r.guard.describe()})")
    return problems
