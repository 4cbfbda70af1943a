"""What FarSkip's series on /metrics cost: ITL and TTFT with them on and off, side by side.

    .venv/bin/python bench/metrics_cost.py [--tp 2] [--rounds 5] [--batch 4] [--decode-tokens 32]

Two servers of the demo model, the same layout, both with SGLang's --enable-metrics: one with
FarSkip's counters (the default, --farskip-metrics on), one without (--farskip-metrics off), so
the difference is FarSkip's alone. Both stay up (--sleep-on-idle: the idle one takes no core);
the rounds alternate between them (A B A B ...), each round --batch concurrent streams of
--decode-tokens tokens and one single-request TTFT, and the report gives each round's ratio
on/off and their median: a ratio measured in one run, side by side, as these noisy machines
need. Not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import urllib.request

from sglang_farskip.testbed.servers import Server, stream_times


def one_round(url: str, args, rng: random.Random) -> tuple[float, float]:
    """(median ITL, TTFT) of one round on one server."""
    prompt = lambda n: [0] + [rng.randrange(2, 4000) for _ in range(n - 1)]  # noqa: E731
    ttft = stream_times(url, prompt(args.prompt_len), 1)[0]
    gaps, lock = [], threading.Lock()

    def client():
        times = stream_times(url, prompt(8), args.decode_tokens)
        with lock:
            gaps.extend(b - a for a, b in zip(times, times[1:]))

    threads = [threading.Thread(target=client) for _ in range(args.batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(gaps), ttft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    args = p.parse_args()
    common = ["--tp", str(args.tp), "--enable-metrics", "--sleep-on-idle"]
    servers = {"on": Server([*common, "--farskip-metrics", "on"], env={"OMP_NUM_THREADS": "1"}),
               "off": Server([*common, "--farskip-metrics", "off"], env={"OMP_NUM_THREADS": "1"})}
    try:
        for s in servers.values():
            s.wait_ready()
        rng = random.Random(0)
        for s in servers.values():  # warm-up: the first requests of a server are slower
            one_round(s.url, args, rng)
        rows = []
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            got = {label: one_round(servers[label].url, args, rng) for label in order}
            rows.append(got)
            print(f"round {r + 1}: ITL on {got['on'][0] * 1e3:.1f} ms, off {got['off'][0] * 1e3:.1f} ms "
                  f"(x{got['on'][0] / got['off'][0]:.3f}); TTFT on {got['on'][1] * 1e3:.0f} ms, "
                  f"off {got['off'][1] * 1e3:.0f} ms (x{got['on'][1] / got['off'][1]:.3f})", flush=True)
        itl = statistics.median(g["on"][0] / g["off"][0] for g in rows)
        ttft = statistics.median(g["on"][1] / g["off"][1] for g in rows)
        metrics = urllib.request.urlopen(servers["on"].url + "/metrics", timeout=30).read().decode()
        series = sum(1 for line in metrics.splitlines() if line.startswith("farskip:"))
        print(f"\nTP={args.tp}, demo model, {args.batch} streams x {args.decode_tokens} tokens, "
              f"{args.rounds} alternating rounds: median ITL ratio on/off x{itl:.3f}, "
              f"median TTFT ratio x{ttft:.3f} ({series} farskip: series on /metrics with them on)")
    finally:
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
