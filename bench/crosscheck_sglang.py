#!/usr/bin/env python3
"""Check the harness against sglang.benchmark.serving on the same server and workload.

    python bench/crosscheck_sglang.py --url http://127.0.0.1:30000 --concurrency 1 --requests 32

Workload for both tools: random token-id prompts of exactly --input-len tokens (sglang:
`--dataset-name random-ids --tokenize-prompt --random-range-ratio 1`, which needs its native
backend, so the harness uses --endpoint generate), --max-tokens output tokens, temperature 0,
ignore_eos, a closed loop of --concurrency requests in flight.

Two ways to share the server fairly (--mode):
- alternate (default): the tools take turns, --rounds times each, alternating who goes first,
  and their samples are pooled, so slow drift of the machine falls on both;
- concurrent: both load the server at the same moment and only harness requests inside
  sglang's main run are compared. No drift, but the tools then race for the server's next
  prefill: when their requests run in lockstep, whichever client submits a millisecond sooner
  gets the earlier prefill, which biases TTFT (ITL, sharing every decode batch, stays fair).

A median agrees when within --rel-tol of sglang's or within --abs-tol-ms of it (justified in
bench/README.md, "Agreement with sglang.benchmark.serving"). Exit 0: TTFT and ITL medians
agree; 1: one disagrees; 3: inconclusive (outside the tolerance, but within sampling noise, or
the server's own histograms moved just as much between the runs); 2: bad input or a tool
failed. The server's /metrics histograms are read around every run as a third, independent
view: each tool's client numbers against the server's own are compared too (drift-free).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from sglang_farskip.loadtest import loadstats, servermetrics
from sglang_farskip.loadtest.crosscheck import median_ms, compare
from sglang_farskip.loadtest.servers import BenchError, check_reachable, server_facts, warm_up

HERE = Path(__file__).resolve().parent
MAIN_RUN_MARK = "Starting main benchmark run"  # printed by sglang.benchmark.serving after warm-up


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--tokenizer", help="checkpoint dir (default: the server's tokenizer path)")
    p.add_argument("--mode", choices=["alternate", "concurrent"], default="alternate")
    p.add_argument("--rounds", type=int, default=2, help="alternate mode: runs per tool")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight per tool")
    p.add_argument("--requests", type=int, default=32, help="requests per run of a tool")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rel-tol", type=float, default=0.10, help="relative tolerance on medians (0.10 = 10%%)")
    p.add_argument("--abs-tol-ms", type=float, default=2.0, help="absolute tolerance on medians, ms")
    p.add_argument("--timeout", type=int, default=600, help="give up after this many seconds")
    p.add_argument("--out", default="bench-results/crosscheck")
    args = p.parse_args(argv)
    for name in ("concurrency", "requests", "input_len", "rounds"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        raise BenchError("--max-tokens must be >= 2: with one output token there is no inter-token latency")
    args.url = args.url.rstrip("/")
    return args


# ---------------------------------------------------------------- the two tools
def harness_cmd(args, tokenizer: str, out: Path, seed: int, *, requests: int | None) -> list[str]:
    how_long = ["--requests", str(requests)] if requests else ["--duration", str(args.timeout)]
    return [sys.executable, str(HERE / "run_load.py"), "--url", args.url, "--endpoint", "generate",
            "--concurrency", str(args.concurrency), *how_long, "--input-len", str(args.input_len),
            "--max-tokens", str(args.max_tokens), "--tokenizer", tokenizer, "--warmup", "0",
            "--seed", str(seed), "--out", str(out)]


def sglang_cmd(args, tokenizer: str, result: Path, seed: int) -> list[str]:
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", args.url,
            "--dataset-name", "random-ids", "--tokenize-prompt", "--tokenizer", tokenizer, "--model", tokenizer,
            "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_tokens),
            "--random-range-ratio", "1", "--request-rate", "inf", "--seed", str(seed),
            "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(result), "--output-details"]


def harness_side(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["ok"]]
    raw = loadstats.samples(recs)
    return {"requests": len(recs), "failed": len(recs) - len(ok), "ttft": raw["ttft"],
            "itl_by_request": [r["itl"] for r in ok],
            "tpot_p50_ms": [median_ms(raw["tpot"])], "e2e_p50_ms": [median_ms(raw["e2e"])]}


def sglang_side(result: Path) -> dict:
    d = json.loads(result.read_text().splitlines()[-1])
    ok = [i for i, e in enumerate(d["errors"]) if not e]
    # Its details hold per-request TTFTs and ITLs but no per-request E2E: TPOT and E2E
    # medians come from its own summary.
    return {"requests": len(d["errors"]), "failed": len(d["errors"]) - len(ok),
            "ttft": [d["ttfts"][i] for i in ok], "itl_by_request": [d["itls"][i] for i in ok],
            "tpot_p50_ms": [d["median_tpot_ms"]], "e2e_p50_ms": [d["median_e2e_latency_ms"]]}


def _pool(sides: list[dict]) -> dict:
    return {k: (sum(s[k] for s in sides) if isinstance(sides[0][k], int) else [x for s in sides for x in s[k]])
            for k in sides[0]}


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def _run(cmd: list[str], log: Path, what: str, timeout: float) -> None:
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(f"{what} still running after --timeout; {log} ends:\n{_tail(log)}") from None
    if rc != 0:
        raise BenchError(f"{what} failed (exit {rc}); {log} ends:\n{_tail(log)}")


# ---------------------------------------------------------------- the two modes
def run_alternate(args, tokenizer: str, out: Path) -> dict:
    deadline = time.monotonic() + args.timeout
    sides: dict[str, list] = {"harness": [], "sglang": []}
    runs = []
    for rnd in range(args.rounds):
        for tool in (("harness", "sglang") if rnd % 2 == 0 else ("sglang", "harness")):
            before, t0 = servermetrics.scrape(args.url), time.monotonic()
            left = max(1.0, deadline - t0)
            if tool == "harness":
                d = out / f"harness-r{rnd}"
                _run(harness_cmd(args, tokenizer, d, 100 + rnd, requests=args.requests),
                     out / f"harness-r{rnd}.log", "the harness (bench/run_load.py)", left)
                (level,) = json.loads((d / "results.json").read_text())["levels"]
                side = harness_side(loadstats.read_records(d / level["records"]))
            else:
                result = out / f"sglang-r{rnd}.jsonl"
                result.unlink(missing_ok=True)
                _run(sglang_cmd(args, tokenizer, result, 100 + rnd), out / f"sglang-r{rnd}.log",
                     "sglang.benchmark.serving", left)
                side = sglang_side(result)
            sides[tool].append(side)
            runs.append(_run_summary(tool, rnd, side, time.monotonic() - t0, before, args.url))
    return {"harness": _pool(sides["harness"]), "sglang": _pool(sides["sglang"]), "runs": runs}


def run_concurrent(args, tokenizer: str, out: Path) -> dict:
    deadline = time.monotonic() + args.timeout
    harness_dir, harness_log, sglang_log = out / "harness", out / "harness.log", out / "sglang.log"
    result = out / "sglang.jsonl"
    result.unlink(missing_ok=True)
    records = harness_dir / "requests" / f"run-c{args.concurrency}.jsonl"
    records.unlink(missing_ok=True)
    with open(harness_log, "w") as hl, open(sglang_log, "w") as sl:
        harness = subprocess.Popen(harness_cmd(args, tokenizer, harness_dir, 100, requests=None),
                                   stdout=hl, stderr=subprocess.STDOUT)
        sglang = None
        try:
            # Steady state first: every harness user has finished a request.
            _wait(lambda: _record_count(records) >= args.concurrency, harness, deadline,
                  "the harness never reached steady state", harness_log)
            before = servermetrics.scrape(args.url)
            sglang = subprocess.Popen(sglang_cmd(args, tokenizer, result, 100), stdout=sl, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})  # see the mark at once
            _wait(lambda: MAIN_RUN_MARK in sglang_log.read_text(errors="replace"), sglang, deadline,
                  "sglang.benchmark.serving did not start its main run", sglang_log)
            window_start = time.time()
            _wait(lambda: sglang.poll() is not None, harness, deadline, "the harness stopped during sglang's run",
                  harness_log)
            window_end = time.time()
            if sglang.returncode != 0:
                raise BenchError(f"sglang.benchmark.serving failed (exit {sglang.returncode}); "
                                 f"{sglang_log} ends:\n{_tail(sglang_log)}")
            harness.send_signal(signal.SIGTERM)  # graceful: run_load lets requests in flight finish
            harness.wait(timeout=max(30.0, deadline - time.monotonic()))
        finally:
            for proc in (harness, sglang):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    if harness.returncode != 0:
        raise BenchError(f"the harness failed (exit {harness.returncode}); {harness_log} ends:\n{_tail(harness_log)}")
    inside = [r for r in loadstats.read_records(records)
              if r["start_unix"] >= window_start and r["start_unix"] + r["e2e"] <= window_end]
    h, s = harness_side(inside), sglang_side(result)
    window = window_end - window_start
    # One server view for the window: the server cannot tell the two tools' requests apart.
    runs = [_run_summary("both", 0, s, window, before, args.url)]
    return {"harness": h, "sglang": s, "runs": runs, "window_s": round(window, 2)}


def _wait(cond, proc: subprocess.Popen, deadline: float, what: str, log: Path) -> None:
    while not cond():
        if proc.poll() is not None:
            raise BenchError(f"{what}: the process exited with {proc.returncode}; {log} ends:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: timed out (--timeout); {log} ends:\n{_tail(log)}")
        time.sleep(0.05)


def _record_count(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _run_summary(tool: str, rnd: int, side: dict, wall: float, before, url: str) -> dict:
    flat = [g for req in side["itl_by_request"] for g in req]
    return {"tool": tool, "round": rnd, "wall_s": round(wall, 1), "requests": side["requests"],
            "failed": side["failed"], "ttft_p50_ms": median_ms(side["ttft"]), "itl_p50_ms": median_ms(flat),
            "ttft_mean_ms": 1000.0 * sum(side["ttft"]) / len(side["ttft"]) if side["ttft"] else None,
            "itl_mean_ms": 1000.0 * sum(flat) / len(flat) if flat else None,
            "server": servermetrics.summarize(servermetrics.delta(before, servermetrics.scrape(url)))}


def server_referenced(runs: list[dict]) -> dict | None:
    """Each tool against the server's own histograms of the same run: client TTFT mean minus
    the server's (the client-side overhead) and client ITL mean over the server's. Drift of
    the machine between runs moves client and server alike, so these compare the two tools
    even when their runs saw different load."""
    out = {}
    for tool in ("harness", "sglang"):
        own = [r for r in runs if r["tool"] == tool and r["server"] and r["server"]["itl"]["mean_ms"]]
        if not own:
            return None
        out[tool] = {
            "ttft_client_minus_server_ms": sum(r["ttft_mean_ms"] - r["server"]["ttft"]["mean_ms"] for r in own) / len(own),
            "itl_client_over_server": sum(r["itl_mean_ms"] / r["server"]["itl"]["mean_ms"] for r in own) / len(own),
        }
    return out


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_summary(summary: dict, res: dict, out: Path) -> None:
    c = summary["counts"]
    n_itl = {t: sum(len(r) for r in res[t]["itl_by_request"]) for t in ("harness", "sglang")}
    print(f"mode {summary['mode']}: harness {c['harness']['requests']} requests, sglang {c['sglang']['requests']} "
          f"requests compared; {n_itl['harness']} vs {n_itl['sglang']} ITL samples")
    print(f"{'median':10s} {'harness ms':>11s} {'sglang ms':>10s} {'diff ms':>8s} {'rel':>7s}  {'sampling 95% of diff':>21s}")
    for r in summary["medians"]:
        rel = f"{100 * r['diff_rel']:+.1f}%" if r["diff_rel"] is not None else "-"
        ci = "[{:+.2f}, {:+.2f}]".format(*r["diff_ci95_ms"]) if "diff_ci95_ms" in r else ""
        print(f"{r['metric']:10s} {_f(r['harness_ms']):>11s} {_f(r['sglang_ms']):>10s} "
              f"{_f(r['diff_ms'], '+.2f'):>8s} {rel:>7s}  {ci:>21s}  {r['verdict'] or '(shown only)'}"
              + (f" ({r['why']})" if r.get("why") else ""))
    for run in summary["runs"]:
        sv = run["server"]
        server = (f"server /metrics TTFT mean {_f(sv['ttft']['mean_ms'], '.1f')} p50~{_f(sv['ttft']['p50_ms'], '.1f')}, "
                  f"ITL mean {_f(sv['itl']['mean_ms'], '.1f')} p50~{_f(sv['itl']['p50_ms'], '.1f')}"
                  if sv else "server /metrics not available (--enable-metrics)")
        print(f"  run {run['round']} {run['tool']:7s} ({run['wall_s']} s): client TTFT p50 {_f(run['ttft_p50_ms'], '.1f')}, "
              f"ITL p50 {_f(run['itl_p50_ms'], '.1f')} | {server} (ms)")
    ref = summary["server_referenced"]
    if ref:
        h, s = ref["harness"], ref["sglang"]
        print(f"against the server's own histograms of each run: client TTFT mean minus server's "
              f"{h['ttft_client_minus_server_ms']:+.2f} ms (harness) vs {s['ttft_client_minus_server_ms']:+.2f} ms "
              f"(sglang); client ITL mean / server's {h['itl_client_over_server']:.3f} vs {s['itl_client_over_server']:.3f}")
    advice = " (raise --requests, or rerun on a quieter machine)" if summary["verdict"] == "inconclusive" else ""
    tol = summary["tolerance"]
    print(f"tolerance: within {100 * tol['rel']:.0f}% or {tol['abs_ms']} ms -> {summary['verdict'].upper()}"
          f"{advice}; details in {out}/crosscheck.json")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_reachable("server", args.url)
        tokenizer = args.tokenizer or server_facts(args.url).get("tokenizer_path")
        if not tokenizer or not Path(tokenizer).exists():
            raise BenchError(f"the server's tokenizer {tokenizer!r} is not on this machine: pass --tokenizer")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        # One shared warm-up, so that neither tool's first request pays the server's one-off costs
        # (both then run without their own warm-up, and /metrics counts only measured requests).
        warm_up(args.url, SimpleNamespace(endpoint="generate", input_len=args.input_len, request_timeout=120), 2)
        res = (run_alternate if args.mode == "alternate" else run_concurrent)(args, tokenizer, out)
        if res["harness"]["failed"] or res["sglang"]["failed"] or len(res["harness"]["ttft"]) < 2:
            raise BenchError(f"nothing fair to compare: harness {len(res['harness']['ttft'])} requests done "
                             f"({res['harness']['failed']} failed), sglang {res['sglang']['failed']} failed")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ref = server_referenced(res["runs"])
    rows, verdict = compare(res, args.rel_tol, args.abs_tol_ms, ref)
    summary = {"url": args.url, "mode": args.mode, "tolerance": {"rel": args.rel_tol, "abs_ms": args.abs_tol_ms},
               "workload": {k: getattr(args, k) for k in ("concurrency", "requests", "input_len", "max_tokens", "rounds")},
               "medians": rows, "verdict": verdict, "server_referenced": ref,
               "runs": res["runs"], "window_s": res.get("window_s"),
               "counts": {t: {"requests": len(res[t]["ttft"]), "failed": res[t]["failed"]} for t in ("harness", "sglang")}}
    (out / "crosscheck.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary, res, out)
    return {"agree": 0, "disagree": 1, "inconclusive": 3}[verdict]


if __name__ == "__main__":
    sys.exit(main())
