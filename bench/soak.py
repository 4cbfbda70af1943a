"""Soak under a fault: constant concurrency against node 0 for a set time, a fault injected at a
set moment, and an account of every request.

    python bench/soak.py --url http://node0:30000 --duration 600 --concurrency 8 \
        --fault-at 120 --fault-cmd "ssh node1 sudo kill -9 $(ssh node1 pgrep -of launch_server)"

Each of --concurrency clients sends one non-streaming /v1/completions request after another
(--max-tokens tokens, ignore_eos, so a good answer has exactly that many). A request succeeds
when it answers 200 with that many tokens within --request-timeout; anything else (an error
status, a refused or reset connection, a timeout, a short answer) is a failure, and the client
waits --retry-wait before its next request so that a refused port is not hammered.

Printed (and written as JSON with --out): successes and failures per second, the outage window
(from the first failure after the fault to the last failure), the recovery time (from the
fault to the end of the first success after the last failure; 0 when none failed after the
fault), the longest request, and three
checks, each of which makes the exit status non-zero:
- every request started was accounted for (an answer or an error): none silently dropped;
- every request ended within --request-timeout plus a 5 s margin: no client hangs;
- the run ends with at least --settle seconds in which every request succeeded: after
  recovery every request succeeds. With --until-settled MAX_S the load goes on after
  --duration until it does (up to MAX_S seconds in all), so that a slow recovery on a busy
  machine is measured rather than cut off.
The API key: --api-key or API_KEY, as the other load tools.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

MARGIN_S = 5.0  # beyond --request-timeout before a request counts as hung


@dataclass
class Record:
    start: float  # seconds since the run began
    end: float
    ok: bool
    error: str = ""


def one_request(url: str, body: bytes, headers: dict, max_tokens: int, timeout: float) -> str:
    """"" on success, else what went wrong."""
    req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as e:
        return f"status {e.code}"
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"[:200]
    got = (answer.get("usage") or {}).get("completion_tokens")
    return "" if got == max_tokens else f"{got} tokens, not {max_tokens}"


def soak(args) -> dict:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    # --prompts N: request k sends "(k mod N). PROMPT", prompts that differ from the first
    # character on (N <= 10). Why: a router's cache-aware policy sends one prompt to one worker,
    # every time; N of them spread the load over the workers, each prompt staying with its own.
    bodies = [json.dumps({"model": args.model, "prompt": f"{k}. {args.prompt}" if args.prompts > 1 else args.prompt,
                          "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}).encode()
              for k in range(args.prompts)]
    records: list[Record] = []
    started = [0]
    lock = threading.Lock()
    t0 = time.monotonic()
    cap = max(args.duration, args.until_settled)
    stopped_at: list[float] = []  # when the load stopped (seconds since t0), once it has

    def keep_going() -> bool:
        """--duration, then (--until-settled) on until the run ends with --settle s of success."""
        now = time.monotonic() - t0
        if stopped_at or now >= cap:
            going = False
        elif now < args.duration:
            going = True
        else:
            with lock:
                failures = [r.end for r in records if not r.ok]
                last_ok = max((r.end for r in records if r.ok), default=None)
            going = bool(failures) and (now - failures[-1] < args.settle or last_ok is None
                                        or last_ok < failures[-1])
        if not going and not stopped_at:
            stopped_at.append(now)
        return going

    def client():
        while keep_going():
            start = time.monotonic() - t0
            with lock:
                body = bodies[started[0] % len(bodies)]
                started[0] += 1
            error = one_request(args.url, body, headers, args.max_tokens, args.request_timeout)
            with lock:
                records.append(Record(start, time.monotonic() - t0, not error, error))
            if error:
                time.sleep(args.retry_wait)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    fault = None
    if args.fault_cmd:
        time.sleep(max(0.0, t0 + args.fault_at - time.monotonic()))
        at = time.monotonic() - t0
        proc = subprocess.run(shlex.split(args.fault_cmd), capture_output=True, text=True,
                              timeout=60)
        fault = {"at": round(at, 2), "cmd": args.fault_cmd, "status": proc.returncode,
                 "output": (proc.stdout + proc.stderr)[-500:]}
    # A client ends its last request at most --request-timeout after the load stopped (plus the
    # margin); the load stops by `cap` at the latest.
    while not stopped_at and time.monotonic() - t0 < cap:
        time.sleep(0.5)
    deadline = t0 + (stopped_at[0] if stopped_at else cap) + args.request_timeout + MARGIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung_clients = sum(t.is_alive() for t in threads)
    return summarize(records, started[0], hung_clients, fault, args)


def summarize(records: list[Record], started: int, hung_clients: int, fault: dict | None,
              args) -> dict:
    records = sorted(records, key=lambda r: r.end)
    seconds = int(max((r.end for r in records), default=0.0)) + 1
    per_second = [{"t": s, "ok": 0, "failed": 0} for s in range(seconds)]
    for r in records:
        per_second[min(int(r.end), seconds - 1)]["ok" if r.ok else "failed"] += 1
    while per_second and per_second[-1]["ok"] == per_second[-1]["failed"] == 0:
        per_second.pop()
    fault_at = fault["at"] if fault else 0.0
    failures = [r for r in records if not r.ok]
    after = [r for r in failures if r.end >= fault_at]
    last_failure = failures[-1].end if failures else None
    first_success_after = next((r.end for r in records if r.ok and
                                (last_failure is None or r.start > last_failure)), None)
    longest = max((r.end - r.start for r in records), default=0.0)
    settled_s = (records[-1].end - last_failure) if records and last_failure is not None else (
        records[-1].end if records else 0.0)
    errors: dict[str, int] = {}
    for r in failures:
        kind = r.error.split(":")[0]
        errors[kind] = errors.get(kind, 0) + 1
    checks = {
        "every request accounted for": started == len(records) and hung_clients == 0,
        f"every request ended within {args.request_timeout + MARGIN_S:.0f} s":
            longest <= args.request_timeout + MARGIN_S,
        f"the last {args.settle:.0f} s all succeeded":
            first_success_after is not None and settled_s >= args.settle,
    }
    return {
        "requests": len(records), "started": started, "succeeded": len(records) - len(failures),
        "failed": len(failures), "errors": errors, "fault": fault,
        "outage_window_s": [round(after[0].end, 1), round(after[-1].end, 1)] if after else None,
        # No failure after the fault: nothing to recover from (0, not the time of a success
        # from before the fault).
        "recovery_s": (None if not fault or first_success_after is None else
                       0.0 if not after else round(first_success_after - fault_at, 1)),
        "longest_request_s": round(longest, 2), "checks": checks, "per_second": per_second,
        "records": [asdict(r) for r in records] if args.records else None,
    }


def print_report(result: dict) -> None:
    print("  t   ok  failed")
    for row in result["per_second"]:
        if row["ok"] or row["failed"]:
            print(f"{row['t']:4d} {row['ok']:4d} {row['failed']:6d}")
    fault = result["fault"]
    print(f"requests {result['requests']}, succeeded {result['succeeded']}, failed "
          f"{result['failed']} {result['errors'] or ''}")
    if fault:
        print(f"fault at {fault['at']:.1f} s: {fault['cmd']} (status {fault['status']})")
    window = result["outage_window_s"]
    print(f"outage window: {f'{window[0]:.1f}-{window[1]:.1f} s' if window else 'none'}; "
          f"recovery: {result['recovery_s']} s after the fault; longest request: "
          f"{result['longest_request_s']:.1f} s")
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="node 0's base URL, e.g. http://10.0.0.1:30000")
    p.add_argument("--duration", type=float, required=True, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--fault-at", type=float, default=0.0, help="seconds into the run")
    p.add_argument("--fault-cmd", default="", help="command run at --fault-at (split like a shell "
                   "command, not run by one: wrap it in sh -c '...' for pipes)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--retry-wait", type=float, default=0.5)
    p.add_argument("--settle", type=float, default=30.0,
                   help="seconds of success the run must end with")
    p.add_argument("--until-settled", type=float, default=0.0, metavar="MAX_S",
                   help="after --duration, go on (up to MAX_S seconds in all) until the run ends "
                        "with --settle seconds of success: a slow recovery is then measured, "
                        "not cut off")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--prompts", type=int, default=1, choices=range(1, 11), metavar="1..10",
                   help="distinct prompts, sent in turn")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default=os.environ.get("API_KEY") or "",
                   help="sent as 'Authorization: Bearer KEY' (default: $API_KEY)")
    p.add_argument("--out", help="write the result here as JSON")
    p.add_argument("--records", action="store_true", help="include every request in --out")
    args = p.parse_args(argv)
    for name in ("duration", "request_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be above 0")
    if args.concurrency < 1:
        p.error("--concurrency must be 1 or more")
    if args.fault_cmd and not 0 <= args.fault_at < args.duration:
        p.error("--fault-at must fall within --duration")
    if args.until_settled and args.until_settled < args.duration:
        p.error("--until-settled must be at least --duration")
    if args.settle >= args.duration:
        p.error("--settle must be shorter than --duration")
    result = soak(args)
    print_report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
