"""The upgrade check: does the installed SGLang still have every target of the table, with the
parameters our code relies on? The first step of any SGLang upgrade (docs/upgrading.md).

    python -m sglang_farskip.boundary check     # exit 1 and one line per broken row

It reads SGLang only (imports its modules, inspects signatures and source); nothing of ours is
installed. A row breaks when its target is gone (renamed, moved), when a hooked or overridden
function no longer takes the parameters the owner uses, in that order, or when SGLang no longer
reads an environment switch we set.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

from sglang_farskip.boundary.installer import _ABSENT, raw
from sglang_farskip.boundary.table import KINDS, ROWS, Row


def problems(rows=ROWS) -> list[str]:
    """One line per row that does not hold against the installed SGLang."""
    out = []
    for row in rows:
        problem = _problem(row)
        if problem:
            out.append(f"{row.kind} {row.target} (owner {row.owner}): {problem}")
    return out


def _problem(row: Row) -> str | None:
    if row.kind == "env":
        return None if _reads_env(row.target) else "SGLang no longer reads this variable"
    # A swapped class is checked by its constructor's parameters; anything else as an attribute.
    path, attribute = (row.target, "__init__") if row.kind == "class-swap" else row.target.rsplit(".", 1)
    try:
        holder = pkgutil.resolve_name(path)
    except (ImportError, AttributeError) as e:
        return f"not found ({type(e).__name__}: {e})"
    value = raw(holder, attribute)
    if value is _ABSENT:
        if row.kind == "private" and _assigned_in_source(holder, attribute):
            return None  # an instance attribute: set in the class's (or module's) code
        return f"{attribute} not found in {getattr(holder, '__name__', holder)}"
    if row.params:
        return _params_problem(value, row.params)
    return None


def _params_problem(value, wanted: tuple[str, ...]) -> str | None:
    function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    function = inspect.unwrap(function)  # a hook already applied in this process
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "cannot read its signature"
    at = 0
    for name in wanted:
        if name not in names[at:]:
            return f"parameters are ({', '.join(names)}); the owner relies on ({', '.join(wanted)})"
        at = names.index(name, at) + 1
    return None


def _assigned_in_source(holder, attribute: str) -> bool:
    try:
        return f".{attribute}" in inspect.getsource(holder)
    except (OSError, TypeError):
        return False


def _reads_env(name: str) -> bool:
    from sglang.srt.environ import envs

    if hasattr(envs, name):
        return True
    root = Path(importlib.util.find_spec("sglang").origin).parent
    return any(name in path.read_text(errors="ignore") for path in root.rglob("*.py"))


def markdown(rows=ROWS) -> str:
    """The table as Markdown (patches/README.md holds it; tests/test_boundary.py compares)."""
    counts = ", ".join(f"{sum(r.kind == k for r in rows)} {k}" for k in KINDS if any(r.kind == k for r in rows))
    lines = [f"{len(rows)} rows: {counts}.", "",
             "| kind | SGLang target | owner (sglang_farskip.) | processes | why |", "|---|---|---|---|---|"]
    for r in rows:
        target = r.target.removeprefix("sglang.srt.") + (f" [{r.key}]" if r.key else "")
        owner = r.owner.removeprefix("sglang_farskip.")
        lines.append(f"| {r.kind} | `{target}` | `{owner}` | {r.processes} | {r.why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m sglang_farskip.boundary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "markdown"],
                        help="check: every row against the installed SGLang; markdown: print the table")
    args = parser.parse_args(argv)
    if args.command == "markdown":
        print(markdown(), end="")
        return 0
    import sglang

    found = problems()
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    verdict = f"{len(found)} of {len(ROWS)} rows broken" if found else f"all {len(ROWS)} rows hold"
    print(f"sglang {sglang.__version__} ({Path(sglang.__file__).parent}): {verdict}")
    return 1 if found else 0
