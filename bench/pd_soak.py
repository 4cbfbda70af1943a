"""Soak a prefill/decode deployment through SGLang's router while one of its servers crashes.

    python bench/pd_soak.py --fault prefill --duration 150 --request-timeout 60

It starts the built-in demo model as a prefill server and a decode server (TP=1 each, on this
machine), each under the deployment's watchdog (serve/watchdog.py, which starts a crashed
server again), and the router in PD mode. Then it runs bench/soak.py's constant load through
the router and, --fault-at seconds in, SIGKILLs the whole process tree of the prefill or the
decode server (`--fault none`: no fault, a plain soak). soak.py's report follows: successes and
failures per second, outage, recovery, longest request, and its checks (its exit status is this
script's). docs/pd.md, "Failures", has what it measured here and why requests in flight end as
they do.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from pathlib import Path

from sglang_farskip.testbed import REPO, pd
from sglang_farskip.testbed.servers import ONE_THREAD, side_by_side

# A restart as soon as a check fails twice, 1 s after the crash: the deployment's defaults
# (deploy/entrypoint.sh) wait minutes, which a short soak would spend waiting.
WATCHDOG = ["--interval", "2", "--timeout", "10", "--failures", "2", "--backoff", "1", "--restarts", "3"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fault", choices=["prefill", "decode", "none"], required=True)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    p.add_argument("--fault-at", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=60.0, help="the clients' timeout")
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--logs", type=Path, default=Path("/tmp"), help="where the servers' logs go")
    p.add_argument("--out", help="soak.py's JSON result")
    args = p.parse_args(argv)

    runs, bootstrap = pd.pd_runs("pd", [], env=ONE_THREAD)
    for name, run in runs.items():  # "pd/prefill", "pd/decode0"
        run.update(watchdog=WATCHDOG, log_path=args.logs / f"pd-soak-{name.split('/')[1]}.log")
    with side_by_side(runs) as servers, contextlib.ExitStack() as stack:
        router = stack.enter_context(pd.router(servers, "pd", bootstrap, log_path=args.logs / "pd-soak-router.log"))
        router.wait_ready()
        fault = []
        if args.fault != "none":
            victim = "prefill" if args.fault == "prefill" else "decode0"
            fault = ["--fault-at", str(args.fault_at),
                     "--fault-cmd", f"kill -KILL -- -{servers['pd/' + victim].server_pid()}"]
        cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--url", router.url,
               "--duration", str(args.duration), "--concurrency", str(args.concurrency), *fault,
               "--request-timeout", str(args.request_timeout), "--settle", str(args.settle),
               "--max-tokens", str(args.max_tokens), *(["--out", args.out] if args.out else [])]
        status = subprocess.run(cmd).returncode
        print(f"logs: {args.logs}/pd-soak-{{prefill,decode0,router}}.log")
        return status


if __name__ == "__main__":
    sys.exit(main())
