"""Compat guards (patches/compat-guards.toml) and the dropped-patch ledger (patches/dropped.toml).

Guards name upstream interfaces the series relies on but does not patch (cache layout constants,
signatures it hooks, env names). They are checked against PRISTINE upstream at a tag, so a rebase
can tell "every patch applies, but the ground under them moved".

A guard names a SYMBOL (function, class, kernel, constant, env switch or module file) and the
behaviour relied on (`expect`, checked in the symbol's definition or, with scope = "file", in the
file that defines it). `file` is where the symbol was at the pin: the search starts there and, when
the symbol is not there any more, follows it through the whole tree. So a result is one of
  ok       the symbol is where it was and `expect` holds;
  moved    found at another path (or several), `expect` holds there: the guard holds;
  changed  the symbol is found but `expect` no longer holds: re-read the consumer;
  gone     the symbol is defined nowhere in the tree.
Guards without `symbol` (a `regex`/`literal` on `file`) are the older path form and still work. The ledger lists patches dropped
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


KINDS = ("function", "class", "kernel", "constant", "env", "module")
C_EXT = ("*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp", "*.hip")


@dataclasses.dataclass
class Guard:
    id: str
    file: str
    pattern: str
    literal: bool
    count: int | None
    why: str
    used_by: str
    symbol: str | None = None
    kind: str | None = None
    scope: str = "definition"  # or "file"
    within: str | None = None  # a word the defining file must also contain (disambiguates)
    may_move: bool | None = None  # None: constants and kernels may move, code reached by path not

    def can_move(self) -> bool:
        """Whether the symbol may live at another path and still hold. The series reads a
        constant's or kernel's value (a cache layout) wherever it is, but reaches functions,
        classes, env readers and modules by their module path (`envs.is_set`, a hook in
        rocm.py): same name elsewhere is not the thing the series calls."""
        return self.may_move if self.may_move is not None else self.kind in ("constant", "kernel")

    def describe(self) -> str:
        what = f"literal {self.pattern!r}" if self.literal else f"regex /{self.pattern}/"
        what += f" x{self.count}" if self.count is not None else ""
        if self.symbol:
            return f"{self.kind} `{self.symbol}`: {what}" + (" (in its file)" if self.scope == "file" else "")
        return what


@dataclasses.dataclass
class GuardResult:
    guard: Guard
    ok: bool
    matches: int
    detail: str  # what was found, or why it failed
    lines: list[int]
    status: str = ""  # ok | moved | changed | gone (symbol guards); ok | failed (path guards)
    path: str | None = None  # where the symbol was found


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
        sym, kind = g.get("symbol"), g.get("kind")
        if sym is not None and kind not in KINDS:
            raise StackError(f"{path.name}: guard {gid}: symbol {sym!r} needs kind = one of {', '.join(KINDS)}")
        scope = g.get("scope", "definition")
        if scope not in ("definition", "file"):
            raise StackError(f"{path.name}: guard {gid}: scope must be \"definition\" or \"file\"")
        may_move = g.get("may-move")
        if may_move is not None and not isinstance(may_move, bool):
            raise StackError(f"{path.name}: guard {gid}: may-move must be true or false")
        guards.append(Guard(gid, g["file"], g.get("regex", g.get("literal")), "literal" in g,
                            count, g.get("why", ""), g.get("used-by", ""), sym, kind, scope,
                            g.get("within"), may_move))
    ids = [g.id for g in guards]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise StackError(f"{path.name}: guard id(s) listed twice: {', '.join(dup)}")
    return guards


def read_at(repo: Path, rev: str, path: str) -> str | None:
    proc = git.run(repo, "show", f"{rev}:{path}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def check_guard(g: Guard, text: str | None) -> GuardResult:
    """A path guard: the pattern in the file at g.file."""
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

    def read(f: str) -> str | None:
        if f not in cache:
            cache[f] = read_at(repo, rev, f)
        return cache[f]

    out = []
    for g in guards:
        if g.symbol:
            out.append(check_symbol_guard(g, repo, rev, read))
        else:
            r = check_guard(g, read(g.file))
            r.status, r.path = ("ok" if r.ok else "failed"), g.file
            out.append(r)
    return out


# ---------------------------------------------------------------- symbol guards


def definition_regex(kind: str, name: str) -> re.Pattern:
    n = re.escape(name)
    if kind == "function":
        rx = rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{n}\b"
    elif kind == "class":
        rx = rf"^[ \t]*(?:class|struct)[ \t]+{n}\b"
    elif kind == "kernel":  # a Triton/Python def, or a C/HIP/CUDA function definition with a body
        rx = (rf"^[ \t]*def[ \t]+{n}\b|^[ \t]*(?:template[ \t]*<[^>\n]*>[ \t]*\n?[ \t]*)?"
              rf"(?:[\w:<>,*&]+[ \t*&]+)+{n}[ \t]*\([^;{{}}]*\)[^;{{}}]*\{{")
    elif kind == "constant":
        rx = (rf"^[ \t]*(?:(?:static|constexpr|const|inline|__device__|__constant__)[ \t]+)*"
              rf"(?:[\w:<>]+[ \t]+)?{n}[ \t]*(?::[^=\n]+)?=(?!=)")
    elif kind == "env":
        rx = rf"^[ \t]*[\"']{n}[\"'][ \t]*:"
    else:
        raise StackError(f"no definition pattern for kind {kind!r}")
    return re.compile(rx, re.M)


def _block(text: str, start: int, python: bool) -> tuple[int, int]:
    """(start, end) offsets of the definition that starts at `start`: a Python def/class is its
    indented block; anything else runs to the `;`, closing `}` or (Python) end of line at bracket
    depth 0, then to the end of that line."""
    line_start = text.rfind("\n", 0, start) + 1
    first = text[line_start:text.find("\n", start) if "\n" in text[start:] else len(text)]
    if python and re.match(r"[ \t]*(?:async[ \t]+)?(?:def|class)\b", first):
        indent = len(first) - len(first.lstrip())
        pos = text.find("\n", start)
        while pos != -1:
            nxt = text.find("\n", pos + 1)
            line = text[pos + 1: nxt if nxt != -1 else len(text)]
            if line.strip() and not line.lstrip().startswith((")", "]", "#", "@")) and \
                    len(line) - len(line.lstrip()) <= indent:
                return line_start, pos
            pos = nxt
        return line_start, len(text)
    depth, braces, i = 0, False, start
    while i < len(text):
        c = text[i]
        if c in "([{":
            depth += 1
            braces = braces or (c == "{" and depth == 1)
        elif c in ")]}":
            depth -= 1
            if depth == 0 and c == "}" and braces:
                break
        elif depth == 0 and (c == ";" or (python and c == "\n" and text[i - 1] != "\\")):
            break
        i += 1
    end = text.find("\n", i)
    return line_start, end if end != -1 else len(text)


def symbol_regions(g: Guard, text: str, path: str) -> list[tuple[int, int]]:
    if g.kind == "module":
        return [(0, len(text))] if path.rsplit("/", 1)[-1] == g.symbol else []
    py = path.endswith(".py")
    return [_block(text, m.start(), py) for m in definition_regex(g.kind, g.symbol).finditer(text)]


def _candidates(g: Guard, repo: Path, rev: str) -> list[str]:
    """Files at rev that may define g.symbol: same basename first, then the rest."""
    if g.kind == "module":
        files = git.run(repo, "ls-tree", "-r", "--name-only", rev).stdout.splitlines()
        return [f for f in files if f.rsplit("/", 1)[-1] == g.symbol]
    spec = ["*.py"] if g.file.endswith(".py") else list(C_EXT)
    proc = git.run(repo, "grep", "-l", "-w", "-F", "-e", g.symbol, rev, "--", *spec, check=False)
    files = [line.split(":", 1)[1] for line in proc.stdout.splitlines() if ":" in line]
    base = g.file.rsplit("/", 1)[-1]
    return sorted(files, key=lambda f: (f.rsplit("/", 1)[-1] != base, f))


def _expect_in(g: Guard, text: str, regions: list[tuple[int, int]]) -> tuple[int, list[int]]:
    rx = re.compile(re.escape(g.pattern) if g.literal else g.pattern, re.M)
    spans = [(0, len(text))] if g.scope == "file" else regions
    lines = []
    for a, b in spans:
        for m in rx.finditer(text, a, b):
            lines.append(text.count("\n", 0, m.start()) + 1)
    return len(lines), lines


def _holds(g: Guard, n: int) -> bool:
    return n == g.count if g.count is not None else n > 0


def check_symbol_guard(g: Guard, repo: Path, rev: str, read) -> GuardResult:
    found: list[tuple[str, int, list[int], list[int]]] = []  # path, matches, match lines, def lines
    paths = [g.file] + [f for f in _candidates(g, repo, rev) if f != g.file]
    for f in paths:
        text = read(f)
        if text is None:
            continue
        if g.within and not re.search(rf"\b{re.escape(g.within)}\b", text):
            continue
        regions = symbol_regions(g, text, f)
        if not regions:
            continue
        n, lines = _expect_in(g, text, regions)
        found.append((f, n, lines, [text.count("\n", 0, a) + 1 for a, _ in regions]))
        if f == g.file:
            break  # still where it was: that is the answer
    if not found:
        return GuardResult(g, False, 0, f"{g.kind} `{g.symbol}` is defined nowhere in the tree"
                           + (f" (with `{g.within}` in the same file)" if g.within else ""), [],
                           "gone", None)
    holding = [x for x in found if _holds(g, x[1])]
    best = holding[0] if holding else found[0]
    f, n, lines, defs = best
    where = f"{f}:{','.join(map(str, defs))}"
    if not holding:
        return GuardResult(g, False, n, f"{g.kind} `{g.symbol}` found at {where}, but "
                           + (f"expected {g.count} match(es), found {n}" if g.count is not None else "no match")
                           + " of what the series relies on", lines, "changed", f)
    others = [x[0] for x in holding[1:]]
    if f == g.file:
        return GuardResult(g, True, n, f"{n} match(es)", lines, "ok", f)
    also = f" (also in {', '.join(others)})" if others else ""
    if not g.can_move():
        return GuardResult(g, False, n, f"moved: {g.file} -> {where}{also}; the series reaches this "
                           f"{g.kind} by its module path ({g.used_by or 'see used-by'}), so a {g.kind} of "
                           f"that name elsewhere is not what it calls: port the consumer, then set "
                           f"may-move = true or the new file", lines, "moved", f)
    return GuardResult(g, True, n, f"moved: {g.file} -> {where}{also}", lines, "moved", f)


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
    """Ledger violations + guards failing on the PINNED upstream (tag pin.tag in vllm/) + a
    patches/rebase-checks.toml that does not load.

    Guards are skipped when vllm/ holds no upstream yet (check reports that itself)."""
    try:
        problems = ledger_problems(patch_dir)
        guards = load_guards(patch_dir / "compat-guards.toml")
        from .rebase_checks import load_checks
        load_checks(patch_dir / "rebase-checks.toml")  # a bad hazard/fix entry is named at check time
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
