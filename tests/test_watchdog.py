"""The entrypoint's watchdog (python/sglang_farskip/serve/watchdog.py) on its own: SIGTERM reaches the
server and the watchdog exits with the server's status; failed checks before the first success
end nothing (a server that is still starting); the server dies with the watchdog.

Its real job, ending a hung server so that both nodes restart, runs end to end in
tests/test_docker.py (node 1's schedulers stopped with SIGSTOP, the deployment serving again,
the watchdog's message in that node's log).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import REPO, free_port

from sglang_farskip.serve.watchdog import EXIT_UNHEALTHY

INTERVAL_S, TIMEOUT_S, FAILURES = 1, 2, 2


def watchdog(cmd: list[str], url: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_farskip.serve.watchdog", "--url", url, "--interval",
         str(INTERVAL_S), "--timeout", str(TIMEOUT_S), "--failures", str(FAILURES), "--", *cmd],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env={**os.environ, **ONE_THREAD})


def wait_for(predicate, timeout: float, what: str, log_path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout} s:\n{log_path.read_text()[-3000:]}")


def test_a_stopped_server_is_ended_once_armed(tmp_path):
    """The "server" is Python's http.server answering the health URL (the SGLang case is
    tests/test_docker.py's hang): it answers, the watchdog arms, the server is stopped
    (SIGSTOP), every check then times out, and after FAILURES of them the stopped process is
    killed and the watchdog exits EXIT_UNHEALTHY."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health_generate").write_text("ok")
    port = free_port()
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        proc = watchdog([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                         "--directory", str(tmp_path / "www")],
                        f"http://127.0.0.1:{port}/health_generate", log)
    try:
        wait_for(lambda: "; armed" in log_path.read_text(), 60, "armed watchdog", log_path)
        (server,) = psutil.Process(proc.pid).children()
        server.send_signal(signal.SIGSTOP)
        assert proc.wait(timeout=60) == EXIT_UNHEALTHY, log_path.read_text()
        server.wait(timeout=10)  # killed although stopped
        log = log_path.read_text()
        assert f"failed ({FAILURES} of {FAILURES})" in log and "killing the server" in log
    finally:
        if proc.poll() is None:
            proc.kill()


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
    """A supervisor that SIGKILLs the watchdog's process group (sglang_farskip/testbed/netns.py does, as would
    `kill -9` of the entrypoint) must not leave the server, in its own group, running."""
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        proc = watchdog(["sleep", "600"], f"http://127.0.0.1:{free_port()}/health_generate", log)
    wait_for(lambda: "started the server" in log_path.read_text(), 30, "start", log_path)
    (server,) = psutil.Process(proc.pid).children()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    server.wait(timeout=10)  # psutil.TimeoutExpired if it outlived the watchdog


def test_a_start_that_never_answers_is_ended(tmp_path):
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_farskip.serve.watchdog", "--url",
             f"http://127.0.0.1:{free_port()}/health_generate", "--interval", "1",
             "--start-timeout", "3", "--", "sleep", "600"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    assert proc.wait(timeout=30) == EXIT_UNHEALTHY, log_path.read_text()
    assert "has not answered within 3 s of the start" in log_path.read_text()
