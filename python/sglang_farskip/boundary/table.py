"""Every place sglang_farskip touches SGLang 0.5.23, one row each: the list to re-check on an
SGLang upgrade (`python -m sglang_farskip.boundary check` checks it against the installed SGLang).
The rows are data, in table.csv beside this file (one line a row; `patches/README.md` shows them
as a page); this module reads and validates them once.

A row says what is touched (`target`, SGLang's dotted path, or an environment variable's name),
how (`kind`), in which processes, which module of ours owns it (`owner`, "module:attribute"), and
why. Kinds:

    before, after, around   a hook through SGLang's HookRegistry (upstream's plugin machinery)
    replace                 an SGLang attribute set to an object of ours where a hook cannot do it
    registry                an entry in one of SGLang's registries (models, attention backends,
                            its HTTP app's middleware)
    subclass                a method of an SGLang class that a class of ours overrides
    class-swap              an SGLang object whose class is swapped for a subclass of ours
    env                     an environment switch SGLang reads, set by us ("launcher") or read
                            by us too ("read": the launcher refuses what it turns on)
    private                 a private SGLang attribute that our code reads

Processes (`when` for the installed kinds): "every" = every SGLang process, at plugin load;
"cpu" = every process of a CPU run, at plugin load; "http" = the launcher's HTTP process, before
it serves; "model" = when a FarSkip model is built; "launcher" = set by the launcher or the plugin
before SGLang reads it; "read" = wherever the owner runs.

In table.csv, targets are relative to `sglang.srt.` (but environment variables) and owners to
`sglang_farskip.`. `params`: for hooks, overrides and swaps, the parameter names of the target
the owner relies on, in order, space-separated (the upgrade check compares them with the
installed SGLang's signature). `key`: the registry entry's name; `how`: how the registry takes
it. This module imports nothing of SGLang's or ours.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

KINDS = ("before", "after", "around", "replace", "registry", "subclass", "class-swap", "env", "private")
HOOK_KINDS = ("before", "after", "around")
INSTALLED = HOOK_KINDS + ("replace", "registry")  # what boundary.install() puts in place
GROUPS = ("every", "cpu", "http")  # the install groups (see boundary.install)


@dataclass(frozen=True)
class Row:
    kind: str
    target: str
    owner: str
    processes: str
    why: str
    params: tuple[str, ...] = ()
    key: str | None = None
    how: str = ""  # registry: "item" (target[key] = value), "call" (target(key, value)),
    #                "decorator" (target(key)(value)), "name" (target(key): the name alone),
    #                "middleware" (target(value): an ASGI middleware class for an app's
    #                add_middleware; key names it)
    only_if: str = ""  # installed kinds: "module:predicate" of ours that must answer True


CSV = Path(__file__).with_name("table.csv")
PROCESSES = GROUPS + ("model", "launcher", "read")
HOW = {"registry": ("item", "call", "decorator", "name", "middleware")}


def _row(line: dict) -> Row:
    def ours(name: str) -> str:
        return f"sglang_farskip.{name}" if name else ""

    kind = line["kind"]
    row = Row(kind=kind, target=line["target"] if kind == "env" else f"sglang.srt.{line['target']}",
              owner=ours(line["owner"]), processes=line["processes"], why=line["why"],
              params=tuple(line["params"].split()), key=line["key"] or None, how=line["how"],
              only_if=ours(line["only_if"]))
    wrong = []
    if kind not in KINDS:
        wrong.append(f"kind {kind!r}")
    if row.processes not in PROCESSES:
        wrong.append(f"processes {row.processes!r}")
    if kind in HOW and (row.how not in HOW[kind] or row.key is None):
        wrong.append(f"registry style {row.how!r} or no key")
    if wrong:  # a developer's slip in table.csv: said at import, in every process
        raise ValueError(f"{CSV}: row {line['target']}: unknown {', '.join(wrong)}")
    return row


def load(path: Path = CSV) -> tuple[Row, ...]:
    with open(path, newline="") as f:
        return tuple(_row(line) for line in csv.DictReader(f))


ROWS: tuple[Row, ...] = load()
