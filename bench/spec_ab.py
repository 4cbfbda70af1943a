#!/usr/bin/env python3
"""Speculative decoding with FarSkip, measured: FarSkip + MTP vs FarSkip vs stock + MTP on the
same weights, side by side in one load run (bench/run_load.py, three targets).

    python bench/spec_ab.py --tp 2 --concurrency 1,4 --duration 30

It builds the tiny demo checkpoint with an MTP layer made to predict what the target will
(demo_model.predictable_mtp: drafts mostly accepted, as a trained MTP layer's are; `--draft
random` keeps the demo's random MTP layer, whose drafts are mostly rejected: the worst case),
starts three servers on it at once, and runs the load:
- farskip_mtp: the FarSkip wiring (overlap) + EAGLE on the MTP layer;
- farskip:     the FarSkip wiring (overlap), no speculative decoding;
- stock_mtp:   `--farskip-mode off` (SGLang's DeepSeek-V3 wiring) + EAGLE.
Ratios in the report are farskip_mtp / each other; the accept length comes from SGLang's
per-request verify counts. EAGLE's shape defaults to the LMSYS blog's DeepSeek-V3 setting (2
steps, top-1, 3 draft tokens). Every server gets --sleep-on-idle (the launcher's CPU default),
so the two idle servers leave the cores to the one under load. Output: the run_load report in
--out, and the servers' logs beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
import run_load  # noqa: E402

BASE_PORT = 30100
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "3"]
TARGETS = {  # label: launcher flags beyond the checkpoint and layout
    "farskip_mtp": ["--farskip-mode", "overlap", *EAGLE],
    "farskip": ["--farskip-mode", "overlap"],
    "stock_mtp": ["--farskip-mode", "off", *EAGLE],
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of every server (default 2)")
    p.add_argument("--draft", choices=["predictable", "random"], default="predictable",
                   help="the MTP layer: made to predict the target (default), or the demo's random one")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--duration", type=int, default=30, help="seconds per level and target")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--start-timeout", type=int, default=900, help="seconds for all three servers to answer")
    p.add_argument("--out", type=Path, default=None, help="default bench-results/spec-ab-<time>")
    return p.parse_args(argv)


def prepare_checkpoint(out: Path, draft: str) -> Path:
    """The demo with an MTP layer under `out` (built once, reused by later runs there)."""
    from sglang_farskip.tools.demo_model import build_checkpoint, predictable_mtp

    base = out / "ckpt-demo"
    if not base.exists():
        build_checkpoint(base, seed=0)
    if draft == "random":
        return base
    path = out / "ckpt-predictable-mtp"
    return path if path.exists() else predictable_mtp(base, path)


def start(label: str, flags: list[str], port: int, model: Path, tp: int, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang_farskip.serve.launcher", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--tp", str(tp), "--enable-metrics", "--sleep-on-idle", *flags]
    log = open(out / f"server-{label}.log", "w")
    print(f"starting {label}: {' '.join(cmd[1:])}", file=sys.stderr)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)


def wait_ready(servers: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = dict(servers)
    while waiting:
        for label, (proc, url) in list(waiting.items()):
            if proc.poll() is not None:
                raise SystemExit(f"error: the {label} server exited with {proc.returncode}; see its log")
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        del waiting[label]
            except (urllib.error.URLError, OSError):
                pass
        if waiting and time.monotonic() > deadline:
            raise SystemExit(f"error: {sorted(waiting)} not ready after {timeout} s; see the logs")
        time.sleep(2)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = (args.out or REPO / "bench-results" / f"spec-ab-{datetime.now():%Y%m%d-%H%M%S}").absolute()
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_checkpoint(out, args.draft)
    servers = {}
    try:
        for k, (label, flags) in enumerate(TARGETS.items()):
            port = BASE_PORT + 10 * k
            servers[label] = (start(label, flags, port, model, args.tp, out), f"http://127.0.0.1:{port}")
        wait_ready(servers, args.start_timeout)
        targets = [arg for label, (_, url) in servers.items() for arg in ("--target", f"{label}={url}")]
        return run_load.main([*targets, "--concurrency", args.concurrency, "--duration", str(args.duration),
                              "--max-tokens", str(args.max_tokens), "--input-len", str(args.input_len),
                              "--out", str(out / "load"),
                              "--title", f"Speculative decoding with FarSkip: TP={args.tp}, {args.draft} MTP drafts"])
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
