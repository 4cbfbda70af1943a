#!/usr/bin/env python3
"""Check the harness against sglang.benchmark.serving: same server, same workload, same clock
definitions; the two tools take turns and their TTFT/ITL medians must agree.

    python bench/crosscheck_sglang.py --url http://127.0.0.1:30000 --concurrency 4 --requests 32

Workload: random token-id prompts of exactly --input-len tokens (sglang: `--dataset-name
random-ids --tokenize-prompt --random-range-ratio 1`, which needs its native backend, so the
harness runs with --endpoint generate), --max-tokens output tokens with ignore_eos, a closed
loop of --concurrency requests in flight. Rounds alternate which tool goes first, so drift in
the machine's load falls on both. Samples are pooled per tool over the rounds; the server's
/metrics histograms are read around every run as a third, independent view.

Exit 0: medians within tolerance; 1: a median outside it; 2: bad input or a tool failed.
The tolerance (bench/README.md, "Agreement with sglang.benchmark.serving") is: a median agrees
when it is within --rel-tol of sglang's, or within --abs-tol-ms of it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadstats  # noqa: E402
import servermetrics  # noqa: E402
from run_load import BenchError, check_reachable, server_facts  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--tokenizer", help="checkpoint dir (default: the server's tokenizer path)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32, help="requests per tool per round")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rel-tol", type=float, default=0.15, help="relative tolerance on medians (0.15 = 15%%)")
    p.add_argument("--abs-tol-ms", type=float, default=5.0, help="absolute tolerance on medians, ms")
    p.add_argument("--out", default="bench-results/crosscheck")
    args = p.parse_args(argv)
    for name in ("concurrency", "requests", "input_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        raise BenchError("--max-tokens must be >= 2: with one output token there is no inter-token latency")
    args.url = args.url.rstrip("/")
    return args


def _run(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {rc}); {log} ends:\n{tail}")


def run_harness(args, out: Path, rnd: int) -> dict:
    d = out / f"harness-r{rnd}"
    cmd = [sys.executable, str(HERE / "run_load.py"), "--url", args.url, "--endpoint", "generate",
           "--concurrency", str(args.concurrency), "--requests", str(args.requests),
           "--input-len", str(args.input_len), "--max-tokens", str(args.max_tokens),
           "--warmup", "1", "--seed", str(100 + rnd), "--out", str(d)]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    _run(cmd, out / f"harness-r{rnd}.log", "the harness (bench/run_load.py)")
    (level,) = json.loads((d / "results.json").read_text())["levels"]
    recs = loadstats.read_records(d / level["records"])
    raw = loadstats.samples(recs)
    return {"ttft": raw["ttft"], "itl": raw["itl"], "tpot_p50_ms": level["client"]["tpot"]["p50_ms"],
            "e2e_p50_ms": level["client"]["e2e"]["p50_ms"],
            "completed": level["client"]["completed"], "failed": level["client"]["failed"]}


def run_sglang(args, out: Path, rnd: int, tokenizer: str) -> dict:
    result = out / f"sglang-r{rnd}.jsonl"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", args.url,
           "--dataset-name", "random-ids", "--tokenize-prompt", "--tokenizer", tokenizer, "--model", tokenizer,
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_tokens),
           "--random-range-ratio", "1", "--request-rate", "inf", "--seed", str(100 + rnd),
           "--warmup-requests", "1", "--flush-cache", "--disable-tqdm",
           "--output-file", str(result), "--output-details"]
    _run(cmd, out / f"sglang-r{rnd}.log", "sglang.benchmark.serving")
    d = json.loads(result.read_text().splitlines()[-1])
    ok = [i for i, e in enumerate(d["errors"]) if not e]
    # Its details hold per-request TTFTs and ITLs but no per-request E2E: TPOT and E2E come
    # from its own summary.
    return {"ttft": [d["ttfts"][i] for i in ok], "itl": [x for i in ok for x in d["itls"][i]],
            "tpot_p50_ms": d["median_tpot_ms"], "e2e_p50_ms": d["median_e2e_latency_ms"],
            "completed": d["completed"], "failed": len(d["errors"]) - len(ok)}


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _median_ms(xs: list[float]) -> float | None:
    return 1000.0 * loadstats.percentile(xs, 50) if xs else None


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_reachable("server", args.url)
        tokenizer = args.tokenizer or server_facts(args.url).get("tokenizer_path")
        if not tokenizer or not Path(tokenizer).exists():
            raise BenchError(f"the server's tokenizer {tokenizer!r} is not on this machine: pass --tokenizer")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        pooled = {"harness": {"ttft": [], "itl": []}, "sglang": {"ttft": [], "itl": []}}
        per_run = {"harness": {"tpot": [], "e2e": []}, "sglang": {"tpot": [], "e2e": []}}
        server = {"harness": [], "sglang": []}
        runs = []
        for rnd in range(args.rounds):
            order = ("harness", "sglang") if rnd % 2 == 0 else ("sglang", "harness")
            for tool in order:
                before = servermetrics.scrape(args.url)
                t0 = time.monotonic()
                res = run_harness(args, out, rnd) if tool == "harness" else run_sglang(args, out, rnd, tokenizer)
                sv = servermetrics.summarize(servermetrics.delta(before, servermetrics.scrape(args.url)))
                server[tool].append(sv)
                runs.append({"tool": tool, "round": rnd, "wall_s": round(time.monotonic() - t0, 1),
                             "completed": res["completed"], "failed": res["failed"],
                             "ttft_p50_ms": _median_ms(res["ttft"]), "itl_p50_ms": _median_ms(res["itl"]),
                             "server": sv})
                print(f"round {rnd} {tool:8s}: {res['completed']} done, {res['failed']} failed, "
                      f"TTFT p50 {_f(runs[-1]['ttft_p50_ms'])} ms, ITL p50 {_f(runs[-1]['itl_p50_ms'])} ms",
                      file=sys.stderr)
                for k in ("ttft", "itl"):
                    pooled[tool][k].extend(res[k])
                for k in ("tpot", "e2e"):
                    per_run[tool][k].append(res[f"{k}_p50_ms"])
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    rows, verdict = [], True
    for metric in ("ttft", "itl", "tpot", "e2e"):
        checked = metric in ("ttft", "itl")  # the criterion; TPOT/E2E are shown alongside
        if checked:  # medians of the samples pooled over all rounds
            h, s = _median_ms(pooled["harness"][metric]), _median_ms(pooled["sglang"][metric])
        else:  # the mean of each round's median (sglang reports no per-request E2E)
            h, s = (sum(per_run[t][metric]) / len(per_run[t][metric]) for t in ("harness", "sglang"))
        diff = None if h is None or s is None else h - s
        ok = diff is not None and (abs(diff) <= args.abs_tol_ms or abs(diff) <= args.rel_tol * s)
        if checked:
            verdict &= ok
        rows.append({"metric": f"{metric} p50", "harness_ms": h, "sglang_ms": s, "diff_ms": diff,
                     "diff_rel": None if diff is None or not s else diff / s,
                     "checked": checked, "agrees": ok})
    summary = {"url": args.url, "workload": {k: getattr(args, k) for k in
                                             ("concurrency", "requests", "input_len", "max_tokens", "rounds")},
               "tolerance": {"rel": args.rel_tol, "abs_ms": args.abs_tol_ms}, "medians": rows, "runs": runs,
               "agree": verdict}
    (out / "crosscheck.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'median':10s} {'harness ms':>11s} {'sglang ms':>10s} {'diff':>14s}")
    for r in rows:
        rel = f"{100 * r['diff_rel']:+.1f}%" if r["diff_rel"] is not None else "-"
        mark = ("ok" if r["agrees"] else "OUTSIDE TOLERANCE") if r["checked"] else "(shown only)"
        print(f"{r['metric']:10s} {_f(r['harness_ms']):>11s} {_f(r['sglang_ms']):>10s} "
              f"{_f(r['diff_ms'], '+.2f'):>8s} {rel:>6s}  {mark}")
    for tool in ("harness", "sglang"):
        for sv in server[tool]:
            if sv:
                print(f"server /metrics during {tool:7s}: TTFT mean {_f(sv['ttft']['mean_ms'])} ms "
                      f"p50 {_f(sv['ttft']['p50_ms'])} ms, ITL mean {_f(sv['itl']['mean_ms'])} ms "
                      f"p50 {_f(sv['itl']['p50_ms'])} ms ({sv['itl']['count']} tokens)")
    print(f"tolerance: within {100 * args.rel_tol:.0f}% or {args.abs_tol_ms} ms -> "
          f"{'AGREE' if verdict else 'DISAGREE'}; details in {out}/crosscheck.json")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
