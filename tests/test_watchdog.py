"""The entrypoint's watchdog (python/sglang_farskip/serve/watchdog.py) on its own: SIGTERM reaches the
server and the watchdog exits with the server's status; failed checks before the deployment is
up end nothing (a server that is still starting); the server dies with the watchdog; a
deployment that is up (node 0's /health answers) but never answered /health_generate, as when
a rank hangs the moment node 0 first serves, is ended within the module's bound; a crash loop
backs off and gives up with one line and EXIT_GAVE_UP; a refused setting (exit 2) is never
restarted; a server's process group is signalled after its exit only while its pid is no
other process's. The "servers" are real processes: Python HTTP servers and shell commands.

Its real job, ending a hung server so that both nodes restart, runs end to end in
tests/test_docker.py (node 1's schedulers stopped with SIGSTOP, the deployment serving again,
the watchdog's message in that node's log).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import REPO, free_port

import pytest

from sglang_farskip.serve.watchdog import EXIT_GAVE_UP, EXIT_UNHEALTHY, signal_group

INTERVAL_S, TIMEOUT_S, FAILURES = 1, 2, 2


def watchdog(cmd: list[str], url: str, log, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_farskip.serve.watchdog", "--url", url, "--interval",
         str(INTERVAL_S), "--timeout", str(TIMEOUT_S), "--failures", str(FAILURES), *flags,
         "--", *cmd],
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


# A node 0 that is up but whose deployment never generates: /health (no generation, the
# entrypoint's SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0) answers 200, /health_generate 503, as
# SGLang answers once a rank of either node hangs right after the warm-up.
UP_BUT_HUNG = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_deployment_hung_from_its_first_moment_is_ended_within_the_bound(tmp_path):
    """No check of /health_generate ever succeeds, so a watchdog that armed only at its own
    first success (the old rule) would wait for --start-timeout: node 1's case in issue 34."""
    port = free_port()
    log_path = tmp_path / "watchdog.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = watchdog([sys.executable, "-c", UP_BUT_HUNG, str(port)], base + "/health_generate",
                        log, "--up-url", base + "/health", "--start-timeout", "3600")
    started = time.monotonic()
    try:
        # The module's bound, (FAILURES + 1) x (INTERVAL + TIMEOUT), plus the interpreter's start.
        bound = (FAILURES + 1) * (INTERVAL_S + TIMEOUT_S) + 10
        assert proc.wait(timeout=bound) == EXIT_UNHEALTHY, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert "the deployment is up; armed" in log and "the deployment stopped answering" in log, log
    print(f"\nhung from the first moment: ended after {time.monotonic() - started:.1f} s")


def starts(path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def run_to_exit(tmp_path, exit_line: str, timeout: float) -> tuple[int, str, list[float]]:
    """A server command that records each start and ends with `exit_line`, under the
    watchdog (3 restarts, 0.5 s back-off) with nothing answering: (its exit status, its log,
    the start times)."""
    record, log_path = tmp_path / "starts", tmp_path / "watchdog.log"
    with open(log_path, "w") as log:
        proc = watchdog(["sh", "-c", f"date +%s.%N >> {record}; {exit_line}"],
                        f"http://127.0.0.1:{free_port()}/health_generate", log,
                        "--restarts", "3", "--backoff", "0.5")
    try:
        status = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, log_path.read_text(), starts(record)


def test_a_crash_loop_backs_off_and_gives_up_with_one_line(tmp_path):
    status, log, times = run_to_exit(tmp_path, "exit 1", timeout=60)
    assert status == EXIT_GAVE_UP, log
    assert len(times) == 4, times  # the first start and 3 restarts
    # The back-off doubles: 0.5, 1, 2 s, as announced, and each gap between starts is at least
    # its back-off. (Not "each gap longer than the one before": a start slowed by a busy machine
    # can make a gap longer than the next one's longer back-off.)
    assert re.findall(r"starting it again in ([0-9.]+) s", log) == ["0.5", "1", "2"], log
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap >= 0.5 * 2 ** i for i, gap in enumerate(gaps)), gaps
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "giving up after 3 restarts" in errors[0], log


def test_a_refused_setting_is_never_restarted(tmp_path):
    status, log, times = run_to_exit(tmp_path, "echo 'error: bad setting' >&2; exit 2", timeout=30)
    assert status == 2, log
    assert len(times) == 1 and "not restarting" in log, log


def test_a_start_that_came_up_resets_the_count(tmp_path):
    """A server that comes up (node 0's /health answers) and then crashes is restarted each
    time, whatever --restarts says: only starts that never come up count towards giving up."""
    record = tmp_path / "starts"
    port = free_port()
    log_path = tmp_path / "watchdog.log"
    base = f"http://127.0.0.1:{port}"
    # Up for 2.5 s (two checks), then a crash.
    up_then_crash = ["sh", "-c", f"date +%s.%N >> {record}; timeout 2.5 {sys.executable} -c "
                                 f"'{UP_BUT_HUNG}' {port}; exit 1"]
    with open(log_path, "w") as log:
        proc = watchdog(up_then_crash, base + "/health_generate", log, "--up-url",
                        base + "/health", "--restarts", "1", "--backoff", "0.2")
    try:
        wait_for(lambda: len(starts(record)) >= 4, 60, "fourth start", log_path)
        assert proc.poll() is None, log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert "giving up" not in log_path.read_text()


def _reuse_pid(pid: int) -> subprocess.Popen:
    """A new session leader with `pid`, as when the kernel goes round pid_max (32768 on many
    hosts) and hands a freed pid out again: the next pid is set through ns_last_pid (root)."""
    for _ in range(50):  # another process forking in between takes the pid first: try again
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        other = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if other.pid == pid:
            return other
        other.kill()
        other.wait()
    pytest.fail(f"pid {pid} was never handed out again in 50 tries")


def test_an_exited_servers_group_is_signalled_only_while_its_pid_is_not_reused():
    """signal_group (the watchdog's forward of SIGTERM in a restart's back-off, the test bed's
    stop of a node that exited): what the server left in its group is killed; once its pid
    leads another program's session, nothing is (a plain killpg would kill that program)."""
    server = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    left = psutil.Process(int(server.stdout.readline()))
    server.wait()  # reaped: the pid is free, the group lives on in the sleep it left
    signal_group(server, signal.SIGKILL)
    left.wait(timeout=10)  # psutil.TimeoutExpired if the leftover survived

    other = _reuse_pid(server.pid)
    try:
        signal_group(server, signal.SIGKILL)
        time.sleep(0.5)
        assert other.poll() is None, "signal_group killed the process that now has the pid"
    finally:
        other.kill()
        other.wait()
