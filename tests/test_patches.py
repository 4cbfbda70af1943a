"""`python -m sglang_farskip.tools.patches` against the installed SGLang, with the repository's
patches/ and with a real patch fixture.

patches/ holds no patch at present, so checking it alone would pass with a broken mechanism.
tests/patch_fixture/ holds one patch in the patches/ form against two real SGLang 0.5.23 files.
It is checked read-only against the installed SGLang (the default root, as CI checks
patches/), and applied, re-applied and made stale on copies of those two files in a temporary
directory through the same command with --root. The installed SGLang is never written.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_farskip import SGLANG_VERSION
from sglang_farskip.tools import patches

TESTS = Path(__file__).resolve().parent
FIXTURE_DIR = TESTS / "patch_fixture"
FIXTURE = FIXTURE_DIR / "01-fixture-marker.patch"
TARGETS = ["sglang/srt/plugins/__init__.py", "sglang/srt/plugins/hook_registry.py"]
MARKER = "FARSKIP_PATCH_FIXTURE = True"


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sglang_farskip.tools.patches", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def site_packages() -> Path:
    import sglang

    return Path(sglang.__file__).resolve().parents[1]


@pytest.fixture
def copy_root(tmp_path) -> Path:
    """The fixture's two target files copied from the installed SGLang, at their site-packages
    paths under a fresh root."""
    root = tmp_path / "site-packages"
    for rel in TARGETS:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site_packages() / rel, root / rel)
    return root


def contents(root: Path) -> dict[str, str]:
    return {rel: (root / rel).read_text() for rel in TARGETS}


def test_repository_patches_apply_to_pinned_sglang():
    proc = run("check")
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (TESTS.parent / "patches").glob("*.patch"))
    reported = [line.split(":")[0] for line in proc.stdout.splitlines() if ".patch:" in line]
    assert reported == names, proc.stdout
    assert f"{len(names)} patch(es) apply cleanly to sglang {SGLANG_VERSION}" in proc.stdout


def test_fixture_matches_the_installed_sglang_read_only():
    """The default root (the installed SGLang's site-packages) and the version check, with a
    patch that really has something to apply; --dir relative to the caller's directory."""
    assert importlib.metadata.version("sglang") == SGLANG_VERSION
    before = contents(site_packages())
    proc = run("check", "--dir", "patch_fixture", cwd=TESTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"{FIXTURE.name}: applicable",
                                        f"1 patch(es) apply cleanly to sglang {SGLANG_VERSION}"]
    assert contents(site_packages()) == before and MARKER not in "".join(before.values())


def test_fixture_applies_once_and_is_idempotent(copy_root):
    original = contents(copy_root)
    proc = run("apply", "--dir", str(FIXTURE_DIR), "--root", str(copy_root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{FIXTURE.name}: applied now" in proc.stdout
    patched = contents(copy_root)
    for rel in TARGETS:
        # exactly the two added lines, and the file still compiles
        assert patched[rel].count(MARKER) == 1, rel
        assert len(patched[rel].splitlines()) == len(original[rel].splitlines()) + 2, rel
        compile(patched[rel], rel, "exec")

    again = run("apply", "--dir", str(FIXTURE_DIR), "--root", str(copy_root))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{FIXTURE.name}: applied\n" in again.stdout  # recognised as applied, not re-applied
    assert contents(copy_root) == patched
    check = run("check", "--dir", str(FIXTURE_DIR), "--root", str(copy_root))
    assert check.returncode == 0 and f"{FIXTURE.name}: applied\n" in check.stdout
    assert patches.status(FIXTURE, copy_root) == "applied"


def test_stale_fixture_fails_loudly_and_changes_nothing(copy_root):
    # What an SGLang upgrade does to a patch: a context line of its second file has changed.
    stale_file = copy_root / TARGETS[1]
    text = stale_file.read_text()
    assert text.count("logger = logging.getLogger(__name__)\n") == 1
    stale_file.write_text(text.replace("logger = logging.getLogger(__name__)\n",
                                       "logger = logging.getLogger('sglang.hooks')\n"))
    before = contents(copy_root)

    for command in ("check", "apply"):
        proc = run(command, "--dir", str(FIXTURE_DIR), "--root", str(copy_root))
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        (line,) = [line for line in proc.stdout.splitlines() if line.startswith(FIXTURE.name)]
        # the patch, the file and line git could not match, and what to do
        assert line.startswith(f"{FIXTURE.name}: conflict (") and f"{TARGETS[1]}:33" in line, line
        assert (f"error: 1 patch(es) do not apply to sglang {SGLANG_VERSION} at {copy_root}: "
                f"{FIXTURE.name}; rebase them on the pinned SGLang") in proc.stderr
        # git apply is all or nothing: the first file, which would apply, is untouched too
        assert contents(copy_root) == before, command
    assert patches.status(FIXTURE, copy_root) == "conflict"


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


def test_checker_applies_in_name_order_and_reports_each(tmp_path):
    """Several patches in one directory: applied in name order, each reported, and one stale
    patch fails the run while the others still apply."""
    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "pkg" / "other.py").write_text("X = 1\n")
    directory = tmp_path / "patches"
    directory.mkdir()
    (directory / "01-good.patch").write_text(GOOD)
    (directory / "02-stale.patch").write_text(STALE.replace("mod.py", "other.py"))
    proc = run("apply", "--dir", str(directory), "--root", str(root))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == "01-good.patch: applied now" and lines[1].startswith("02-stale.patch: conflict (")
    assert "return 2" in (root / "pkg" / "mod.py").read_text()
    assert (root / "pkg" / "other.py").read_text() == "X = 1\n"
