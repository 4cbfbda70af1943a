"""The entrypoint's watchdog (python/sglang_farskip/watchdog.py) around a real demo server.

A hung server (its scheduler stopped with SIGSTOP, as a rank stuck in a GPU call would be) is
ended, its whole process tree with it, and the watchdog exits EXIT_UNHEALTHY; a server that is
still starting is left alone (the checks fail then too, for ~20 s, but the watchdog is not yet
armed); SIGTERM reaches the server and the watchdog exits with the server's status. The
two-node recovery this enables runs in tests/test_docker.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from parity import ONE_THREAD
from serverutil import EAGER, REPO, free_port

from sglang_farskip.watchdog import EXIT_UNHEALTHY

INTERVAL_S, TIMEOUT_S, FAILURES = 1, 25, 2
# Detection of the hang: FAILURES checks, each SGLang's 20 s health-check timeout (503) plus
# the interval; the start before it is ~25 s here, minutes on a busy CI machine.
BOUND_S = 300


def watchdog(cmd: list[str], url: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_farskip.watchdog", "--url", url, "--interval",
         str(INTERVAL_S), "--timeout", str(TIMEOUT_S), "--failures", str(FAILURES), "--", *cmd],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env={**os.environ, **EAGER, **ONE_THREAD})


def wait_for(predicate, timeout: float, what: str, log_path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout} s:\n{log_path.read_text()[-3000:]}")


def test_a_stopped_scheduler_is_ended_and_reported(tmp_path):
    port = free_port()
    log_path = tmp_path / "watchdog.log"
    server = [sys.executable, "-m", "sglang_farskip.launch_server", "--host", "127.0.0.1",
              "--port", str(port)]
    with open(log_path, "w") as log:
        proc = watchdog(server, f"http://127.0.0.1:{port}/health_generate", log)
    tree: list[psutil.Process] = []
    try:
        wait_for(lambda: "; armed" in log_path.read_text() or proc.poll() is not None, BOUND_S,
                 "armed watchdog", log_path)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        tree = psutil.Process(proc.pid).children(recursive=True)
        schedulers = [p for p in tree if "sglang::scheduler" in " ".join(p.cmdline())]
        assert schedulers, [p.cmdline() for p in tree]
        stopped = time.monotonic()
        for p in schedulers:
            p.send_signal(signal.SIGSTOP)
        code = proc.wait(timeout=BOUND_S)
        took = time.monotonic() - stopped
        log = log_path.read_text()
        assert code == EXIT_UNHEALTHY, log[-3000:]
        assert f"failed ({FAILURES} of {FAILURES})" in log and "killing the server" in log
        # The whole tree is gone, the stopped process included.
        time.sleep(1)
        assert not [p.pid for p in tree if alive(p)]
        print(f"watchdog: a stopped scheduler ended the server {took:.0f} s later")
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigterm_reaches_the_server_and_its_status_is_returned(tmp_path):
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        # A server that never answers: the watchdog never arms, and only the signal ends it.
        proc = watchdog(["sleep", "600"], f"http://127.0.0.1:{free_port()}/health_generate", log)
    wait_for(lambda: "started the server" in log_path.read_text(), 30, "start", log_path)
    time.sleep(3)  # a few failed checks: not armed, so nothing is killed
    assert proc.poll() is None, log_path.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM, log_path.read_text()
    assert "passing signal 15" in log_path.read_text()


def test_the_server_dies_with_the_watchdog(tmp_path):
    """A supervisor that SIGKILLs the watchdog's process group (tests/netns.py does, as would
    `kill -9` of the entrypoint) must not leave the server, in its own group, running."""
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        proc = watchdog(["sleep", "600"], f"http://127.0.0.1:{free_port()}/health_generate", log)
    wait_for(lambda: "started the server" in log_path.read_text(), 30, "start", log_path)
    (server,) = psutil.Process(proc.pid).children()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    server.wait(timeout=10)  # psutil.TimeoutExpired if it outlived the watchdog
