"""The boundary with SGLang is one table (python/sglang_farskip/boundary/table.csv), and what is
installed is what it says:
- one module installs (HookRegistry.register, `__class__ =`): boundary/installer.py;
- in a CPU run of the plugin and the launcher's HTTP set-up, every installed row is in place,
  every hook of ours that SGLang's HookRegistry holds is a row (no hook outside the table), every
  subclass of an SGLang class in our modules that overrides an SGLang method is a row, and each
  subclass and class-swap row's owner really derives from its target; the comparison is also run
  on the table with one row left out, and must report it;
- the upgrade check (`python -m sglang_farskip.boundary check`) passes against the installed
  SGLang, and fails naming the target and owner when one SGLang function is renamed (a copy of
  SGLang, as symlinks, with one file edited);
- patches/README.md holds the table as `python -m sglang_farskip.boundary markdown` prints it.

Cost: one subprocess that runs the upgrade check and loads the plugin (~35 s), one upgrade check
on the renamed copy (~25 s). No server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_farskip.boundary import check
from sglang_farskip.boundary.table import ROWS
from sglang_farskip.cpu.environment import cpu_base_environment

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "sglang_farskip"
INSTALLER = PACKAGE / "boundary" / "installer.py"


def test_one_module_installs():
    pattern = re.compile(r"HookRegistry\.register|__class__\s*=(?!=)")
    found = sorted({str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())})
    assert found == [str(INSTALLER.relative_to(ROOT))], found


# Runs in a fresh CPU process: the plugin as SGLang loads it, then the launcher's HTTP rows.
_INSTALLED = r"""
import inspect, json, pkgutil, sys
from sglang_farskip.boundary import check
unchecked = check.problems()  # the upgrade check, before anything of ours is installed
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from sglang.srt.entrypoints.http_server import app  # the launcher has it imported by then
from sglang_farskip import boundary, options
from sglang_farskip.boundary import installer as inst
from sglang_farskip.boundary.table import ROWS, HOOK_KINDS
from sglang_farskip.serve import admission
admission.configure(options.current())
boundary.install("http")
boundary.apply()

def drift(rows):
    out = [f"not in place: {m}" for g in ("every", "cpu", "http") for m in boundary.missing(g)]
    # HookRegistry's own list: every hook of ours registered is a row, and the other way round.
    ours = {(t, ht.value, f"{h.__module__}:{h.__qualname__}")
            for t, hooks in HookRegistry._hooks.items() for ht, h, _ in hooks
            if getattr(h, "__module__", "").startswith("sglang_farskip")}
    wanted = {(r.target, r.kind, r.owner) for r in rows if r.kind in HOOK_KINDS
              and (not r.only_if or inst.owned(r.only_if)())}
    def name(spec):  # owner "module:attr" as __module__:__qualname__ of the object
        obj = inst.owned(spec)
        return f"{obj.__module__}:{obj.__qualname__}"
    wanted = {(t, k, name(o)) for t, k, o in wanted}
    out += [f"hook outside the table: {x}" for x in sorted(ours - wanted)]
    out += [f"row not registered: {x}" for x in sorted(wanted - ours)]
    # Subclasses: each row's owner derives from the target's class and defines the method.
    listed = set()
    for r in rows:
        if r.kind in ("subclass", "class-swap"):
            cls = inst.owned(r.owner)
            base = pkgutil.resolve_name(r.target if r.kind == "class-swap" else r.target.rpartition(".")[0])
            if not (isinstance(cls, type) and issubclass(cls, base)):
                out.append(f"{r.owner} does not derive from {base.__qualname__}")
            if r.kind == "subclass":
                method = r.target.rpartition(".")[2]
                if not any(method in vars(k) for k in cls.__mro__[:cls.__mro__.index(base)]):
                    out.append(f"{r.owner} does not override {method}")
                listed.add((cls, method))
    # ... and every override of an SGLang method by a class of our modules is a row.
    classes = {c for n, m in list(sys.modules.items()) if n.startswith("sglang_farskip.") and m
               for c in vars(m).values() if isinstance(c, type) and c.__module__ == n}
    classes |= {inst.owned(r.owner) for r in ROWS if r.kind in ("subclass", "class-swap")}  # factory-built
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
            mod = cls.__module__
            upstream = [k for k in cls.__mro__ if k.__module__.startswith("sglang.")]
            for method in vars(cls):
                if method.startswith("__") and method != "__init__":
                    continue
                if callable(vars(cls)[method]) or isinstance(vars(cls)[method], (classmethod, staticmethod)):
                    if any(method in vars(k) for k in upstream) and (cls, method) not in listed:
                        out.append(f"override outside the table: {mod}:{cls.__qualname__}.{method}")
    return out

whole = drift(ROWS)
left_out = next(r for r in ROWS if r.target.endswith("TokenizerManager.generate_request"))
planted = drift(tuple(r for r in ROWS if r is not left_out))
print(json.dumps({"whole": whole, "planted": planted, "check": unchecked}))
"""


def _cpu_env() -> dict:
    return {**os.environ, **cpu_base_environment()}


@pytest.fixture(scope="module")
def installed() -> dict:
    """One CPU process: the upgrade check, then the plugin and the HTTP rows installed."""
    run = subprocess.run([sys.executable, "-c", _INSTALLED], capture_output=True, text=True,
                         env=_cpu_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_what_is_installed_is_the_table(installed):
    result = installed
    assert result["whole"] == [], "\n".join(result["whole"])
    # The same comparison without one row: it must see the hook that is installed but not listed.
    assert any("hook outside the table" in line and "generate_request" in line for line in result["planted"]), \
        result["planted"]


def test_the_upgrade_check_passes_on_the_pinned_sglang(installed):
    assert installed["check"] == [], "\n".join(installed["check"])


def test_the_upgrade_check_names_a_renamed_target(tmp_path):
    """SGLang renames TokenizerManager.generate_request: a copy of the sglang package made of
    symlinks, but for that one file, edited, shadows the installed one."""
    import sglang

    source = Path(sglang.__file__).resolve().parent
    copy = tmp_path / "sglang"
    subprocess.run(["cp", "-rs", str(source), str(copy)], check=True)
    edited = copy / "srt" / "managers" / "tokenizer_manager.py"
    text = edited.read_text()
    assert "    async def generate_request(" in text
    edited.unlink()
    edited.write_text(text.replace("    async def generate_request(", "    async def generate_request_renamed("))
    env = {**_cpu_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "python")])}
    run = subprocess.run([sys.executable, "-m", "sglang_farskip.boundary", "check"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    assert str(tmp_path) in run.stdout  # it checked the copy
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert "TokenizerManager.generate_request" in errors[0]
    assert "sglang_farskip.serve.admission:around_generate" in errors[0]


# Our code names SGLang's environment switches as `envs.NAME` or as the string "NAME".
_ENV_NAME = re.compile(r"\benvs\.([A-Z][A-Z0-9_]+)|[\"']([A-Z][A-Z0-9_]+)[\"']")


def env_switches_named(sources) -> set[str]:
    """The environment switches SGLang defines (sglang.srt.environ.envs) that these sources name."""
    from sglang.srt.environ import envs

    named = {a or b for path in sources for a, b in _ENV_NAME.findall(path.read_text())}
    return {name for name in named if hasattr(envs, name)}


def test_every_sglang_switch_we_set_or_read_is_a_row(tmp_path):
    """An SGLang environment switch our code sets (the launcher's environment) or reads (the
    refusal of SGLANG_RUST_SERVER) is a row, so an SGLang upgrade that drops or renames it is
    caught by the upgrade check rather than silently ignored. The test bed's and the tools'
    switches are not the product's boundary."""
    sources = [p for p in PACKAGE.rglob("*.py") if p.parent.name not in ("testbed", "tools")]
    rows = {r.target for r in ROWS if r.kind == "env"}
    named = env_switches_named(sources)
    assert named - rows == set(), f"switches without a row in boundary/table.csv: {sorted(named - rows)}"
    assert {"SGLANG_RUST_SERVER", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"} <= named  # it sees both forms
    # A switch named in a new module without a row is found.
    planted = tmp_path / "planted.py"
    planted.write_text("if envs.SGLANG_ENABLE_TORCH_COMPILE.get():\n    pass\n")
    assert "SGLANG_ENABLE_TORCH_COMPILE" in env_switches_named([*sources, planted]) - rows


def test_patches_readme_holds_the_table():
    text = (ROOT / "patches" / "README.md").read_text()
    copy = text.split("<!-- boundary-table:start -->\n", 1)[1].split("<!-- boundary-table:end -->", 1)[0]
    assert copy == check.markdown(), (
        "patches/README.md's table is stale: paste `python -m sglang_farskip.boundary markdown` "
        "between its boundary-table markers")
