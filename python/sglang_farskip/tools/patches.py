"""Apply or check the repository's `patches/` against the installed SGLang.

    python -m sglang_farskip.tools.patches check [--dir patches] [--root DIR]   # every patch applies (or is applied)
    python -m sglang_farskip.tools.patches apply [--dir patches] [--root DIR]   # apply what is not applied yet

A patch is a unified diff with paths relative to site-packages (`a/sglang/srt/...`), named
NN-concern.patch, its header stating why no plugin hook can do the same. Patches are applied
in name order with `git apply`, which refuses fuzz: a patch that no longer matches the pinned
SGLang fails loudly (exit 1, naming the file and line git could not match) instead of
half-applying. The installed SGLang must be exactly the pinned version; `--root` (a tree laid out
like site-packages; no version check) is for tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from sglang_farskip import SGLANG_VERSION


def default_dir() -> Path:
    repo = Path(__file__).resolve().parents[2] / "patches"  # editable install / checkout
    return repo if repo.is_dir() else Path.cwd() / "patches"


def _site_packages() -> Path:
    import sglang

    return Path(sglang.__file__).resolve().parents[1]


def _git_apply(patch: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    # git runs in `root`: a patch path relative to the caller's directory (`--dir patches`)
    # would not be found there, and "can't open patch" would read as a conflict.
    return subprocess.run(["git", "apply", "-p1", *extra, str(Path(patch).resolve())], cwd=root,
                          capture_output=True, text=True)


def status(patch: Path, root: Path) -> str:
    """'applied', 'applicable' or 'conflict'."""
    if _git_apply(patch, root, "--check", "--reverse").returncode == 0:
        return "applied"
    if _git_apply(patch, root, "--check").returncode == 0:
        return "applicable"
    return "conflict"


def conflict_reason(patch: Path, root: Path) -> str:
    """git's own words for why `patch` does not apply (which file, which line)."""
    lines = _git_apply(patch, root, "--check").stderr.strip().splitlines()
    return "; ".join(line.removeprefix("error: ") for line in lines) or "git apply --check failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_farskip.tools.patches")
    parser.add_argument("command", choices=["check", "apply"])
    parser.add_argument("--dir", type=Path, default=None, help="patch directory (default: patches/)")
    parser.add_argument("--root", type=Path, default=None, help="tree to patch (default: site-packages)")
    args = parser.parse_args(argv)

    installed = importlib.metadata.version("sglang")
    if installed != SGLANG_VERSION and args.root is None:
        print(f"error: sglang {installed} is installed; these patches are for {SGLANG_VERSION}: "
              f"install sglang=={SGLANG_VERSION}", file=sys.stderr)
        return 1
    directory = args.dir or default_dir()
    if not directory.is_dir():
        print(f"error: patch directory {directory} not found: pass --dir", file=sys.stderr)
        return 1
    root = args.root or _site_packages()
    patches = sorted(directory.glob("*.patch"))
    failed = []
    for patch in patches:
        state = status(patch, root)
        if state == "applicable" and args.command == "apply":
            result = _git_apply(patch, root)
            state = "applied now" if result.returncode == 0 else "conflict"
        if state == "conflict":
            failed.append(patch.name)
            state = f"conflict ({conflict_reason(patch, root)})"
        print(f"{patch.name}: {state}")
    if failed:
        print(f"error: {len(failed)} patch(es) do not apply to sglang {installed} at {root}: "
              f"{', '.join(failed)}; rebase them on the pinned SGLang", file=sys.stderr)
        return 1
    print(f"{len(patches)} patch(es) {'applied' if args.command == 'apply' else 'apply cleanly'} "
          f"to sglang {installed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
