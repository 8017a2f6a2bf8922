# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-kernel register / scratch / LDS / occupancy report of an AMD build; fails on what gfx936 lacks.

    python3 csrc_gfx936/resource_report.py --arch gfx90a --out build/kernel-check \\
        [--allow csrc_gfx936/kernel_resources_allow.json] SRC.s:SRC.remarks ...

Input, per source, two files of one ``hipcc -c -save-temps=obj -Rpass-analysis=kernel-resource-usage``
compile (``compile_check.sh`` makes them): the device assembly (``*-hip-amdgcn-amd-amdhsa-<arch>.s``,
the code in the object) and the compiler's stderr. From them, per kernel:

- the remarks (``Function Name``, ``VGPRs``, ``SGPRs``, ``AGPRs``, ``ScratchSize [bytes/lane]``,
  ``Occupancy [waves/SIMD]``, ``LDS Size [bytes/block]``, spills);
- the HSA metadata of the assembly (``.amdgpu_metadata``: ``.agpr_count``, ``.sgpr_count``,
  ``.private_segment_fixed_size``, ``.group_segment_fixed_size``, ``.uses_dynamic_stack``), which
  must agree with the remarks (else the parse is wrong and the run fails);
- the kernel's own instructions: ``v_mfma*``, ``v_accvgpr_*`` and FP8 conversions counted.

A kernel fails on scratch > 0 (or a dynamic stack), any AGPR (count or ``v_accvgpr`` instruction),
any ``v_mfma`` or FP8 conversion instruction: gfx936 has no MFMA, no AGPRs and no FP8 conversions,
so on gfx90a (the stand-in target of Debian's hipcc) AGPRs and scratch are where register pressure
that would spill to scratch on gfx936 shows. An entry of the allow-list (JSON, checked in) names a
kernel, its measured numbers and the issue that tracks it: the kernel is then reported as known debt
and does not fail the run, as long as its numbers are exactly the listed ones (any change, better or
worse, fails and names the entry to update). Writes ``<out>/resources.<arch>.json`` and
``<out>/resources.<arch>.md``. Exit 0 = no unlisted failure, 1 = failures (each named with its
number), 2 = usage / unreadable input.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REMARK_KEYS = {
    "SGPRs": "sgpr", "VGPRs": "vgpr", "AGPRs": "agpr", "ScratchSize [bytes/lane]": "scratch",
    "Occupancy [waves/SIMD]": "waves_per_simd", "SGPRs Spill": "sgpr_spill",
    "VGPRs Spill": "vgpr_spill", "LDS Size [bytes/block]": "lds",
}
_REMARK = re.compile(r"remark:\s+(.+?):\s+(\S+)\s+\[-Rpass-analysis=kernel-resource-usage\]")
_META_ITEM = re.compile(r"^  - \.([\w]+):\s*(.*)$")
_META_FIELD = re.compile(r"^    \.([\w]+):\s*(.*)$")
_LABEL = re.compile(r"^([A-Za-z_.$][\w.$]*):")
_FUNC_END = re.compile(r"^\.Lfunc_end\d+:")
ISA_COUNTS = {  # instruction families counted per kernel
    "mfma": re.compile(r"^\s+v_mfma\w*"),
    "accvgpr": re.compile(r"^\s+v_accvgpr_\w+"),
    "fp8_cvt": re.compile(r"^\s+v_cvt_\w*(fp8|bf8)\w*"),
}


class ReportError(Exception):
    """The inputs cannot be read as one compile's remarks and assembly."""


def parse_remarks(text: str) -> dict[str, dict[str, int]]:
    """{mangled function name: {field: int}} from -Rpass-analysis=kernel-resource-usage output."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in text.splitlines():
        m = _REMARK.search(line)
        if not m:
            continue
        # "remark: Function Name: X" or, with -save-temps, "remark: file:line:col: Function Name: X"
        key, val = m.group(1).split(": ")[-1].strip(), m.group(2)
        if key == "Function Name":
            cur = out.setdefault(val, {})
        elif key in REMARK_KEYS and cur is not None:
            cur[REMARK_KEYS[key]] = int(val)
    return out


def parse_metadata(asm: str) -> dict[str, dict[str, str]]:
    """{kernel name: {metadata field without its dot: raw value}} from .amdgpu_metadata."""
    try:
        start = asm.index(".amdgpu_metadata")
        end = asm.index(".end_amdgpu_metadata", start)
    except ValueError as e:
        raise ReportError("no .amdgpu_metadata block (not an AMDGPU HSA assembly file?)") from e
    kernels, cur = [], None
    for line in asm[start:end].splitlines():
        m = _META_ITEM.match(line)
        if m:
            cur = {m.group(1): m.group(2).strip()}
            kernels.append(cur)
            continue
        m = _META_FIELD.match(line)
        if m and cur is not None:
            cur[m.group(1)] = m.group(2).strip()
    return {k["name"]: k for k in kernels if "name" in k}


def scan_isa(asm: str, names: set[str]) -> dict[str, dict[str, int]]:
    """Counts of ISA_COUNTS per kernel body (from its label to .Lfunc_end)."""
    counts: dict[str, dict[str, int]] = {}
    cur = None
    for line in asm.splitlines():
        if cur is None:
            m = _LABEL.match(line)
            if m and m.group(1) in names:
                cur = counts.setdefault(m.group(1), dict.fromkeys(ISA_COUNTS, 0))
            continue
        if _FUNC_END.match(line):
            cur = None
            continue
        for key, pat in ISA_COUNTS.items():
            if pat.match(line):
                cur[key] += 1
    return counts


def demangle(names: list[str]) -> dict[str, str]:
    """Short readable names: `sparse_mla_decode_kernel<4, true>` (c++filt when present)."""
    tool = shutil.which("c++filt") or shutil.which("llvm-cxxfilt")
    full = list(names)
    if tool and names:
        done = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
        if done.returncode == 0 and len(done.stdout.splitlines()) == len(names):
            full = done.stdout.splitlines()
    short = {}
    for mangled, name in zip(names, full):
        name = re.sub(r"^void ", "", name)
        name = name.replace("(anonymous namespace)::", "")
        name = re.sub(r"^(\w+::)+", "", name)
        name = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name)  # the parameter list
        short[mangled] = name
    return short


def kernels_of(source: str, asm: str, remarks: str) -> list[dict]:
    """One record per kernel of one compile; a disagreement between remarks and metadata raises."""
    meta = parse_metadata(asm)
    rem = parse_remarks(remarks)
    if not meta:
        raise ReportError(f"{source}: the assembly lists no kernels")
    isa = scan_isa(asm, set(meta))
    names = demangle(sorted(meta))
    rows = []
    for mangled in sorted(meta, key=lambda m: names[m]):
        md, r = meta[mangled], rem.get(mangled)
        if r is None or set(r) < {"vgpr", "sgpr", "agpr", "scratch", "waves_per_simd", "lds"}:
            raise ReportError(f"{source}: no kernel-resource-usage remarks for {names[mangled]} "
                              "(compiled without -Rpass-analysis=kernel-resource-usage?)")
        pairs = (("agpr", "agpr_count"), ("scratch", "private_segment_fixed_size"),
                 ("lds", "group_segment_fixed_size"), ("sgpr", "sgpr_count"))
        for key, field in pairs:
            if field in md and int(md[field]) != r[key]:
                raise ReportError(f"{source}: {names[mangled]}: remarks say {key}={r[key]}, "
                                  f"metadata .{field}={md[field]}")
        row = {"source": source, "kernel": names[mangled], "symbol": mangled,
               **{k: r.get(k, 0) for k in ("vgpr", "sgpr", "agpr", "scratch", "lds",
                                           "waves_per_simd", "vgpr_spill", "sgpr_spill")},
               "dynamic_stack": md.get("uses_dynamic_stack", "false") == "true",
               "wavefront_size": int(md.get("wavefront_size", "0") or 0),
               **isa.get(mangled, dict.fromkeys(ISA_COUNTS, 0))}
        rows.append(row)
    return rows


def violations(row: dict) -> list[str]:
    """What gfx936 cannot run, each with its number."""
    out = []
    if row["scratch"] > 0:
        out.append(f"scratch {row['scratch']} bytes/lane")
    if row["dynamic_stack"]:
        out.append("dynamic stack (scratch of unknown size)")
    if row["agpr"] > 0 or row["accvgpr"] > 0:
        out.append(f"{row['agpr']} AGPRs ({row['accvgpr']} v_accvgpr instructions)")
    if row["mfma"] > 0:
        out.append(f"{row['mfma']} v_mfma instructions")
    if row["fp8_cvt"] > 0:
        out.append(f"{row['fp8_cvt']} FP8 conversion instructions")
    return out


MEASURED = ("agpr", "scratch", "mfma")  # the numbers an allow-list entry must repeat exactly


def load_allow(path: Path | None, arch: str) -> list[dict]:
    if path is None:
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"allow-list {path}: {e}") from e
    entries = [e for e in data.get("entries", []) if e.get("arch") == arch]
    for e in entries:
        missing = [k for k in ("source", "kernel", "issue", "why", *MEASURED) if k not in e]
        if missing:
            raise ReportError(f"allow-list {path}: entry {e.get('kernel')!r} lacks {missing}")
    return entries


def check(rows: list[dict], allow: list[dict]) -> list[str]:
    """Sets row['status'] ('ok' / 'allowed (issue N)' / 'FAIL'); returns the failure messages."""
    by_key = {(e["source"], e["kernel"]): e for e in allow}
    seen, failures = set(), []
    for row in rows:
        bad = violations(row)
        entry = by_key.get((row["source"], row["kernel"]))
        row["violations"] = bad
        if entry is not None:
            seen.add((row["source"], row["kernel"]))
            listed = {k: entry[k] for k in MEASURED}
            now = {k: row[k] for k in MEASURED}
            if listed != now or not bad:
                row["status"] = "FAIL"
                failures.append(f"{row['source']}: {row['kernel']}: allow-list entry (issue "
                                f"{entry['issue']}) lists {listed}, the build measures {now}: "
                                "update or remove the entry")
            else:
                row["status"] = f"allowed (issue {entry['issue']})"
            continue
        if bad:
            row["status"] = "FAIL"
            failures.append(f"{row['source']}: {row['kernel']}: " + ", ".join(bad))
        else:
            row["status"] = "ok"
    for key in sorted(set(by_key) - seen):
        failures.append(f"{key[0]}: {key[1]}: allow-list entry names a kernel this build does "
                        "not have: remove it")
    return failures


COLUMNS = (("kernel", "kernel"), ("VGPR", "vgpr"), ("SGPR", "sgpr"), ("AGPR", "agpr"),
           ("scratch B/lane", "scratch"), ("LDS B/block", "lds"), ("waves/SIMD", "waves_per_simd"),
           ("v_mfma", "mfma"), ("check", "status"))


def _span(vals):
    lo, hi = min(vals), max(vals)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def tables(rows: list[dict]) -> dict[str, list[str]]:
    """The report's two tables, as lines: "templates" (one row per kernel template, ranges over
    its instances) and "every" (one row per instance)."""
    tmpl = ["| source | kernel | instances | VGPR | SGPR | AGPR | scratch B/lane | LDS B/block "
            "| waves/SIMD | allowed (issue) | failing |", "|" + "---|" * 11]
    families: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        families.setdefault((r["source"], r["kernel"].split("<")[0]), []).append(r)
    for (src, fam), rs in families.items():
        allowed = sum(r["status"].startswith("allowed") for r in rs)
        failing = sum(r["status"] == "FAIL" for r in rs)
        tmpl.append(f"| {src} | `{fam}` | {len(rs)} | " + " | ".join(
            _span([r[k] for r in rs]) for k in ("vgpr", "sgpr", "agpr", "scratch", "lds",
                                                "waves_per_simd")) + f" | {allowed} | {failing} |")
    every = ["| source | " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for r in rows:
        every.append(f"| {r['source']} | `{r['kernel']}` | " +
                     " | ".join(str(r[k]) for _, k in COLUMNS[1:]) + " |")
    return {"templates": tmpl, "every": every}


def markdown(rows: list[dict], arch: str, failures: list[str]) -> str:
    t = tables(rows)
    lines = [f"# csrc_gfx936 kernel resources on {arch}", "",
             "From the compiler's own output (`-Rpass-analysis=kernel-resource-usage` and the "
             "HSA metadata of the device assembly); see docs/kernel-resources.md for how to read "
             "it. A kernel fails on scratch > 0, any AGPR, any `v_mfma`.", "",
             "## By kernel template", "", *t["templates"], "", "## Every kernel", "", *t["every"]]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


DOC_MARK = "<!-- resource_report {} -->"  # docs/kernel-resources.md: begin / end of a table


def updated_doc(doc: str, rows: list[dict]) -> str:
    """doc with the text between each DOC_MARK pair replaced by that table of the report on
    rows: what `make kernel-doc` writes and tests/kernels/test_kernel_resources.py compares."""
    for key, lines in tables(rows).items():
        begin, end = DOC_MARK.format(key), DOC_MARK.format("/" + key)
        if begin not in doc or end not in doc:
            raise ReportError(f"doc: no {begin} ... {end} section")
        a, b = doc.index(begin) + len(begin), doc.index(end)
        doc = doc[:a] + "\n" + "\n".join(lines) + "\n" + doc[b:]
    return doc


def rewrite_doc(doc: Path, report_json: Path) -> None:
    """`make kernel-doc`: doc's marked tables from a report's JSON (resources.ARCH.json)."""
    doc.write_text(updated_doc(doc.read_text(), json.loads(report_json.read_text())["kernels"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--allow", type=Path, default=None, help="allow-list JSON (known debt)")
    ap.add_argument("inputs", nargs="+", metavar="ASM:REMARKS[:SOURCE]")
    args = ap.parse_args(argv)
    rows = []
    try:
        for spec in args.inputs:
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise ReportError(f"input {spec!r}: expected ASM:REMARKS[:SOURCE]")
            asm, rem = Path(parts[0]), Path(parts[1])
            source = parts[2] if len(parts) == 3 else asm.name
            for p in (asm, rem):
                if not p.is_file():
                    raise ReportError(f"input {spec!r}: no file {p}")
            rows += kernels_of(source, asm.read_text(), rem.read_text(errors="replace"))
        allow = load_allow(args.allow, args.arch)
    except ReportError as e:
        print(f"resource_report: {e}", file=sys.stderr)
        return 2
    failures = check(rows, allow)
    args.out.mkdir(parents=True, exist_ok=True)
    js = args.out / f"resources.{args.arch}.json"
    md = args.out / f"resources.{args.arch}.md"
    js.write_text(json.dumps({"arch": args.arch, "kernels": rows, "failures": failures},
                             indent=1) + "\n")
    md.write_text(markdown(rows, args.arch, failures))
    allowed = sum(r["status"].startswith("allowed") for r in rows)
    print(f"resource_report: {len(rows)} kernels on {args.arch}, {allowed} allow-listed, "
          f"{len(failures)} failing -> {md}, {js}")
    for f in failures:
        print(f"resource_report: FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
