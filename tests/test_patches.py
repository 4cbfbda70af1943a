"""patches/ against the installed SGLang, and the checker itself on a tree of its own."""

from __future__ import annotations

import subprocess
import sys

from sglang_farskip import patches


def run(*args):
    return subprocess.run([sys.executable, "-m", "sglang_farskip.patches", *args],
                          capture_output=True, text=True, timeout=120)


def test_repository_patches_apply_to_pinned_sglang():
    proc = run("check")
    assert proc.returncode == 0, proc.stderr
    assert "to sglang 0.5.23" in proc.stdout


GOOD = """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
"""
STALE = """--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 def f():
-    return 41
+    return 42
"""


def test_checker_applies_once_and_fails_loudly_on_a_stale_patch(tmp_path):
    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    good = tmp_path / "good"
    good.mkdir()
    (good / "01-good.patch").write_text(GOOD)
    assert run("apply", "--dir", str(good), "--root", str(root)).returncode == 0
    assert "return 2" in (root / "pkg" / "mod.py").read_text()
    again = run("apply", "--dir", str(good), "--root", str(root))  # idempotent
    assert again.returncode == 0 and "01-good.patch: applied" in again.stdout

    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "01-stale.patch").write_text(STALE)
    proc = run("check", "--dir", str(stale), "--root", str(root))
    assert proc.returncode == 1
    assert "01-stale.patch: conflict" in proc.stdout and "do not apply" in proc.stderr
    assert patches.status(stale / "01-stale.patch", root) == "conflict"
