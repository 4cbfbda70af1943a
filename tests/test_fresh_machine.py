"""The README's first command on a fresh machine of the project's kind (Debian 12, Python 3.11,
this host's pip configuration) that has neither Mooncake's system libraries
(requirements/pd-cpu.debs) nor a C++ compiler: a container of the stand-in base image
(docker/standin/python-base.sh: debootstrap's minbase and Python 3.11, what python:3.11-slim is),
with a copy of this checkout as a fresh clone has it (tracked and untracked files, nothing
ignored: no .venv).

One container, one step after the other:
1. a normal user (uid 1000) runs ./scripts/bootstrap.sh: everything installs, one warning says
   that PD is refused until `apt-get install ...`, exit 0;
2. the same user runs ./scripts/demo.sh: the demo answers the README's streamed completion and
   /farskip/info reports the FarSkip model; with no compiler, the launcher says it runs SGLang's
   compiled CPU functions eagerly;
3. a prefill server (`--disaggregation-mode prefill`) is refused at once: exit 2, exactly one
   `error:` line, naming the apt-get command;
4. root runs ./scripts/bootstrap.sh: it installs the libraries with apt, and Mooncake's engine
   loads.

Cost: about 4-5 minutes, most of it step 1's install (pip reads the host's configuration: its
local indexes are mounted read-only at the same paths, as on the host).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from containers import ROOT, SKIP, report
from docker_images import ensure_base, sh

pytestmark = [SKIP, pytest.mark.timeout(1500)]

USER = "1000:1000"
HOME = "/home/farskip"
REPO = f"{HOME}/sglang-farskip"
INSTALL_TIMEOUT_S = 900  # the whole install from a cold pip cache; ~3 min here
DEMO_TIMEOUT_S = 300
# The README's example request (Quick start), sent from inside the container.
CLIENT = r'''
import json, sys, time, urllib.request
base = "http://127.0.0.1:30000"
deadline = time.monotonic() + float(sys.argv[1])
while True:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            models = json.load(r)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the demo did not answer /v1/models")
        time.sleep(1)
body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stream": True}
req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    stream = r.read().decode()
with urllib.request.urlopen(base + "/farskip/info", timeout=30) as r:
    info = json.load(r)
print(json.dumps({"models": models, "stream": stream, "info": info}))
'''


def pip_setup() -> tuple[str, list[str]]:
    """This host's pip configuration as a pip.conf, and the local paths it names (indexes,
    wheel folders, constraint files) to mount read-only at the same place."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    settings = {}
    for line in out.splitlines():  # global.find-links='/opt/wheels', :env:.cert='...'
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip("'")
    paths = set()
    for value in settings.values():
        for token in value.split():
            path = token.removeprefix("file://")
            if path.startswith("/") and os.path.exists(path):
                # A file:// index links to its files beside "simple/".
                paths.add(str(Path(path).parent) if Path(path).name == "simple" else path)
    conf = "[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items()))
    return conf, sorted(paths)


def fresh_clone(dest: Path) -> None:
    """The checkout's files as a clone of it has them (the working tree, so uncommitted edits
    are tried too): tracked and untracked, nothing git ignores."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


class Machine:
    """A container of the stand-in base, kept running; each step is a `docker exec`."""

    def __init__(self, base: str, home: Path, pip_conf: Path, mounts: list[str]):
        self.name = f"farskip-test-fresh-{os.getpid()}"
        sh(["docker", "rm", "-f", self.name], check=False)
        volumes = [f"{home}:{HOME}", f"{pip_conf}:/etc/pip.conf:ro"]
        volumes += [f"{p}:{p}:ro" for p in mounts]
        cmd = ["docker", "run", "-d", "--init", "--name", self.name]
        for v in volumes:
            cmd += ["-v", v]
        sh([*cmd, base, "sleep", "infinity"], timeout=120)

    def run(self, command: str, user: str = USER, timeout: float = 120, detach: bool = False):
        args = ["docker", "exec", *(["-d"] if detach else []), "--user", user, "-e", f"HOME={HOME}",
                "-w", REPO, self.name, "bash", "-c", command]
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)

    def remove(self) -> None:
        sh(["docker", "rm", "-f", self.name], check=False, timeout=120)


@pytest.fixture(scope="module")
def machine(request, tmp_path_factory):
    base = ensure_base(lambda line: report(request, line))
    home = tmp_path_factory.mktemp("fresh-home")
    fresh_clone(home / "sglang-farskip")
    conf, mounts = pip_setup()
    pip_conf = home.parent / "pip.conf"
    pip_conf.write_text(conf)
    sh(["chown", "-R", USER, str(home)])
    m = Machine(base, home, pip_conf, mounts)
    try:
        missing = m.run("ldconfig -p | grep -c 'libibverbs.so.1' || true; command -v g++ || true")
        assert missing.stdout.split() == ["0"], f"the base is not a fresh machine: {missing.stdout}"
        yield m
    finally:
        m.remove()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_readme_commands_on_a_fresh_machine(request, machine):
    debs = [line.split() for line in (ROOT / "requirements" / "pd-cpu.debs").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    absent = [pkg for pkg, lib in debs
              if machine.run(f"ldconfig -p | grep -q {shlex.quote(lib)}").returncode != 0]
    assert absent, "the stand-in base has every library: nothing to try"

    # 1. A normal user installs: everything but PD's libraries, one warning, exit 0.
    start = time.monotonic()
    boot = machine.run("./scripts/bootstrap.sh", timeout=INSTALL_TIMEOUT_S)
    installed_s = time.monotonic() - start
    assert boot.returncode == 0, boot.stdout[-3000:] + boot.stderr[-5000:]
    warnings = [line for line in boot.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"apt-get install {' '.join(absent)}" in warnings[0], boot.stderr[-3000:]
    assert not error_lines(boot.stderr), boot.stderr[-3000:]

    # 2. The demo serves the README's request.
    start = time.monotonic()
    machine.run(f"./scripts/demo.sh > {HOME}/demo.log 2>&1", detach=True)
    client = machine.run(f".venv/bin/python - {DEMO_TIMEOUT_S} <<'PY'\n{CLIENT}\nPY", timeout=DEMO_TIMEOUT_S + 180)
    log = machine.run(f"cat {HOME}/demo.log").stdout
    assert client.returncode == 0, client.stderr[-2000:] + "\n--- demo log\n" + log[-5000:]
    served_s = time.monotonic() - start
    answer = json.loads(client.stdout)
    assert [m["id"] for m in answer["models"]["data"]] == ["farskip-demo"]
    chunks = [json.loads(line[6:]) for line in answer["stream"].splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert answer["stream"].rstrip().endswith("data: [DONE]") and text, answer["stream"][-500:]
    (rank,) = answer["info"]["ranks"]
    assert rank["model_class"].endswith("FarSkipDeepseekV3ForCausalLM") and rank["converted_layers"]
    assert "no C++ compiler (g++) on PATH" in log, log[-3000:]

    # 3. PD is refused at once, in one line that names the fix.
    start = time.monotonic()
    pd = machine.run(".venv/bin/python -m sglang_farskip.launch_server --disaggregation-mode prefill "
                     "--port 30100", timeout=180)
    refused_s = time.monotonic() - start
    errors = error_lines(pd.stderr)
    assert pd.returncode == 2 and len(errors) == 1, pd.stderr[-3000:]
    assert f"apt-get install {' '.join(absent)}" in errors[0] and "as root" in errors[0], errors

    # 4. Root installs the libraries; the engine loads.
    root = machine.run("./scripts/bootstrap.sh", user="0:0", timeout=600)
    assert root.returncode == 0, root.stderr[-3000:]
    assert f"== installing {' '.join(absent)}" in root.stderr and "warning:" not in root.stderr, root.stderr
    engine = machine.run(".venv/bin/python -c 'from mooncake.engine import TransferEngine'")
    assert engine.returncode == 0, engine.stderr[-2000:]

    report(request, f"fresh machine: installed in {installed_s:.0f} s as uid 1000 without "
                    f"{', '.join(absent)} and g++; demo answered {served_s:.0f} s after demo.sh "
                    f"({text!r}); PD refused in {refused_s:.0f} s: {errors[0][:160]}")
