"""The package's layers only look down, and no folder has an import circle.

The contracts are pyproject.toml's [tool.importlinter], the one place the layer order is
written; import-linter (requirements/tools.txt, installed by scripts/bootstrap.sh; a missing
tool fails here rather than skipping) checks them over every import in python/sglang_farskip,
those inside functions included. A broken contract fails the test, naming each offending import
and its line, e.g. `sglang_farskip.parallel -> sglang_farskip.serve.launcher (l.28)`.
The contracts are also shown a copy of the package with upward imports and a circle planted,
so contracts that check nothing cannot pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "sglang_farskip"

_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def lint(python_dir: Path) -> subprocess.CompletedProcess:
    """lint-imports with pyproject.toml's contracts, over the package found in `python_dir`
    (first on the path, so not whichever copy the venv installed)."""
    path = os.pathsep.join(p for p in (str(python_dir), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", _LINT], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=120)


def broken(proc: subprocess.CompletedProcess) -> str:
    """What a failing run says: its broken contracts, or all of it (the tool itself failed)."""
    out = proc.stdout + proc.stderr
    if "Broken contracts" in out:
        return out[out.find("Broken contracts"):]
    return f"lint-imports failed (scripts/bootstrap.sh installs it, from requirements/tools.txt):\n{out}"


def test_layers_only_look_down():
    proc = lint(PACKAGE.parent)
    if proc.returncode:
        pytest.fail(broken(proc), pytrace=False)


def test_an_upward_import_or_a_circle_is_named(tmp_path):
    copy = tmp_path / "sglang_farskip"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    plants = {
        # the two the layers exist to forbid: models and parallel importing serve/ (one of
        # them inside a function, where upward imports used to hide)
        "parallel.py": ("from sglang_farskip.serve import launcher\n",
                        "sglang_farskip.parallel -> sglang_farskip.serve.launcher"),
        "models/instella_moe.py": ("def _planted():\n    from sglang_farskip.serve import plugin\n",
                                   "sglang_farskip.models.instella_moe -> sglang_farskip.serve.plugin"),
        # the load harness's old circle (routers builds on servers)
        "loadtest/servers.py": ("from sglang_farskip.loadtest import routers\n", ".servers -> .routers"),
    }
    for name, (line, _) in plants.items():
        path = copy / name
        path.write_text(path.read_text() + "\n" + line)
    proc = lint(tmp_path)
    said = broken(proc)
    assert proc.returncode == 1, said
    for name, (_, named) in plants.items():
        assert named in said, f"the import planted in {name} is not named:\n{said}"


def test_the_design_page_lists_the_contracts_layers():
    """docs/design.md, "Layers", lowest first, names the modules of each layer of the contract
    (which is the one place the order is written: the page must follow it)."""
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10: import-linter brings tomli there
        import tomli as tomllib

    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
                    ["contracts"] if c["type"] == "layers")
    want = [set(re.split(r"\s*[:|]\s*", layer)) for layer in reversed(contract["layers"])]
    page = (ROOT / "docs" / "design.md").read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    ours = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |\Z)", page, flags=re.M | re.S)
    listed = [{n.rstrip("/") for n in re.findall(r"`([a-z_]+/?)`", item)} & ours for item in items]
    assert listed == want, f"docs/design.md 'Layers' (lowest first) names {listed}; pyproject.toml's contract {want}"
