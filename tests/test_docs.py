"""The launcher's flags and the user pages agree: every `--farskip-*` flag the launcher defines
is documented in README.md or docs/*.md, and every one those pages name exists (the launcher's
parser: no SGLang import); and the admin routes docs/serving.md lists are the ones that need the
admin key (this one imports SGLang's HTTP app); and every flag of the planner is on its page;
and docs/serving.md's table of runtime options is the one generated from their declaration."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from sglang_farskip.serve.launcher import own_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"--farskip-[a-z0-9]+(?:-[a-z0-9]+)*")


def launcher_flags() -> tuple[set[str], set[str]]:
    """(user flags, test-only flags): the second are hidden from --help (python/sglang_farskip/checks/device.py
    passes them), so the pages may name them but need not."""
    shown, hidden = set(), set()
    for action in own_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--farskip-"):
                (hidden if action.help == argparse.SUPPRESS else shown).add(option)
    return shown, hidden


def documented_flags() -> dict[str, list[str]]:
    """{flag: the pages that name it}."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for flag in set(FLAG.findall(page.read_text())):
            found.setdefault(flag, []).append(page.relative_to(ROOT).as_posix())
    return found


def test_every_launcher_flag_is_documented():
    shown, _ = launcher_flags()
    assert shown, "found no --farskip-* flag in the launcher's parser"
    missing = sorted(shown - set(documented_flags()))
    assert not missing, f"launcher flags no page documents (README.md, docs/*.md): {missing}"


def test_every_documented_flag_exists():
    shown, hidden = launcher_flags()
    unknown = {flag: pages for flag, pages in documented_flags().items() if flag not in shown | hidden}
    assert not unknown, f"pages name --farskip-* flags the launcher does not have: {unknown}"


def test_the_runtime_options_table_is_the_generated_one():
    """docs/serving.md's table of runtime options is what `python -m sglang_farskip.options`
    prints from their one declaration, so a flag, default or help line cannot drift."""
    from sglang_farskip.options import markdown_table

    text = (ROOT / "docs" / "serving.md").read_text()
    found = re.search(r"<!-- runtime options: generated .*? -->\n(.*?)<!-- end of runtime options -->",
                      text, re.S)
    assert found, "docs/serving.md lost its runtime-options markers"
    assert found[1].strip() == markdown_table(), (
        "docs/serving.md's runtime-options table is stale: paste `python -m sglang_farskip.options` between its markers")


def test_the_admin_routes_listed_are_the_routes_that_need_the_admin_key():
    """docs/serving.md lists the admin routes; the launcher marks them on SGLang's app."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_farskip.serve.admin import admin_routes

    text = (ROOT / "docs" / "serving.md").read_text()
    listing = text.split("The admin routes of SGLang 0.5.23:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`(/[a-z0-9_/{}-]+)`", listing)) == set(admin_routes(app))


def test_every_planner_flag_is_documented():
    """docs/planner.md names every flag `python -m sglang_farskip.plan` takes, --pd's included."""
    from sglang_farskip.plan.cli import build_parser

    text = (ROOT / "docs" / "planner.md").read_text()
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert flags, "found no flag in the planner's parser"
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![a-z0-9-])", text))
    assert not missing, f"planner flags docs/planner.md does not name: {missing}"
