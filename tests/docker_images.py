"""The images tests/test_docker.py runs, built once: by that test's fixture, or ahead of time
by .ci/run in the background (`python3 tests/docker_images.py`) while the rest of the suite runs
(the cold build is mostly downloads, which overlap the CPU-bound tests). A lock file makes a
second caller wait for the first, then find Docker's layer cache warm. Standard library only:
.ci/run starts it before the test venv exists."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
VERSIONS = DOCKER / "versions.env"
CPU_IMAGE = "sglang-farskip-test:cpu"
ROUTER_IMAGE = "sglang-farskip-test:router"
TORCH_SGLANG_IMAGE = "farskip-standin/torch-sglang:test"
BUILD_TIMEOUT_S = 1800  # the cold CPU build downloads ~4 GB of torch; measured ~5-8 min here
LOCK = Path(tempfile.gettempdir()) / "sglang-farskip-test-images.lock"
# The stand-in base alone (tests/test_fresh_machine.py needs nothing else): taken inside LOCK by
# ensure_images, alone by ensure_base, so that one does not wait for the other's image builds.
BASE_LOCK = Path(tempfile.gettempdir()) / "sglang-farskip-test-base.lock"


def sh(cmd: list[str], *, timeout: float = 120, env: dict | None = None,
       check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def versions() -> dict[str, str]:
    out = {}
    for line in VERSIONS.read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key] = value
    return out


def build(flavour: str, image: str, *args: str) -> float:
    """docker/build.sh FLAVOUR --local-base, tagged IMAGE; seconds taken. Every base here is a
    stand-in built on this machine (no registry, so no digest): --local-base says so."""
    start = time.monotonic()
    sh([str(DOCKER / "build.sh"), flavour, "--local-base", *args], timeout=BUILD_TIMEOUT_S,
       env={"FARSKIP_IMAGE": image})
    return time.monotonic() - start


def ensure_base(report=print) -> str:
    """The stand-in Python base (docker/standin/python-base.sh), built once; its name."""
    with open(BASE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.monotonic()
        base = sh([str(DOCKER / "standin" / "python-base.sh")], timeout=900).stdout.strip()
        report(f"stand-in python base {base}: {time.monotonic() - start:.0f} s")
    return base


def ensure_images(report=print) -> dict[str, str]:
    """The stand-in Python base, the CPU image, its torch-sglang stage (the GPU stand-ins'
    base) and the router image; `report` gets one line per step with its time (near 0 s when
    cached)."""
    with open(LOCK, "a+") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        if time.monotonic() - start > 1:
            report(f"waited {time.monotonic() - start:.0f} s for another build of the test images")
        base = ensure_base(report)
        standin = ["--build-arg", f"PYTHON_IMAGE={base}"]
        seconds = build("cpu", CPU_IMAGE, *standin)
        report(f"docker/build.sh cpu ({CPU_IMAGE}): {seconds:.0f} s")
        seconds = build("cpu", TORCH_SGLANG_IMAGE, *standin, "--target", "torch-sglang")
        report(f"torch-sglang stage ({TORCH_SGLANG_IMAGE}): {seconds:.0f} s")
        seconds = build("router", ROUTER_IMAGE, *standin)
        report(f"docker/build.sh router ({ROUTER_IMAGE}): {seconds:.0f} s")
    return {"base": base, "cpu": CPU_IMAGE, "torch-sglang": TORCH_SGLANG_IMAGE, "router": ROUTER_IMAGE,
            "sglang": versions()["SGLANG_VERSION"]}


if __name__ == "__main__":
    try:
        ensure_images(lambda line: print(f"[docker prebuild] {line}", flush=True))
    except Exception as e:  # noqa: BLE001 - the test's own build will retry and report
        print(f"[docker prebuild] failed, tests/test_docker.py will build: {e}", flush=True)
        sys.exit(1)
