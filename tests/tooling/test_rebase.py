"""`make rebase` / `rebase-accept` (tools/stack/rebase.py) on small synthetic upstream trees.

Each classification is produced by a constructed upstream change; the new release is served by a
local PEP 691 index so the real download + index-hash verification path runs. The current series
(patches/, upstream.toml, vllm/'s checkout) must come out of a rebase byte-for-byte unchanged."""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading

import pytest

from conftest import make_sdist, sha256, tree_digest


def lines(prefix: str, n: int = 40) -> str:
    return "".join(f"{prefix}_{i} = {i}\n" for i in range(n))


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BASE = {
    "README.md": "fake upstream\n",
    "pkg/a.py": "LAYOUT = 576\n" + lines("A"),
    "pkg/b.py": lines("B"),
    "pkg/c.py": lines("C"),
    "pkg/d.py": lines("D"),
    "pkg/e.py": lines("E"),
    "pkg/f.py": lines("F"),
    "pkg/h.py": lines("H"),
    "PKG-INFO": "Name: fakeup\n",
}
GUARDS = """
[[guard]]
id = "layout-bytes"
file = "pkg/a.py"
regex = '^LAYOUT = 576$'
count = 1
why = "a kernel reads 576-byte entries"
used-by = "p-clean.patch"
"""


class Index:
    """A PEP 691 JSON simple index on localhost serving release files (and lying on request)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.lie: dict[str, str] = {}
        index = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/simple/fakeup/"):
                    body = json.dumps({"files": [
                        {"filename": n, "url": f"http://127.0.0.1:{index.port}/files/{n}",
                         "hashes": {"sha256": index.lie.get(n, hashlib.sha256(d).hexdigest())}}
                        for n, d in index.files.items()]}).encode()
                    ctype = "application/vnd.pypi.simple.v1+json"
                elif self.path.startswith("/files/") and self.path[7:] in index.files:
                    body, ctype = index.files[self.path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple"


@pytest.fixture
def index():
    ix = Index()
    yield ix
    ix.server.shutdown()


def setup_fork(fork, tmp_path, index, base=BASE, guards=GUARDS):
    """Pin the fork on a 1.0 sdist of `base`, add compat guards, commit: a clean fork repo."""
    (tmp_path / "v1").mkdir()
    fork.sdist = make_sdist(tmp_path / "v1", "1.0", files=base)
    pin = fork.root / "upstream.toml"
    pin.write_text(re.sub(r'sdist_sha256 = "\w+"', f'sdist_sha256 = "{sha256(fork.sdist)}"', pin.read_text()))
    if guards:
        (fork.patches / "compat-guards.toml").write_text(guards)
    fork.run("upstream")
    fork.env = {"PIP_INDEX_URL": index.url}
    return fork


def commit_fork(fork):
    fork.git("add", "-A", cwd=fork.root)
    fork.git("commit", "-q", "-m", "series", cwd=fork.root)


def release(index, tmp_path, version: str, files: dict):
    d = tmp_path / f"rel-{version}"
    d.mkdir()
    path = make_sdist(d, version, files=files)
    index.files[path.name] = path.read_bytes()
    return path


def rebase(fork, target: str, ok: bool | None = None):
    proc = fork.run("rebase", target, ok=False, env=fork.env)
    if ok is not None:
        assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    out = fork.root / "build" / f"rebase-{target[:12] if len(target) == 40 else target}"
    res = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else None
    return proc, out, res


def statuses(res) -> dict[str, str]:
    return {p["name"].removesuffix(".patch"): p["status"] for p in res["patches"]}


def all_cases(fork):
    """One patch per classification, in series order."""
    b = BASE
    fork.add_patch("p-clean", {"pkg/a.py": edit(b["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")})
    fork.add_patch("p-offset", {"pkg/b.py": edit(b["pkg/b.py"], "B_30 = 30\n", "B_30 = 3030\n")})
    fork.add_patch("p-3way", {"pkg/c.py": edit(b["pkg/c.py"], "C_20 = 20\n", "C_20 = 2020\n")})
    fork.add_patch("p-conflict", {"pkg/d.py": edit(b["pkg/d.py"], "D_5 = 5\n", "D_5 = 'ours'\n"),
                                  "pkg/extra.py": "EXTRA = 1\n"})
    fork.add_patch("p-blocked", {"pkg/extra.py": "EXTRA = 2\n"})
    fork.add_patch("p-upstreamed", {"pkg/e.py": edit(b["pkg/e.py"], "E_7 = 7\n", "E_7 = 'fixed'\n")})
    fork.add_patch("p-renamed", {"pkg/f.py": edit(b["pkg/f.py"], "F_3 = 3\n", "F_3 = 'gfx936'\n")})
    fork.add_patch("p-gone", {"pkg/h.py": edit(b["pkg/h.py"], "H_3 = 3\n", "H_3 = 'gfx936'\n")})


def upstream_2_0(changed_guard: bool = False) -> dict:
    b = dict(BASE)
    b["pkg/b.py"] = lines("NEW", 5) + b["pkg/b.py"]  # code moved down 5 lines
    b["pkg/c.py"] = edit(b["pkg/c.py"], "C_18 = 18\n", "C_18 = 'upstream'\n")  # in the context
    b["pkg/d.py"] = edit(b["pkg/d.py"], "D_5 = 5\n", "D_5 = 'theirs'\n")  # same line
    b["pkg/e.py"] = edit(b["pkg/e.py"], "E_7 = 7\n", "E_7 = 'fixed'\n")  # the fix landed
    b["pkg/g.py"] = b.pop("pkg/f.py")  # renamed, same content
    del b["pkg/h.py"]  # removed
    if changed_guard:
        b["pkg/a.py"] = edit(b["pkg/a.py"], "LAYOUT = 576\n", "LAYOUT = 640\n")
    return b


def fork_state(fork) -> dict:
    return {"patches": tree_digest(fork.patches), "pin": sha256(fork.root / "upstream.toml"),
            "changelog": sha256(fork.root / "CHANGELOG.md"), "head": fork.git("rev-parse", "HEAD"),
            "branch": fork.git("symbolic-ref", "HEAD"), "tree": tree_digest(fork.vllm),
            "status": fork.git("status", "--porcelain"), "outer": fork.git("status", "--porcelain",
                                                                             cwd=fork.root)}


def test_rebase_produces_each_classification_and_lists_conflicting_hunks(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    all_cases(fork)
    release(index, tmp_path, "2.0", upstream_2_0())
    proc, out, res = rebase(fork, "2.0", ok=False)  # conflicts: not ready, exit 1
    assert statuses(res) == {
        "p-clean": "clean", "p-offset": "offset", "p-3way": "3-way", "p-conflict": "conflict",
        "p-blocked": "blocked", "p-upstreamed": "already-in-upstream", "p-renamed": "renamed",
        "p-gone": "target-gone"}
    report = (out / "report.md").read_text()
    row = lambda n: next(l for l in report.splitlines() if l.startswith("|") and f"`{n}.patch`" in l)  # noqa: E731
    assert "pkg/b.py: hunk #1 now at line" in row("p-offset") and "(+5)" in row("p-offset")
    assert "pkg/f.py -> pkg/g.py" in row("p-renamed")
    assert "pkg/h.py: removed upstream" in row("p-gone")
    assert "created by p-conflict.patch" in row("p-blocked")
    assert "upstream does p-clean" in row("p-clean")  # Remove-When shown beside the check
    assert "1/1 present: condition likely met" in row("p-upstreamed")
    assert "0/1 present: not upstream" in row("p-clean")
    # The conflicting hunk, both sides, with its location in the merged file.
    assert re.search(r"pkg/d.py:\d+-\d+\n<<<<<<< HEAD\nD_5 = 'theirs'\n=======\nD_5 = 'ours'\n>>>>>>>", report)
    assert "hunk #1 of pkg/c.py" in report  # why plain apply failed before the 3-way merge
    assert "| conflict | 1 | p-conflict.patch |" in report and "| **total** | 8 |" in report
    assert "Not ready to accept" in report
    # Carried patches are written in canonical form on the new base (zero offsets), others not.
    rebased = sorted(p.name for p in (out / "patches").glob("*.patch"))
    assert rebased == ["p-3way.patch", "p-clean.patch", "p-offset.patch", "p-renamed.patch"]
    assert "diff --git a/pkg/g.py b/pkg/g.py" in (out / "patches" / "p-renamed.patch").read_text()
    assert "# dropped (already in upstream v2.0): p-upstreamed.patch" in (out / "patches" / "series").read_text()
    assert re.search(r"1:  \w+ ! 1:  \w+ pkg: p-3way", report)  # range-diff: content changed
    assert re.search(r"1:  \w+ = 1:  \w+ pkg: p-clean", report)  # range-diff: identical


def test_rebase_never_touches_the_current_series_or_vllm_checkout(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    all_cases(fork)
    (fork.vllm / "pkg" / "a.py").write_text("user's unsaved work\n")  # mid-work: must survive
    before = fork_state(fork)
    release(index, tmp_path, "2.0", upstream_2_0())
    rebase(fork, "2.0", ok=False)
    assert fork_state(fork) == before
    # The new upstream is only one more (parentless) tag in vllm/.git.
    assert fork.git("rev-list", "--count", "upstream/v2.0") == "1"
    assert fork.git("log", "-1", "--format=%an %ad %s", "--date=iso-strict", "upstream/v2.0") == \
        "upstream 2000-01-01T00:00:00+00:00 upstream v2.0"


def ready_scenario(fork, tmp_path, index, changed_guard=False):
    setup_fork(fork, tmp_path, index)
    fork.add_patch("p-clean", {"pkg/a.py": edit(BASE["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")})
    fork.add_patch("p-upstreamed", {"pkg/e.py": edit(BASE["pkg/e.py"], "E_7 = 7\n", "E_7 = 'fixed'\n")})
    fork.add_patch("p-3way", {"pkg/c.py": edit(BASE["pkg/c.py"], "C_20 = 20\n", "C_20 = 2020\n")})
    commit_fork(fork)
    new = dict(upstream_2_0(changed_guard))
    new["pkg/d.py"], new["pkg/f.py"], new["pkg/h.py"] = BASE["pkg/d.py"], BASE["pkg/f.py"], BASE["pkg/h.py"]
    return release(index, tmp_path, "2.0", new)


def test_a_changed_compat_guard_fails_closed_and_blocks_accept(fork, tmp_path, index):
    ready_scenario(fork, tmp_path, index, changed_guard=True)
    proc, out, res = rebase(fork, "2.0", ok=False)
    assert proc.returncode == 1 and res["guards_failed"] == ["layout-bytes"]
    assert all(p["status"] != "conflict" for p in res["patches"])  # every patch carried ...
    report = (out / "report.md").read_text()
    assert re.search(r"\| `layout-bytes` \| `pkg/a.py` .*\| 1× at 1 \| expected 1 match\(es\), found 0 \| \*\*FAILED\*\* \|", report)
    acc = fork.run("rebase-accept", "2.0", ok=False, env=fork.env)  # ... but the ground moved
    assert acc.returncode == 2 and "compat guards failed: layout-bytes" in acc.stderr
    assert "version = \"1.0\"" in (fork.root / "upstream.toml").read_text()


def test_make_check_verifies_guards_on_the_pinned_upstream(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index, guards=GUARDS.replace("576", "512"))
    fork.add_patch("p-clean", {"pkg/a.py": edit(BASE["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")})
    proc = fork.run("check", ok=False)
    assert proc.returncode == 1 and "guard layout-bytes fails on the pinned upstream upstream/v1.0" in proc.stderr


def test_accept_installs_pin_patches_changelog_ledger_and_moves_vllm(fork, tmp_path, index):
    sdist = ready_scenario(fork, tmp_path, index)
    proc, out, res = rebase(fork, "2.0", ok=True)
    assert statuses(res) == {"p-clean": "clean", "p-upstreamed": "already-in-upstream", "p-3way": "3-way"}
    (fork.patches / "series").write_text((fork.patches / "series").read_text() + "# local edit\n")
    refused = fork.run("rebase-accept", "2.0", ok=False, env=fork.env)
    assert refused.returncode == 2 and "uncommitted changes in patches/" in refused.stderr
    fork.git("checkout", "--", "patches/series", cwd=fork.root)
    acc = fork.run("rebase-accept", "2.0", env=fork.env).stdout
    pin = (fork.root / "upstream.toml").read_text()
    assert 'version = "2.0"' in pin and 'sdist = "fakeup-2.0.tar.gz"' in pin
    assert f'sdist_sha256 = "{sha256(sdist)}"' in pin
    assert "rebase-accept: `commit` below is still v1.0's" in pin  # sdist only: commit unknown, noted
    assert "upstream commit of v2.0 unknown here" in acc
    assert sorted(p.name for p in fork.patches.glob("*.patch")) == ["p-3way.patch", "p-clean.patch"]
    assert (fork.patches / "p-3way.patch").read_bytes() == (out / "patches" / "p-3way.patch").read_bytes()
    ledger = (fork.patches / "dropped.toml").read_text()
    assert 'name = "p-upstreamed.patch"' in ledger and 'series = "s4"' in ledger and 'upstream = "2.0"' in ledger
    cl = (fork.root / "CHANGELOG.md").read_text()
    assert re.search(r"^## s4 — \d{4}-\d\d-\d\d — upstream v2\.0\n", cl, re.M)
    assert cl.index("## s4") < cl.index("## s3")
    # vllm/ moved onto the new base with the rebased series applied, and the whole fork checks OK
    # (zero-fuzz apply on upstream/v2.0, pin, changelog, ledger, guards).
    st = fork.run("status", env={**fork.env, "UPSTREAM_SDIST": str(sdist)}).stdout
    assert "2 of 2 patch(es) applied" in st and "[x] p-3way.patch" in st
    assert "OK" in fork.run("check", env={"UPSTREAM_SDIST": str(sdist)}).stdout


def test_accept_of_a_commit_rebase_moves_the_vllm_gitlink(fork, tmp_path, index):
    ready_scenario(fork, tmp_path, index)
    # A commit "fetched" from upstream: here built inside vllm/.git (no network in tests).
    tree = fork.git("rev-parse", "upstream/v1.0^{tree}")
    c = fork.git("commit-tree", tree, "-m", "upstream at some commit")
    proc, out, res = rebase(fork, c, ok=True)
    assert res["commit"] == c and res["tag"] == f"upstream/g{c[:12]}"
    missing = fork.run("rebase-accept", c[:12], ok=False)
    assert "give the release version" in missing.stderr
    fork.run("rebase-accept", c[:12], "--version", "1.1")
    assert f'commit = "{c}"' in (fork.root / "upstream.toml").read_text()
    assert fork.git("ls-files", "-s", "vllm", cwd=fork.root).split()[1] == c
    assert fork.git("rev-parse", "upstream/v1.1") == c


def test_accept_refuses_a_rebase_with_conflicts(fork, tmp_path, index):
    setup_fork(fork, tmp_path, index)
    all_cases(fork)
    commit_fork(fork)
    release(index, tmp_path, "2.0", upstream_2_0())
    rebase(fork, "2.0", ok=False)
    acc = fork.run("rebase-accept", "2.0", ok=False)
    assert acc.returncode == 2 and "p-conflict.patch (conflict)" in acc.stderr and "p-gone.patch (target-gone)" in acc.stderr
    assert fork.git("status", "--porcelain", cwd=fork.root) == ""


def test_rebase_refuses_an_sdist_whose_hash_differs_from_the_index(fork, tmp_path, index):
    ready_scenario(fork, tmp_path, index)
    index.lie["fakeup-2.0.tar.gz"] = "0" * 64
    proc, out, res = rebase(fork, "2.0")
    assert proc.returncode == 2 and "does not match " + "0" * 64 in proc.stderr and res is None
    assert fork.git("tag", "-l", "upstream/v2.0") == ""


def test_rebase_onto_an_unreachable_commit_is_a_clear_error(fork, tmp_path, index):
    ready_scenario(fork, tmp_path, index)
    proc, _, _ = rebase(fork, "ab" * 20)
    assert proc.returncode == 2 and "cannot be fetched from https://example.invalid/fakeup.git" in proc.stderr


@pytest.mark.parametrize("by", ["name", "subject"])
def test_check_refuses_a_patch_listed_in_the_dropped_ledger(fork, tmp_path, index, by):
    setup_fork(fork, tmp_path, index)
    fork.add_patch("p-clean", {"pkg/a.py": edit(BASE["pkg/a.py"], "A_10 = 10\n", "A_10 = 1010\n")},
                   subject="pkg: old workaround")
    assert "OK" in fork.run("check").stdout
    name = "p-clean.patch" if by == "name" else "p-renamed-since.patch"
    (fork.patches / "dropped.toml").write_text(
        f'[[dropped]]\nname = "{name}"\nsubject = "pkg: old workaround"\nseries = "s2"\n'
        'upstream = "0.9"\nreason = "fixed upstream in abc123"\n')
    proc = fork.run("check", ok=False)
    assert proc.returncode == 1
    assert f"patches/p-clean.patch: its {'name' if by == 'name' else 'Subject'} is in patches/dropped.toml" in proc.stderr
    assert "fixed upstream in abc123" in proc.stderr
