#!/usr/bin/env python3
"""Run the locust load test headless over concurrency levels and write a report.

One server:
    python bench/run_load.py --url http://127.0.0.1:30000 --concurrency 1,4,16 --duration 30
SGLang's router (plain or PD) is a target like a server: the report names the servers behind it
(its /workers) and, in PD mode, which one's phase each figure measures:
    python bench/run_load.py --url http://127.0.0.1:8000 --endpoint generate --concurrency 1,4 --duration 30
A/B, interleaved level by level (ratios are first label / second label):
    python bench/run_load.py --target farskip=http://127.0.0.1:30000 \
        --target baseline=http://127.0.0.1:30001 --concurrency 1,4,16 --duration 30
Up to four targets take turns the same way; each is compared with the first.
A/B from two saved single-server runs:
    python bench/run_load.py --saved farskip=results/a --saved baseline=results/b --out results/ab

Each level runs `python -m locust -f bench/locustfile.py --headless` in its own process (locust's
gevent patching must not meet SGLang or matplotlib in one process). Statistics come from the
per-request JSONL records, never from locust's rounded percentiles. Exit codes: 0 all requests
succeeded, 1 some failed (reported; --allow-failures gives 0), 2 bad input or unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from datetime import datetime, timezone
from pathlib import Path

from sglang_farskip.loadtest import loadstats, report, routers, servermetrics, workload
from sglang_farskip.loadtest.servers import BenchError, machine_facts, warm_up

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
LABEL_RE = re.compile(r"^[A-Za-z0-9_.-]+$")  # labels become file names
MAX_TARGETS = 4


class Interrupted(Exception):
    """SIGTERM or Ctrl-C: finish the current level's in-flight requests, report, stop."""


def _interrupt(signum, frame):
    raise Interrupted()


# ---------------------------------------------------------------- arguments
def _pair(text: str, what: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not value:
        raise BenchError(f"{what} {text!r} is not LABEL=VALUE, e.g. farskip=http://127.0.0.1:30000")
    if not LABEL_RE.match(label):
        raise BenchError(f"label {label!r} may hold only letters, digits, '_', '.', '-'")
    return label, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    where = p.add_argument_group("what to test")
    where.add_argument("--url", help="one server (label 'run'); same as --target run=URL")
    where.add_argument("--target", action="append", default=[], metavar="LABEL=URL",
                       help=f"a server to test; two or more (at most {MAX_TARGETS}) for an A/B run "
                            "comparing each with the first")
    where.add_argument("--saved", action="append", default=[], metavar="LABEL=DIR",
                       help="compare two saved runs (their results.json) instead of running load")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default="1,4,16", help="comma-separated user counts (default 1,4,16)")
    how_long = load.add_mutually_exclusive_group()
    how_long.add_argument("--duration", type=int, help="seconds per level and target (default 30)")
    how_long.add_argument("--requests", type=int, help="requests per level and target, instead of --duration")
    load.add_argument("--warmup", type=int, default=2, help="requests per target before the first level")
    load.add_argument("--stop-timeout", type=int, default=120,
                      help="seconds in-flight requests may take to finish when a --duration ends")
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--level-timeout", type=int, default=900, help="cap on one --requests level, seconds")
    work = p.add_argument_group("workload")
    work.add_argument("--endpoint", choices=["completions", "generate"], default="completions",
                      help="completions: OpenAI /v1/completions (default); generate: SGLang /generate")
    work.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    work.add_argument("--dataset", choices=["random", "text"], default="random")
    work.add_argument("--dataset-path", help="text dataset: a UTF-8 .txt, or .jsonl with 'text'/'prompt'")
    work.add_argument("--tokenizer", help="checkpoint dir or tokenizer.json (default: the server's)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--keep-alive", action="store_true",
                      help="reuse connections (default: one per request, as sglang.benchmark.serving)")
    work.add_argument("--write-prompts", metavar="FILE", help="write the text-dataset prompts and exit")
    p.add_argument("--api-key", default=os.environ.get("API_KEY") or None,
                   help="the servers' API key, sent as 'Authorization: Bearer KEY' (default: $API_KEY); "
                        "handed to locust in its environment, not on its command line")
    p.add_argument("--out", help="output directory (default bench-results/<time>)")
    p.add_argument("--title", help="report title")
    p.add_argument("--allow-failures", action="store_true", help="exit 0 even if requests failed")
    args = p.parse_args(argv)

    targets = [_pair(t, "--target") for t in args.target]
    if args.url:
        targets.insert(0, ("run", args.url))
    saved = [_pair(s, "--saved") for s in args.saved]
    if saved and targets:
        raise BenchError("--saved compares finished runs: drop --url/--target, or drop --saved")
    if saved and len(saved) != 2:
        raise BenchError(f"--saved needs exactly two runs (got {len(saved)}): --saved a=DIR --saved b=DIR")
    if not saved and not targets and not args.write_prompts:
        raise BenchError("nothing to test: pass --url URL, or --target LABEL=URL (twice for A/B)")
    if len(targets) > MAX_TARGETS:
        raise BenchError(f"{len(targets)} targets given: a run compares at most {MAX_TARGETS} "
                         "(each level runs once per target)")
    labels = [t[0] for t in targets] + [s[0] for s in saved]
    if len(set(labels)) != len(labels):
        raise BenchError(f"labels must differ, got {labels}")
    for _, url in targets:
        if not re.match(r"^https?://[^/\s]+", url):
            raise BenchError(f"{url!r} is not an http(s) URL, e.g. http://127.0.0.1:30000")
    args.targets, args.saved_runs = [(label, url.rstrip("/")) for label, url in targets], saved
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--concurrency {args.concurrency!r} is not a comma-separated list of integers") from None
    if not args.levels or min(args.levels) < 1 or len(set(args.levels)) != len(args.levels):
        raise BenchError(f"--concurrency {args.concurrency!r}: give distinct user counts >= 1, e.g. 1,4,16")
    if args.duration is None and args.requests is None:
        args.duration = 30
    if args.duration is not None and args.duration < 1:
        raise BenchError(f"--duration {args.duration}: give whole seconds >= 1")
    if args.requests is not None and args.requests < 1:
        raise BenchError(f"--requests {args.requests}: give a count >= 1")
    if args.max_tokens < 0 or (args.max_tokens == 0 and args.endpoint == "completions"):
        raise BenchError(f"--max-tokens {args.max_tokens}: /v1/completions needs >= 1 "
                         "(zero-token requests work only with --endpoint generate)")
    if args.input_len < 1:
        raise BenchError(f"--input-len {args.input_len}: prompts need at least 1 token")
    if args.dataset == "text" and not args.dataset_path:
        raise BenchError("--dataset text needs --dataset-path FILE")
    if args.write_prompts and args.dataset != "text":
        raise BenchError("--write-prompts writes text-dataset prompts: add --dataset text --dataset-path FILE "
                         "(random prompts need no file: pass --input-len and --vocab-size to locust)")
    return args


# ---------------------------------------------------------------- one level
def _count_records(path: Path) -> tuple[int, int]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0, 0
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return len(lines), sum('"ok": false' in ln for ln in lines)


def run_level(label: str, url: str, concurrency: int, index: int, args, prompt_args: list[str],
              out: Path, facts: dict) -> dict:
    name = f"{label}-c{concurrency}"
    records = out / "requests" / f"{name}.jsonl"
    records.unlink(missing_ok=True)
    stem = out / "locust" / name
    run_time = args.duration if args.duration is not None else args.level_timeout
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-u", str(concurrency), "-r", str(concurrency), "-t", f"{run_time}s", "--host", url,
           "--stop-timeout", str(args.stop_timeout), "--exit-code-on-error", "0", "--loglevel", "WARNING",
           "--json-file", str(stem), "--records-out", str(records), "--endpoint", args.endpoint,
           "--max-tokens", str(args.max_tokens), "--request-timeout", str(args.request_timeout),
           *prompt_args]
    if args.dataset == "random":
        # A fresh prompt stream per level, the same for both labels of an A/B pair.
        cmd += ["--seed", str(args.seed * 1000 + index)]
    if args.requests is not None:
        cmd += ["--max-requests", str(args.requests)]
    if args.keep_alive:
        cmd.append("--keep-alive")
    # Verify-step counts only from servers that decode speculatively (another may refuse the field).
    if facts.get("speculative_algorithm"):
        cmd.append("--spec-details")
    # The target's own /metrics, or each of a router's workers' (the router has none of theirs).
    sources = routers.metric_sources(facts)
    before = [_scrape(source) for _, source in sources]
    started = time.monotonic()
    hard_limit = run_time + args.stop_timeout + 60
    interrupted = False
    with open(f"{stem}.log", "w") as log:
        env = {**os.environ, "API_KEY": args.api_key or ""}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            _show_progress(label, concurrency, records, proc, started, args, hard_limit)
        except (Interrupted, KeyboardInterrupt):
            # Locust's own SIGTERM handling stops users gracefully: requests in flight get
            # --stop-timeout to finish, and its stats are written as at a normal end.
            interrupted = True
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print(f"\n[{label} c={concurrency}] stopping: letting requests in flight finish", file=sys.stderr)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=args.stop_timeout + 30)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log_tail = "\n".join(Path(f"{stem}.log").read_text(errors="replace").splitlines()[-20:])
    if proc.returncode != 0:
        raise BenchError(f"locust failed at {name} (exit {proc.returncode}); {stem}.log ends:\n{log_tail}")
    recs = loadstats.read_records(records) if records.exists() else []
    level = {"label": label, "concurrency": concurrency, "order": index,
             "records": str(records.relative_to(out)), "client": loadstats.level_summary(recs)}
    server = [servermetrics.summarize(servermetrics.delta(b, _scrape(source)))
              for b, (_, source) in zip(before, sources)]
    if facts.get("router"):
        level["server"] = None
        level["phase_servers"] = [{"role": role, "url": source, "metrics": m}
                                  for (role, source), m in zip(sources, server)]
    else:
        level["server"] = server[0]
    level["locust"] = _locust_counts(Path(f"{stem}.json"))
    # Every request locust saw must have a record, and the other way round.
    if level["locust"] != {"requests": len(recs), "failures": level["client"]["failed"]}:
        raise BenchError(f"{name}: locust counted {level['locust']} but {records} holds "
                         f"{len(recs)} records, {level['client']['failed']} failed: records were lost")
    if interrupted:
        level["interrupted"] = True
        level["note"] = "stopped early by a signal; later levels were not run"
    elif args.requests is not None and len(recs) < args.requests:
        level["note"] = f"stopped by --level-timeout after {len(recs)} of {args.requests} requests"
    return level


def _scrape(url: str) -> dict | None:
    try:
        return servermetrics.scrape(url)
    except (urllib.error.URLError, OSError, ValueError):
        return None  # metrics are a bonus: their absence must not fail a load test


def _locust_counts(path: Path) -> dict:
    entries = json.loads(path.read_text()) if path.exists() else []
    main = [e for e in entries if e["method"] == "POST"]
    return {"requests": sum(e["num_requests"] for e in main), "failures": sum(e["num_failures"] for e in main)}


def _show_progress(label, concurrency, records, proc, started, args, hard_limit) -> None:
    tty = sys.stderr.isatty()
    goal = f"{args.requests} requests" if args.requests is not None else f"{args.duration} s"
    last = 0.0
    while proc.poll() is None:
        time.sleep(0.5)
        elapsed = time.monotonic() - started
        if elapsed > hard_limit:
            raise BenchError(f"{label} c={concurrency}: locust still running after {hard_limit} s; "
                             "raise --request-timeout/--stop-timeout or check the server")
        done, failed = _count_records(records)
        line = f"[{label} c={concurrency}] {elapsed:5.0f} s  {done} requests done, {failed} failed  (goal {goal})"
        if tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif elapsed - last >= 10:
            print(line, file=sys.stderr, flush=True)
            last = elapsed
    done, failed = _count_records(records)
    print(("\r" if tty else "") + f"[{label} c={concurrency}] finished: {done} requests, {failed} failed"
          + " " * 20, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- whole runs
def workload_line(args) -> str:
    prompts = (f"random token prompts of {args.input_len} tokens" if args.dataset == "random"
               else f"text windows of {args.input_len} tokens from {Path(args.dataset_path).name}")
    span = f"{args.duration} s per level" if args.duration is not None else f"{args.requests} requests per level"
    return f"{prompts}, {args.max_tokens} output tokens, {'/v1/completions' if args.endpoint == 'completions' else '/generate'}, {span}"


def run(args) -> dict:
    facts = {label: routers.target_facts(label, url, args.api_key) for label, url in args.targets}
    for label, f in facts.items():
        routers.check_endpoint(label, f, args.endpoint)
    tok_path = args.tokenizer or facts[args.targets[0][0]].get("tokenizer_path")
    if not tok_path or not Path(tok_path).exists():
        raise BenchError(f"the server's tokenizer {tok_path!r} is not on this machine: pass --tokenizer DIR")
    tok = workload.load_tokenizer(tok_path)
    out = Path(args.out or f"bench-results/{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    (out / "requests").mkdir(parents=True, exist_ok=True)
    (out / "locust").mkdir(parents=True, exist_ok=True)
    if args.dataset == "random":
        vocab, specials = workload.vocabulary(tok)
        prompt_args = ["--input-len", str(args.input_len), "--vocab-size", str(vocab),
                       "--skip-ids", ",".join(map(str, specials))]
    else:
        prompts = workload.text_prompts(tok, args.dataset_path, args.input_len)
        workload.write_prompts(prompts, out / "prompts.jsonl")
        prompt_args = ["--prompts-file", str(out / "prompts.jsonl")]
        if args.requests is not None and args.requests > len(prompts):
            print(f"warning: {args.requests} requests per level cycle through {len(prompts)} prompts: repeats "
                  "hit the server's prefix cache (use a longer text or --disable-radix-cache)", file=sys.stderr)
    for label, url in args.targets:
        if args.warmup:
            warm_up(url, args, args.warmup)
    levels = []
    for index, concurrency in enumerate(args.levels):
        # A/B: each level starts with the next label (A B, B A, ... for two; A B C, B C A, ...
        # for three), so slow drift (heat, other load) is shared.
        turn = index % len(args.targets)
        order = args.targets[turn:] + args.targets[:turn]
        for label, url in order:
            levels.append(run_level(label, url, concurrency, index, args, prompt_args, out, facts[label]))
            if levels[-1].get("interrupted"):
                break
        if levels[-1].get("interrupted"):
            break
    labels = [label for label, _ in args.targets]
    interleave = (" Levels ran interleaved, each level starting with the next server in turn."
                  if len(labels) >= 2 else "")
    results = {
        "format": "farskip-bench/1", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "title": args.title or (f"A/B load test: {' vs '.join(labels)}" if len(labels) >= 2 else "Load test"),
        "machine": machine_facts(), "targets": facts, "workload_line": workload_line(args),
        "workload": {k: getattr(args, k) for k in ("endpoint", "max_tokens", "input_len", "dataset", "dataset_path",
                                                   "duration", "requests", "seed", "levels", "warmup",
                                                   "keep_alive")},
        "levels": levels,
    }
    results["note"] = report.make_note(results["machine"], facts, results["workload_line"], interleave.strip())
    results["comparisons"] = [{"a": labels[0], "b": b, "ratios": report.ab_ratios(levels, labels[0], b)}
                              for b in labels[1:]]
    report.write_all(results, out)
    results["out"] = str(out)
    return results


def compare_saved(args) -> dict:
    runs = []
    for label, directory in args.saved_runs:
        path = Path(directory) / "results.json"
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            raise BenchError(f"{path} does not exist: pass the --out directory of a finished run") from None
        except json.JSONDecodeError as e:
            raise BenchError(f"{path} is not JSON ({e})") from None
        if saved.get("format") != "farskip-bench/1":
            raise BenchError(f"{path} is not a bench/run_load.py results file")
        if len(saved["targets"]) != 1:
            raise BenchError(f"{path} holds {len(saved['targets'])} labels {sorted(saved['targets'])}; "
                             "compare single-server runs")
        (old,) = saved["targets"]
        levels = [{**lv, "label": label, "records": str((Path(directory) / lv["records"]).resolve())}
                  for lv in saved["levels"]]
        runs.append((label, saved, saved["targets"][old], levels))
    out = Path(args.out or f"bench-results/{datetime.now().strftime('%Y%m%d-%H%M%S')}-ab")
    (a, ra, fa, la), (b, rb, fb, lb) = runs
    if ra["workload_line"] != rb["workload_line"]:
        print(f"warning: the runs used different workloads:\n  {a}: {ra['workload_line']}\n  {b}: {rb['workload_line']}",
              file=sys.stderr)
    results = {
        "format": "farskip-bench/1", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "title": args.title or f"A/B from saved runs: {a} vs {b}", "machine": ra["machine"],
        "targets": {a: fa, b: fb}, "workload_line": ra["workload_line"], "workload": ra["workload"],
        "levels": la + lb, "comparisons": [{"a": a, "b": b, "ratios": report.ab_ratios(la + lb, a, b)}],
    }
    extra = f"Compared from saved runs made {ra['created']} ({a}) and {rb['created']} ({b}), not interleaved."
    if ra["machine"] != rb["machine"]:
        extra += f" The {b} run was on another machine: {rb['machine']['cpu']}, {rb['machine']['cpus']} CPUs."
    results["note"] = report.make_note(ra["machine"], results["targets"], ra["workload_line"], extra)
    report.write_all(results, out)
    results["out"] = str(out)
    return results


def write_prompts_only(args) -> None:
    tok = workload.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tok is None:
        if not args.targets:
            raise BenchError("--write-prompts needs --tokenizer DIR (or --url to ask the server for its tokenizer)")
        facts = routers.target_facts(*args.targets[0], args.api_key)
        tok = workload.load_tokenizer(facts.get("tokenizer_path") or "")
    prompts = workload.text_prompts(tok, args.dataset_path, args.input_len)
    workload.write_prompts(prompts, args.write_prompts)
    print(f"wrote {len(prompts)} prompts to {args.write_prompts}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        args = parse_args(argv)
        if args.write_prompts:
            write_prompts_only(args)
            return 0
        results = compare_saved(args) if args.saved_runs else run(args)
    except (BenchError, workload.WorkloadError, loadstats.RecordError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt):
        print("error: interrupted before a level finished; nothing was reported", file=sys.stderr)
        return 130
    failed = sum(lv["client"]["failed"] for lv in results["levels"])
    total = sum(lv["client"]["requests"] for lv in results["levels"])
    print(f"report: {results['out']}/report.md ({total} requests, {failed} failed)")
    if failed and not args.allow_failures:
        first = next(lv["client"]["first_error"] for lv in results["levels"] if lv["client"]["failed"])
        print(f"error: {failed} of {total} requests failed (first: {first}); see {results['out']}/requests/*.jsonl",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
