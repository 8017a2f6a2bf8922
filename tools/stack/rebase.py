"""`make rebase UPSTREAM=<version|commit>`: carry the series onto a new upstream, write a report.

Nothing of the current series is touched: not patches/, not upstream.toml, not vllm/'s checked-out
branch or work tree. The new upstream only becomes one more tag in vllm/.git (a parentless,
fixed-author/date import of the release sdist, the same commit `make upstream` would make), and
all the work happens in a scratch clone under build/rebase-<X>/:

  build/rebase-<X>/work/      clone of vllm/: branch `old` = old tag + series (clean apply),
                              branch `rebased` = new tag + every patch that carried
  build/rebase-<X>/patches/   the carried patches in canonical form + series (what accept installs)
  build/rebase-<X>/report.md  a row per patch, guards, Remove-When checks, range-diffs
  build/rebase-<X>/result.json  the same, for `rebase-accept`

Each patch is carried in series order and classified:
  clean                applies with zero fuzz at the same lines
  offset               applies with zero fuzz, some hunks at other lines
  3-way                plain apply fails; a 3-way merge (cherry-pick of the patch commit, whose
                       full-index blobs give the merge base) succeeds without conflicts
  renamed              a file it patches was renamed upstream; carried by a rename-following merge
  already-in-upstream  it reverse-applies on the new base, or its 3-way merge adds nothing
  target-gone          a file it patches was removed upstream (no rename found); not carried
  conflict             the 3-way merge conflicts; the conflicting hunks are listed; not carried
  blocked              it patches a file that an earlier, not carried patch creates, or (import
                       closure, after the carry) a module it imports is missing from the carried
                       tree: "blocked by <patch>" names the patch that creates it; not carried
A patch that is not carried is skipped and the next one is tried, so the report is complete.
Beside the carry (tools/stack/rebase_checks.py, patches/rebase-checks.toml): compat guards by
symbol (ok / moved / changed / gone), "probably obsolete" per patch (its added lines already
upstream, or a named upstream fix whose evidence is in the new tree; with --run-tests, its own
engine-free tests passing on the new upstream without it: tools/stack/rebase_tests.py), a hazard scan of the new
upstream, the environment (torch/Python/Triton, ROCm build list, CPU-ops wheel), a work estimate
per patch and a recommendation across every target rebased for this series.
`rebase-accept` installs the result, and refuses while anything conflicted or a guard failed.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from . import changelog, engine, git, guards as guards_mod, patchfile, rebase_checks as checks_mod
from . import rebase_tests as tests_mod
from . import series as series_mod, upstream
from .errors import StackError
from .pin import PIN_FILE, ROOT, Pin

BUILD = ROOT / "build"
HEX40 = re.compile(r"[0-9a-f]{40}")
CARRIED = ("clean", "offset", "3-way", "renamed")
BLOCKING = ("conflict", "target-gone", "blocked")
ORDER = ("clean", "offset", "3-way", "renamed", "already-in-upstream", "target-gone", "conflict",
         "blocked")


@dataclasses.dataclass
class Target:
    label: str  # the X of build/rebase-X
    version: str | None  # release version, None for a bare commit
    tag: str
    commit: str | None  # the real upstream git commit, when known
    commit_hint: str | None  # e.g. 'g1a2b3c4d5' from the sdist's vllm/_version.py
    sdist: str | None
    sdist_sha256: str | None
    sha_source: str | None
    import_commit: str  # the commit the tag points to in vllm/.git


@dataclasses.dataclass
class PatchResult:
    name: str
    subject: str
    status: str
    remove_when: str
    moved: list[str] = dataclasses.field(default_factory=list)
    detail: list[str] = dataclasses.field(default_factory=list)
    conflicts: list[str] = dataclasses.field(default_factory=list)
    added_present: int = 0
    added_total: int = 0
    added_where: list[str] = dataclasses.field(default_factory=list)
    range_diff: str = ""
    old_commit: str = ""
    new_commit: str | None = None
    blocked_by: list[str] = dataclasses.field(default_factory=list)
    fixed_upstream: list[str] = dataclasses.field(default_factory=list)  # named upstream fixes found
    tests: list[str] = dataclasses.field(default_factory=list)
    obsolete: bool = False
    tests_state: str = ""  # --run-tests: "pass" | "fail" | "not-run"; "" when the check was off
    tests_verdict: str = ""
    hours: float = 0.0
    disposition: str = ""


def out_dir(label: str) -> Path:
    return BUILD / f"rebase-{label}"


def series_digest(patch_dir: Path = series_mod.PATCHES) -> str:
    s = series_mod.read(patch_dir)
    h = hashlib.sha256((patch_dir / "series").read_bytes())
    for p in s.paths:
        h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"<missing>"))
    return h.hexdigest()


# ---------------------------------------------------------------- getting the new upstream


def project_name(pin: Pin) -> str:
    suffix = f"-{pin.version}.tar.gz"
    if not pin.sdist.endswith(suffix):
        raise StackError(f"upstream.toml: sdist {pin.sdist!r} is not '<project>{suffix}'")
    return pin.sdist[: -len(suffix)]


def index_sha256(project: str, filename: str) -> tuple[str, str]:
    """(sha256, index url) of a release file, as the PEP 691 simple API of the index lists it."""
    files, url = upstream.index_files(project)
    match = [f for f in files if f["filename"] == filename]
    if not match:
        raise StackError(f"{filename} is not on {url} (is the version right?)")
    sha = match[0].get("hashes", {}).get("sha256")
    if not sha:
        raise StackError(f"{url} gives no sha256 for {filename}; refusing an unverifiable sdist")
    return sha, url


def fetch_sdist(pin: Pin, version: str) -> tuple[Path, str, str, str]:
    """(path, filename, sha256, where the hash came from), verified. $REBASE_SDIST may name a
    local copy; the hash is always the index's, or $REBASE_SDIST_SHA256 when offline."""
    project = project_name(pin)
    filename = f"{project}-{version}.tar.gz"
    try:
        want, source = index_sha256(project, filename)
    except StackError as e:
        want = os.environ.get("REBASE_SDIST_SHA256", "")
        if not want:
            raise StackError(f"{e}\nOffline? Set REBASE_SDIST=<file> and REBASE_SDIST_SHA256=<hash "
                             "from a trusted listing> to rebase onto a local sdist.") from None
        source = "$REBASE_SDIST_SHA256 (index unreachable)"
    path = upstream.fetch_verified(project, filename, want, "REBASE_SDIST", expected=f"{want} from {source}")
    return path, filename, want, source


def import_tree(repo: Path, src: Path, version: str, tag: str) -> str:
    """Commit the files under src into repo's object store as a parentless commit with the fixed
    upstream author/date (what upstream.import_sdist makes), tag it, and touch nothing else:
    a temporary index, src as the work tree, no HEAD move."""
    gitdir = Path(git.out(repo, "rev-parse", "--absolute-git-dir"))
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        base = ("--git-dir", str(gitdir), "--work-tree", str(src))
        git.run(src, *base, "add", "-A", "-f", "--", *upstream.sdist_pathspec(), env=env)
        tree = git.out(src, *base, "write-tree", env=env)
    commit = git.out(repo, "commit-tree", tree, "-m", upstream.import_message(version),
                     env=upstream.IMPORT_ENV)
    existing = git.run(repo, "rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}", check=False)
    if existing.returncode == 0:
        if existing.stdout.strip() != commit:
            raise StackError(f"vllm/ already has tag {tag} at {existing.stdout.strip()[:12]}, which is "
                             f"not this sdist's import ({commit[:12]}); remove it "
                             f"(git -C vllm tag -d {tag}) if it is stale")
    else:
        git.run(repo, "tag", tag, commit)
    return commit


def get_target(pin: Pin, x: str, repo: Path, scratch: Path) -> Target:
    if HEX40.fullmatch(x):
        if git.run(repo, "cat-file", "-e", f"{x}^{{commit}}", check=False).returncode != 0:
            proc = git.remote(repo, "fetch", "-q", "--no-tags", pin.repository, x, timeout=300)
            err = ("timed out" if proc is None else
                   (proc.stderr.strip() or f"exit {proc.returncode}") if proc.returncode else "")
            if err:
                raise StackError(
                    f"commit {x} is not in vllm/.git and cannot be fetched from {pin.repository} "
                    f"({err.splitlines()[-1] if err else ''}). On a machine without GitHub access "
                    "rebase onto a release version instead (make rebase UPSTREAM=<version>).")
        tag = f"upstream/g{x[:12]}"
        git.run(repo, "tag", "-f", tag, x)
        return Target(x[:12], None, tag, x, None, None, None, None, x)
    if not re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", x):
        raise StackError(f"UPSTREAM={x!r}: give a release version (e.g. 0.28.0) or a 40-hex commit")
    path, filename, sha, source = fetch_sdist(pin, x)
    hint = None
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        src = upstream.extract_sdist(path, filename.removesuffix(".tar.gz"), Path(tmp))
        vf = src / "vllm" / "_version.py"
        if vf.is_file():
            m = re.search(r"commit_id\s*=\s*'g?([0-9a-f]{7,40})'", vf.read_text())
            hint = m.group(1) if m else None
        commit = import_tree(repo, src, x, f"upstream/v{x}")
    return Target(x, x, f"upstream/v{x}", None, hint, filename, sha, source, commit)


# ---------------------------------------------------------------- carrying one patch


def _conflict_regions(work: Path, path: str, limit: int = 60) -> str:
    try:
        lines = (work / path).read_text(errors="replace").splitlines()
    except OSError:
        return f"{path}: (conflict on the file itself: added/deleted/renamed on both sides)"
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("<<<<<<< "):
            j = i
            while j < len(lines) and not lines[j].startswith(">>>>>>> "):
                j += 1
            block = lines[i:j + 1]
            if len(block) > limit:
                block = block[:limit] + [f"... ({len(lines[i:j + 1]) - limit} more lines)"]
            blocks.append(f"{path}:{i + 1}-{j + 1}\n" + "\n".join(block))
            i = j
        i += 1
    return "\n\n".join(blocks) or f"{path}: unmerged (no text conflict markers)"


def renames_between(repo: Path, old: str, new: str) -> dict[str, str | None]:
    """Files of `old` that are gone in `new`: old path -> new path (renamed) or None (deleted)."""
    text = git.run(repo, "diff", "--no-color", "--name-status", "-M50%", "-z", "--diff-filter=RD",
                   old, new).stdout
    parts = text.split("\0")
    out: dict[str, str | None] = {}
    i = 0
    while i < len(parts) - 1:
        st = parts[i]
        if st.startswith("R"):
            out[parts[i + 1]] = parts[i + 2]
            i += 3
        elif st.startswith("D"):
            out[parts[i + 1]] = None
            i += 2
        else:
            i += 1
    return out


def carry(work: Path, path: Path, p: patchfile.PatchFile, old_sha: str, renames,
          skipped: dict[str, str]) -> PatchResult:
    """p: the parsed `path`. skipped: file -> earlier patch that was not carried and creates (or
    touches) that file."""
    r = PatchResult(path.name, p.subject, "", p.trailers.get("Remove-When", ""), old_commit=old_sha)
    r = _carry(work, path, p, r, old_sha, renames, skipped)
    if r.status in BLOCKING + ("already-in-upstream",):
        for f in p.files:
            skipped.setdefault(f.path, r.name)
    return r


def _carry(work, path, p, r, old_sha, renames, skipped) -> PatchResult:
    fwd = git.run(work, "apply", "--check", "-v", "--index", str(path), check=False)
    if fwd.returncode == 0:
        r.moved = engine.offsets(fwd.stderr + fwd.stdout)
        engine.am(work, path)
        r.status = "offset" if r.moved else "clean"
        r.new_commit = git.out(work, "rev-parse", "HEAD")
        return r
    r.detail = ["plain apply: " + engine._apply_errors(work, p, fwd.stderr).replace("\n  ", "\n  plain apply: ")]
    rev = git.run(work, "apply", "--check", "--reverse", "--index", str(path), check=False)
    if rev.returncode == 0:
        r.status = "already-in-upstream"
        r.detail.append("the patch reverse-applies cleanly on the new base: upstream has its effect")
        return r
    missing = [f.old_path for f in p.files if f.old_path and
               git.run(work, "cat-file", "-e", f"HEAD:{f.old_path}", check=False).returncode != 0]
    blockers = sorted({skipped[m] for m in missing if m in skipped})
    if blockers:
        r.status = "blocked"
        r.blocked_by = blockers
        r.moved = [f"{m}: created by {skipped[m]}, which was not carried" for m in missing if m in skipped]
        r.detail.append(f"carry {', '.join(blockers)} first, then this patch")
        return r
    renamed = {m: renames().get(m) for m in missing}
    gone = [m for m, to in renamed.items() if to is None]
    if gone:
        r.status = "target-gone"
        r.moved = [f"{m}: removed upstream (no rename found)" for m in gone]
        r.moved += [f"{m} -> {to} (renamed)" for m, to in renamed.items() if to]
        return r
    pick = git.run(work, "cherry-pick", "--keep-redundant-commits", old_sha, check=False)
    unmerged = git.out(work, "diff", "--name-only", "--diff-filter=U").split()
    if pick.returncode == 0:
        new = git.out(work, "rev-parse", "HEAD")
        if not git.out(work, "diff", "--name-only", f"{new}^", new):
            git.run(work, "reset", "-q", "--hard", "HEAD^")
            r.status = "already-in-upstream"
            r.detail.append("its 3-way merge onto the new base changes nothing: upstream has its effect")
            return r
        r.new_commit = new
        r.status = "renamed" if renamed else "3-way"
        r.moved = [f"{m} -> {to} (renamed upstream; merge followed it)" for m, to in renamed.items()]
        return r
    if not unmerged and git.run(work, "diff", "--cached", "--quiet", check=False).returncode == 0:
        git.run(work, "cherry-pick", "--abort", check=False)
        r.status = "already-in-upstream"
        r.detail.append("its 3-way merge onto the new base changes nothing: upstream has its effect")
        return r
    r.status = "conflict"
    also = sorted({skipped[f.path] for f in p.files if f.path in skipped})
    if also:
        r.detail.append(f"touches files of earlier patch(es) not carried ({', '.join(also)}): "
                        "port those first; this conflict may vanish")
    r.conflicts = [_conflict_regions(work, f) for f in unmerged] or [pick.stderr.strip()]
    r.moved = [f"{m} -> {to} (renamed upstream)" for m, to in renamed.items()]
    git.run(work, "cherry-pick", "--abort", check=False)
    if git.run(work, "status", "--porcelain", check=False).stdout.strip():
        git.run(work, "reset", "-q", "--hard", "HEAD")
    return r


# ---------------------------------------------------------------- Remove-When evidence


def _added_lines(p: patchfile.PatchFile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur = None
    for line in p.text.split("\n"):
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(\S+) b/(\S+)", line)
            cur = m.group(2) if m else None
        elif cur and line.startswith("+") and not line.startswith("+++ "):
            s = line[1:].strip()
            # Lines that say something: not blank, not bare punctuation, not just a comment mark.
            if len(s) >= 6 and re.search(r"[A-Za-z0-9]{3}", s):
                out.setdefault(cur, []).append(s)
    return out


def added_lines_check(work: Path, r: PatchResult, p: patchfile.PatchFile, old: str, new: str,
                      renames) -> None:
    """How many of the patch's added lines (not already in the old upstream file) the new
    upstream has, file by file. n/n suggests the Remove-When condition holds."""
    present = total = 0
    for f, lines in _added_lines(p).items():
        old_text = guards_mod.read_at(work, old, f) or ""
        new_path = renames().get(f) or f
        new_text = guards_mod.read_at(work, new, new_path)
        old_set = {l.strip() for l in old_text.splitlines()}
        new_set = {l.strip() for l in (new_text or "").splitlines()}
        fresh = [l for l in dict.fromkeys(lines) if l not in old_set]
        hit = [l for l in fresh if l in new_set]
        present, total = present + len(hit), total + len(fresh)
        if fresh:
            r.added_where.append(f"{f}: {len(hit)}/{len(fresh)}" + ("" if new_text is not None
                                                                   else " (file absent upstream)"))
    r.added_present, r.added_total = present, total


def verdict(r: PatchResult) -> str:
    if r.added_total == 0:
        return "n/a (adds no new lines)"
    if r.added_present == r.added_total:
        return f"**{r.added_present}/{r.added_total} present: condition likely met, review for drop**"
    if r.added_present == 0:
        return f"0/{r.added_total} present: not upstream"
    return f"{r.added_present}/{r.added_total} present: partly upstream, review"


# ---------------------------------------------------------------- the whole rebase


def _keep_if_edited(out: Path) -> Path | None:
    """A previous run's scratch clone that someone worked in (edits, or commits on `rebased`
    beyond what that run wrote, per its result.json) is moved aside, never deleted: returns
    where it went, or None when it holds only the tool's own output."""
    work, rj = out / "work", out / "result.json"
    edited = False
    if (work / ".git").exists():
        dirty = git.run(work, "status", "--porcelain", check=False).stdout.strip()
        head = git.run(work, "rev-parse", "-q", "--verify", "rebased", check=False).stdout.strip()
        wrote = json.loads(rj.read_text()).get("rebased_head") if rj.exists() else None
        edited = bool(dirty) or (head and head != wrote)
    if not edited:
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kept = out.with_name(f"{out.name}.kept-{stamp}")
    out.rename(kept)
    print(f"rebase: {out}/work holds edits or commits this tool did not write; moved to {kept}")
    return kept


def rebase(pin: Pin, x: str, repo: Path = engine.VLLM, run_tests: bool = False,
           test_python: str | None = None, tests_timeout: int = 300) -> tuple[Path, bool]:
    """Carry the series onto X; returns (report path, ready-to-accept). run_tests: run each
    patch's engine-free tests on the new upstream without it (tools/stack/rebase_tests.py)."""
    engine.require_upstream(pin, repo)
    s = series_mod.read()
    if not s.names:
        raise StackError("patches/series lists no patches: nothing to rebase")
    digest = series_digest()
    cfg = checks_mod.load_checks(s.dir / "rebase-checks.toml")  # bad config: fail before any work
    guards_mod.load_guards(s.dir / "compat-guards.toml")
    label_guess = x[:12] if HEX40.fullmatch(x) else x
    out = out_dir(label_guess)
    if out.exists():
        kept = _keep_if_edited(out)
        if kept is None:
            shutil.rmtree(out)
    out.mkdir(parents=True)
    t = get_target(pin, x, repo, out)
    work = out / "work"
    git.clone_at(repo, work, pin.tag, branch="old")
    try:
        engine.apply_series(work, s)
    except StackError as e:
        raise StackError(f"the current series does not apply to {pin.tag} (run `make check`):\n{e}") from None
    old_commits = engine.applied_commits(pin, work)
    git.run(work, "checkout", "-q", "-B", "rebased", t.tag)

    @functools.cache
    def renames():
        return renames_between(work, pin.tag, t.tag)

    results: list[PatchResult] = []
    skipped: dict[str, str] = {}
    creators: dict[str, str] = {}  # file -> the series patch that creates it
    for path, sha in zip(s.paths, old_commits):
        print(f"rebase: {path.name} ...", end=" ", flush=True)
        p = patchfile.parse(path)
        for f in p.files:
            if f.old_path is None:
                creators.setdefault(f.path, path.name)
        r = carry(work, path, p, sha, renames, skipped)
        r.tests = list(p.tests)
        print(r.status, flush=True)
        added_lines_check(work, r, p, pin.tag, t.tag, renames)
        if r.new_commit:
            rd = git.run(work, "range-diff", "--no-color", "--creation-factor=100",
                         f"{sha}^..{sha}", f"{r.new_commit}^..{r.new_commit}", check=False)
            r.range_diff = rd.stdout.rstrip() or rd.stderr.strip()
        results.append(r)

    # Import closure: a carried patch whose imports the carried tree lacks is blocked.
    final_rev = git.out(work, "rev-parse", "HEAD")
    on_rebased = {r.name: r.new_commit for r in results if r.new_commit}  # before the closure
    for name, reasons in checks_mod.import_closure(work, results, creators, final_rev,
                                                   old_commits[-1], CARRIED).items():
        r = next(x for x in results if x.name == name)
        r.status = "blocked"
        r.blocked_by = checks_mod.blockers_of(reasons)
        r.moved = [f"import: {x}" for x in reasons] + r.moved
        r.detail.append("import closure: its commit stays on branch `rebased` for the port, but the "
                        "carried series would not import; carry " + (", ".join(r.blocked_by) or
                                                                      "the missing module") + " first")
        r.new_commit = None
    print("rebase: import closure, guards, hazards, environment ...", flush=True)

    guards = guards_mod.load_guards(s.dir / "compat-guards.toml")
    g_old = guards_mod.check_guards(work, pin.tag, guards)
    g_new = guards_mod.check_guards(work, t.tag, guards)
    statuses = {r.name: r.status for r in results}
    touched = {r.name: set(git.run(work, "diff", "--name-only", f"{r.new_commit}^", r.new_commit).stdout.split())
               for r in results if r.new_commit}
    hits = checks_mod.hazard_scan(work, pin.tag, t.tag, final_rev, cfg["hazard"], statuses, CARRIED,
                                  touched)
    fixes = checks_mod.upstream_fix_evidence(work, t.tag, cfg["upstream-fix"])
    env_old, env_new = checks_mod.upstream_env(work, pin.tag), checks_mod.upstream_env(work, t.tag)
    if run_tests:
        verdicts = tests_mod.run_patch_tests(work, final_rev, results, on_rebased, creators,
                                             test_python or tests_mod.default_python(), tests_timeout,
                                             env_new.get("torch_build"))
        for r in results:
            v = verdicts[r.name]
            r.tests_state, r.tests_verdict = v.state, v.text + "".join(f" — {d}" for d in v.detail)
    for r in results:
        r.fixed_upstream = fixes.get(r.name, [])
        full = [f for f in r.fixed_upstream if checks_mod.PARTIAL not in f]
        cheap = bool(full or (r.added_total and r.added_present == r.added_total))
        # Its own tests decide when they ran: passing without it = probably obsolete, failing =
        # still needed whatever the added lines or a named fix suggest.
        by_tests = {"pass": True, "fail": False}.get(r.tests_state, cheap)
        r.obsolete = r.status != "already-in-upstream" and by_tests
        regions = sum(len(re.findall(r"(?m)^<<<<<<< ", c)) for c in r.conflicts) or len(r.conflicts)
        r.hours = checks_mod.patch_hours(r.status, regions, r.obsolete)
        r.disposition = checks_mod.disposition(r.status, r.obsolete, r.blocked_by,
                                               partly=bool(r.fixed_upstream), tests=r.tests_state,
                                               tests_cheap_disagree=cheap and r.tests_state == "fail")
    cpu = (pin.cpu_ops or {}).get("name")
    cpu_versions, cpu_where = (checks_mod.cpu_wheel_versions(cpu) if cpu and t.version else (None, ""))
    env_lines, env_blockers = checks_mod.env_section(env_old, env_new, t.version, cpu, cpu_versions,
                                                     cpu_where, cfg["environment"])

    pdir = out / "patches"
    pdir.mkdir()
    dropped = {r.name for r in results if r.status == "already-in-upstream"}
    for r in results:
        if r.new_commit:
            (pdir / r.name).write_text(engine.format_commit(work, r.new_commit))
    lines = []
    for raw in (s.dir / "series").read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        lines.append(f"# dropped (already in upstream v{t.label}): {name}" if name in dropped else raw)
    (pdir / "series").write_text("\n".join(lines) + "\n")

    blocking = [r for r in results if r.status in BLOCKING]
    g_fail = [g for g in g_new if not g.ok]
    ready = not blocking and not g_fail
    ctx = Context(pin, t, results, g_old, g_new, ready, hits, env_lines, env_blockers, digest,
                  cpu_versions, run_tests)
    result = {
        "label": t.label, "version": t.version, "tag": t.tag, "commit": t.commit,
        "commit_hint": t.commit_hint, "import_commit": t.import_commit, "sdist": t.sdist,
        "sdist_sha256": t.sdist_sha256, "sha_source": t.sha_source,
        "old_version": pin.version, "old_tag": pin.tag, "series_digest": digest, "ready": ready,
        "patches": [{"name": r.name, "subject": r.subject, "status": r.status} for r in results],
        "guards_failed": [g.guard.id for g in g_fail],
        "estimate_hours": ctx.hours(), "env_blockers": env_blockers, "summary": summary_line(ctx),
        "uncovered_hazards": len(ctx.uncovered()),
        "rebased_head": git.run(work, "rev-parse", "rebased").stdout.strip(),
    }
    for pr, r in zip(result["patches"], results):
        pr.update(obsolete=r.obsolete, hours=r.hours, blocked_by=r.blocked_by,
                  tests=r.tests_state or "off", tests_verdict=r.tests_verdict)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    report = out / "report.md"
    report.write_text(render(ctx))
    LAST[t.label] = ctx
    return report, ready


LAST: dict[str, "Context"] = {}  # label -> context of the rebases run in this process


def reports(pin: Pin, targets: list[str], docs: Path, **kw) -> list[tuple[str, bool, str]]:
    """`make rebase-reports`: rebase onto each target, then write every report again (so each
    recommendation compares all of them) to build/rebase-X/report.md and, without range-diffs,
    to docs/rebase-X.md. Returns (label, ready, summary line) per target."""
    out = []
    for x in targets:
        rebase(pin, x, **kw)
    for x in targets:
        label = x[:12] if HEX40.fullmatch(x) else x
        ctx = LAST[label]
        (out_dir(label) / "report.md").write_text(render(ctx))
        (docs / f"rebase-{label}.md").write_text(render(ctx, doc=True))
        out.append((label, ctx.ready, summary_line(ctx)))
    return out


# ---------------------------------------------------------------- the report


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", "<br>")


@dataclasses.dataclass
class Context:
    pin: Pin
    t: Target
    results: list[PatchResult]
    g_old: list
    g_new: list
    ready: bool
    hits: list
    env_lines: list[str]
    env_blockers: list[str]
    digest: str
    cpu_versions: list[str] | None = None
    run_tests: bool = False

    def uncovered(self):
        return [h for h in self.hits if h.new and not h.covered]

    def guard_counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for g in self.g_new:
            c[g.status] = c.get(g.status, 0) + 1
        return c

    def hazard_groups(self) -> dict[tuple[str, str], list]:
        """New, not neutralized hits grouped by (hazard, file): one review item each."""
        g: dict[tuple[str, str], list] = {}
        for h in self.uncovered():
            g.setdefault((h.hazard["id"], h.path), []).append(h)
        return g

    def hours(self) -> float:
        bad_guards = sum(1 for g in self.g_new if not g.ok)
        return round(sum(r.hours for r in self.results) + 1.0 * len(self.hazard_groups())
                     + 2.0 * bad_guards, 1)


def summary_line(c: Context) -> str:
    n = {k: sum(1 for r in c.results if r.status == k) for k in ORDER}
    carried = sum(n[k] for k in CARRIED)
    obs = sum(1 for r in c.results if r.obsolete)
    gc = c.guard_counts()
    held = sum(1 for g in c.g_new if g.ok)
    new_hits = [h for h in c.hits if h.new]
    parts = [f"{len(c.results)} patches: {carried} carried ("
             + ", ".join(f"{n[k]} {k}" for k in CARRIED if n[k]) + ")",
             f"{n['already-in-upstream'] + obs} obsolete or probably obsolete",
             f"{sum(1 for r in c.results if r.fixed_upstream and not r.obsolete)} partly fixed upstream",
             f"{n['conflict']} conflict", f"{n['blocked']} blocked"]
    if n["target-gone"]:
        parts.append(f"{n['target-gone']} target-gone")
    return (f"v{c.pin.version} → {c.t.label}: " + ", ".join(parts)
            + f"; guards {held}/{len(c.g_new)} hold ({gc.get('moved', 0)} moved, "
            f"{gc.get('changed', 0) + gc.get('failed', 0)} changed, {gc.get('gone', 0)} gone)"
            + f"; hazards: {len(c.uncovered())} new hits not neutralized (in {len(c.hazard_groups())} "
            f"hazard/file pairs), {len(new_hits)} new in all"
            + f"; {tests_summary(c)}"
            + f"; estimate ~{c.hours():g} h"
            + (f"; environment: {'; '.join(c.env_blockers)}" if c.env_blockers else "; environment: no change")
            + ".")


def tests_summary(c: Context) -> str:
    if not c.run_tests:
        return "patch tests without the patch: not run (--run-tests off)"
    n = {k: sum(1 for r in c.results if r.tests_state == k) for k in ("pass", "fail", "not-run")}
    torch = any(r.tests_state == "not-run" and "builds against torch" in r.tests_verdict
                for r in c.results)
    return (f"patch tests without the patch: {n['pass']} pass (probably obsolete), {n['fail']} fail "
            f"(still needed), {n['not-run']} not run"
            + (" (the test Python's torch does not match this upstream)" if torch else ""))


def _others(c: Context) -> list[dict]:
    """result.json of every rebase of this series (same digest) under build/, this one included."""
    out = {}
    for rj in sorted(BUILD.glob("rebase-*/result.json")):
        try:
            res = json.loads(rj.read_text())
        except (OSError, ValueError):
            continue
        if res.get("series_digest") == c.digest and "estimate_hours" in res:
            out[res["label"]] = res
    for label, ctx in LAST.items():
        if ctx.digest == c.digest:
            out[label] = {"label": label, "version": ctx.t.version, "estimate_hours": ctx.hours(),
                          "env_blockers": ctx.env_blockers, "summary": summary_line(ctx)}
    out[c.t.label] = {"label": c.t.label, "version": c.t.version, "estimate_hours": c.hours(),
                      "env_blockers": c.env_blockers, "summary": summary_line(c)}
    return sorted(out.values(), key=lambda r: _vkey_label(r["label"]))


def _vkey_label(label: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", label))


def recommendation(c: Context) -> list[str]:
    rows = _others(c)
    L = ["Filled in by the tool from the rebases of this series found under `build/` (same series "
         "digest). The decision to move the pin stays with the maintainers.", ""]
    L.append("| target | estimate | environment blockers |")
    L.append("|---|---:|---|")
    for r in rows:
        L.append(f"| {r['label']} | ~{r['estimate_hours']:g} h | {'; '.join(r['env_blockers']) or 'none'} |")
    L.append("")
    free = [r for r in rows if not r["env_blockers"]]
    pool = free or rows
    best = min(pool, key=lambda r: (r["estimate_hours"], _vkey_label(r["label"])))
    why = (f"the cheapest port (~{best['estimate_hours']:g} h of patch work)"
           + (" with no environment change" if best in free else
              f"; every examined target changes the environment ({'; '.join(best['env_blockers'])})"))
    L.append(f"**Cheapest next pin among those examined: {best['label']}**: {why}.")
    if len(rows) == 1:
        L.append("Only this target was examined: run `make rebase UPSTREAM=<other>` (or `make "
                 "rebase-reports VERSIONS=\"a b c\"`) to compare others.")
    costly = [r for r in rows if r is not best and r["env_blockers"]]
    for r in costly:
        L.append(f"- {r['label']}: ~{r['estimate_hours']:g} h, and the environment moves: "
                 f"{'; '.join(r['env_blockers'])}.")
    if c.cpu_versions:
        newer = [v for v in c.cpu_versions if _vkey_label(v) > _vkey_label(c.pin.version)
                 and re.fullmatch(r"\d+\.\d+\.\d+", v)]
        unexamined = [v for v in newer if v not in {r["label"] for r in rows}]
        if unexamined:
            L.append(f"- Not examined here, with a `{(c.pin.cpu_ops or {}).get('name')}` wheel on the "
                     f"index (so the CPU tier could follow): {', '.join(unexamined)}. Compare them with "
                     f"`make rebase-reports REBASE_VERSIONS=\"{' '.join(sorted(unexamined + [r['label'] for r in rows], key=_vkey_label))}\"`.")
    L.append("")
    L.append("The estimate counts hours of a maintainer who knows the series: per patch by its "
             "disposition (carry 0.1–0.5 h, probably obsolete 0.5 h to verify and drop, conflict "
             "1 h + 0.5 h per conflicting region up to 6 h, target-gone 3 h, blocked 1 h after "
             "its blocker), plus 1 h per hazard and file with new hits no patch neutralizes and 2 h per changed or gone "
             "guard. Environment moves (torch, Python, missing CPU-ops wheel) are not in the hours: "
             "they decide whether the cluster and CI can follow at all.")
    return L


def render(c: Context, doc: bool = False) -> str:
    pin, t, results, g_old, g_new, ready = c.pin, c.t, c.results, c.g_old, c.g_new, c.ready
    counts = {k: [r.name for r in results if r.status == k] for k in ORDER}
    L = [f"# Rebase of the gfx936 series: upstream v{pin.version} → {t.label}", ""]
    L.append(f"Generated by `make rebase UPSTREAM={t.commit or t.version}` "
             f"(`python -m tools.stack rebase`) on {datetime.date.today().isoformat()}"
             + (" and copied here by `make rebase-reports` (range-diffs and long conflict regions "
                f"are in `build/rebase-{t.label}/report.md`)" if doc else "")
             + ". The current series, upstream.toml and vllm/'s checkout were not touched.")
    L.append("")
    L.append(f"- **from**: upstream v{pin.version}, tag `{pin.tag}`, commit `{pin.commit}`, "
             f"sdist `{pin.sdist}` sha256 `{pin.sdist_sha256}`")
    if t.sdist:
        L.append(f"- **to**: `{t.sdist}`, sha256 `{t.sdist_sha256}` (hash from {t.sha_source}; "
                 "the downloaded file was verified against it)")
        L.append(f"- imported into vllm/.git as tag `{t.tag}` = commit `{t.import_commit}` "
                 f"(parentless, fixed author/date: the commit `make upstream` makes from this sdist)")
        L.append(f"- upstream git commit: not known from an sdist"
                 + (f"; its `vllm/_version.py` says `{t.commit_hint}`" if t.commit_hint else "")
                 + f". Accepting needs the full commit for the `vllm` gitlink: on a machine with "
                 f"GitHub access, `git ls-remote {pin.repository} refs/tags/v{t.version}`.")
    else:
        L.append(f"- **to**: upstream commit `{t.commit}` (tag `{t.tag}` in vllm/.git)")
    L.append(f"- series digest `{c.digest[:16]}` ({len(results)} patches)")
    L.append(f"- scratch clone: `build/rebase-{t.label}/work` (branch `old` = old base + series, "
             f"branch `rebased` = new base + carried patches); rebased patches: "
             f"`build/rebase-{t.label}/patches/`")
    L += ["", "## Summary", "", f"**Summary:** {summary_line(c)}", ""]
    L.append("| status | count | patches |")
    L.append("|---|---:|---|")
    for k in ORDER:
        L.append(f"| {k} | {len(counts[k])} | {', '.join(counts[k]) or '—'} |")
    obs = [r.name for r in results if r.obsolete]
    L.append(f"| (probably obsolete) | {len(obs)} | {', '.join(obs) or '—'} |")
    L.append(f"| **total** | {len(results)} | |")
    roots = checks_mod.root_blockers(results)
    if roots:
        L += ["", "Port first (each unblocks the blocked patches that wait on it, directly or through "
              "another blocked patch):", ""]
        for name, waiting in roots:
            L.append(f"- `{name}` ({statuses_of(results, name)}): unblocks {len(waiting)}: "
                     + ", ".join(waiting))
    g_fail = [g for g in g_new if not g.ok]
    gc = c.guard_counts()
    L.append("")
    L.append(f"Compat guards: {len(g_new) - len(g_fail)}/{len(g_new)} hold on {t.tag}"
             + (f" ({gc['moved']} moved: {', '.join(g.guard.id for g in g_new if g.status == 'moved')})"
                if gc.get("moved") else "")
             + (f"; **failed: {', '.join(f'{g.guard.id} ({g.status})' for g in g_fail)}**" if g_fail else "")
             + ".")
    L.append("")
    if ready:
        L.append(f"**Ready to accept**: `python -m tools.stack rebase-accept {t.label}` installs "
                 "the rebased patches, the pin, the gitlink and a CHANGELOG entry.")
    else:
        why = []
        stuck = sum(len(counts[k]) for k in BLOCKING)
        if stuck:
            why.append(f"{stuck} patch(es) not carried need a manual "
                       f"port (resolve in `build/rebase-{t.label}/work` on branch `rebased`, or port the "
                       "patch on the current series after acceptance of the rest)")
        if g_fail:
            why.append(f"{len(g_fail)} compat guard(s) failed: re-check the code that relies on them")
        L.append("**Not ready to accept** (fails closed): " + "; ".join(why) + ".")
    L += ["", "## Recommendation", ""] + recommendation(c)
    unc = c.uncovered()
    L += ["", "## New upstream code no patch neutralizes", ""]
    if unc:
        L.append("Hazards (`patches/rebase-checks.toml`) hit by lines that are new in "
                 f"{t.label} and that the carried series does not neutralize, one row per hazard and "
                 "file (each is a review item: decide, then neutralize it in a patch or record why "
                 "gfx936 never reaches it):")
        L.append("")
        L += _group_table(c.hazard_groups())
    else:
        L.append("None: every new hazard hit is rewritten or gated by a carried patch.")
    L += ["", "## Environment", ""] + c.env_lines
    L += ["", "## Patches", ""]
    L.append("| # | patch | status | disposition | est. h | what moved / why | Remove-When | obsolete? (its tests without it; added lines upstream; known upstream fix) |")
    L.append("|---:|---|---|---|---:|---|---|---|")
    for i, r in enumerate(results, 1):
        moved = "<br>".join(_cell(m) for m in r.moved) or "—"
        if doc and len(moved) > 600:
            moved = moved[:600] + " …"
        obs_cell = ((f"tests: **{_cell(r.tests_verdict)}**<br>" if r.tests_state else "") + verdict(r)
                    + ("".join(f"<br>known fix {_cell(f)}" for f in r.fixed_upstream)))
        L.append(f"| {i} | `{r.name}` | **{r.status}** | {r.disposition} | {r.hours:g} | {moved} | "
                 f"{_cell(r.remove_when) or '—'} | {obs_cell} |")
    L.append(f"| | **total** | | | {sum(r.hours for r in results):g} | | | |")
    L += ["", "## Compat guards", "",
          "Upstream interfaces the series relies on but does not patch (`patches/compat-guards.toml`), "
          "found by symbol on pristine upstream at both tags: `moved` = same behaviour at another path, "
          "`changed` = the symbol is there but the behaviour relied on is not, `gone` = defined nowhere.", ""]
    L.append(f"| guard | symbol | expects | v{pin.version} | {t.label} | result |")
    L.append("|---|---|---|---|---|---|")
    for a, b in zip(g_old, g_new):
        res = {"ok": "ok", "moved": "**moved**"}.get(b.status, f"**{b.status.upper()}**")
        fmt = lambda g: ((f"`{g.path}` " if g.path and g.guard.symbol else "") + f"{g.matches}× at "  # noqa: E731
                         + ",".join(map(str, g.lines)) if g.lines else g.detail)
        d = a.guard.pattern if a.guard.literal else f"/{a.guard.pattern}/"
        d = d if len(d) <= 90 else d[:87] + "..."
        sym = f"{a.guard.kind} `{a.guard.symbol}`" if a.guard.symbol else f"`{a.guard.file}`"
        L.append(f"| `{a.guard.id}` | {sym} | {_cell(d)} | {_cell(fmt(a))} | "
                 f"{_cell(fmt(b) if b.ok else b.detail)}{'<br>' + _cell(b.detail) if b.status == 'moved' else ''} | {res} |")
    L += ["", "## Hazard scan", "",
          f"Each hazard of `patches/rebase-checks.toml` in pristine {t.tag}; a hit is *new* unless the "
          f"same line was a hit in a file of the same name in {pin.tag}.", ""]
    L.append("| hazard | why it breaks gfx936 | neutralized by | hits | new | new, not neutralized |")
    L.append("|---|---|---|---:|---:|---:|")
    for hz in {h.hazard["id"]: h.hazard for h in c.hits}.values():
        mine = [h for h in c.hits if h.hazard["id"] == hz["id"]]
        L.append(f"| `{hz['id']}` | {_cell(hz['why'])} | {hz.get('neutralized-by') or '—'} "
                 f"({hz.get('mode', 'rewrite')}) | {len(mine)} | {sum(h.new for h in mine)} | "
                 f"{sum(h.new and not h.covered for h in mine)} |")
    covered_new = [h for h in c.hits if h.new and h.covered]
    if covered_new:
        L += ["", "New hits the carried series neutralizes:", ""] + _hit_table(covered_new)
    L += ["", "## Per patch", ""]
    for i, r in enumerate(results, 1):
        L.append(f"### {i}. `{r.name}` — {r.status}")
        L.append("")
        L.append(f"- Subject: {r.subject}")
        L.append(f"- Disposition: {r.disposition} (~{r.hours:g} h)")
        L.append(f"- Remove-When: {r.remove_when or '—'}")
        L.append(f"- Tests: {' '.join(r.tests) or '—'}")
        L.append(f"- its tests on the new upstream without it: "
                 + (r.tests_verdict if r.tests_state else "not run (--run-tests off)"))
        L.append(f"- added lines found in new upstream: {verdict(r)}"
                 + (f" ({'; '.join(r.added_where)})" if r.added_where else ""))
        for f in r.fixed_upstream:
            L.append(f"- known upstream fix present: {f}")
        if r.blocked_by:
            L.append(f"- blocked by: {', '.join(r.blocked_by)}")
        for d in r.detail:
            L.append(f"- {d.splitlines()[0]}")
            for more in d.splitlines()[1:]:
                L.append(f"  {more.strip()}")
        if r.conflicts:
            text = "\n\n".join(r.conflicts)
            if doc and text.count("\n") > 40:
                text = "\n".join(text.splitlines()[:40]) + f"\n... ({text.count(chr(10)) - 40} more lines " \
                    f"in build/rebase-{t.label}/report.md)"
            L += ["", "Conflicting hunks (3-way merge, ours = new upstream + carried patches, "
                  "theirs = this patch):", "", "```diff", text, "```"]
        if r.range_diff and not doc:
            L += ["", "Range-diff (old patch commit vs rebased; `=` identical content, `!` changed):",
                  "", "```diff", r.range_diff, "```"]
        L.append("")
    return "\n".join(L).rstrip() + "\n"


def statuses_of(results, name: str) -> str:
    return next((r.status for r in results if r.name == name), "?")


def _group_table(groups) -> list[str]:
    L = ["| hazard | file | lines | first hit | neutralized? | why it breaks gfx936 |",
         "|---|---|---|---|---|---|"]
    for (hid, path), hs in groups.items():
        h = hs[0]
        L.append(f"| `{hid}` | `{path}` | {', '.join(str(x.line) for x in hs)} | `{_cell(h.text[:100])}` | "
                 f"{_cell(h.how)} | {_cell(h.hazard['why'])} |")
    return L


def _hit_table(hits) -> list[str]:
    L = ["| hazard | where | line | neutralized? | why it breaks gfx936 |", "|---|---|---|---|---|"]
    for h in hits:
        L.append(f"| `{h.hazard['id']}` | `{h.path}:{h.line}` | `{_cell(h.text[:110])}` | {_cell(h.how)} | "
                 f"{_cell(h.hazard['why'])} |")
    return L


# ---------------------------------------------------------------- accept


def _set_key(text: str, key: str, value: str) -> str:
    """Replace `key = "..."` in the [upstream] section of upstream.toml."""
    head, sep, rest = text.partition("[upstream]")
    body, nxt, tail = rest.partition("\n[")
    new, n = re.subn(rf'(?m)^{key}\s*=\s*"[^"]*"', f'{key} = "{value}"', body)
    if n != 1:
        raise StackError(f"upstream.toml: cannot find `{key} = \"...\"` in [upstream]")
    return head + sep + new + nxt + tail


def _resolve_tag_commit(pin: Pin, version: str) -> str | None:
    proc = git.remote(ROOT, "ls-remote", pin.repository, f"refs/tags/v{version}",
                      f"refs/tags/v{version}^{{}}", timeout=30)
    if proc is None or proc.returncode:
        return None
    refs = dict(reversed(line.split("\t")) for line in proc.stdout.splitlines() if "\t" in line)
    return refs.get(f"refs/tags/v{version}^{{}}") or refs.get(f"refs/tags/v{version}")


def accept(pin: Pin, label: str, version: str | None = None, repo: Path = engine.VLLM) -> str:
    out = out_dir(label)
    rj = out / "result.json"
    if not rj.is_file():
        raise StackError(f"{rj} missing: run `make rebase UPSTREAM={label}` first")
    res = json.loads(rj.read_text())
    if not res["ready"]:
        bad = [f"{p['name']} ({p['status']})" for p in res["patches"] if p["status"] in BLOCKING]
        raise StackError("refusing to accept: "
                         + "; ".join(filter(None, [
                             bad and f"not carried: {', '.join(bad)}",
                             res["guards_failed"] and f"compat guards failed: {', '.join(res['guards_failed'])}"]))
                         + f". See {out / 'report.md'}.")
    dirty = git.run(ROOT, "status", "--porcelain", "--", "patches", "upstream.toml", "CHANGELOG.md").stdout
    if dirty.strip():
        raise StackError("refusing to accept: the fork has uncommitted changes in patches/, "
                         f"upstream.toml or CHANGELOG.md:\n{dirty.rstrip()}\nCommit or stash them first.")
    if series_digest() != res["series_digest"]:
        raise StackError(f"refusing to accept: patches/ changed since the rebase was made; run "
                         f"`make rebase UPSTREAM={label}` again")
    new_version = version or res["version"]
    if not new_version:
        raise StackError(f"{label} is a bare commit: give the release version it is "
                         f"(rebase-accept {label} --version X.Y.Z)")
    commit = res["commit"] or _resolve_tag_commit(pin, new_version)
    if commit and res["commit_hint"] and not commit.startswith(res["commit_hint"]):
        raise StackError(f"{pin.repository} tag v{new_version} is {commit}, but the sdist says it was "
                         f"built from {res['commit_hint']}; refusing to pin a mismatch")
    new_tag = f"upstream/v{new_version}"
    if res["tag"] != new_tag:
        git.run(repo, "tag", "-f", new_tag, res["import_commit"])
    notes = []

    # 1. the pin
    text = PIN_FILE.read_text()
    text = _set_key(text, "version", new_version)
    if res["sdist"]:
        text = _set_key(text, "sdist", res["sdist"])
        text = _set_key(text, "sdist_sha256", res["sdist_sha256"])
    if commit:
        text = _set_key(text, "commit", commit)
    else:
        note = (f"# rebase-accept: `commit` below is still v{pin.version}'s; v{new_version} came from "
                f"the sdist (built from {res['commit_hint'] or 'an unknown commit'}). Set it and the "
                f"gitlink on a machine with GitHub access:\n#   git ls-remote {pin.repository} "
                f"refs/tags/v{new_version}\n#   git update-index --cacheinfo 160000,<commit>,vllm\n")
        text = re.sub(r'(?m)^(commit\s*=)', note.replace("\\", "\\\\") + r"\1", text, count=1)
        notes.append(f"upstream commit of v{new_version} unknown here (sdist only): upstream.toml keeps "
                     f"v{pin.version}'s commit with a note; set it and the gitlink where GitHub is reachable")
    if re.search(r'(?ms)^\[cpu_ops\].*?^version\s*=\s*"' + re.escape(pin.version) + '"', text):
        notes.append(f"[cpu_ops] in upstream.toml still names the v{pin.version} CPU wheel: update it "
                     "with its hashes from the index before `make demo`")
    PIN_FILE.write_text(text)
    # 2. the gitlink
    if commit:
        git.run(ROOT, "update-index", "--cacheinfo", f"160000,{commit},vllm")
        upstream.protect_gitlink(repo)
    # 3. patches/ and the ledger
    pd = series_mod.PATCHES
    for f in list(pd.glob("*.patch")) + [pd / "series"]:
        f.unlink(missing_ok=True)
    for f in (out / "patches").iterdir():
        shutil.copy2(f, pd / f.name)
    rev = changelog.series_revision() + 1
    dropped = [p for p in res["patches"] if p["status"] == "already-in-upstream"]
    if dropped:
        with open(pd / "dropped.toml", "a") as fh:
            for p in dropped:
                fh.write(guards_mod.ledger_entry_toml(
                    p["name"], p["subject"], f"s{rev}", new_version,
                    f"already in upstream v{new_version} (make rebase found its effect present)"))
    # 4. the changelog entry template
    by = lambda st: [p["name"] for p in res["patches"] if p["status"] == st]  # noqa: E731
    entry = [f"## s{rev} — {datetime.date.today().isoformat()} — upstream v{new_version}", "",
             f"Rebased from upstream v{pin.version} onto v{new_version}"
             + (f" ({commit[:12]})" if commit else f" (sdist {res['sdist']})") + ". Report: "
             f"docs/rebase-{label}.md.", ""]
    for st in ORDER:
        if by(st):
            entry.append(f"- {st}: {', '.join(by(st))}")
    entry += ["", "TODO: what changed for users (new behaviour, dropped workarounds, new guards).", "", ""]
    cl = changelog.CHANGELOG.read_text()
    m = re.search(r"(?m)^## s\d+ ", cl)
    pos = m.start() if m else len(cl)
    changelog.CHANGELOG.write_text(cl[:pos] + "\n".join(entry) + cl[pos:])
    # 5. vllm/: move onto the new base only when nothing there can be lost
    if git.operation_in_progress(repo) or git.dirty_paths(repo):
        notes.append(f"vllm/ has uncommitted work, left as is: `git -C vllm checkout -B gfx936 {new_tag}` "
                     "and `make apply` when ready")
    else:
        saved = engine.backup(repo, "rebase-accept")
        git.run(repo, "checkout", "-q", "-B", "gfx936", new_tag)
        engine.apply_series(repo, series_mod.read())
        notes.append(f"vllm/ now holds {new_tag} + the rebased series (old HEAD saved as {saved})")
    return (f"accepted rebase onto v{new_version}: upstream.toml, "
            + ("vllm gitlink, " if commit else "") + f"patches/ ({len(res['patches']) - len(dropped)} "
            f"patch(es)), CHANGELOG.md s{rev}" + (f", {len(dropped)} dropped into patches/dropped.toml" if dropped else "")
            + ".\n" + "\n".join(f"note: {n}" for n in notes)
            + "\nReview (`git diff`, fill the CHANGELOG TODO), then commit.")
