# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""List the offload-bundle targets of HIP objects / shared objects; fail unless each has the arch.

    python3 csrc_gfx936/check_offload.py --want gfx936 FILE...          # every FILE must have it
    python3 csrc_gfx936/check_offload.py --want gfx936 --wheel WHEEL    # build.sh's final check

Where device code lives: hipcc puts the device images of a HIP object in its ELF section
``.hip_fatbin`` as clang offload bundles, either uncompressed (``__CLANG_OFFLOAD_BUNDLE__``:
``magic[24] | u64 entries | entries x (u64 offset, u64 size, u64 triple length, triple)``,
triples like ``hipv4-amdgcn-amd-amdhsa--gfx936``) or compressed (``CCOB`` header
``magic[4] | u16 version | u16 method (0 zlib, 1 zstd) | [v2: u32, v3: u64 file size] |
u32/u64 uncompressed size | u64 hash``, then the compressed uncompressed-bundle). An ELF file
without ``.hip_fatbin`` carries no device code (host-only: vLLM's ``cumem_allocator``,
``spinloop``, ``fs_io_C``); a non-ELF file (a bare bundle) is read as a whole.

zlib bundles are read with the stdlib, zstd ones with the ``zstandard`` module when importable,
else listed with ``clang-offload-bundler --list`` (PATH, ``$ROCM_PATH/llvm/bin``); a compressed
bundle that nothing here can read fails, naming what to install.

``--wheel`` checks every shared object in the wheel: host-only ones pass (listed as such), each
one with device code must have ``--want``, at least one must carry device code and
``vllm/_gfx936_C*.so`` must be among them. Exit 0 = all good, 1 = a check failed, 2 = usage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
CCOB = b"CCOB"
FATBIN_SECTION = ".hip_fatbin"
# (header size, struct of the fields after magic+version+method) per CCOB version
CCOB_HEADERS = {1: (20, "<IQ"), 2: (24, "<IIQ"), 3: (32, "<QQQ")}


@dataclass
class Report:
    path: str
    device_code: bool = False          # a .hip_fatbin section (or a bare bundle) was found
    arches: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def elf_sections(data: bytes) -> dict[str, bytes] | None:
    """{section name: contents} of an ELF file (32/64-bit, either endianness); None if not ELF."""
    if data[:4] != b"\x7fELF" or len(data) < 52:
        return None
    is64, end = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        if is64:
            shoff, = struct.unpack_from(end + "Q", data, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x3A)
        else:
            shoff, = struct.unpack_from(end + "I", data, 0x20)
            shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x2E)
        heads = []
        for i in range(shnum):
            base = shoff + i * shentsize
            if is64:
                name, typ, _f, _a, off, size = struct.unpack_from(end + "IIQQQQ", data, base)
            else:
                name, typ, _f, _a, off, size = struct.unpack_from(end + "IIIIII", data, base)
            heads.append((name, typ, off, size))
        _n, _t, stroff, strsize = heads[shstrndx]
        strtab = data[stroff:stroff + strsize]
    except (struct.error, IndexError):
        return None
    out = {}
    for name, typ, off, size in heads:
        label = strtab[name:strtab.find(b"\0", name)].decode("ascii", "replace")
        out[label] = b"" if typ == 8 else data[off:off + size]  # SHT_NOBITS holds nothing
    return out


def _uncompressed_triples(blob: bytes, problems: list[str]) -> list[str]:
    triples = []
    pos = blob.find(MAGIC)
    while pos >= 0:
        try:
            (n,) = struct.unpack_from("<Q", blob, pos + len(MAGIC))
            off = pos + len(MAGIC) + 8
            for _ in range(min(n, 256)):
                _o, _s, tlen = struct.unpack_from("<QQQ", blob, off)
                off += 24
                triples.append(blob[off:off + tlen].decode("ascii", "replace"))
                off += tlen
        except struct.error:
            problems.append(f"truncated offload bundle at byte {pos}")
        pos = blob.find(MAGIC, pos + len(MAGIC))
    return triples


def _bundler() -> str | None:
    found = shutil.which("clang-offload-bundler")
    if found:
        return found
    for root in filter(None, (os.environ.get("ROCM_PATH"), os.environ.get("ROCM_HOME"))):
        cand = Path(root) / "llvm" / "bin" / "clang-offload-bundler"
        if cand.is_file():
            return str(cand)
    return None


def _list_with_bundler(blob: bytes, problems: list[str]) -> list[str]:
    tool = _bundler()
    if tool is None:
        problems.append("a zstd-compressed (CCOB) bundle: pip install zstandard, or put DTK's "
                        "clang-offload-bundler on PATH (or set ROCM_PATH), to list its targets")
        return []
    with tempfile.NamedTemporaryFile(suffix=".bundle") as f:
        f.write(blob)
        f.flush()
        proc = subprocess.run([tool, "--list", "--type=o", f"--input={f.name}"],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        problems.append(f"{tool} --list failed: {proc.stderr.strip()[:200]}")
        return []
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]


def _compressed_triples(blob: bytes, pos: int, problems: list[str]) -> list[str]:
    try:
        version, method = struct.unpack_from("<HH", blob, pos + 4)
        if version not in CCOB_HEADERS:
            problems.append(f"compressed bundle version {version} at byte {pos} is unknown")
            return []
        hsize, fmt = CCOB_HEADERS[version]
        fields = struct.unpack_from(fmt, blob, pos + 8)
    except struct.error:
        problems.append(f"truncated compressed bundle header at byte {pos}")
        return []
    total = fields[0] if version >= 2 else len(blob) - pos
    body = blob[pos + hsize:pos + total]
    inner = None
    if method == 0:
        try:
            inner = zlib.decompress(body)
        except zlib.error as e:
            problems.append(f"zlib bundle at byte {pos} does not decompress: {e}")
            return []
    elif method == 1:
        try:
            import zstandard  # optional
            inner = zstandard.ZstdDecompressor().decompress(body, max_output_size=fields[-2])
        except ImportError:
            return _list_with_bundler(blob[pos:pos + total], problems)
        except Exception as e:  # noqa: BLE001 - zstandard's own error types
            problems.append(f"zstd bundle at byte {pos} does not decompress: {e}")
            return []
    else:
        problems.append(f"compressed bundle at byte {pos} uses unknown method {method}")
        return []
    return _uncompressed_triples(inner, problems)


def scan(path: Path) -> Report:
    data = path.read_bytes()
    rep = Report(str(path))
    sections = elf_sections(data)
    if sections is None:
        blobs = [data] if (MAGIC in data or data[:4] == CCOB) else []
    else:
        blobs = [v for k, v in sections.items() if k == FATBIN_SECTION]
    triples: list[str] = []
    for blob in blobs:
        rep.device_code = True
        triples += _uncompressed_triples(blob, rep.problems)
        pos = blob.find(CCOB)
        while pos >= 0:
            triples += _compressed_triples(blob, pos, rep.problems)
            pos = blob.find(CCOB, pos + 4)
        if not triples and not rep.problems:
            rep.problems.append(f"{FATBIN_SECTION} holds no offload bundle")
    rep.arches = sorted({t.rsplit("-", 1)[-1] for t in triples if "amdgcn" in t})
    return rep


def has_arch(rep: Report, want: str) -> bool:
    return any(a.split(":")[0] == want for a in rep.arches)


def describe(rep: Report, want: str) -> tuple[bool, str]:
    """(ok, line) for a file that must carry `want` code."""
    if has_arch(rep, want):
        return True, f"{rep.path}: {want} code present (bundle targets: {', '.join(rep.arches)})"
    if not rep.device_code:
        why = "no device code (no .hip_fatbin section, no offload bundle)"
    elif rep.arches:
        why = f"bundle targets: {', '.join(rep.arches)}"
    else:
        why = "; ".join(rep.problems) or "no amdgcn target in its bundles"
    return False, f"{rep.path}: no {want} code; {why}"


def check(path: Path, want: str) -> tuple[bool, str]:
    return describe(scan(path), want)


def check_wheel(wheel: Path, want: str) -> tuple[bool, list[str]]:
    """build.sh's final gate over the ROCm wheel (see the module docstring)."""
    lines, ok, with_code = [], True, []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zw:
        sos = [n for n in zw.namelist() if n.endswith(".so") or ".so." in n.rsplit("/", 1)[-1]]
        if not sos:
            return False, [f"FAIL: {wheel}: ships no shared object"]
        for name in sorted(sos):
            rep = scan(Path(zw.extract(name, tmp)))
            rep.path = name
            if not rep.device_code:
                lines.append(f"ok: {name}: host-only (no device code)")
                continue
            with_code.append(name)
            good, msg = describe(rep, want)
            lines.append(("ok: " if good else "FAIL: ") + msg)
            ok &= good
    if not with_code:
        ok = False
        lines.append(f"FAIL: {wheel}: no shared object carries device code (not a ROCm build?)")
    if not any(Path(n).name.startswith("_gfx936_C") for n in with_code):
        ok = False
        lines.append(f"FAIL: {wheel}: lacks vllm/_gfx936_C*.so with device code "
                     "(csrc_gfx936 kernels not grafted)")
    return ok, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--want", default="gfx936")
    ap.add_argument("--wheel", type=Path, help="check every shared object of this wheel")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args(argv)
    if bool(args.wheel) == bool(args.files):
        ap.error("give FILE... or --wheel WHEEL (one of them)")
    if args.wheel:
        if not args.wheel.is_file():
            print(f"FAIL: --wheel {args.wheel}: no such file")
            return 1
        ok, lines = check_wheel(args.wheel, args.want)
        print("\n".join(lines))
        return 0 if ok else 1
    ok = True
    for f in args.files:
        good, msg = check(Path(f), args.want)
        print(("ok: " if good else "FAIL: ") + msg)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
