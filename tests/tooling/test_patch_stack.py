"""The patch-stack engine (tools/stack) on a synthetic upstream: the maintainer's workflow and its
failure modes. Every failure must name the thing at fault and leave vllm/ exactly as it was."""
from __future__ import annotations

import re

import pytest

from conftest import PIN_COMMIT, UPSTREAM_FILES, Fork, make_sdist, sha256, tree_digest


def _two_patches(fork):
    fork.run("upstream")
    fork.add_patch("platform-arch", {"pkg/platform.py": UPSTREAM_FILES["pkg/platform.py"].replace(
        "'gfx942'", "'gfx936'")})
    init = UPSTREAM_FILES["pkg/__init__.py"].replace("LINE_30 = 30\n", "LINE_30 = 30  # gfx936\n")
    fork.add_patch("pkg-init-marker", {"pkg/__init__.py": init, "pkg/new_module.py": "X = 1\n"})
    return fork


def test_upstream_import_matches_the_sdist_bytes(fork, tmp_path):
    fork.run("upstream")
    extracted = tmp_path / "x"
    import tarfile
    with tarfile.open(fork.sdist) as tf:
        tf.extractall(extracted, filter="data")
    assert tree_digest(fork.vllm) == tree_digest(extracted / "fakeup-1.0")
    assert fork.git("describe", "--tags") == "upstream/v1.0"


def test_upstream_refuses_an_sdist_whose_sha256_differs_from_the_pin(fork, tmp_path):
    bad = make_sdist(tmp_path / "bad" if (tmp_path / "bad").mkdir() is None else tmp_path,
                     files={**UPSTREAM_FILES, "README.md": "tampered\n"})
    proc = fork.run("upstream", ok=False, env={"UPSTREAM_SDIST": str(bad)})
    assert proc.returncode == 2
    assert "does not match the pin" in proc.stderr and sha256(bad) in proc.stderr
    assert not any(fork.vllm.iterdir()) if fork.vllm.exists() else True


def test_apply_then_unapply_restores_upstream_byte_for_byte(fork):
    fork.run("upstream")
    pristine = tree_digest(fork.vllm)
    _two_patches(fork)
    fork.run("unapply")
    fork.run("apply")
    patched = tree_digest(fork.vllm)
    assert patched != pristine and "pkg/new_module.py" in patched
    fork.run("unapply")
    assert tree_digest(fork.vllm) == pristine


def test_refresh_is_idempotent(fork):
    _two_patches(fork)
    before = {p.name: p.read_bytes() for p in fork.patches.iterdir()}
    out = fork.run("refresh").stdout
    assert "already up to date" in out
    assert {p.name: p.read_bytes() for p in fork.patches.iterdir()} == before
    fork.run("unapply")
    fork.run("apply")
    fork.run("refresh")
    assert {p.name: p.read_bytes() for p in fork.patches.iterdir()} == before


def test_check_passes_on_a_healthy_series(fork):
    _two_patches(fork)
    assert "OK" in fork.run("check").stdout


def test_apply_fails_closed_naming_patch_and_hunk_when_context_changed(fork):
    """A patch that would need fuzz (its context line changed) is rejected; vllm/ is untouched."""
    _two_patches(fork)
    fork.run("unapply")
    p = fork.patches / "pkg-init-marker.patch"
    p.write_text(p.read_text().replace(" LINE_28 = 28\n", " LINE_28 = 2800\n", 1))
    head, digest = fork.git("rev-parse", "HEAD"), tree_digest(fork.vllm)
    proc = fork.run("apply", ok=False)
    assert proc.returncode == 2
    assert "patches/pkg-init-marker.patch" in proc.stderr
    assert re.search(r"hunk #1 of pkg/__init__.py \(-\d+,\d+ \+\d+,\d+\)", proc.stderr), proc.stderr
    assert fork.git("rev-parse", "HEAD") == head and tree_digest(fork.vllm) == digest
    assert fork.git("status", "--porcelain") == ""
    chk = fork.run("check", ok=False)
    assert chk.returncode == 1 and "pkg-init-marker.patch" in chk.stderr and "hunk #1" in chk.stderr


def test_apply_names_a_patch_whose_target_file_is_missing(fork):
    _two_patches(fork)
    fork.run("unapply")
    p = fork.patches / "platform-arch.patch"
    p.write_text(p.read_text().replace("pkg/platform.py", "pkg/platfrom.py"))
    proc = fork.run("apply", ok=False)
    assert "patches/platform-arch.patch" in proc.stderr and "pkg/platfrom.py" in proc.stderr
    assert "does not exist upstream" in proc.stderr
    assert fork.git("log", "--format=%s") == "upstream v1.0"


def test_apply_rolls_back_earlier_patches_when_a_later_one_fails(fork):
    _two_patches(fork)
    fork.run("unapply")
    p = fork.patches / "pkg-init-marker.patch"
    p.write_text(p.read_text().replace(" LINE_31 = 31\n", " LINE_31 = -1\n", 1))
    assert fork.run("apply", ok=False).returncode == 2
    assert fork.git("log", "--format=%s") == "upstream v1.0"


@pytest.mark.parametrize("field,mutate,expect", [
    ("Upstream-Status", lambda t: t.replace("Upstream-Status: pending\n", ""), "missing trailer 'Upstream-Status:'"),
    ("Remove-When", lambda t: t.replace("Remove-When:", "Remove-when-typo:"), "missing trailer 'Remove-When:'"),
    ("Tests", lambda t: t.replace("Tests: tests/test_fake.py", "Tests: tests/nope.py"), "'tests/nope.py', which does not exist"),
    ("Description", lambda t: re.sub(r"\nWhy: [^\n]*\n", "\n", t), "no Description"),
    ("Upstream-Status value", lambda t: t.replace("Upstream-Status: pending", "Upstream-Status: maybe"), "'maybe' is not one of"),
    ("submitted needs url", lambda t: t.replace("Upstream-Status: pending", "Upstream-Status: submitted"), "needs a URL"),
])
def test_check_names_the_missing_or_bad_header_field(fork, field, mutate, expect):
    _two_patches(fork)
    p = fork.patches / "platform-arch.patch"
    p.write_text(mutate(p.read_text()))
    proc = fork.run("check", ok=False)
    assert proc.returncode == 1
    assert f"patches/platform-arch.patch: " in proc.stderr and expect in proc.stderr, proc.stderr


@pytest.mark.parametrize("mutate,expect", [
    (lambda f: (f.patches / "stray.patch").write_text("x\n"), "patches/stray.patch exists but is not listed"),
    (lambda f: (f.patches / "series").write_text((f.patches / "series").read_text() + "ghost.patch\n"),
     "ghost.patch is listed but patches/ghost.patch does not exist"),
    (lambda f: (f.patches / "series").write_text((f.patches / "series").read_text() + "platform-arch.patch\n"),
     "platform-arch.patch listed twice"),
    (lambda f: (f.patches / "series").write_text((f.patches / "series").read_text().rstrip("\n")),
     "no newline at end of file"),
])
def test_check_names_series_and_file_disagreements(fork, mutate, expect):
    _two_patches(fork)
    mutate(fork)
    proc = fork.run("check", ok=False)
    assert proc.returncode == 1 and expect in proc.stderr, proc.stderr


def test_check_rejects_a_patch_that_applies_only_at_an_offset(fork):
    _two_patches(fork)
    fork.run("unapply")
    p = fork.patches / "pkg-init-marker.patch"
    text = p.read_text()
    # As if upstream had moved the code 3 lines: both sides of the first hunk header shift.
    p.write_text(re.sub(r"@@ -(\d+),(\d+) \+(\d+),", lambda m: (
        f"@@ -{int(m.group(1)) + 3},{m.group(2)} +{int(m.group(3)) + 3},"), text, count=1))
    proc = fork.run("check", ok=False)
    assert "pkg-init-marker.patch: applies only with offsets" in proc.stderr, proc.stderr
    fork.run("apply")  # apply tolerates offsets (no fuzz) ...
    fork.run("refresh")  # ... and refresh puts the patch back in canonical form
    assert "OK" in fork.run("check").stdout


def test_check_catches_a_moved_vllm_gitlink(fork):
    _two_patches(fork)
    fork.git("update-index", "--cacheinfo", f"160000,{'2' * 40},vllm", cwd=fork.root)
    proc = fork.run("check", ok=False)
    assert "gitlink in the index is 2222" in proc.stderr and "git update-index --cacheinfo" in proc.stderr


@pytest.mark.parametrize("cmd", [("apply",), ("unapply",), ("refresh",), ("new", "x"), ("edit", "platform-arch")])
def test_commands_refuse_to_run_over_uncommitted_edits(fork, cmd):
    _two_patches(fork)
    target = fork.vllm / "pkg" / "platform.py"
    target.write_text(target.read_text() + "# my unsaved work\n")
    (fork.vllm / "scratch.txt").write_text("notes\n")
    head, digest = fork.git("rev-parse", "HEAD"), tree_digest(fork.vllm)
    proc = fork.run(*cmd, ok=False)
    assert proc.returncode == 2 and "uncommitted edits" in proc.stderr and "pkg/platform.py" in proc.stderr
    assert fork.git("rev-parse", "HEAD") == head and tree_digest(fork.vllm) == digest


def test_unapply_refuses_to_drop_unrefreshed_commit_edits_without_force(fork):
    _two_patches(fork)
    (fork.vllm / "pkg" / "new_module.py").write_text("X = 2\n")
    fork.git("commit", "-q", "-a", "--amend", "--no-edit")
    proc = fork.run("unapply", ok=False)
    assert "pkg-init-marker.patch" in proc.stderr and "make refresh" in proc.stderr
    out = fork.run("unapply", "--force").stdout
    backup = re.search(r"saved as (refs/stack/backup/\S+)\)", out).group(1)
    assert fork.git("show", f"{backup}:pkg/new_module.py") == "X = 2"


def test_edit_stops_at_the_named_patch_and_refresh_exports_the_change(fork):
    _two_patches(fork)
    out = fork.run("edit", "platform-arch").stdout
    assert "stopped at platform-arch.patch" in out
    (fork.vllm / "pkg" / "platform.py").write_text(
        (fork.vllm / "pkg" / "platform.py").read_text().replace("return True", "return False"))
    fork.git("commit", "-q", "-a", "--amend", "--no-edit")
    fork.git("-c", "core.editor=true", "rebase", "--continue")
    fork.run("refresh")
    assert "+    return False" in (fork.patches / "platform-arch.patch").read_text()
    assert "OK" in fork.run("check").stdout


def test_status_lists_applied_and_modified_patches(fork):
    _two_patches(fork)
    out = fork.run("status").stdout
    assert "[x] platform-arch.patch" in out and "[x] pkg-init-marker.patch" in out
    fork.run("unapply")
    assert "[ ] platform-arch.patch" in fork.run("status").stdout


def test_new_patch_starts_with_a_header_that_check_rejects_until_written(fork):
    fork.run("upstream")
    fork.run("new", "area-thing")
    proc = fork.run("check", ok=False)
    assert "patches/area-thing.patch: Description or Subject still holds a TODO" in proc.stderr


def test_changelog_top_entry_must_target_the_pinned_upstream(fork):
    _two_patches(fork)
    (fork.root / "CHANGELOG.md").write_text("# Changelog\n\n## s4 — 2026-12-03 — upstream v2.0\n")
    proc = fork.run("check", ok=False)
    assert "top entry s4 targets upstream v2.0, but upstream.toml pins v1.0" in proc.stderr


def test_outer_git_add_all_cannot_move_the_vllm_gitlink(fork):
    """With patches applied, vllm/'s HEAD differs from the pin; `git add -A` / `commit -a` in the
    fork must still record the pinned gitlink (make upstream sets skip-worktree on it)."""
    _two_patches(fork)
    (fork.root / "notes.txt").write_text("x\n")
    fork.git("add", "-A", cwd=fork.root)
    fork.git("commit", "-q", "-a", "-m", "work", cwd=fork.root)
    assert fork.git("ls-tree", "HEAD", "vllm", cwd=fork.root).split()[2] == "1" * 40
    assert "OK" in fork.run("check").stdout


def test_a_too_old_git_is_named_before_anything_runs(fork, tmp_path):
    """Cluster login nodes can carry an old git; the stack needs >= 2.28 (init -b and friends)."""
    import os

    fake = tmp_path / "oldgit"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\necho 'git version 1.8.3.1'\n")
    (fake / "git").chmod(0o755)
    proc = fork.run("upstream", ok=False, env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert proc.returncode == 2 and "git version 1.8.3.1 is too old" in proc.stderr
    assert ">= 2.28" in proc.stderr and not (fork.vllm / ".git").exists()


def _clone_like_checkout(fork: Fork, pin_head: bool) -> str:
    """vllm/ as `git clone --recurse-submodules` leaves it: a repo at some upstream commit, no
    upstream/v<ver> tag. With pin_head the pin names that commit (as the real gitlink does)."""
    fork.vllm.mkdir(exist_ok=True)
    fork.git("init", "-q", "-b", "main")
    for rel, text in UPSTREAM_FILES.items():
        (fork.vllm / rel).parent.mkdir(parents=True, exist_ok=True)
        (fork.vllm / rel).write_bytes(text.encode("latin-1"))
    fork.git("add", "-A", "-f")
    fork.git("commit", "-q", "-m", "upstream")
    head = fork.git("rev-parse", "HEAD")
    if pin_head:
        toml = fork.root / "upstream.toml"
        toml.write_text(toml.read_text().replace(PIN_COMMIT, head))
    return head


def test_a_recursive_clone_at_the_pinned_commit_is_tagged_not_refused(fork):
    """Regression (issue #17 review, item 2): after `git clone --recurse-submodules`, vllm/ is
    the pinned commit without the fork's tag, and `make upstream` called it "another upstream".
    A clean checkout of exactly the pinned commit is tagged and used; anything else still
    refuses."""
    head = _clone_like_checkout(fork, pin_head=True)
    r = fork.run("upstream")
    assert "tagged upstream/v1.0" in r.stdout + r.stderr
    assert fork.git("rev-parse", "upstream/v1.0^{commit}") == head
    fork.run("apply")
    assert "holds upstream v1.0" in (fork.run("upstream").stdout + fork.run("upstream").stderr)


def test_a_clone_at_another_commit_or_with_edits_is_still_refused(fork):
    _clone_like_checkout(fork, pin_head=False)
    r = fork.run("upstream", ok=False)
    assert r.returncode != 0 and "holds another upstream" in r.stderr
    toml = fork.root / "upstream.toml"
    toml.write_text(toml.read_text().replace(PIN_COMMIT, fork.git("rev-parse", "HEAD")))
    (fork.vllm / "README.md").write_text("edited\n")
    r = fork.run("upstream", ok=False)
    assert r.returncode != 0 and "uncommitted edits" in r.stderr
