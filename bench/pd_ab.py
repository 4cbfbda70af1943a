#!/usr/bin/env python3
"""Prefill/decode disaggregation, measured: FarSkip PD vs stock PD vs a colocated FarSkip
server on the same weights, side by side in one load run (bench/run_load.py, three targets).

    python bench/pd_ab.py --concurrency 1,4 --duration 20 --out /tmp/pd-ab

Targets, every server through our launcher with `--enable-metrics`, on the built-in demo model
(the launcher's `--demo deepseek-v3`, its default without --model-path):
- farskip_pd: SGLang's router in PD mode over a prefill server (`--prefill-tp`, one node) and
  a decode server (`--decode-tp` as `--decode-nodes` node processes), both FarSkip `overlap`;
- stock_pd:   the same deployment with `--farskip-mode off` on both servers (SGLang's
  DeepSeek-V3 wiring);
- colocated:  one FarSkip `overlap` server doing both phases (`--colocated-tp`, one node).
Ratios in the report are farskip_pd / each other. For the two routers the report names which
server each figure comes from (TTFT: the prefill phase, ITL: the decode phase) with each one's
own histograms. Every process gets one OpenMP thread (a rank per core; more threads than cores
made TP=2 about 3x slower here) and --sleep-on-idle (the launcher's CPU default), so the idle
deployments leave the cores to the one under load, and runs SGLang's CPU MoE router eagerly
(testbed.servers.EAGER: compiled, it recompiles at each new batch size, a stall of a second or
more inside a level: seen as a 1.5 s ITL in a PD smoke run). The deployments start one after the other
(all at once, a dozen processes importing SGLang on 2 cores, is slower than in turn). Output:
run_load's report in OUT/load, the servers' and routers' logs in OUT/logs.

`--quick` (a smoke run: every layout TP=1, one level of a few requests) checks the script and
the harness end to end in about two minutes; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from datetime import datetime
from pathlib import Path

import run_load  # bench/run_load.py, beside this script

from sglang_farskip.testbed import REPO, pd
from sglang_farskip.testbed.servers import ONE_THREAD, side_by_side

SERVER_FLAGS = ["--enable-metrics"]
START_TIMEOUT_S = 600  # a two-node decode server beside a prefill server, on 2 cores


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill server's TP size, one node (default 1)")
    p.add_argument("--decode-tp", type=int, default=2, help="decode server's TP size (default 2)")
    p.add_argument("--decode-nodes", type=int, default=2,
                   help="node processes the decode server's ranks are spread over (default 2)")
    p.add_argument("--colocated-tp", type=int, default=2, help="the colocated server's TP size (default 2)")
    p.add_argument("--concurrency", default="1,4")
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--duration", type=int, help="seconds per level and target (default 20)")
    how_long.add_argument("--requests", type=int, help="requests per level and target, instead of --duration")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: TP=1 everywhere, one level of 3 requests, short prompts")
    p.add_argument("--out", type=Path, default=None, help="default bench-results/pd-ab-<time>")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill_tp = args.decode_tp = args.decode_nodes = args.colocated_tp = 1
        args.concurrency, args.requests, args.duration = "2", 3, None
        args.max_tokens, args.input_len = 8, 32
    elif args.requests is None and args.duration is None:
        args.duration = 20
    if args.decode_tp % args.decode_nodes:
        p.error(f"--decode-tp {args.decode_tp} does not split over --decode-nodes {args.decode_nodes}")
    return args


def tp(size: int) -> list[str]:
    return ["--tp", str(size)]


def start_pd(stack: contextlib.ExitStack, name: str, mode: str, args, logs: Path) -> str:
    """One PD deployment and its router, ready; the router's URL."""
    runs, bootstrap = pd.pd_runs(name, [*SERVER_FLAGS, "--farskip-mode", mode], prefill=tp(args.prefill_tp),
                                 decode=tp(args.decode_tp), decode_nodes=args.decode_nodes, env=ONE_THREAD)
    for run_name, kwargs in runs.items():
        kwargs["log_path"] = logs / f"{run_name.replace('/', '-')}.log"
    print(f"starting {name}: {', '.join(runs)}", file=sys.stderr, flush=True)
    servers = stack.enter_context(side_by_side(runs, timeout=START_TIMEOUT_S, serving=pd.serving(runs)))
    # A timed request is never cut and sent again (the tests' 20 s would under heavy load).
    router = stack.enter_context(pd.router(servers, name, bootstrap, log_path=logs / f"{name}-router.log",
                                           extra=["--request-timeout-secs", "600"]))
    return router.wait_ready().url


def start_colocated(stack: contextlib.ExitStack, args, logs: Path) -> str:
    runs = {"colocated": dict(args=[*SERVER_FLAGS, "--farskip-mode", "overlap", *tp(args.colocated_tp)],
                              env=ONE_THREAD, log_path=logs / "colocated.log")}
    print("starting colocated", file=sys.stderr, flush=True)
    return stack.enter_context(side_by_side(runs, timeout=START_TIMEOUT_S))["colocated"].url


def main(argv=None) -> int:
    args = parse_args(argv)
    out = (args.out or REPO / "bench-results" / f"pd-ab-{datetime.now():%Y%m%d-%H%M%S}").absolute()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    layout = (f"prefill TP={args.prefill_tp}, decode TP={args.decode_tp} on {args.decode_nodes} node process(es), "
              f"colocated TP={args.colocated_tp}")
    with contextlib.ExitStack() as stack:  # every server and router killed on the way out
        try:
            urls = {"farskip_pd": start_pd(stack, "farskip_pd", "overlap", args, logs),
                    "stock_pd": start_pd(stack, "stock_pd", "off", args, logs),
                    "colocated": start_colocated(stack, args, logs)}
        except (RuntimeError, TimeoutError) as e:
            print(f"error: a deployment did not start (logs in {logs}): {e}", file=sys.stderr)
            return 2
        targets = [arg for label, url in urls.items() for arg in ("--target", f"{label}={url}")]
        span = ["--duration", str(args.duration)] if args.duration is not None else ["--requests", str(args.requests)]
        # SGLang's native /generate for all three: the router's /v1/completions takes no token ids.
        return run_load.main([*targets, "--endpoint", "generate", "--concurrency", args.concurrency, *span,
                              "--max-tokens", str(args.max_tokens), "--input-len", str(args.input_len),
                              "--out", str(out / "load"),
                              "--title", f"PD with FarSkip: {layout}"])


if __name__ == "__main__":
    sys.exit(main())
