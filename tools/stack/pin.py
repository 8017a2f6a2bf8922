"""Read the pin file (upstream.toml): the one record of which upstream the fork is built on."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (some DTK images): the pin file is simple enough to read by hand
    tomllib = None

from .errors import StackError

ROOT = Path(__file__).resolve().parents[2]
PIN_FILE = ROOT / "upstream.toml"


@dataclasses.dataclass(frozen=True)
class Pin:
    version: str
    commit: str
    repository: str
    sdist: str
    sdist_sha256: str
    cpu_ops: dict

    @property
    def tag(self) -> str:
        """Tag inside vllm/ that marks the pristine upstream commit."""
        return f"upstream/v{self.version}"


def load(path: Path = PIN_FILE) -> Pin:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StackError(f"{path}: pin file missing") from None
    try:
        data = tomllib.loads(text) if tomllib else _loads_simple(text)
    except ValueError as e:  # tomllib.TOMLDecodeError is a ValueError
        raise StackError(f"{path}: not valid TOML: {e}") from None
    up = data.get("upstream", {})
    missing = [k for k in ("version", "commit", "repository", "sdist", "sdist_sha256") if k not in up]
    if missing:
        raise StackError(f"{path}: [upstream] lacks {', '.join(missing)}")
    if len(up["commit"]) != 40:
        raise StackError(f"{path}: upstream.commit must be a full 40-hex commit, got {up['commit']!r}")
    return Pin(
        version=up["version"],
        commit=up["commit"],
        repository=up["repository"],
        sdist=up["sdist"],
        sdist_sha256=up["sdist_sha256"],
        cpu_ops=dict(data.get("cpu_ops", {})),
    )


def _loads_simple(text: str) -> dict:
    """Sections of `key = "string"` lines: all upstream.toml uses."""
    data: dict = {}
    section = data
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line:
            continue
        if m := re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]", line):
            section = data.setdefault(m.group(1), {})
        elif m := re.fullmatch(r'([A-Za-z0-9_-]+)\s*=\s*"([^"]*)"', line):
            section[m.group(1)] = m.group(2)
        else:
            raise ValueError(f"line {n}: unsupported syntax {raw!r}")
    return data
