"""The checks `make rebase` runs beside the carry (tools/stack/rebase_checks.py, guards by symbol),
each on a small synthetic upstream built for it: a guarded symbol that moved (and one that
changed), a patch whose fix landed upstream, a carried patch importing a module of a patch that
was not carried, a new hazard in the new upstream; plus the environment section and `make rebase`
from a fresh clone. Helpers (local PEP 691 index, fork setup) come from test_rebase.py."""
from __future__ import annotations

import json
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


def test_a_function_found_only_in_another_module_does_not_hold(fork, tmp_path, index):
    """The series calls `pkg.a.decode` by its module path: upstream dropping it from pkg/a.py while
    an unrelated `decode` of the same signature exists elsewhere must fail the guard ("moved",
    not holding), where a moved constant holds (its value is what a kernel reads)."""
    setup_fork(fork, tmp_path, index, base=WITH_DECODE, guards=SYMBOL_GUARD)
    fork.add_patch("p-clean", {"pkg/b.py": edit(BASE["pkg/b.py"], "B_10 = 10\n", "B_10 = 1010\n")})
    commit_fork(fork)
    new = dict(WITH_DECODE)
    new["pkg/a.py"] = BASE["pkg/a.py"]  # decode gone from pkg/a.py, LAYOUT still there
    new["pkg/unrelated.py"] = "def decode(q, kv_cache, scale):\n    return None\n"
    release(index, tmp_path, "2.0", new)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert res["guards_failed"] == ["decode-signature"]
    r = row((out / "report.md").read_text(), "`decode-signature`")
    assert "pkg/unrelated.py" in r and "module path" in r, r


def test_rerunning_rebase_keeps_a_scratch_clone_someone_worked_in(fork, tmp_path, index):
    """The report says to resolve in build/rebase-X/work; running `make rebase` again must not
    delete what was done there (review P2): a clone with a commit of its own is moved aside, one
    holding only the tool's output is replaced."""
    setup_fork(fork, tmp_path, index, base=WITH_DECODE, guards=SYMBOL_GUARD)
    fork.add_patch("p-clean", {"pkg/b.py": edit(BASE["pkg/b.py"], "B_10 = 10\n", "B_10 = 1010\n")})
    commit_fork(fork)
    release(index, tmp_path, "2.0", dict(WITH_DECODE))
    _, out, _ = rebase(fork, "2.0")
    _, out2, _ = rebase(fork, "2.0")  # only the tool's output: replaced, nothing kept
    assert out2 == out and not list(out.parent.glob(out.name + ".kept-*"))
    work = out / "work"
    (work / "pkg" / "resolved.py").write_text("X = 1\n")
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(work), "-c", "user.name=m", "-c", "user.email=m@x", "commit", "-qm",
                    "port by hand"], check=True)
    rebase(fork, "2.0")
    kept = list(out.parent.glob(out.name + ".kept-*"))
    assert len(kept) == 1 and (kept[0] / "work" / "pkg" / "resolved.py").read_text() == "X = 1\n"
    assert not (out / "work" / "pkg" / "resolved.py").exists()


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


# --run-tests: each patch's own tests on the new upstream without it. The fake upstream carries a
# `vllm` package so the real tests/runtime/conftest.py (GFX936_TEST_VLLM_TREE) puts the scratch
# tree on sys.path, as for the real series.
FILLER = lines("V", 20)
CALC = ("def clamp(x):\n    return x\n\n\n" + FILLER + "\n\ndef scale(x):\n    return clamp(x) * 2\n")
VBASE = dict(BASE, **{"vllm/__init__.py": "", "vllm/calc.py": CALC, "vllm/limits.py": lines("L") + "LIMIT = 10\n",
                      "vllm/d.py": lines("D")})
RUNTIME_TESTS = {
    # p-obs clamps inside scale(); upstream 2.0 fixes clamp() itself, far from the patch: it still
    # applies cleanly (carried), yet its test passes on the carried tree with it reverted.
    "tests/runtime/test_p_obs.py": "from vllm.calc import scale\n\n\ndef test_scale_clamps():\n"
                                   "    assert scale(-3) == 0 and scale(2) == 4\n",
    # p-need sets the gfx936 limit; upstream 2.0 does not: carried, and needed.
    "tests/runtime/test_p_need.py": "from vllm.limits import LIMIT\n\n\ndef test_limit():\n    assert LIMIT == 4\n\n\n"
                                    "def test_limit_positive():\n    assert LIMIT > 0\n",
    # p-conf conflicts (upstream rewrote the same line to the same value, with a comment): not
    # carried, and its test passes on the carried tree, which lacks it.
    "tests/runtime/test_p_conf.py": "from vllm.d import D_5\n\n\ndef test_d5():\n    assert D_5 == 'five'\n",
    "tests/e2e/test_engine.py": "",
}


def runtime_fork(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index, base=VBASE)
    (fork.root / "tests" / "runtime").mkdir()
    (fork.root / "tests" / "e2e").mkdir()
    (fork.root / "tests" / "runtime" / "conftest.py").write_text((REPO / "tests/runtime/conftest.py").read_text())
    for rel, text in RUNTIME_TESTS.items():
        (fork.root / rel).write_text(text)
    fork.add_patch("p-obs", {"vllm/calc.py": edit(CALC, "return clamp(x) * 2", "return clamp(max(x, 0)) * 2")},
                   tests="tests/runtime/test_p_obs.py")
    fork.add_patch("p-need", {"vllm/limits.py": edit(VBASE["vllm/limits.py"], "LIMIT = 10\n", "LIMIT = 4\n")},
                   tests="tests/runtime/test_p_need.py")
    fork.add_patch("p-conf", {"vllm/d.py": edit(VBASE["vllm/d.py"], "D_5 = 5\n", "D_5 = 'five'\n")},
                   tests="tests/runtime/test_p_conf.py")
    fork.add_patch("p-engine", {"pkg/e.py": edit(VBASE["pkg/e.py"], "E_30 = 30\n", "E_30 = 'x'\n")},
                   tests="tests/e2e/test_engine.py")
    commit_fork(fork)
    new = dict(VBASE)
    new["vllm/calc.py"] = edit(CALC, "    return x\n", "    return max(x, 0)\n")
    new["vllm/d.py"] = edit(VBASE["vllm/d.py"], "D_5 = 5\n", "D_5 = 'five'  # upstream\n")
    release(index, tmp_path, "2.0", new)


def test_run_tests_reports_obsolete_when_a_patchs_tests_pass_without_it(fork, tmp_path, index):
    runtime_fork(fork, tmp_path, index)
    proc = fork.run("rebase", "2.0", "--run-tests", "--tests-timeout", "120", ok=False, env=fork.env)
    out = fork.root / "build" / "rebase-2.0"
    res = json.loads((out / "result.json").read_text())
    assert statuses(res) == {"p-obs": "clean", "p-need": "clean", "p-conf": "conflict", "p-engine": "clean"}, \
        proc.stdout + proc.stderr
    by = {p["name"].removesuffix(".patch"): p for p in res["patches"]}
    assert {n: (p["tests"], p["obsolete"]) for n, p in by.items()} == {
        "p-obs": ("pass", True), "p-need": ("fail", False), "p-conf": ("pass", True), "p-engine": ("not-run", False)}
    assert by["p-obs"]["tests_verdict"] == "probably obsolete (its tests pass without it: 1 of 1)"
    assert by["p-need"]["tests_verdict"].startswith("still needed (1 of 2 tests fail without it)")
    assert "assert 10 == 4" in by["p-need"]["tests_verdict"]  # the failing assertion, named
    assert by["p-conf"]["tests_verdict"].startswith("probably obsolete (its tests pass without it: 1 of 1 on "
                                                    "the carried tree)")
    assert by["p-engine"]["tests_verdict"] == ("not run: no engine-free test (tests/e2e/test_engine.py "
                                               "(starts the engine))")
    report = (out / "report.md").read_text()
    assert "probably obsolete (its tests pass without it): verify, then drop" in row(report, "`p-obs.patch`")
    assert "carry as is; still needed: its tests fail without it" in row(report, "`p-need.patch`")
    assert ("patch tests without the patch: 2 pass (probably obsolete), 1 fail (still needed), 1 not run"
            in res["summary"])
    assert "2 obsolete or probably obsolete" in res["summary"]
    # The scratch tree is back at the carried tree; the fork's own tree is untouched.
    tree = out / "tests-tree"
    assert "LIMIT = 4" in (tree / "vllm/limits.py").read_text()
    assert "LIMIT = 4" in (fork.vllm / "vllm/limits.py").read_text()


def test_without_run_tests_no_patch_is_judged_by_its_tests(fork, tmp_path, index):
    """The check off (the default): the same series, and p-obs is not found obsolete (nothing of
    its upstream-fixed behaviour is in the cheaper signals): the verdict needs the tests to run."""
    runtime_fork(fork, tmp_path, index)
    proc, out, res = rebase(fork, "2.0", ok=False)
    by = {p["name"].removesuffix(".patch"): p for p in res["patches"]}
    assert {n: (p["tests"], p["obsolete"]) for n, p in by.items()} == {
        "p-obs": ("off", False), "p-need": ("off", False), "p-conf": ("off", False), "p-engine": ("off", False)}
    assert "patch tests without the patch: not run (--run-tests off)" in res["summary"]
    assert not (out / "tests-tree").exists()


def test_run_tests_names_a_torch_mismatch_and_runs_nothing(fork, tmp_path, index):
    runtime_fork(fork, tmp_path, index)
    # The new upstream builds against a torch the test Python does not have: nothing is run.
    import torch
    have = torch.__version__.split("+")[0].split(".")
    other = f"{have[0]}.{int(have[1]) + 1}.0"
    new = dict(VBASE, **{"pyproject.toml": f'[build-system]\nrequires = [\n    "torch == {other}",\n]\n'})
    release(index, tmp_path, "3.0", new)
    fork.run("rebase", "3.0", "--run-tests", ok=False, env=fork.env)
    res = json.loads((fork.root / "build" / "rebase-3.0" / "result.json").read_text())
    by = {p["name"].removesuffix(".patch"): p for p in res["patches"]}
    assert by["p-obs"]["tests"] == "not-run" and f"builds against torch {other}" in by["p-obs"]["tests_verdict"]
    assert "not run (the test Python's torch does not match this upstream)" in res["summary"]
