"""Parse a `git format-patch` style patch with a DEP-3-like header, and lint that header.

The header this fork requires (see STYLE.md):

    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: <author>
    Date: <date>
    Subject: [PATCH] area: what it does

    Why (the Description: one or more paragraphs).

    Upstream-Status: pending | not-needed (...) | submitted <url> | backport <ref> | inappropriate (...)
    Remove-When: the upstream change that makes this patch unnecessary
    Tests: tests/runtime/test_x.py [more paths]

    diff --git a/... b/...
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REQUIRED_TRAILERS = ("Upstream-Status", "Remove-When", "Tests")
UPSTREAM_STATUSES = {
    "pending": False,
    "not-needed": False,
    "inappropriate": False,
    "submitted": True,  # needs a URL or reference after it
    "backport": True,
    "accepted": True,
}
_TRAILER = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s*(.*)$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_PLACEHOLDER = re.compile(r"\bTODO\b")


@dataclasses.dataclass
class Hunk:
    number: int  # 1-based within its file
    header: str
    old_start: int


@dataclasses.dataclass
class FileDiff:
    path: str  # path in the upstream tree (b/ side, or a/ side for deletions)
    old_path: str | None  # None for a new file
    hunks: list[Hunk]


@dataclasses.dataclass
class PatchFile:
    name: str
    author: str
    date: str
    subject: str
    description: str
    trailers: dict[str, str]
    files: list[FileDiff]
    text: str

    @property
    def tests(self) -> list[str]:
        return re.split(r"[\s,]+", self.trailers.get("Tests", "").strip()) if self.trailers.get("Tests") else []

    def hunk_at(self, path: str, old_line: int) -> tuple[FileDiff, Hunk] | None:
        for f in self.files:
            if path in (f.path, f.old_path):
                for h in f.hunks:
                    if h.old_start == old_line:
                        return f, h
        return None


def parse(path: Path) -> PatchFile:
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    lines = text.split("\n")
    i = 0
    headers: dict[str, str] = {}
    # mbox "From <sha> <date>" line is optional.
    if lines and lines[0].startswith("From ") and not lines[0].startswith("From:"):
        i = 1
    last = None
    while i < len(lines) and lines[i] != "":
        line = lines[i]
        if line[:1] in (" ", "\t") and last:
            headers[last] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            last = key.strip()
            headers[last] = value.strip()
        else:
            break
        i += 1
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers.get("Subject", "")).strip()
    # Message body runs to the diff (or to a '---' separator before a diffstat).
    body: list[str] = []
    while i < len(lines) and not lines[i].startswith("diff --git ") and lines[i] != "---":
        body.append(lines[i])
        i += 1
    paragraphs = [p.strip() for p in "\n".join(body).strip().split("\n\n") if p.strip()]
    trailers: dict[str, str] = {}
    if paragraphs and all(_TRAILER.match(l) for l in paragraphs[-1].splitlines()):
        for l in paragraphs[-1].splitlines():
            m = _TRAILER.match(l)
            trailers[m.group(1)] = m.group(2).strip()
        paragraphs = paragraphs[:-1]
    description = "\n\n".join(paragraphs)
    return PatchFile(
        name=path.name, author=headers.get("From", ""), date=headers.get("Date", ""),
        subject=subject, description=description, trailers=trailers,
        files=_parse_diff(lines[i:]), text=text,
    )


def _parse_diff(lines: list[str]) -> list[FileDiff]:
    files: list[FileDiff] = []
    cur: FileDiff | None = None
    for line in lines:
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(\S+) b/(\S+)", line)
            a, b = (m.group(1), m.group(2)) if m else (None, None)
            cur = FileDiff(path=b or "", old_path=a, hunks=[])
            files.append(cur)
        elif cur is None:
            continue
        elif line.startswith("new file mode"):
            cur.old_path = None
        elif line.startswith("deleted file mode"):
            cur.path = cur.old_path or cur.path
        elif line.startswith("@@ "):
            m = _HUNK.match(line)
            if m:
                cur.hunks.append(Hunk(len(cur.hunks) + 1, line, int(m.group(1))))
    return files


def lint(p: PatchFile, repo_root: Path) -> list[str]:
    """Problems with the patch header; each names the field at fault."""
    problems = []
    if not p.subject:
        problems.append("no Subject line")
    elif ":" not in p.subject.split(" ", 1)[0] + " ":
        problems.append(f"Subject {p.subject!r} lacks an 'area: ' prefix (e.g. 'platform/rocm: ...')")
    if not p.author:
        problems.append("no From: (author) line")
    if not p.description:
        problems.append("no Description: the body must say why the patch exists")
    elif _PLACEHOLDER.search(p.description) or _PLACEHOLDER.search(p.subject):
        problems.append("Description or Subject still holds a TODO placeholder")
    for key in REQUIRED_TRAILERS:
        value = p.trailers.get(key, "")
        if not value:
            problems.append(f"missing trailer '{key}:' in the header's last paragraph")
        elif _PLACEHOLDER.search(value):
            problems.append(f"trailer '{key}:' still holds a TODO placeholder")
    status = p.trailers.get("Upstream-Status", "")
    if status:
        word = status.split()[0].rstrip(",;")
        if word not in UPSTREAM_STATUSES:
            problems.append(
                f"Upstream-Status {word!r} is not one of {', '.join(sorted(UPSTREAM_STATUSES))}")
        elif UPSTREAM_STATUSES[word] and len(status.split()) < 2:
            problems.append(f"Upstream-Status '{word}' needs a URL or reference after it")
    for t in p.tests:
        if t and not (repo_root / t).exists():
            problems.append(f"Tests names {t!r}, which does not exist in this repository")
    if not p.files:
        problems.append("contains no diff")
    return problems
