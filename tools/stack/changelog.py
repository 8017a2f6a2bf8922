"""CHANGELOG.md holds one entry per series revision; its top entry names the current one.

Entry heading form:  `## s<N> — <YYYY-MM-DD> — upstream v<version>`
The series revision N goes into every wheel version (0.27.1+gfx936.sN...).
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import StackError
from .pin import ROOT, Pin

CHANGELOG = ROOT / "CHANGELOG.md"
_ENTRY = re.compile(r"^## s(\d+) — (\d{4}-\d{2}-\d{2}) — upstream v(\S+)\s*$", re.M)


def entries(path: Path = CHANGELOG) -> list[tuple[int, str, str]]:
    if not path.exists():
        return []
    return [(int(m.group(1)), m.group(2), m.group(3)) for m in _ENTRY.finditer(path.read_text())]


def series_revision(path: Path = CHANGELOG) -> int:
    found = entries(path)
    if not found:
        raise StackError(f"{path.name}: no entry like '## s1 — 2026-12-02 — upstream v0.27.1'")
    return found[0][0]


def lint(pin: Pin, path: Path = CHANGELOG) -> list[str]:
    found = entries(path)
    if not found:
        return [f"{path.name}: no entry like '## s1 — 2026-12-02 — upstream v{pin.version}'"]
    problems = []
    rev, _, version = found[0]
    if version != pin.version:
        problems.append(f"{path.name}: top entry s{rev} targets upstream v{version}, "
                        f"but upstream.toml pins v{pin.version}")
    revs = [r for r, _, _ in found]
    if revs != sorted(revs, reverse=True) or len(set(revs)) != len(revs):
        problems.append(f"{path.name}: entries must be newest first with unique revisions, got "
                        + ", ".join(f"s{r}" for r in revs))
    return problems
