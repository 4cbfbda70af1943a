"""Every reference to a file of this repository leads to a file the repository has, and the
README is a front door: at most 16 KB, with a Layout that has a line per module. Cheap: reads
text, imports neither SGLang nor torch.

Where references are looked for: README.md, docs/*.md, and every text file under bench/,
deploy/, docker/, scripts/, tests/, patches/ and python/ (this file aside: it names the bad
references it looks for). What counts as one:
- a Markdown link `[text](target)` in a .md file, relative to that file (web links aside); an
  anchor (`page.md#a-heading`, `#a-heading`) must be one of that page's headings as GitHub
  spells it;
- a path whose first component is a top-level folder of the repository (`docs/serving.md`,
  `python/sglang_farskip/comm.py`, `bench/run_load.py`, `deploy/k8s/`), backticked or not,
  relative to the repository root; `sglang_farskip/...` relative to python/, and a subpackage's
  module (`serve/plugin.py`, `fcsd/student.py`) relative to python/sglang_farskip/. A glob or a
  template (`docs/*.md`, `deploy/node{0,1}.env`, `tests/<file>`) names no one file and is left
  alone;
- a page name with no folder (`serving.md`) must be the name of a .md file somewhere in the
  repository, unless NOT_OURS lists it (another project's file, or one a tool writes);
- design notes kept outside the repository are always wrong: `shared/notes/...`,
  `shared/reference...`, `notes/x.md`, and the word DESIGN that named the outside design notes.
Not references, because they are not ours: a path whose first component is anything else
(`sglang/srt/models/deepseek_v2.py` is SGLang's, `/models/DeepSeek-V3` a user's, `training/...`
another repository's), and anything inside a URL.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "sglang_farskip"
SCANNED_DIRS = ("bench", "deploy", "docker", "scripts", "tests", "patches", "python")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache"}
README_LIMIT = 16 * 1024

# Names that look like ours but are not files of this repository, and what they are.
NOT_OURS = {
    "README_WEIGHTS.md": "DeepSeek-V3's own weight description (tests/test_plan.py)",
    "report.md": "what loadtest/report.py writes into a run's output folder",
    "docker/dockerfile": "BuildKit's Dockerfile syntax image (`# syntax=docker/dockerfile:1`)",
    "docker/Dockerfile": "upstream SGLang's Dockerfile, in SGLang's repository (docs/deploy.md)",
    "docker/rocm.Dockerfile": "upstream SGLang's ROCm Dockerfile, in SGLang's repository",
    "deploy/prefill.env": "the copy of deploy/node0.env a PD deployment makes (docs/deploy.md)",
    "deploy/nodeN.env": "deploy/node0.env or deploy/node1.env, in the entrypoint's error line",
    "deploy/loadtest": "the load test's output folder, made when it runs",
}
NOT_OURS_UNDER = {
    "python/sglang/": "SGLang's own source tree (its repository keeps the package under python/ too)",
}

MD_LINK = re.compile(r"\[[^\]\n]*\]\(([^()\s]+)\)")
# The rest of a path: a reference ends at anything else (space, quote, backtick, bracket).
_PATH_TAIL = r"(?:/[\w.@+-]*)+"
_NOT_AFTER = r"(?<![\w./@-])"  # nothing path-like before: not the tail of another path or URL
TEMPLATE_NEXT = set("*{<$[\\")  # a glob, a template, or a regular expression's escape
BARE_PAGE = re.compile(_NOT_AFTER + r"([\w-]+(?:\.[\w-]+)*\.md)(?![\w/])")
OUTSIDE = re.compile(_NOT_AFTER + r"(?:\.\./)*(shared/(?:notes|reference|paper)\b[\w./-]*"
                     r"|notes/[\w.-]+\.md|DESIGN(?:\.md)?\b)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S*")


def repo_files() -> list[str]:
    """The repository's files, relative to the root: what git tracks plus what it would add
    (a new file counts before its commit); every file on disk where git is not there."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return sorted({f for f in out.splitlines() if (ROOT / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                      if p.is_file() and not set(p.relative_to(ROOT).parts) & SKIPPED_PARTS)


def top_folders(files: list[str]) -> set[str]:
    return {f.split("/", 1)[0] for f in files if "/" in f}


def scanned(files: list[str]) -> list[str]:
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return [f for f in files
            if f != me and not set(f.split("/")) & SKIPPED_PARTS
            and (f == "README.md" or re.fullmatch(r"docs/[^/]+\.md", f) or f.split("/", 1)[0] in SCANNED_DIRS)]


def path_pattern(roots: set[str]) -> re.Pattern:
    names = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
    return re.compile(_NOT_AFTER + r"((?:" + names + r")" + _PATH_TAIL + r")")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


class Checker:
    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.pages = {Path(f).name for f in files if f.endswith(".md")}
        pkg = root / "python" / "sglang_farskip"
        subpackages = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()} if pkg.is_dir() else set()
        python_roots = {p.name for p in (root / "python").iterdir() if p.is_dir()} if (root / "python").is_dir() else set()
        self.bases = [(path_pattern(top_folders(files)), ""),
                      (path_pattern(python_roots), "python/")]
        if subpackages:
            self.bases.append((path_pattern(subpackages), "python/sglang_farskip/"))

    def exists(self, relative: str, base: Path | None = None) -> bool:
        """`relative` (to `base`, else the root) is a file or folder inside the repository."""
        path = ((base or self.root) / relative).resolve()
        return (path == self.root or self.root in path.parents) and path.exists()

    @staticmethod
    def not_ours(path: str) -> bool:
        return path.rstrip("/") in NOT_OURS or path.startswith(tuple(NOT_OURS_UNDER))

    def line_problems(self, source: str, line: str) -> list[str]:
        problems = []
        line_no_urls = URL.sub(" ", line)
        outside = list(OUTSIDE.finditer(line_no_urls))
        problems += [f"{m.group(1)!r} is outside the repository" for m in outside]
        for pattern, prefix in self.bases:
            for m in pattern.finditer(line_no_urls):
                ref = m.group(1).rstrip(".")
                after = line_no_urls[m.end():m.end() + 1]
                if after in TEMPLATE_NEXT or "..." in ref or self.not_ours(prefix + ref):
                    continue
                if prefix == "python/sglang_farskip/" and not ref.endswith(".py"):
                    continue  # `serve/plugin.register` is an attribute, `cpu/` SGLang's too often
                if not self.exists(prefix + ref):
                    problems.append(f"{ref!r}: no {prefix + ref}")
        for m in BARE_PAGE.finditer(line_no_urls):
            name = m.group(1)
            if any(o.start() <= m.start() < o.end() for o in outside):
                continue  # said above
            if name not in self.pages and name not in NOT_OURS:
                problems.append(f"{name!r}: the repository has no page of that name")
        if source.endswith(".md"):
            for m in MD_LINK.finditer(line):
                problems += self.link_problems(source, m.group(1))
        return problems

    def link_problems(self, source: str, target: str) -> list[str]:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            return []  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        here = (self.root / source).parent
        if file_part and not self.exists(file_part, here):
            return [f"link {target!r}: no such file"]
        page = (here / file_part).resolve() if file_part else self.root / source
        if anchor and page.suffix == ".md" and anchor not in anchors(page):
            return [f"link {target!r}: {page.relative_to(self.root).as_posix()} has no heading #{anchor}"]
        return []

    def problems(self, sources: list[str]) -> list[str]:
        out = []
        for source in sources:
            try:
                text = (self.root / source).read_text()
            except (UnicodeDecodeError, OSError):
                continue  # not text
            for number, line in enumerate(text.splitlines(), 1):
                out += [f"{source}:{number}: {p}" for p in self.line_problems(source, line)]
        return out


def test_every_reference_resolves_inside_the_repository():
    files = repo_files()
    problems = Checker(ROOT, files).problems(scanned(files))
    assert not problems, "references to files the repository does not have:\n" + "\n".join(problems)


def test_a_planted_bad_reference_is_named_with_its_file_and_line(tmp_path):
    """The check itself: a small repository with one good and several bad references."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "python" / "sglang_farskip" / "serve").mkdir(parents=True)
    (tmp_path / "python" / "sglang_farskip" / "serve" / "__init__.py").write_text("")
    (tmp_path / "python" / "sglang_farskip" / "serve" / "plugin.py").write_text("")
    (tmp_path / "docs" / "good.md").write_text("# Good page\n\n## A section\n")
    bad = "DES" + "IGN"  # spelled apart: this file is not scanned, but stays honest to grep
    (tmp_path / "README.md").write_text(
        "[ok](docs/good.md#a-section), `docs/good.md`, serve/plugin.py, sglang/srt/models/x.py,\n"
        "`docs/*.md`, https://example.com/docs/nothing.md and good.md are fine.\n"
        "[gone](docs/gone.md) and [anchor](docs/good.md#nowhere)\n"
        "see `python/sglang_farskip/nothing.py` and serve/nothing.py\n"
        f"the wiring of {bad} section 1, shared/notes/perf-model.md, and perf-model.md\n")
    files = ["README.md", "docs/good.md", "python/sglang_farskip/serve/__init__.py",
             "python/sglang_farskip/serve/plugin.py"]
    problems = Checker(tmp_path, files).problems(["README.md"])
    assert {p.split(": ", 1)[0] for p in problems} == {"README.md:3", "README.md:4", "README.md:5"}, problems
    text = "\n".join(problems)
    for name in ("docs/gone.md", "#nowhere", "python/sglang_farskip/nothing.py", "serve/nothing.py",
                 bad, "shared/notes/perf-model.md", "'perf-model.md'"):
        assert name in text, (name, problems)


# ------------------------------------------------------------------------------- the front door
def test_readme_is_at_most_16_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, (f"README.md is {size} bytes, over {README_LIMIT}: it is the front door; "
                                  "move a section into a page of docs/ and link to it")


def layout_entries(readme: str) -> list[str]:
    """The paths README's "Layout" names, one per entry line, in order.

    The Layout is an indented block: an entry is a line whose first word is a file or folder
    name (folders end with "/") at its parent's indentation plus two, or at the block's own
    indentation for the repository's top level; a line indented further continues the
    description above it."""
    assert "\n## Layout\n" in readme, "README.md has no \"## Layout\" section"
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("    ") and line.strip()]
    base = min(len(line) - len(line.lstrip()) for line in lines)
    entries, stack = [], []  # stack: (indentation, path) of the folders above
    for line in lines:
        indent, word = len(line) - len(line.lstrip()), line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == base:
            path = word
        elif stack and indent == stack[-1][0] + 2:
            path = stack[-1][1] + word
        else:
            continue  # a description's next line
        assert word.endswith(("/", ".py")) or indent == base, f"Layout: {line.strip()!r} is no module or folder"
        entries.append(path)
        if word.endswith("/"):
            stack.append((indent, path))
    return entries


def test_readme_layout_has_a_line_per_module_and_names_only_what_exists():
    """The rule, for a newcomer who reads the Layout to find where a thing lives: every module
    of python/sglang_farskip/ (each .py but `__init__.py`, in every subpackage) and every
    subpackage has its own line, under its folder; every line names a file or folder that
    exists, once; every top-level folder of the repository is there."""
    files = repo_files()
    entries = layout_entries((ROOT / "README.md").read_text())
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    missing_paths = [e for e in entries if not (ROOT / e).exists() or e.endswith("/") != (ROOT / e).is_dir()]
    package = PACKAGE.relative_to(ROOT).as_posix() + "/"
    modules = [f for f in files if f.startswith(package) and f.endswith(".py")]
    wanted = {f for f in modules if not f.endswith("/__init__.py")}
    wanted |= {f.removesuffix("__init__.py") for f in modules if f.endswith("/__init__.py") and f != package + "__init__.py"}
    unlisted = sorted(wanted - set(entries))
    tops = {e.split("/", 1)[0] for e in entries}
    folders_left_out = sorted(top_folders(files) - tops)
    assert not (repeated or missing_paths or unlisted or folders_left_out), (
        f"README.md Layout: listed twice {repeated}; not in the tree {missing_paths}; "
        f"modules and packages it leaves out {unlisted}; top-level folders it leaves out {folders_left_out}")
