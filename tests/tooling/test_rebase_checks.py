"""The checks `make rebase` runs beside the carry (tools/stack/rebase_checks.py, guards by symbol),
each on a small synthetic upstream built for it: a guarded symbol that moved (and one that
changed), a patch whose fix landed upstream, a carried patch importing a module of a patch that
was not carried, a new hazard in the new upstream; plus the environment section and `make rebase`
from a fresh clone. Helpers (local PEP 691 index, fork setup) come from test_rebase.py."""
from __future__ import annotations

import re
import subprocess

from conftest import REPO
from test_rebase import BASE, commit_fork, edit, index, lines, rebase, release, setup_fork, statuses  # noqa: F401

SYMBOL_GUARD = """
[[guard]]
id = "layout-bytes"
symbol = "LAYOUT"
kind = "constant"
file = "pkg/a.py"
regex = '= 576$'
count = 1
why = "a kernel reads 576-byte entries"
used-by = "p-clean.patch"

[[guard]]
id = "decode-signature"
symbol = "decode"
kind = "function"
file = "pkg/a.py"
literal = "def decode(q, kv_cache, scale):"
count = 1
why = "the gfx936 decode is called with these arguments"
used-by = "p-clean.patch"
"""

WITH_DECODE = dict(BASE, **{"pkg/a.py": BASE["pkg/a.py"] + "\n\ndef decode(q, kv_cache, scale):\n    return q\n"})


def row(report: str, needle: str) -> str:
    return next(line for line in report.splitlines() if line.startswith("|") and needle in line)


def test_guard_follows_a_moved_symbol_and_tells_moved_from_changed(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index, base=WITH_DECODE, guards=SYMBOL_GUARD)
    fork.add_patch("p-clean", {"pkg/b.py": edit(BASE["pkg/b.py"], "B_10 = 10\n", "B_10 = 1010\n")})
    commit_fork(fork)
    new = dict(WITH_DECODE)
    # Upstream moves the module (a reorganisation, like csrc/libtorch_stable/ -> csrc/) with more
    # code around it, and changes decode's signature: one guard moved, one changed.
    moved = lines("X", 30) + new.pop("pkg/a.py").replace("def decode(q, kv_cache, scale):",
                                                          "def decode(q, kv_cache, scale, sink):")
    new["pkg/kernels/layout.py"] = moved
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert res["guards_failed"] == ["decode-signature"]
    report = (out / "report.md").read_text()
    layout = row(report, "`layout-bytes`")
    assert "**moved**" in layout and "pkg/a.py -> pkg/kernels/layout.py:31" in layout
    assert "**CHANGED**" in row(report, "`decode-signature`")
    assert "function `decode` found at pkg/kernels/layout.py" in row(report, "`decode-signature`")
    assert "guards 1/2 hold (1 moved, 1 changed, 0 gone)" in res["summary"]


def test_guard_on_a_symbol_defined_nowhere_is_gone(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index, base=WITH_DECODE, guards=SYMBOL_GUARD)
    fork.add_patch("p-clean", {"pkg/b.py": edit(BASE["pkg/b.py"], "B_10 = 10\n", "B_10 = 1010\n")})
    commit_fork(fork)
    new = dict(WITH_DECODE)
    new["pkg/a.py"] = new["pkg/a.py"].replace("LAYOUT = 576\n", "SLOT_BYTES = 576\n")
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert res["guards_failed"] == ["layout-bytes"]
    assert "**GONE**" in row((out / "report.md").read_text(), "`layout-bytes`")


FIX = """
[[upstream-fix]]
patch = "p-fixed.patch"
since = "2.0"
what = "upstream validates E_7 itself"
file = "pkg/e.py"
regex = '^E_7 = validate\\(7\\)$'

[[upstream-fix]]
patch = "p-needed.patch"
what = "upstream names D_5"
file = "pkg/d.py"
regex = "^D_5 = 'theirs'$"
partial = "the gfx936 value"
"""


def test_a_patch_whose_fix_landed_upstream_is_probably_obsolete(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    (fork.patches / "rebase-checks.toml").write_text(FIX)
    # Both patches conflict on the new upstream; upstream fixed one of the two problems its own way.
    fork.add_patch("p-fixed", {"pkg/e.py": edit(BASE["pkg/e.py"], "E_7 = 7\n", "E_7 = check(7)  # gfx936\n")})
    fork.add_patch("p-needed", {"pkg/d.py": edit(BASE["pkg/d.py"], "D_5 = 5\n", "D_5 = 'ours'\n")})
    commit_fork(fork)
    new = dict(BASE)
    new["pkg/e.py"] = edit(BASE["pkg/e.py"], "E_7 = 7\n", "E_7 = validate(7)\n")
    new["pkg/d.py"] = edit(BASE["pkg/d.py"], "D_5 = 5\n", "D_5 = 'theirs'\n")
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert statuses(res) == {"p-fixed": "conflict", "p-needed": "conflict"}
    obsolete = {p["name"]: p["obsolete"] for p in res["patches"]}
    assert obsolete == {"p-fixed.patch": True, "p-needed.patch": False}
    report = (out / "report.md").read_text()
    fixed = row(report, "`p-fixed.patch`")
    assert "probably obsolete: verify, then drop" in fixed
    assert "since v2.0: upstream validates E_7 itself — `pkg/e.py:8`: `E_7 = validate(7)`" in fixed
    # A partial upstream fix is named but does not make the patch obsolete.
    assert "partly fixed upstream: shrink to what upstream lacks" in row(report, "`p-needed.patch`")
    assert "(partial: still to port: the gfx936 value)" in row(report, "`p-needed.patch`")
    assert "1 obsolete or probably obsolete" in res["summary"]


def test_a_carried_patch_importing_an_uncarried_patchs_module_is_blocked_by_it(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    # p-cap creates pkg/gfx936_cap.py and changes pkg/d.py, which conflicts upstream; p-user only
    # edits pkg/b.py (applies cleanly) but imports the module p-cap creates.
    fork.add_patch("p-cap", {"pkg/gfx936_cap.py": "def no_fp8():\n    return True\n",
                             "pkg/d.py": edit(BASE["pkg/d.py"], "D_5 = 5\n", "D_5 = 'ours'\n")})
    fork.add_patch("p-user", {"pkg/b.py": "from pkg.gfx936_cap import no_fp8\n" + BASE["pkg/b.py"]})
    fork.add_patch("p-other", {"pkg/c.py": "import pkg.b\n" + BASE["pkg/c.py"]})  # pkg.b exists upstream
    commit_fork(fork)
    new = dict(BASE)
    new["pkg/d.py"] = edit(BASE["pkg/d.py"], "D_5 = 5\n", "D_5 = 'theirs'\n")
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert statuses(res) == {"p-cap": "conflict", "p-user": "blocked", "p-other": "clean"}
    user = next(p for p in res["patches"] if p["name"] == "p-user.patch")
    assert user["blocked_by"] == ["p-cap.patch"]
    report = (out / "report.md").read_text()
    assert ("import: pkg/b.py imports pkg.gfx936_cap, created by p-cap.patch, which was not carried"
            in row(report, "`p-user.patch`"))
    assert "- `p-cap.patch` (conflict): unblocks 1: p-user.patch" in report  # what to port first
    # Not carried: not among the rebased patches accept would install.
    assert sorted(p.name for p in (out / "patches").glob("*.patch")) == ["p-other.patch"]


HAZARDS = """
[[hazard]]
id = "triton-softmax-dim"
regex = 'tl\\.softmax\\([^)]*\\bdim\\s*='
paths = "pkg/*.py"
why = "DAS Triton's tl.softmax has no dim="
neutralized-by = "p-softmax.patch"
mode = "rewrite"

[[hazard]]
id = "fp8-capability"
regex = '\\bsupports_fp8\\('
why = "gfx936 must answer False"
neutralized-by = "p-nofp8.patch"
mode = "platform"
"""

KERNEL = "def k(s):\n    return tl.softmax(s, dim=0)\n"


def test_new_hazards_nobody_neutralizes_are_listed_first(fork, tmp_path, index):
    base = dict(BASE, **{"pkg/k.py": KERNEL, "pkg/cap.py": "def supports_fp8():\n    return True\n"})
    setup_fork(fork, tmp_path, index, base=base)
    (fork.patches / "rebase-checks.toml").write_text(HAZARDS)
    fork.add_patch("p-softmax", {"pkg/k.py": KERNEL.replace("tl.softmax(s, dim=0)", "softmax0(s)")})
    fork.add_patch("p-nofp8", {"pkg/cap.py": "def supports_fp8():\n    return False\n"})
    commit_fork(fork)
    new = dict(base)
    new["pkg/compress.py"] = lines("Z", 3) + "def pool(score):\n    return tl.softmax(score, dim=0)\n"
    new["pkg/use.py"] = "if supports_fp8():\n    pass\n"
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=True)
    report = (out / "report.md").read_text()
    first = report.index("## New upstream code no patch neutralizes")
    assert first < report.index("## Environment") < report.index("## Patches")
    section = report[first:report.index("## Environment")]
    # The new call site in pkg/compress.py: not rewritten by the carried series, listed first.
    assert re.search(r"\| `triton-softmax-dim` \| `pkg/compress.py` \| 5 \| `return tl.softmax\(score, dim=0\)` "
                     r"\| still present after the carry", section)
    # The old one (pkg/k.py) is rewritten by p-softmax; the new supports_fp8 user is answered by p-nofp8.
    assert "pkg/k.py" not in section and "pkg/use.py" not in section
    assert "| `fp8-capability` | gfx936 must answer False | p-nofp8.patch (platform) | 2 | 1 | 0 |" in report
    assert "hazards: 1 new hits not neutralized (in 1 hazard/file pairs), 2 new in all" in res["summary"]


def test_environment_section_reads_the_new_upstreams_requirements(fork, tmp_path, index):
    def pyproject(torch, py):
        return (f'[build-system]\nrequires = [\n    "cmake>=3.26",\n    "torch == {torch}",\n]\n\n'
                f'[project]\nname = "fakeup"\nrequires-python = "{py}"\n')
    base = dict(BASE, **{"pyproject.toml": pyproject("2.13.0", ">=3.10,<3.15"),
                         "requirements/build/rocm.txt": "torch==2.11.0\ntriton==3.6.0\n"})
    setup_fork(fork, tmp_path, index, base=base)
    fork.add_patch("p-clean", {"pkg/a.py": edit(BASE["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")})
    commit_fork(fork)
    new = dict(base, **{"pyproject.toml": pyproject("2.14.0", ">=3.11,<3.15")})
    del new["requirements/build/rocm.txt"]
    new["requirements/build/rock.txt"] = "torch==2.12.0+rocm7.14.0\ntriton==3.7.1\n"
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=True)
    report = (out / "report.md").read_text()
    assert "| torch, build (`pyproject.toml`) | ==2.13.0 | **==2.14.0** |" in report
    assert "| Python (`requires-python`) | >=3.10,<3.15 | **>=3.11,<3.15** |" in report
    assert "| torch, ROCm build list | ==2.11.0 | **==2.12.0+rocm7.14.0** |" in report
    assert "| Triton, ROCm build list | ==3.6.0 | **==3.7.1** |" in report
    assert res["env_blockers"] == ["torch 2.13.0 → 2.14.0", "Python >=3.11,<3.15"]
    assert "## Recommendation" in report and "Cheapest next pin among those examined: 2.0" in report


def test_make_rebase_gets_upstream_first_on_a_fresh_clone():
    """`make rebase` on a fresh clone (no vllm/ checkout) must run the `upstream` step first."""
    for target in ("rebase", "rebase-accept", "rebase-reports"):
        proc = subprocess.run(["make", "-n", target, "UPSTREAM=9.9"], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        cmds = [l for l in proc.stdout.splitlines() if "tools.stack" in l]
        assert cmds[0].endswith("tools.stack upstream"), (target, cmds)
        assert re.search(rf"tools\.stack {target}\b", cmds[-1]), (target, cmds)


def test_make_check_names_a_bad_hazard_entry(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    fork.add_patch("p-clean", {"pkg/a.py": edit(BASE["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")})
    (fork.patches / "rebase-checks.toml").write_text(
        "[[hazard]]\nid = \"broken-one\"\nregex = 'tl\\.softmax('\nwhy = \"x\"\n")
    proc = fork.run("check", ok=False)
    assert proc.returncode == 1 and "rebase-checks.toml: hazard broken-one: bad regex" in proc.stderr
