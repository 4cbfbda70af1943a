"""Run the server, end it when the deployment stops answering, and start it again, a bounded
number of times, so that a node heals without anyone logged in and never loops in silence.

    python -m sglang_farskip.serve.watchdog --url http://node0:30000/health_generate \
        --up-url http://node0:30000/health -- CMD...

Why a separate process: a crashed server ends on its own, but a hung one (a rank stuck in a
GPU call, a stopped process) keeps its node alive and its peer waiting, and nothing inside the
hung process can notice. This process only waits, polls and starts, so it stays responsive
when the server does not.

The check is node 0's `/health_generate`, from every node: it generates one token through
every rank of both nodes, so a hang anywhere fails it (SGLang answers 503 after 20 s,
HEALTH_CHECK_TIMEOUT), and a node 1 whose node 0 is gone or restarted sees it fail too.

Arming. Before the deployment is up, failed checks mean "still starting" (DeepSeek-V3 loads
for many minutes) and end nothing. The watchdog arms at whichever comes first: its own first
successful check, or node 0's `--up-url` (`/health`) answering 200. The second is what lets a
node learn that the deployment is up without a success of its own: node 0's HTTP server opens
only once every rank of both nodes has loaded and joined, and `/health` answers 200 only once
the warm-up request has generated through all of them (SGLang's ServerStatus.Up; the entrypoint
sets SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 so that `/health` reports that status and does
not generate itself). `/health` is asked first while unarmed and needs no scheduler, so a hang
or crash of either node's ranks right after the first answer, the first second included, is
still seen: before this, node 1's watchdog armed only at its own first success, and a node 1
hung before that waited for the start timeout (1 h) while node 0 restarted alone.

Bound: once node 0's `/health` first answers 200, every watchdog is armed within INTERVAL plus
one check, and a hang or crash anywhere from then on ends the server on every node within
(FAILURES + 1) x (INTERVAL + TIMEOUT) seconds: 160 s with the entrypoint's defaults (10, 30, 3);
the restart then costs one two-node start. A start that never gets there (stuck loading or
capturing graphs) is ended once `--start-timeout` passes.

Ending means killing the server's whole process group (EXIT_UNHEALTHY is logged). The server
is then started again after a back-off (`--backoff` seconds, doubling each time, at most
BACKOFF_CAP_S), unless:
- it exited 0 (a clean stop) or was told to stop (SIGTERM/SIGINT are passed on): this process
  exits with the server's own status;
- it exited EXIT_USER_ERROR (2: a setting it refused, `sglang_farskip.errors`): a restart would
  fail the same way, so this process exits 2 at once;
- `--restarts` starts in a row have failed without the deployment coming up (a crash loop):
  one `error:` line, and this process exits EXIT_GAVE_UP, which the node's supervisor must
  leave stopped (compose `restart: "no"`, docs/deploy.md). A start that came up resets the count.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_farskip.errors import EXIT_USER_ERROR, ArgumentParser

logger = logging.getLogger("sglang_farskip.serve.watchdog")

# Distinct from the server's own statuses (a Python error is 1, a signal 128+N): the log and
# `docker inspect` then say that the watchdog ended it.
EXIT_UNHEALTHY = 70
# A crash loop given up: the one status the node's supervisor must not restart (nor 2).
EXIT_GAVE_UP = 71
BACKOFF_CAP_S = 300.0


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


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the process group that `proc` leads (started with start_new_session).

    Once proc has been reaped (`returncode` set) its pid is free, and the kernel hands it out
    again once its counter goes round pid_max (32768 on many hosts; a long-lived container
    does). A group of that number may then be another program's, led by the new process with
    that pid, and a plain killpg would end that program. So after proc's exit only a group
    without its leader is signalled: what proc itself left behind."""
    if proc.returncode is not None and os.path.exists(f"/proc/{proc.pid}"):
        return  # that number is another process's now
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def _kill_group(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)  # SIGKILL also ends a stopped (SIGSTOP) process
    proc.wait()


def _die_with_parent() -> None:
    """In the server, before exec: the kernel kills it if this watchdog dies (SIGKILLed with
    its process group, as a supervisor may do), so that no server is left running unwatched.
    SGLang's own processes already die with the launcher (kill_itself_when_parent_died)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_once(cmd: list[str], url: str, up_url: str | None, stopping: list, procs: list,
              keys: dict[str, str], *, interval_s: float, timeout_s: float, failures: int,
              start_timeout_s: float) -> tuple[int, bool]:
    """One start of the server: (its exit status, or EXIT_UNHEALTHY when ended here; whether
    the deployment came up meanwhile)."""
    # Its own process group, so that the whole tree (SGLang's schedulers, detokenizer) can be
    # killed at once; the launcher's SIGTERM handling stops the tree itself on a normal stop.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                            env={**os.environ, **keys})
    procs[:] = [proc]
    armed, failed = False, 0
    start_deadline = time.monotonic() + start_timeout_s if start_timeout_s else None
    logger.info("watchdog: started the server (pid %d); checking %s every %.0f s, "
                "it arms once the deployment is up", proc.pid, url, interval_s)
    while True:
        deadline = time.monotonic() + interval_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return _exit_status(proc.returncode), armed
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if stopping:
            continue
        if not armed and up_url is not None and check(up_url, min(timeout_s, 10.0)) is None:
            # Node 0 is up (its warm-up generated through every rank): from now on a failure
            # is a fault, even before this node's own first success.
            armed = True
            logger.info("watchdog: %s answered: the deployment is up; armed (%d failed checks "
                        "in a row end the server)", up_url, failures)
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
                             "%d)", url, start_timeout_s, problem, proc.pid)
                _kill_group(proc)
                return EXIT_UNHEALTHY, armed
            continue
        failed += 1
        logger.warning("watchdog: %s failed (%d of %d): %s", url, failed, failures, problem)
        if failed >= failures:
            logger.error("watchdog: the deployment stopped answering; killing the server "
                         "(process group %d); exit %d", proc.pid, EXIT_UNHEALTHY)
            _kill_group(proc)
            return EXIT_UNHEALTHY, armed


def _keys_out_of_environment() -> dict[str, str]:
    """The API keys this process was given in its environment, now only in its memory: each
    start of the server gets them in its own environment, which the launcher clears at once
    (serve/redact.py), while this process lives as long as the deployment. (The entrypoint
    gives it key files' paths instead; this covers any other way of starting it.)"""
    from sglang_farskip.serve.redact import KEY_VARIABLES, take_from_environment

    keys = {name: take_from_environment(name) for name in KEY_VARIABLES.values()}
    return {name: key for name, key in keys.items() if key is not None}


def supervise(cmd: list[str], url: str, *, interval_s: float, timeout_s: float,
              failures: int, start_timeout_s: float = 0.0, up_url: str | None = None,
              restarts: int = 0, backoff_s: float = 10.0) -> int:
    stopping: list = []  # set once a stop signal was passed on: the server's shutdown is no hang
    procs: list = []  # the server now running

    def forward(signum, _frame):
        logger.info("watchdog: passing signal %d to the server", signum)
        stopping.append(signum)
        for proc in procs:  # the last server, maybe exited (a restart's back-off)
            signal_group(proc, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    keys = _keys_out_of_environment()

    failed_starts = 0
    while True:
        status, came_up = _run_once(cmd, url, up_url, stopping, procs, keys, interval_s=interval_s,
                                    timeout_s=timeout_s, failures=failures,
                                    start_timeout_s=start_timeout_s)
        if stopping or status == 0:
            return status
        if status == EXIT_USER_ERROR:
            logger.error("watchdog: the server refused its settings (exit %d): not restarting",
                         status)
            return status
        if restarts == 0:
            return status  # no restarts here: the node's supervisor restarts it
        failed_starts = 0 if came_up else failed_starts + 1
        if failed_starts > restarts:
            # The one line an operator looks for: stderr, so the container log and `kubectl
            # logs` end with it (and Kubernetes' terminationMessage, FallbackToLogsOnError).
            print(f"error: the server failed {failed_starts} starts in a row without the "
                  f"deployment coming up (last exit status {status}); giving up after "
                  f"{restarts} restarts (WATCHDOG_RESTARTS), exit {EXIT_GAVE_UP}: read the "
                  f"log above on both nodes, fix the cause, then start the node again",
                  file=sys.stderr, flush=True)
            return EXIT_GAVE_UP
        delay = min(BACKOFF_CAP_S, backoff_s * 2 ** max(0, failed_starts - 1))
        logger.warning("watchdog: the server ended (status %d); starting it again in %g s "
                       "(failed start %d of %d allowed in a row)", status, delay,
                       failed_starts, restarts)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not stopping:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if stopping:
            return 128 + stopping[0]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m sglang_farskip.serve.watchdog",
        description="Run CMD; kill it once URL has failed FAILURES checks in a row after the "
                    "deployment came up, and start it again up to RESTARTS times in a row "
                    "(exit %d then)." % EXIT_GAVE_UP)
    parser.add_argument("--url", required=True, help="node 0's /health_generate")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between checks")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a check may take (above SGLang's own 20 s)")
    parser.add_argument("--failures", type=int, default=3,
                        help="failed checks in a row that end the server")
    parser.add_argument("--start-timeout", type=float, default=0.0,
                        help="seconds the server may take to answer the first time (0: no limit)")
    parser.add_argument("--up-url", default=None,
                        help="node 0's /health: a 200 there arms the watchdog (the deployment "
                             "is up) before its own first success")
    parser.add_argument("--restarts", type=int, default=0,
                        help="failed starts in a row restarted before giving up (0: none)")
    parser.add_argument("--backoff", type=float, default=10.0,
                        help="seconds before the first restart, doubling after each failed "
                             "start (at most %.0f)" % BACKOFF_CAP_S)
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
    if args.restarts < 0 or args.backoff < 0:
        parser.error("--restarts and --backoff must be 0 or more")
    if args.failures < 1:
        parser.error("--failures must be 1 or more")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s] %(message)s")
    return supervise(cmd, args.url, interval_s=args.interval, timeout_s=args.timeout,
                     failures=args.failures, start_timeout_s=args.start_timeout,
                     up_url=args.up_url, restarts=args.restarts, backoff_s=args.backoff)


if __name__ == "__main__":
    sys.exit(main())
