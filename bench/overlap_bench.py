"""FarSkip overlap on CPU, measured: overlap vs sync vs off, side by side in one run.

    sudo .venv/bin/python bench/overlap_bench.py --link loopback
    sudo .venv/bin/python bench/overlap_bench.py --link shaped --rate 200mbit
    sudo .venv/bin/python bench/overlap_bench.py --link shaped --layout dp-attention

Each mode gets its own two-rank server on the tiny demo model (the same weights), started one
after another (two idle servers busy-poll the 2 cores), and the same workload:
- TTFT: serial single requests of --prompt-len random tokens (no prefix-cache hits), 1 token;
- ITL: --batch concurrent streams decoding --decode-tokens tokens each.
In overlap and sync mode the server records, per collective, its duration and how long the
caller was blocked waiting (comm.OverlapProfiler); from rank 0's record:
    hidden = 1 - blocked / duration                                  (overlap mode)
    f      = blocked / wall time of the phase                        (sync mode; every
             collective blocks there, so this is the exposed-communication share of a step)
    bound  = 1 / (1 - f)                  best speed-up if compute could hide all communication
    link-bound = 1 / max(f, 1 - f)        best speed-up at all: overlap cannot beat the longer
                                          of compute and communication (the tighter one once
                                          communication is the larger share)

Per collective lane (attn, attn+shared, routed; under DP attention also gather, which is
waited at once) the report adds its own hidden share in overlap mode and its blocked time in
sync mode.

--layout tp:           --tp 2: attention and MoE both tensor-parallel over the two ranks.
--layout dp-attention: --tp 2 --dp 2 --enable-dp-attention: each rank attends over its own
                       requests (SGLang hands them out in turn), the MoE runs on both ranks'
                       tokens. Add --server-arg=--ep-size=2 for expert parallelism.
--link loopback: both ranks in one node, gloo over 127.0.0.1.
--link shaped:   two "nodes" (nnodes 2, one rank each) in two network namespaces joined by a
                 veth pair, each end rate-limited with `tc qdisc ... tbf` (a small bucket:
                 see shaped_link), each node with its own /dev/shm; made here and removed
                 afterwards (needs root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sglang_farskip.serve.watchdog import signal_group
from sglang_farskip.testbed.netns import BENCH, shaped_link
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.servers import stream_times

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
NS, VETH, ADDR = BENCH.ns, BENCH.veth, BENCH.addr  # the two namespaces this script creates, nothing else


# ------------------------------------------------------------------ client (runs in node 0's netns)
def client(args) -> dict:
    rng = random.Random(args.seed)
    prompt = lambda n: [0] + [rng.randrange(2, 4000) for _ in range(n - 1)]  # noqa: E731
    stream_times(args.url, prompt(16), 4)  # warm-up
    if args.phase == "ttft":
        t0 = time.perf_counter()
        ttfts = [stream_times(args.url, prompt(args.prompt_len), 1)[0] for _ in range(args.repeats)]
        return {"ttft_s": statistics.median(ttfts), "wall_s": time.perf_counter() - t0}
    gaps, lock = [], threading.Lock()

    def one():
        times = stream_times(args.url, prompt(8), args.decode_tokens)
        with lock:
            gaps.extend(b - a for a, b in zip(times, times[1:]))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(args.batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"itl_s": statistics.median(gaps), "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ orchestration
LAYOUTS = {"tp": ["--tp", "2"], "dp-attention": ["--tp", "2", "--dp", "2", "--enable-dp-attention"]}


class Deployment:
    """One two-rank FarSkip server in one mode and layout, on loopback or across the two
    namespaces."""

    def __init__(self, link: str, layout: str, mode: str, model: str, profile_dir: Path, log_dir: Path,
                 extra: list[str]):
        self.link, self.port, self.procs = link, free_port(), []
        common = ["--model-path", model, "--farskip-mode", mode, *LAYOUTS[layout],
                  "--max-running-requests", "128", *extra]
        if profile_dir is not None:
            common += ["--farskip-profile-dir", str(profile_dir)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if link == "loopback":
            self._spawn([PY, "-m", "sglang_farskip.serve.launcher", "--host", "127.0.0.1",
                         "--port", str(self.port), *common], env, log_dir / f"{mode}.log")
            return
        init = f"{ADDR[0]}:{free_port()}"
        for rank in (0, 1):
            node = [PY, "-m", "sglang_farskip.serve.launcher", "--host", "127.0.0.1",
                    "--port", str(self.port), "--nnodes", "2", "--node-rank", str(rank),
                    "--dist-init-addr", init, "--dist-timeout", "120", *common]
            # Each node: its own netns and its own /dev/shm (SGLang probes shared memory to
            # decide whether ranks share a host).
            inner = "mount -t tmpfs tmpfs /dev/shm && exec " + " ".join(map(_quote, node))
            cmd = ["ip", "netns", "exec", NS[rank], "unshare", "-m", "sh", "-c", inner]
            self._spawn(cmd, {**env, "SGLANG_HOST_IP": ADDR[rank], "GLOO_SOCKET_IFNAME": VETH[rank]},
                        log_dir / f"{mode}-node{rank}.log")

    def _spawn(self, cmd, env, log: Path) -> None:
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                           start_new_session=True, cwd=REPO))

    def prefix(self) -> list[str]:
        return [] if self.link == "loopback" else ["ip", "netns", "exec", NS[0]]

    def run_client(self, phase: str, args) -> dict:
        cmd = [*self.prefix(), PY, __file__, "--client", "--url", f"http://127.0.0.1:{self.port}",
               "--phase", phase, "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats),
               "--batch", str(args.batch), "--decode-tokens", str(args.decode_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_ready(self, timeout=600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a node exited during start-up; see the logs")
            probe = [*self.prefix(), "curl", "-sf", f"http://127.0.0.1:{self.port}/health_generate"]
            if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
                return
            time.sleep(2)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        for p in self.procs:
            signal_group(p, signal.SIGKILL)
            p.wait()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def profile_delta(path: Path, before: dict) -> dict:
    """{phase: {comm_s, blocked_s, lanes: {lane: {comm_s, blocked_s}}}} since `before`; the
    profile's keys are "phase/layer/lane"."""
    now = json.loads(path.read_text()) if path.exists() else {}
    out = {phase: {"comm_s": 0.0, "blocked_s": 0.0, "lanes": {}} for phase in ("prefill", "decode")}
    for key, v in now.items():
        phase, _, lane = key.split("/", 2)
        if phase not in out:
            continue
        then = before.get(key, {})
        lane_sums = out[phase]["lanes"].setdefault(lane, {"comm_s": 0.0, "blocked_s": 0.0})
        for field in ("comm_s", "blocked_s"):
            d = float(v[field] - then.get(field, 0))
            out[phase][field] += d
            lane_sums[field] += d
    return out


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def measure_mode(link, layout, mode, model, args, work: Path) -> dict:
    profile_dir = work / f"profile-{mode}"
    shutil.rmtree(profile_dir, ignore_errors=True)
    profile_dir.mkdir(parents=True)
    dep = Deployment(link, layout, mode, model, None if args.no_profile else profile_dir, work, args.server_arg)
    try:
        t = time.monotonic()
        dep.wait_ready()
        print(f"  [{mode}] ready in {time.monotonic() - t:.0f} s", flush=True)
        prof = profile_dir / "profile-rank0.json"
        result = {}
        for phase, key in (("ttft", "prefill"), ("itl", "decode")):
            before = read(prof)
            r = dep.run_client(phase, args)
            d = profile_delta(prof, before)[key]
            result.update(r)
            result[f"{phase}_wall_s"] = r["wall_s"]
            result[f"{key}_comm_s"], result[f"{key}_blocked_s"] = d["comm_s"], d["blocked_s"]
            for lane, v in d["lanes"].items():
                result[f"{key}_lane_{lane}_comm_s"], result[f"{key}_lane_{lane}_blocked_s"] = v["comm_s"], v["blocked_s"]
            print(f"  [{mode}] {phase}: {r} comm {d['comm_s']:.3f} s blocked {d['blocked_s']:.3f} s", flush=True)
        return result
    finally:
        dep.stop()


def report(results: dict, args) -> str:
    lines = [f"layout={args.layout} link={args.link}"
             + (f" rate={args.rate} burst={args.burst}" if args.link == "shaped" else "")
             + (f" server_args={' '.join(args.server_arg)}" if args.server_arg else "")
             + f" prompt_len={args.prompt_len} batch={args.batch} decode_tokens={args.decode_tokens}"
             + f" repeats={args.repeats} rounds={args.rounds}",
             "", "| mode | TTFT ms | ITL ms | prefill comm hidden | decode comm hidden |",
             "|---|---|---|---|---|"]

    def hidden(r, phase):
        c, b = r.get(f"{phase}_comm_s", 0), r.get(f"{phase}_blocked_s", 0)
        return f"{100 * (1 - b / c):.1f}%" if c > 0 else "n/a"

    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0] if isinstance(rs[0][k], float)}
           for m, rs in results.items()}
    for mode, r in med.items():
        lines.append(f"| {mode} | {1000 * r['ttft_s']:.1f} | {1000 * r['itl_s']:.2f} | "
                     f"{hidden(r, 'prefill') if mode == 'overlap' else '-'} | "
                     f"{hidden(r, 'decode') if mode == 'overlap' else '-'} |")
    lines.append("")
    if not args.no_profile and ("overlap" in med or "sync" in med):
        lines += lane_table(med)
    if "sync" in med and not args.no_profile:
        s = med["sync"]
        for phase, wall in (("prefill", "ttft_wall_s"), ("decode", "itl_wall_s")):
            f = s[f"{phase}_blocked_s"] / s[wall] if s[wall] else 0.0
            lines.append(f"sync {phase}: exposed communication share f = {f:.2f}, "
                         f"bound 1/(1-f) = {1 / (1 - f) if f < 1 else float('inf'):.2f}x, "
                         f"link-bound 1/max(f,1-f) = {1 / max(f, 1 - f):.2f}x")
    for base in ("blocking", "sync", "off"):
        if "overlap" in med and base in med:
            o, b = med["overlap"], med[base]
            lines.append(f"overlap/{base}: TTFT {o['ttft_s'] / b['ttft_s']:.3f}  ITL {o['itl_s'] / b['itl_s']:.3f}"
                         f"  (speed-up {b['ttft_s'] / o['ttft_s']:.2f}x / {b['itl_s'] / o['itl_s']:.2f}x)")
    return "\n".join(lines)


def lane_table(med: dict) -> list[str]:
    """Per phase and lane: the hidden share in overlap mode, and the seconds callers were
    blocked over the whole phase (rank 0) in sync and in overlap mode."""
    lines = ["| phase | lane | overlap: hidden | sync: blocked s | overlap: blocked s |", "|---|---|---|---|---|"]
    for phase in ("prefill", "decode"):
        lanes = sorted({k.split("_lane_", 1)[1].rsplit("_", 2)[0] for r in med.values() for k in r
                        if k.startswith(f"{phase}_lane_")})
        for lane in lanes:
            def get(mode, field):
                return med.get(mode, {}).get(f"{phase}_lane_{lane}_{field}")
            c, b = get("overlap", "comm_s"), get("overlap", "blocked_s")
            hidden = f"{100 * (1 - b / c):.1f}%" if c else "-"
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            lines.append(f"| {phase} | {lane} | {hidden} | {fmt(get('sync', 'blocked_s'))} | {fmt(b)} |")
    return [*lines, ""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", choices=["loopback", "shaped"], default="loopback")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tp",
                   help="tp: --tp 2; dp-attention: --tp 2 --dp 2 --enable-dp-attention")
    p.add_argument("--rate", default="200mbit", help="tbf rate of each veth end (shaped link)")
    p.add_argument("--burst", default="4kb",
                   help="tbf bucket of each veth end (shaped link); a large one lets idle time be banked")
    p.add_argument("--modes", default="sync,overlap,off")
    p.add_argument("--rounds", type=int, default=1, help="repeat the mode sequence; medians reported")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--model-path", default=None, help="a checkpoint (default: the built-in one of --model)")
    p.add_argument("--model", choices=["deepseek-v3", "v3-bench"], default="deepseek-v3",
                   help="built-in checkpoint: the 4-layer demo, or v3-bench (DeepSeek-V3's proportions, "
                        "20 layers; demo_model.V3_BENCH)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--no-profile", action="store_true",
                   help="run without the overlap profiler (timings only, no hidden fraction)")
    p.add_argument("--server-arg", action="append", default=[], help="extra launcher flag (repeatable)")
    # client mode (internal: runs inside node 0's namespace)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        print(json.dumps(client(args)))
        return 0

    model = args.model_path
    if model is None:
        from sglang_farskip.tools.demo_model import ensure_demo_checkpoint

        model = str(ensure_demo_checkpoint(kind=args.model))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="farskip-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    results = {m: [] for m in modes}
    link_ctx = shaped_link(args.rate, args.burst) if args.link == "shaped" else contextlib.nullcontext()
    with link_ctx:
        for rnd in range(args.rounds):
            for mode in modes:
                print(f"round {rnd + 1}/{args.rounds}: {mode} ({args.layout}, {args.link})", flush=True)
                results[mode].append(measure_mode(args.link, args.layout, mode, model, args, work))
    text = report(results, args)
    print("\n" + text)
    (work / "report.md").write_text(text + "\n")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nlogs and results in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
