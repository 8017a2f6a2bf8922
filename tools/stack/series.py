"""The `patches/series` file: one patch file name per line in apply order, `#` comments."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .errors import StackError

PATCHES = Path(__file__).resolve().parents[2] / "patches"


@dataclasses.dataclass
class Series:
    dir: Path
    names: list[str]

    @property
    def paths(self) -> list[Path]:
        return [self.dir / n for n in self.names]


def read(patch_dir: Path = PATCHES) -> Series:
    path = patch_dir / "series"
    if not path.exists():
        raise StackError(f"{path}: series file missing")
    names = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return Series(patch_dir, names)


def lint(patch_dir: Path = PATCHES) -> list[str]:
    """Disagreements between `series` and the patch files; each message names the file."""
    path = patch_dir / "series"
    if not path.exists():
        return [f"{path}: series file missing"]
    problems = []
    text = path.read_text()
    if text and not text.endswith("\n"):
        problems.append(f"{path}: no newline at end of file")
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line.split()) > 1:
            problems.append(f"series line {lineno}: {line!r}: options after a patch name are not supported")
            continue
        if "/" in line or not line.endswith(".patch"):
            problems.append(f"series line {lineno}: {line!r} must be a bare '<slug>.patch' name")
        if line in seen:
            problems.append(f"series line {lineno}: {line} listed twice (first on line {seen[line]})")
        seen.setdefault(line, lineno)
        if not (patch_dir / line).is_file():
            problems.append(f"series line {lineno}: {line} is listed but patches/{line} does not exist")
    for f in sorted(patch_dir.glob("*.patch")):
        if f.name not in seen:
            problems.append(f"patches/{f.name} exists but is not listed in series")
    return problems


def append(name: str, patch_dir: Path = PATCHES) -> None:
    path = patch_dir / "series"
    text = path.read_text()
    if text and not text.endswith("\n"):
        text += "\n"
    path.write_text(text + name + "\n")
