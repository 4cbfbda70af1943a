"""Per-op times of the CPU testbed, in the planner's --ops schema (python/sglang_farskip/plan/hardware.py), and the planner's prediction
of bench/overlap_bench.py's overlap/sync ratios from them.

    .venv/bin/python bench/plan_testbed.py --out testbed_ops.json [--tp 2] [--threads 1]
    .venv/bin/python -m sglang_farskip.plan --model <demo config.json> --tp 2 --ops testbed_ops.json \
        --prefill 512 --link-mbit 200 --overhead-us <measured>

What is timed: reference.py's own modules (MLA, shared/routed MoE, dense MLP, RMSNorm + add) at
the demo model's widths, each sharded as one rank of a TP group holds it (heads, expert and MLP
widths divided by --tp; the routed experts TP-sharded as SGLang's CPU MoE runs them), bf16, one
thread per rank (the testbed gives each of its two ranks one core). overlap_bench's workload:
prefill of one 512-token prompt; decode of 32 sequences with a few dozen tokens of context.

What is not: SGLang's own CPU kernels and its per-step host work (scheduler, sampling, HTTP),
which on this testbed are most of a step. The planner (python/sglang_farskip/plan/) takes those as --overhead-us (the same
in every mode, never overlapped): docs/planner.md says how to read it off a sync run.

--contention-probe (root: it builds overlap_bench.py's shaped veth link) measures the planner's
--contention knob on the testbed itself: two gloo ranks in their own namespaces, one core each,
time the routed experts at --prefill's first size alone and then while a second thread keeps
an all-reduce of that many hidden rows in flight (what FarSkip's comm thread does); the
fraction of compute throughput lost is 1 - alone / beside. Nothing of overlap_bench's
overlap run goes into it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _best_us(fn, budget_s: float = 0.4, min_runs: int = 3) -> float:
    """Best-of timing: the minimum over repeats is the least noisy estimate on a shared core."""
    fn()  # warm-up: first-call allocations and kernel selection
    best, start, runs = float("inf"), time.perf_counter(), 0
    while runs < min_runs or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
        if runs >= 200:
            break
    return best * 1e6


def shard_args(cfg: dict, tp: int):
    """One rank's ModelArgs: attention heads, expert, shared and dense widths divided by tp."""
    from sglang_farskip.reference import ModelArgs

    args = ModelArgs.from_json(cfg)
    return dataclasses.replace(
        args, num_attention_heads=args.num_attention_heads // tp,
        moe_intermediate_size=args.moe_intermediate_size // tp, intermediate_size=args.intermediate_size // tp)


def measure(cfg: dict, tp: int, prefill: list[int], decode: list[int], decode_context: int) -> list[dict]:
    import torch
    from sglang_farskip import reference as ref

    torch.manual_seed(0)
    args = shard_args(cfg, tp)
    dt = torch.bfloat16
    mla = ref.MLA(args).to(dt)
    moe = ref.MoE(args).to(dt)
    dense = ref.DenseMLP(args.hidden_size, args.intermediate_size).to(dt)
    norm = ref.RMSNorm(args.hidden_size, args.rms_norm_eps).to(dt)
    cos_sin = ref.rope_frequencies(args)
    rows = []

    def rope(T):
        inv, mscale = cos_sin
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        return (freqs.cos() * mscale).to(dt), (freqs.sin() * mscale).to(dt)

    def attention(T):
        x = torch.randn(T, args.hidden_size, dtype=dt)
        cos, sin = rope(T)
        return lambda: mla(x, cos, sin)

    with torch.inference_mode():
        for T in sorted(set(prefill) | set(decode)):
            x = torch.randn(T, args.hidden_size, dtype=dt)
            rows += [
                {"op": "shared_experts", "tokens": T, "context": 0, "tp": tp, "us": _best_us(lambda: moe.shared_experts(x))},
                {"op": "routed_experts", "tokens": T, "context": 0, "tp": tp,
                 "us": _best_us(lambda: moe(x)) - _best_us(lambda: moe.shared_experts(x))},
                {"op": "dense_mlp", "tokens": T, "context": 0, "tp": tp, "us": _best_us(lambda: dense(x))},
                {"op": "norm_add", "tokens": T, "context": 0, "tp": tp, "us": _best_us(lambda: norm(x + x))},
            ]
        for T in prefill:  # one prompt: T queries over T causal keys
            rows.append({"op": "attention_prefill", "tokens": T, "context": T, "tp": tp, "us": _best_us(attention(T))})
        for B in decode:
            # reference.py has no KV cache: B queries attending over B keys stand in for B
            # sequences' single queries over decode_context keys each (the same projections;
            # the core is a small share at these widths)
            rows.append({"op": "attention_decode", "tokens": B, "context": decode_context, "tp": tp,
                         "us": _best_us(attention(B))})
    for r in rows:
        r["us"] = round(max(r["us"], 1.0), 1)
    return rows


def contention_worker(cfg: dict, tp: int, tokens: int, rank: int, init: str, seconds: float) -> None:
    """One rank of --contention-probe: prints the routed experts' median time alone and beside
    a comm thread that keeps an all-reduce in flight, as one JSON line."""
    import torch
    import torch.distributed as dist
    from sglang_farskip import reference as ref

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    args = shard_args(cfg, tp)
    moe = ref.MoE(args).to(torch.bfloat16)
    x = torch.randn(tokens, args.hidden_size, dtype=torch.bfloat16)
    message = torch.randn(tokens, args.hidden_size, dtype=torch.bfloat16)  # [T, H], as each AR sends

    def timed(stop_at: float) -> list[float]:
        out = []
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            moe(x)
            out.append(time.perf_counter() - t0)
        return out

    with torch.inference_mode():
        moe(x)
        dist.barrier()
        alone = timed(time.perf_counter() + seconds)
        # The comm thread has a group of its own (gloo matches collectives per group in call
        # order, so two threads must not share one) and stops on a flag it all-reduces, so
        # that both ranks run the same number of all-reduces.
        side = dist.new_group([0, 1], backend="gloo")
        stop = threading.Event()

        def comm():
            flag = torch.zeros(1)
            while not flag.item():
                dist.all_reduce(message, group=side)
                flag.fill_(float(stop.is_set()))
                dist.all_reduce(flag, group=side)

        thread = threading.Thread(target=comm)
        thread.start()
        beside = timed(time.perf_counter() + seconds)
        stop.set()
        thread.join()
    print(json.dumps({"rank": rank, "alone_ms": 1e3 * statistics.median(alone),
                      "beside_ms": 1e3 * statistics.median(beside), "runs": [len(alone), len(beside)]}))
    dist.destroy_process_group()


def contention_probe(config: str, tp: int, tokens: int, rate: str, burst: str, seconds: float) -> dict:
    from sglang_farskip.testbed.netns import BENCH, shaped_link
    from sglang_farskip.testbed.ports import free_port

    NS, VETH, ADDR = BENCH.ns, BENCH.veth, BENCH.addr

    with shaped_link(rate, burst):
        init = f"{ADDR[0]}:{free_port()}"
        procs = []
        for rank in (0, 1):
            cmd = ["ip", "netns", "exec", NS[rank], "taskset", "-c", str(rank % (os.cpu_count() or 1)),
                   sys.executable, __file__, "--contention-worker", str(rank), "--init", init,
                   "--tp", str(tp), "--prefill", str(tokens), "--seconds", str(seconds), "--out", "-"]
            if config:
                cmd += ["--config", config]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": VETH[rank]}
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120 + 4 * seconds)
            if proc.returncode:
                raise SystemExit(f"error: contention worker exited {proc.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    loss = statistics.mean(1 - o["alone_ms"] / o["beside_ms"] for o in outs)
    return {"link": f"{rate} tbf burst {burst}", "tokens": tokens, "ranks": outs, "contention": round(loss, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="per-op JSON to write")
    p.add_argument("--config", help="config.json (default: the built-in demo model's)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (one core per rank on the testbed)")
    p.add_argument("--prefill", default="256,512,1024")
    p.add_argument("--decode", default="16,32,64")
    p.add_argument("--decode-context", type=int, default=24, help="overlap_bench: 8-token prompts, 32 new tokens")
    p.add_argument("--contention-probe", action="store_true",
                   help="measure --contention on the shaped link instead (root); --out gets its JSON")
    p.add_argument("--rate", default="200mbit", help="--contention-probe: tbf rate (as overlap_bench.py)")
    p.add_argument("--burst", default="2kb", help="--contention-probe: tbf bucket (as overlap_bench.py)")
    p.add_argument("--seconds", type=float, default=15.0, help="--contention-probe: time per phase")
    p.add_argument("--contention-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
    else:
        from sglang_farskip.tools.demo_model import TINY
        cfg = dict(TINY)
    sizes = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    if args.contention_worker is not None:
        contention_worker(cfg, args.tp, sizes(args.prefill)[0], args.contention_worker, args.init, args.seconds)
        return 0
    if args.contention_probe:
        doc = contention_probe(args.config, args.tp, sizes(args.prefill)[0], args.rate, args.burst, args.seconds)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"contention {doc['contention']:.3f} (routed experts, {doc['tokens']} tokens, median ms alone -> "
              f"beside an all-reduce: " + ", ".join(f"rank {o['rank']} {o['alone_ms']:.1f} -> {o['beside_ms']:.1f}"
                                                    for o in doc["ranks"]) + f"); wrote {args.out}")
        return 0
    t0 = time.perf_counter()
    rows = measure(cfg, args.tp, sizes(args.prefill), sizes(args.decode), args.decode_context)
    doc = {"source": f"CPU testbed, reference.py modules, torch {torch.__version__}, {args.threads} thread(s), "
                     f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s",
           "dtype": "bf16", "per_op_us": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
