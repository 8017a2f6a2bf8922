"""How big the patch series is, and how much of it touches files upstream has.

    python3 -m tools.series_stats            # patches/ in the working tree
    python3 -m tools.series_stats --rev REV  # patches/ as committed at REV (e.g. an old revision)
    python3 -m tools.series_stats --total    # only the totals line

Per patch, in apply order:
  lines     the patch file's lines (header and diff)
  up_hunk   lines of hunks (context, added, removed) in files upstream has
  up_chg    added + removed lines in files upstream has
  new       lines of hunks in files the series itself creates (fork-owned)
  marks     net `gfx936:` lines it adds (added minus removed), anywhere

A file is fork-owned when a patch of the series creates it (`--- /dev/null`); every other
file is upstream's. Read from the patches alone, so an old revision needs no applied tree.
The sum of `marks` equals `git -C vllm grep 'gfx936:' | wc -l` in the applied tree (upstream
has no such comment). A rebase conflicts only in upstream files: `up_hunk` is what to keep small.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "gfx936:"


@dataclass
class PatchStats:
    name: str
    lines: int = 0
    up_hunk: int = 0
    up_chg: int = 0
    new: int = 0
    marks: int = 0


def _read(rev: str | None, path: str) -> str:
    if rev is None:
        return Path(path).read_text()
    return subprocess.run(
        ["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def _series(rev: str | None) -> list[str]:
    names = []
    for line in _read(rev, "patches/series").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def _files(text: str):
    """Yield (path, created, hunk_lines) for each file a patch touches. A hunk
    holds exactly the lines its header counts (a format-patch ``-- `` trailer
    after the last hunk is not a removed line)."""
    path, created, body, minus = None, False, [], None
    old_left = new_left = 0
    for line in text.splitlines():
        if old_left > 0 or new_left > 0:
            if line.startswith("\\"):
                continue
            tag = line[:1] or " "
            body.append(tag + line[1:])
            old_left -= tag in " -"
            new_left -= tag in " +"
            continue
        if line.startswith("diff --git "):
            if path is not None:
                yield path, created, body
            path, created, body, minus = None, False, [], None
        elif line.startswith("--- "):
            minus = line[4:]
        elif line.startswith("+++ "):
            target = line[4:]
            path = target[2:] if target.startswith("b/") else target
            created = minus == "/dev/null"
        elif line.startswith("@@ "):
            m = re.match(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", line)
            if m is None:
                raise ValueError(f"bad hunk header: {line!r}")
            old_left = int(m.group(1) or 1)
            new_left = int(m.group(2) or 1)
    if path is not None:
        yield path, created, body


def collect(rev: str | None) -> list[PatchStats]:
    names = _series(rev)
    texts = {n: _read(rev, f"patches/{n}") for n in names}
    owned = {
        path for text in texts.values() for path, created, _ in _files(text) if created
    }
    out = []
    for name in names:
        st = PatchStats(name, lines=len(texts[name].splitlines()))
        for path, _created, body in _files(texts[name]):
            for line in body:
                if MARK in line[1:]:
                    st.marks += {"+": 1, "-": -1}.get(line[0], 0)
            if path in owned:
                st.new += len(body)
            else:
                st.up_hunk += len(body)
                st.up_chg += sum(1 for line in body if line[0] in "+-")
        out.append(st)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="read patches/ from this git revision")
    ap.add_argument("--total", action="store_true", help="print only the totals")
    args = ap.parse_args(argv)
    stats = collect(args.rev)
    cols = ("lines", "up_hunk", "up_chg", "new", "marks")
    width = max(len(s.name) for s in stats)
    if not args.total:
        print(f"{'patch':<{width}} " + " ".join(f"{c:>7}" for c in cols))
        for s in stats:
            print(f"{s.name:<{width}} " + " ".join(f"{getattr(s, c):>7}" for c in cols))
    totals = {c: sum(getattr(s, c) for s in stats) for c in cols}
    print(
        f"{len(stats)} patches: "
        + ", ".join(f"{c} {v}" for c, v in totals.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
