"""tools/series_stats.py counts what a maintainer carries: hunk lines in upstream's files vs
lines of files the series creates, and the net `gfx936:` markers. Checked on a hand-written
two-patch series whose numbers are counted by hand below (regression: a format-patch "-- "
trailer after the last hunk was once counted as a removed upstream line)."""
from __future__ import annotations

from tools import series_stats

# Creates a fork-owned file (4 hunk lines, one marker) and edits an upstream file (3 context,
# 2 removed, 2 added lines; one marker removed, two added).
NEW_AND_EDIT = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] one

Description: x

diff --git a/pkg/new.py b/pkg/new.py
new file mode 100644
--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1,4 @@
+# gfx936: a marker inside a fork-owned file still counts
+A = 1
+B = 2
+C = 3
diff --git a/pkg/up.py b/pkg/up.py
--- a/pkg/up.py
+++ b/pkg/up.py
@@ -1,5 +1,5 @@
 a = 1
-b = 2  # gfx936: old
+b = 3  # gfx936: new
 c = 3
-d = 4
+d = 5  # gfx936: another
 e = 5
--\x20
2.43.0
"""
# Edits the file the first patch created: fork-owned, not upstream's (1 context, 1 -, 1 +).
EDIT_OWNED = """\
Subject: [PATCH] two

diff --git a/pkg/new.py b/pkg/new.py
--- a/pkg/new.py
+++ b/pkg/new.py
@@ -1,2 +1,2 @@
 # gfx936: a marker inside a fork-owned file still counts
-A = 1
+A = 10
"""


def test_counts_match_a_hand_counted_series(tmp_path, monkeypatch):
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "series").write_text("# comment\none.patch\n\ntwo.patch  # x\n")
    (tmp_path / "patches" / "one.patch").write_text(NEW_AND_EDIT)
    (tmp_path / "patches" / "two.patch").write_text(EDIT_OWNED)
    monkeypatch.chdir(tmp_path)
    one, two = series_stats.collect(None)
    assert (one.name, one.up_hunk, one.up_chg, one.new, one.marks) == ("one.patch", 7, 4, 4, 2)
    assert one.lines == len(NEW_AND_EDIT.splitlines())
    assert (two.up_hunk, two.up_chg, two.new, two.marks) == (0, 0, 3, 0)
