"""Run the server and end it when the deployment stops answering, so that whatever runs the
node (Docker's restart policy, the kubelet, Slurm) starts it again.

    python -m sglang_farskip.serve.watchdog --url http://node0:30000/health_generate -- CMD...

Why a separate process: a crashed server ends on its own and its exit already restarts the
node, but a hung one (a rank stuck in a GPU call, a stopped process) keeps its container alive
and its peer waiting, and nothing inside the hung process can notice. This process only waits
and polls, so it stays responsive when the server does not.

The check is node 0's `/health_generate`, from every node: it generates one token through
every rank of both nodes, so a hang anywhere fails it (SGLang answers 503 after 20 s,
HEALTH_CHECK_TIMEOUT), and a node 1 whose node 0 is gone sees it fail too. It arms at the
first success: before that the server is starting (DeepSeek-V3 loads for many minutes), and
most start-up failures end by themselves (`--dist-timeout`); a start that hangs (stuck loading
or capturing graphs) is ended once `--start-timeout` passes without a first success. Once
armed, `--failures` checks in a row that fail (an error status, a refused connection, or no
answer within `--timeout`) end it too. Ending means killing the server's whole process group
and exiting with EXIT_UNHEALTHY. SIGTERM and SIGINT are passed
on to the server, whose own exit status this process then exits with.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_farskip.errors import ArgumentParser

logger = logging.getLogger("sglang_farskip.serve.watchdog")

# Distinct from the server's own statuses (a Python error is 1, a signal 128+N): the log and
# `docker inspect` then say that the watchdog ended it.
EXIT_UNHEALTHY = 70


def check(url: str, timeout_s: float) -> str | None:
    """None when `url` answers 200 within `timeout_s`, else what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"status {response.status}"
    except urllib.error.HTTPError as e:
        return f"status {e.code}"
    except (OSError, ValueError) as e:  # refused, reset, timed out (socket.timeout is OSError)
        return f"{type(e).__name__}: {e}"


def _exit_status(returncode: int) -> int:
    """The status a shell would give: 128 + N for a server ended by signal N."""
    status = 128 - returncode if returncode < 0 else returncode
    logger.info("watchdog: the server exited with status %d", status)
    return status


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL also ends a stopped (SIGSTOP) process
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In the server, before exec: the kernel kills it if this watchdog dies (SIGKILLed with
    its process group, as a supervisor may do), so that no server is left running unwatched.
    SGLang's own processes already die with the launcher (kill_itself_when_parent_died)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(cmd: list[str], url: str, *, interval_s: float, timeout_s: float,
              failures: int, start_timeout_s: float = 0.0) -> int:
    # Its own process group, so that the whole tree (SGLang's schedulers, detokenizer) can be
    # killed at once; the launcher's SIGTERM handling stops the tree itself on a normal stop.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)

    stopping = []  # set once a stop signal was passed on: the server's shutdown is no hang

    def forward(signum, _frame):
        logger.info("watchdog: passing signal %d to the server", signum)
        stopping.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)

    armed, failed = False, 0
    start_deadline = time.monotonic() + start_timeout_s if start_timeout_s else None
    logger.info("watchdog: started the server (pid %d); checking %s every %.0f s, "
                "it arms at the first answer", proc.pid, url, interval_s)
    while True:
        deadline = time.monotonic() + interval_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return _exit_status(proc.returncode)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if stopping:
            continue
        problem = check(url, timeout_s)
        if proc.poll() is not None or stopping:
            continue  # it exited (or was told to) during the check: report its own status
        if problem is None:
            if not armed:
                logger.info("watchdog: %s answered; armed (%d failed checks in a row end the "
                            "server)", url, failures)
            armed, failed = True, 0
            continue
        if not armed:
            if start_deadline is not None and time.monotonic() > start_deadline:
                logger.error("watchdog: %s has not answered within %.0f s of the start "
                             "(--start-timeout; last: %s); killing the server (process group "
                             "%d) so that it is restarted; exit %d", url, start_timeout_s,
                             problem, proc.pid, EXIT_UNHEALTHY)
                _kill_group(proc)
                return EXIT_UNHEALTHY
            continue
        failed += 1
        logger.warning("watchdog: %s failed (%d of %d): %s", url, failed, failures, problem)
        if failed >= failures:
            logger.error("watchdog: the deployment stopped answering; killing the server "
                         "(process group %d) so that it is restarted; exit %d",
                         proc.pid, EXIT_UNHEALTHY)
            _kill_group(proc)
            return EXIT_UNHEALTHY


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m sglang_farskip.serve.watchdog",
        description="Run CMD; kill it and exit %d once URL has failed FAILURES checks in a "
                    "row after its first success." % EXIT_UNHEALTHY)
    parser.add_argument("--url", required=True, help="node 0's /health_generate")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between checks")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a check may take (above SGLang's own 20 s)")
    parser.add_argument("--failures", type=int, default=3,
                        help="failed checks in a row that end the server")
    parser.add_argument("--start-timeout", type=float, default=0.0,
                        help="seconds the server may take to answer the first time (0: no limit)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no server command: give it after --")
    for name in ("interval", "timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be above 0")
    if args.start_timeout < 0:
        parser.error("--start-timeout must be 0 (no limit) or more")
    if args.failures < 1:
        parser.error("--failures must be 1 or more")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s] %(message)s")
    return supervise(cmd, args.url, interval_s=args.interval, timeout_s=args.timeout,
                     failures=args.failures, start_timeout_s=args.start_timeout)


if __name__ == "__main__":
    sys.exit(main())
