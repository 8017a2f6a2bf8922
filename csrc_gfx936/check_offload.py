# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""List the offload-bundle targets of HIP objects / shared objects; fail unless each has the arch.

    python3 csrc_gfx936/check_offload.py --want gfx936 FILE...

Reads clang's offload bundles straight from the file bytes (stdlib only): every
``__CLANG_OFFLOAD_BUNDLE__`` header is ``magic[24] | u64 entries | entries x (u64 offset,
u64 size, u64 triple length, triple)``; the device triples look like
``hipv4-amdgcn-amd-amdhsa--gfx936``. A file with no bundle, a compressed bundle (``CCOB``,
not listable here) or no entry for ``--want`` fails, naming the file and what it has.
``build.sh`` runs it over every shared object the ROCm wheel ships; CI runs it against an
object built for gfx90a (which must fail for gfx936).
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


def bundle_targets(data: bytes) -> tuple[list[str], bool]:
    """(device triples of every uncompressed bundle, whether a compressed one was seen)."""
    triples: list[str] = []
    pos = data.find(MAGIC)
    while pos >= 0:
        try:
            (n,) = struct.unpack_from("<Q", data, pos + len(MAGIC))
            off = pos + len(MAGIC) + 8
            for _ in range(min(n, 64)):
                _o, _s, tlen = struct.unpack_from("<QQQ", data, off)
                off += 24
                triples.append(data[off:off + tlen].decode("ascii", "replace"))
                off += tlen
        except struct.error:
            pass
        pos = data.find(MAGIC, pos + len(MAGIC))
    return triples, b"CCOB" in data


def check(path: Path, want: str) -> tuple[bool, str]:
    triples, compressed = bundle_targets(path.read_bytes())
    arches = sorted({t.rsplit("-", 1)[-1] for t in triples if "amdgcn" in t})
    has = any(a.split(":")[0] == want for a in arches)
    if has:
        return True, f"{path}: {want} code present (bundle targets: {', '.join(arches)})"
    why = ("no uncompressed offload bundle found"
           + (" (a compressed CCOB bundle is present: list it with clang-offload-bundler)"
              if compressed else "")) if not triples else f"bundle targets: {', '.join(arches) or triples}"
    return False, f"{path}: no {want} code; {why}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--want", default="gfx936")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    ok = True
    for f in args.files:
        good, msg = check(Path(f), args.want)
        print(("ok: " if good else "FAIL: ") + msg)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
