"""Soak a deployment behind SGLang's router while one of its server processes fails.

    python bench/router_soak.py --layout pd --fault prefill --duration 150 --request-timeout 60
    python bench/router_soak.py --layout pd --nodes 2 --fault decode1 --hang
    python bench/router_soak.py --layout replicas --nodes 2 --fault a1

Layouts, each on the built-in demo model on this machine, every server process under the
deployment's watchdog (serve/watchdog.py, which ends a crashed or hung server and starts it
again; a node rank above 0 watches its node 0's health, as deploy/entrypoint.sh has it):
- `pd`: a prefill server `prefill` (TP=1) and a decode server at TP=--nodes as --nodes node
  processes `decode0`, `decode1`, ..., the router in PD mode;
- `replicas`: replica `a` at TP=--nodes as node processes `a0`, `a1`, ... and replica `b`
  (TP=1, process `b`), the router in plain mode with the replica flags (testbed/router.py).
Then bench/soak.py's constant non-streaming load runs through the router and, --fault-at seconds
in, the whole process tree of the --fault process is SIGKILLed (`--hang`: SIGSTOPped; `none`: no
fault, a plain soak). soak.py's report follows: successes and failures per second, outage,
recovery, longest request, and its checks; then when the router listed a worker unhealthy and
every worker healthy again (the deployment healed by itself). The exit status is non-zero when
a check of soak.py failed or a worker was still unhealthy --heal-timeout after the load. docs/pd.md, "Failures", has what it
measured here and why requests in flight end as they do.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

from sglang_farskip.testbed import REPO, pd
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.router import Router
from sglang_farskip.testbed.servers import ONE_THREAD, side_by_side

# A restart as soon as a check fails twice, 1 s after the crash: the deployment's defaults
# (deploy/entrypoint.sh) wait minutes, which a short soak would spend waiting.
WATCHDOG = ["--interval", "2", "--timeout", "10", "--failures", "2", "--backoff", "1", "--restarts", "3"]
NODE_DIST_TIMEOUT_S = "60"  # a node whose peer never comes back fails (and is restarted), not hangs


def processes(layout: str, nodes: int) -> list[str]:
    """The layout's server processes (--fault's choices)."""
    if layout == "pd":
        return ["prefill", *(f"decode{rank}" for rank in range(nodes))]
    replica_a = [f"a{rank}" for rank in range(nodes)] if nodes > 1 else ["a"]
    return [*replica_a, "b"]


def replica_runs(name: str, nodes: int) -> dict:
    """side_by_side runs for one demo replica at TP=`nodes`: `name` alone, or node processes
    `name0`, `name1`, ..."""
    if nodes == 1:
        return {name: dict(args=[], env=ONE_THREAD)}
    addr = f"127.0.0.1:{free_port()}"
    return {f"{name}{rank}": dict(args=["--tp", str(nodes), "--nnodes", str(nodes), "--node-rank", str(rank),
                                        "--dist-init-addr", addr, "--dist-timeout", NODE_DIST_TIMEOUT_S],
                                  env=ONE_THREAD)
            for rank in range(nodes)}


def watched(runs: dict, logs: Path) -> dict:
    """Every run under the watchdog; node ranks above 0 watch their node 0 (its port fixed
    here, so that they know it before it starts)."""
    for name, run in runs.items():
        run.update(watchdog=WATCHDOG, log_path=logs / f"router-soak-{name.replace('/', '-')}.log")
        if name[-1:].isdigit() and name[-1] != "0":
            node0 = runs[name[:-1] + "0"]
            node0.setdefault("port", free_port())
            run["watch_url"] = f"http://127.0.0.1:{node0['port']}"
    return runs


@contextlib.contextmanager
def deployment(layout: str, nodes: int, logs: Path):
    """({process name: Server}, the router), both up."""
    if layout == "pd":
        runs, bootstrap = pd.pd_runs("pd", [], decode=["--tp", str(nodes)] if nodes > 1 else [],
                                     decode_nodes=nodes, env=ONE_THREAD)
        runs = {name.removeprefix("pd/"): run for name, run in runs.items()}
        serving = [name for name in runs if name in ("prefill", "decode0")]
    else:
        runs = {**replica_runs("a", nodes), **replica_runs("b", 1)}
        serving = [name for name in runs if not name[-1:].isdigit() or name.endswith("0")]
    with side_by_side(watched(runs, logs), serving=serving) as servers:
        if layout == "pd":
            router = Router([(servers["prefill"].url, bootstrap)], [servers["decode0"].url],
                            log_path=logs / "router-soak-router.log")
        else:
            router = Router(workers=[servers[name].url for name in serving], log_path=logs / "router-soak-router.log")
        with router:
            router.wait_ready()
            yield servers, router


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=["pd", "replicas"], required=True)
    p.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                   help="node processes of the decode server (pd) or of replica a (replicas)")
    p.add_argument("--fault", required=True,
                   help="the process whose tree fails: pd: prefill, decode0, decode1 (--nodes 2); "
                        "replicas: a0, a1 (--nodes 2), a (--nodes 1), b; or none")
    p.add_argument("--hang", action="store_true", help="SIGSTOP the victim instead of SIGKILL")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    p.add_argument("--until-settled", type=float, default=0.0, metavar="MAX_S",
                   help="soak.py's: after --duration, go on up to MAX_S s in all until the run "
                        "ends with --settle s of success")
    p.add_argument("--fault-at", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=60.0, help="the clients' timeout")
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8,
                   help="distinct prompts (soak.py): the router's cache-aware policy then sends "
                        "load to every worker, the failing one included")
    p.add_argument("--logs", type=Path, default=Path("/tmp"), help="where the processes' logs go")
    p.add_argument("--out", help="soak.py's JSON result")
    p.add_argument("--heal-timeout", type=float, default=300.0,
                   help="after the load, how long every worker may take to be healthy again")
    args = p.parse_args(argv)
    names = processes(args.layout, args.nodes)
    if args.fault not in (*names, "none"):
        p.error(f"--fault {args.fault}: layout {args.layout} with --nodes {args.nodes} has "
                f"{', '.join(names)} (or none)")

    with deployment(args.layout, args.nodes, args.logs) as (servers, router):
        fault = []
        if args.fault != "none":
            fault = ["--fault-at", str(args.fault_at), "--fault-cmd",
                     f"kill -{'STOP' if args.hang else 'KILL'} -- -{servers[args.fault].server_pid()}"]
        cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--url", router.url,
               "--duration", str(args.duration), "--concurrency", str(args.concurrency), *fault,
               "--request-timeout", str(args.request_timeout), "--settle", str(args.settle),
               "--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts),
               "--until-settled", str(args.until_settled),
               *(["--out", args.out] if args.out else [])]
        watch = HealthWatch(router, time.monotonic() + args.fault_at)
        status = subprocess.run(cmd).returncode
        healed = watch.healed(args.heal_timeout)
        print(watch.report())
        if not healed:
            print(f"NOT healed: a worker was still unhealthy {args.heal_timeout:.0f} s after the load ended: "
                  f"{router.workers()}")
        print(f"logs: {args.logs}/router-soak-*.log")
        return status or (0 if healed else 1)


class HealthWatch(threading.Thread):
    """The router's view of the deployment, asked every second from the start of the load: when
    it first listed a worker unhealthy and when it listed every worker healthy again after that
    (seconds after the fault)."""

    def __init__(self, router: Router, fault_at: float):
        super().__init__(daemon=True)
        self.router, self.fault_at = router, fault_at
        self.down: float | None = None
        self.up: float | None = None
        self.silent: float | None = None  # when the router itself first failed to answer
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                workers = self.router.workers()
                healthy = len(workers) == self.router.expected and all(w["is_healthy"] for w in workers)
            except (OSError, ValueError, KeyError):
                if self.silent is None:
                    self.silent = time.monotonic() - self.fault_at
            else:
                now = time.monotonic() - self.fault_at
                if not healthy and self.down is None:
                    self.down = now
                elif healthy and self.down is not None and self.up is None:
                    self.up = now
            self.done.wait(1.0)

    def healed(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every worker to be healthy again (at once if it is)."""
        deadline = time.monotonic() + timeout
        while self.down is not None and self.up is None and time.monotonic() < deadline:
            time.sleep(1)
        self.done.set()
        return self.down is None or self.up is not None

    def report(self) -> str:
        silent = ("" if self.silent is None else
                  f"; the router itself failed to answer {self.silent:.1f} s after the fault")
        if self.down is None:
            return "router: never listed a worker unhealthy" + silent
        if self.up is None:
            return f"router: a worker unhealthy from {self.down:.1f} s after the fault, and still" + silent
        return (f"router: a worker unhealthy from {self.down:.1f} s to {self.up:.1f} s after the "
                f"fault (healed)" + silent)


if __name__ == "__main__":
    sys.exit(main())
