"""What the container tests share (tests/test_docker.py, tests/test_compose_pd.py): why they skip,
the images fixture, a compose project of the shipped deploy/compose.yaml, HTTP with a key, and
the line each adds to the run's summary. A plain module, like parity.py: no test module imports
another."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from docker_images import VERSIONS, ensure_images, sh

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
PREFIX = "farskip-test"  # compose projects and networks made here
# What the tests ask the servers: token ids below the demo model's vocabulary, and a text prompt.
PROMPT = "The capital of France is"
PROMPT_IDS = [0, 17, 1234, 77, 3001, 5, 999, 42]
NEW_TOKENS = 8


def _why_not() -> str | None:
    if not shutil.which("docker"):
        return "no docker CLI (install Docker Engine; .ci/run does on CI)"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer (docker info timed out)"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"no Docker engine reachable ({last}); .ci/run starts one on CI"
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        return "the stand-in base image needs root and debootstrap (apt-get install debootstrap)"
    return None


# Every container test module's mark: skipped, with the reason, where no engine answers.
WHY_NOT = _why_not()
SKIP = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def report(request, line: str) -> None:
    """One line in the run's summary (the numbers the README quotes): tests/_durations.py
    prints each test's "measured" properties at the end, from whichever worker ran it."""
    # A module-scoped fixture's request names the module; its `_pyfuncitem` is the test being set up.
    item = getattr(request, "_pyfuncitem", request.node)
    item.user_properties.append(("measured", f"[docker] {line}"))


@pytest.fixture(scope="module")
def images(request) -> dict[str, str]:
    """Every image the tests run, built (or found in the cache) once; see docker_images.py."""
    return ensure_images(lambda line: report(request, line))


def compose_tool() -> str:
    here = Path(sys.executable).parent / "docker-compose"
    found = str(here) if here.exists() else shutil.which("docker-compose")
    if not found:
        pytest.fail("docker-compose is not installed: run scripts/bootstrap.sh (requirements/tools.txt)")
    return found


class Project:
    """One `docker compose -p NAME` of the shipped compose file; `down` at the end, always."""

    def __init__(self, name: str, env: dict[str, str], env_files: tuple[Path, ...] = (),
                 files: tuple[Path, ...] = (), profiles: tuple[str, ...] = ()):
        self.name = f"{PREFIX}-{name}"
        self.env = env
        self.args = [compose_tool(), "-p", self.name, "-f", str(COMPOSE)]
        for f in files:
            self.args += ["-f", str(f)]
        for f in (VERSIONS, *env_files):
            self.args += ["--env-file", str(f)]
        for profile in profiles:  # every command: compose ignores services of other profiles
            self.args += ["--profile", profile]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return sh([*self.args, *args], timeout=timeout, env=self.env, check=check)

    def container(self, service: str) -> str:
        cid = self.run("ps", "-a", "-q", service).stdout.strip()
        assert cid, f"{self.name}: no container for {service}"
        return cid

    def logs(self) -> str:
        proc = self.run("logs", "--no-color", "--tail", "80", check=False)
        return "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                         if "warnings.warn" not in line)

    def down(self) -> None:
        self.run("down", "--timeout", "5", "--volumes", check=False, timeout=180)

    def leftovers(self) -> str:
        return sh(["docker", "ps", "-a", "-q", "--filter",
                   f"label=com.docker.compose.project={self.name}"]).stdout.strip()


def state(cid: str) -> dict:
    return json.loads(sh(["docker", "inspect", "--format", "{{json .State}}", cid]).stdout)


def http(url: str, payload: dict | None = None, key: str | None = None,
         timeout: float = 120) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
