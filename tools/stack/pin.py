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
    if not path.is_file():
        raise StackError(f"{path}: pin file missing")
    data = load_toml(path)
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


def load_toml(path: Path) -> dict:
    """The TOML file at path (tomllib; on Python 3.10 the subset this repo's files use)."""
    text = path.read_text()
    try:
        return tomllib.loads(text) if tomllib else _loads_simple(text)
    except ValueError as e:  # tomllib.TOMLDecodeError is a ValueError
        raise StackError(f"{path}: not valid TOML: {e}") from None


_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_VALUE = re.compile(r"""\s*(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|([+-]?\d+))\s*(?:#.*)?""")


def _unescape(s: str) -> str:
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "uU":
            return chr(int(e[1:], 16))
        if e not in _ESCAPES:
            raise ValueError(f"unsupported escape \\{e}")
        return _ESCAPES[e]
    return re.sub(r"\\(u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)", one, s)


def _loads_simple(text: str) -> dict:
    """What upstream.toml and patches/*.toml use: `[table]` and `[[array-of-tables]]` headers,
    `key = "basic" | 'literal' | integer` lines, `#` comments."""
    data: dict = {}
    cur = data
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.fullmatch(r"\[\[([A-Za-z0-9_.-]+)\]\]\s*(?:#.*)?", line):
            cur = {}
            data.setdefault(m.group(1), []).append(cur)
        elif m := re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]\s*(?:#.*)?", line):
            cur = data.setdefault(m.group(1), {})
        elif (m := re.match(r"([A-Za-z0-9_-]+)\s*=", line)) and (v := _VALUE.fullmatch(line, m.end())):
            basic, literal, integer = v.groups()
            try:
                cur[m.group(1)] = (_unescape(basic) if basic is not None else
                                   literal if literal is not None else int(integer))
            except ValueError as e:
                raise ValueError(f"line {n}: {e}") from None
        else:
            raise ValueError(f"line {n}: unsupported syntax {raw!r}")
    return data
