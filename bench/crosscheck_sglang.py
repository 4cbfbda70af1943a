#!/usr/bin/env python3
"""Check the harness against sglang.benchmark.serving: same server, same workload, same moment.

    python bench/crosscheck_sglang.py --url http://127.0.0.1:30000 --concurrency 4 --requests 32

Both tools load the server at the same time, each keeping --concurrency requests in flight, so
they sample the same batches on the same machine under the same background load. (Run one
after the other on a shared machine, the tools' medians differed by up to 3x from load drift
alone, which would hide any real disagreement.) How:

1. the harness (bench/run_load.py, --endpoint generate) starts and runs until told to stop;
2. once it is in steady state, sglang.benchmark.serving runs --requests requests;
3. the harness is stopped gracefully (SIGTERM: requests in flight finish), and only its
   requests that started after sglang's main run started and ended before sglang finished
   are compared, so every compared request saw both tools' load.

Workload for both: random token-id prompts of exactly --input-len tokens (sglang:
`--dataset-name random-ids --tokenize-prompt --random-range-ratio 1`, which needs its native
/generate backend), --max-tokens output tokens, temperature 0, ignore_eos.

A median agrees when within --rel-tol of sglang's or within --abs-tol-ms of it (justified in
bench/README.md, "Agreement with sglang.benchmark.serving"). Exit 0: TTFT and ITL medians
agree; 1: one disagrees beyond what sampling can explain (its bootstrap 95% interval lies
outside the tolerance); 3: inconclusive (outside the tolerance, but within sampling noise:
raise --requests); 2: bad input or a tool failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadstats  # noqa: E402
import servermetrics  # noqa: E402
from servers import BenchError, check_reachable, server_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
MAIN_RUN_MARK = "Starting main benchmark run"  # printed by sglang.benchmark.serving after warm-up


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--tokenizer", help="checkpoint dir (default: the server's tokenizer path)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per tool")
    p.add_argument("--requests", type=int, default=32, help="requests sglang.benchmark.serving sends")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rel-tol", type=float, default=0.10, help="relative tolerance on medians (0.10 = 10%%)")
    p.add_argument("--abs-tol-ms", type=float, default=2.0, help="absolute tolerance on medians, ms")
    p.add_argument("--timeout", type=int, default=600, help="give up after this many seconds")
    p.add_argument("--out", default="bench-results/crosscheck")
    args = p.parse_args(argv)
    for name in ("concurrency", "requests", "input_len"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        raise BenchError("--max-tokens must be >= 2: with one output token there is no inter-token latency")
    args.url = args.url.rstrip("/")
    return args


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def _wait(cond, proc: subprocess.Popen, deadline: float, what: str, log: Path) -> None:
    while not cond():
        if proc.poll() is not None:
            raise BenchError(f"{what}: the process exited with {proc.returncode}; {log} ends:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: timed out; {log} ends:\n{_tail(log)}")
        time.sleep(0.1)


def _record_count(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def run(args, tokenizer: str, out: Path) -> dict:
    deadline = time.monotonic() + args.timeout
    harness_dir, harness_log, sglang_log = out / "harness", out / "harness.log", out / "sglang.log"
    sglang_result = out / "sglang.jsonl"
    sglang_result.unlink(missing_ok=True)
    records = harness_dir / "requests" / f"run-c{args.concurrency}.jsonl"
    records.unlink(missing_ok=True)
    harness_cmd = [sys.executable, str(HERE / "run_load.py"), "--url", args.url, "--endpoint", "generate",
                   "--concurrency", str(args.concurrency), "--duration", str(args.timeout),
                   "--input-len", str(args.input_len), "--max-tokens", str(args.max_tokens),
                   "--tokenizer", tokenizer, "--warmup", "1", "--out", str(harness_dir)]
    sglang_cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
                  "--base-url", args.url, "--dataset-name", "random-ids", "--tokenize-prompt",
                  "--tokenizer", tokenizer, "--model", tokenizer, "--num-prompts", str(args.requests),
                  "--max-concurrency", str(args.concurrency), "--random-input-len", str(args.input_len),
                  "--random-output-len", str(args.max_tokens), "--random-range-ratio", "1",
                  "--request-rate", "inf", "--seed", "1", "--warmup-requests", "1", "--disable-tqdm",
                  "--output-file", str(sglang_result), "--output-details"]
    with open(harness_log, "w") as hl, open(sglang_log, "w") as sl:
        harness = subprocess.Popen(harness_cmd, stdout=hl, stderr=subprocess.STDOUT)
        sglang = None
        try:
            # Steady state: every harness user has finished at least one request.
            _wait(lambda: _record_count(records) >= args.concurrency, harness, deadline,
                  "the harness never reached steady state", harness_log)
            before = servermetrics.scrape(args.url)
            sglang = subprocess.Popen(sglang_cmd, stdout=sl, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})  # see the mark at once
            _wait(lambda: MAIN_RUN_MARK in sglang_log.read_text(errors="replace"), sglang, deadline,
                  "sglang.benchmark.serving did not start its main run", sglang_log)
            window_start = time.time()
            while sglang.poll() is None:
                if harness.poll() is not None:
                    raise BenchError(f"the harness stopped during sglang's run; {harness_log} ends:\n{_tail(harness_log)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"sglang.benchmark.serving still running after --timeout {args.timeout} s")
                time.sleep(0.05)
            window_end = time.time()
            server = servermetrics.summarize(servermetrics.delta(before, servermetrics.scrape(args.url)))
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

    recs = loadstats.read_records(records)
    inside = [r for r in recs if r["start_unix"] >= window_start and r["start_unix"] + r["e2e"] <= window_end]
    h = loadstats.samples(inside)
    d = json.loads(sglang_result.read_text().splitlines()[-1])
    ok = [i for i, e in enumerate(d["errors"]) if not e]
    return {
        "window_s": round(window_end - window_start, 2),
        "harness": {"requests": len(recs), "compared": len(inside), "failed": sum(not r["ok"] for r in inside),
                    "ttft": h["ttft"], "itl": h["itl"], "itl_by_request": [r["itl"] for r in inside if r["ok"]],
                    "tpot_p50_ms": _median_ms(h["tpot"]), "e2e_p50_ms": _median_ms(h["e2e"])},
        # Its details hold per-request TTFTs and ITLs but no per-request E2E: TPOT and E2E
        # medians come from its own summary.
        "sglang": {"requests": len(d["errors"]), "compared": len(ok), "failed": len(d["errors"]) - len(ok),
                   "ttft": [d["ttfts"][i] for i in ok], "itl": [x for i in ok for x in d["itls"][i]],
                   "itl_by_request": [d["itls"][i] for i in ok],
                   "tpot_p50_ms": d["median_tpot_ms"], "e2e_p50_ms": d["median_e2e_latency_ms"]},
        "server": server,
    }


def _median_ms(xs: list[float]) -> float | None:
    return 1000.0 * loadstats.percentile(xs, 50) if xs else None


def bootstrap_interval(a: list, b: list, pooled: bool, n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of median(a) - median(b) in ms, resampling whole requests (an ITL sample
    is a request's list of gaps: gaps of one request are not independent). It shows how much
    of a difference the sample sizes alone can produce."""
    rng = random.Random(seed)

    def med(xs):
        flat = [g for req in xs for g in req] if pooled else xs
        return loadstats.percentile(flat, 50) if flat else 0.0
    diffs = sorted(1000.0 * (med(rng.choices(a, k=len(a))) - med(rng.choices(b, k=len(b)))) for _ in range(n))
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def compare(res: dict, rel_tol: float, abs_tol_ms: float) -> tuple[list[dict], str]:
    """Per median: 'agree' (difference within tolerance), 'disagree' (outside it, and outside
    even at the near end of its sampling interval), or 'inconclusive' (outside it, but
    sampling alone could explain that: too few requests, or too noisy a machine, to decide)."""
    rows = []
    for metric in ("ttft", "itl", "tpot", "e2e"):
        checked = metric in ("ttft", "itl")  # the criterion; TPOT and E2E are shown alongside
        if checked:
            h, s = _median_ms(res["harness"][metric]), _median_ms(res["sglang"][metric])
        else:
            h, s = res["harness"][f"{metric}_p50_ms"], res["sglang"][f"{metric}_p50_ms"]
        diff = None if h is None or s is None else h - s
        band = None if s is None else max(abs_tol_ms, rel_tol * s)
        row = {"metric": f"{metric} p50", "harness_ms": h, "sglang_ms": s, "diff_ms": diff,
               "diff_rel": diff / s if diff is not None and s else None, "checked": checked,
               "verdict": None}
        if checked and diff is not None:
            key = "ttft" if metric == "ttft" else "itl_by_request"
            lo, hi = bootstrap_interval(res["harness"][key], res["sglang"][key], metric == "itl")
            row["diff_ci95_ms"] = (lo, hi)
            if abs(diff) <= band:
                row["verdict"] = "agree"
            elif hi < -band or lo > band:
                row["verdict"] = "disagree"
            else:
                row["verdict"] = "inconclusive"
        elif checked:
            row["verdict"] = "disagree"  # a tool produced no samples at all
        rows.append(row)
    verdicts = {r["verdict"] for r in rows if r["checked"]}
    overall = "disagree" if "disagree" in verdicts else "inconclusive" if "inconclusive" in verdicts else "agree"
    return rows, overall


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_reachable("server", args.url)
        tokenizer = args.tokenizer or server_facts(args.url).get("tokenizer_path")
        if not tokenizer or not Path(tokenizer).exists():
            raise BenchError(f"the server's tokenizer {tokenizer!r} is not on this machine: pass --tokenizer")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = run(args, tokenizer, out)
        if res["harness"]["compared"] < 2 or res["sglang"]["failed"] or res["harness"]["failed"]:
            raise BenchError(f"nothing fair to compare: harness {res['harness']['compared']} requests inside "
                             f"sglang's {res['window_s']} s run ({res['harness']['failed']} failed), sglang "
                             f"{res['sglang']['failed']} failed; raise --requests")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, verdict = compare(res, args.rel_tol, args.abs_tol_ms)
    summary = {"url": args.url, "tolerance": {"rel": args.rel_tol, "abs_ms": args.abs_tol_ms},
               "workload": {k: getattr(args, k) for k in ("concurrency", "requests", "input_len", "max_tokens")},
               "window_s": res["window_s"], "medians": rows, "server": res["server"], "verdict": verdict,
               "counts": {t: {k: res[t][k] for k in ("requests", "compared", "failed")} for t in ("harness", "sglang")}}
    (out / "crosscheck.json").write_text(json.dumps(summary, indent=1) + "\n")
    c = summary["counts"]
    print(f"window {res['window_s']} s: sglang {c['sglang']['compared']} requests, harness "
          f"{c['harness']['compared']} of {c['harness']['requests']} requests inside it; "
          f"{len(res['harness']['itl'])} vs {len(res['sglang']['itl'])} ITL samples")
    print(f"{'median':10s} {'harness ms':>11s} {'sglang ms':>10s} {'diff ms':>8s} {'rel':>7s}  "
          f"{'sampling 95% of diff':>21s}")
    for r in rows:
        rel = f"{100 * r['diff_rel']:+.1f}%" if r["diff_rel"] is not None else "-"
        ci = "[{:+.2f}, {:+.2f}]".format(*r["diff_ci95_ms"]) if "diff_ci95_ms" in r else ""
        print(f"{r['metric']:10s} {_f(r['harness_ms']):>11s} {_f(r['sglang_ms']):>10s} "
              f"{_f(r['diff_ms'], '+.2f'):>8s} {rel:>7s}  {ci:>21s}  {r['verdict'] or '(shown only)'}")
    sv = res["server"]
    if sv:
        print(f"server /metrics over the window (both tools' requests): TTFT mean {_f(sv['ttft']['mean_ms'])} ms "
              f"p50~{_f(sv['ttft']['p50_ms'])} ms; ITL mean {_f(sv['itl']['mean_ms'])} ms p50~{_f(sv['itl']['p50_ms'])} ms")
    else:
        print("server /metrics: not available (start the server with --enable-metrics)")
    advice = {"agree": "", "disagree": "",
              "inconclusive": " (sampling noise exceeds the tolerance: raise --requests or use a quieter machine)"}
    print(f"tolerance: within {100 * args.rel_tol:.0f}% or {args.abs_tol_ms} ms -> {verdict.upper()}"
          f"{advice[verdict]}; details in {out}/crosscheck.json")
    return {"agree": 0, "disagree": 1, "inconclusive": 3}[verdict]


if __name__ == "__main__":
    sys.exit(main())
