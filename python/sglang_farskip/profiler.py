"""Overlap measurement: how long each collective took and how long the model waited for it.

`parallel.py` attaches an `OverlapProfiler` to the communicator when `--farskip-profile-dir` is
given (each rank then writes `profile-rank{R}.json` after every forward) or when SGLang's
metrics are on (`--enable-metrics`, unless `--farskip-metrics off`: the per-lane totals go to
FarSkip's series on /metrics after every forward, `PrometheusCounters`).

Per (phase, layer, lane) it sums the collective's duration (start to completion) and how long
the caller was blocked in wait(): the fraction of communication hidden = 1 - blocked / duration.
It also keeps the fewest compute steps seen between a launch and its wait (the evidence that a
wait was really deferred).

Host clocks (CPU): completion of an async collective is observed by polling at each
`mark_compute()` (after every sub-block of compute) and at wait(), not by a completion
callback: a Python callback on gloo's thread must take the GIL from the computing thread and
doubled decode step time here. So a duration is exact when the caller had to block, and
otherwise an upper bound by at most one sub-block; the hidden fraction is an upper bound too.

CUDA events (GPU): the host only enqueues, so host clocks say nothing. Each collective gets
`GpuTiming` events (start and end on the stream that runs it, `reached` on the joining stream
just before the join), resolved at `flush()`: duration = end - start, blocked =
max(0, end - reached); a blocking collective stalls its stream for all of it. Python records
the events, so graph replays would go unrecorded: the launcher refuses the profiler on a GPU
unless CUDA graphs are off.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from typing import Optional

import torch


class _Record:
    __slots__ = ("key", "nbytes", "t_start", "t_done", "steps_at_start", "blocked_in_start")

    def __init__(self, key, steps_at_start, nbytes=0):
        self.key = key
        self.nbytes = nbytes
        self.t_start = time.perf_counter()
        self.t_done = None
        self.steps_at_start = steps_at_start
        self.blocked_in_start = 0.0  # a blocking collective blocks the caller at launch


class OverlapProfiler:
    """Accumulates per-(phase, layer, lane) timings of collectives and of waits on them."""

    def __init__(self, out_path: Optional[str] = None, sinks: tuple = ()):
        self.out_path = out_path  # where flush() writes the cumulative snapshot (JSON)
        self.sinks = sinks  # each gets lane_totals() after every forward (PrometheusCounters)
        self.phase = "prefill"
        self.compute_steps = 0
        self._inflight = []  # (record, Work) of async collectives not yet seen complete
        self._lock = threading.Lock()
        self._gpu_pending = []  # (key, steps, GpuTiming) joined but not yet read
        self.stats = defaultdict(lambda: {"count": 0, "comm_s": 0.0, "blocked_s": 0.0, "bytes": 0,
                                          "min_steps_between": None})
        # The same sums per (phase, lane), all layers together: what the metrics publish.
        self.lanes = defaultdict(lambda: {"count": 0, "comm_s": 0.0, "blocked_s": 0.0, "bytes": 0})

    def mark_compute(self) -> None:
        """Called by the model after each sub-block of compute (attention, MLP)."""
        self.compute_steps += 1
        if self._inflight:
            now = time.perf_counter()
            still = []
            for rec, work in self._inflight:
                if work.is_completed():
                    rec.t_done = now
                else:
                    still.append((rec, work))
            self._inflight = still

    def track(self, rec: _Record, work) -> None:
        self._inflight.append((rec, work))

    def on_start(self, lane: str, layer: int, nbytes: int = 0) -> _Record:
        return _Record((self.phase, layer, lane), self.compute_steps, nbytes)

    def on_wait(self, rec: _Record, blocked_s: float, t_end: float) -> None:
        done = rec.t_done if rec.t_done is not None else t_end
        self._add(rec.key, max(0.0, done - rec.t_start), blocked_s + rec.blocked_in_start,
                  self.compute_steps - rec.steps_at_start, rec.nbytes)

    def on_gpu_wait(self, rec: _Record, events: "GpuTiming") -> None:
        """A GPU collective joined: its events are read at the next flush()."""
        self._gpu_pending.append((rec.key, self.compute_steps - rec.steps_at_start, events, rec.nbytes))

    def _add(self, key, comm_s: float, blocked_s: float, steps: int, nbytes: int) -> None:
        phase, _, lane = key
        with self._lock:
            for s in (self.stats[key], self.lanes[(phase, lane)]):
                s["count"] += 1
                s["comm_s"] += comm_s
                s["blocked_s"] += blocked_s
                s["bytes"] += nbytes
            s = self.stats[key]
            if s["min_steps_between"] is None or steps < s["min_steps_between"]:
                s["min_steps_between"] = steps

    def resolve_gpu(self) -> None:
        pending, self._gpu_pending = self._gpu_pending, []
        for key, steps, ev, nbytes in pending:
            comm_ms, blocked_ms = ev.elapsed_ms()
            self._add(key, comm_ms / 1e3, blocked_ms / 1e3, steps, nbytes)

    def snapshot(self) -> dict:
        with self._lock:
            return {f"{p}/{layer}/{lane}": dict(v) for (p, layer, lane), v in self.stats.items()}

    def lane_totals(self) -> dict:
        """{(phase, lane): {count, comm_s, blocked_s, bytes}}, cumulative, all layers summed."""
        with self._lock:
            return {key: dict(v) for key, v in self.lanes.items()}

    def flush(self) -> None:
        """Write the cumulative snapshot (after every forward: a reader subtracts two) and hand
        the per-lane totals to the sinks."""
        self.resolve_gpu()
        if self.sinks:
            totals = self.lane_totals()
            for sink in self.sinks:
                sink.publish(totals)
        if self.out_path is None:
            return
        tmp = f"{self.out_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, self.out_path)


# FarSkip's series on SGLang's /metrics (its --enable-metrics; docs/observing.md), named and
# labelled as SGLang names its own ("sglang:...", with model_name, engine_type, tp_rank,
# pp_rank, moe_ep_rank), plus node, and lane and phase where they apply. Counters, not
# ratios: any window's figures come from rate(), e.g. the fraction of a lane's communication
# hidden over the last minute is
#   1 - rate(farskip:wait_seconds_total[1m]) / rate(farskip:collective_seconds_total[1m])
# which a gauge could only give for one window fixed here.
METRICS = {  # name (prometheus_client adds _total): (help, the lane_totals() field it counts)
    "farskip:collective_seconds": ("Seconds FarSkip's collectives were in flight, from launch to "
                                   "completion, summed over collectives", "comm_s"),
    "farskip:wait_seconds": ("Seconds the forward was blocked waiting for FarSkip's collectives "
                             "(the part of collective_seconds not hidden behind compute)", "blocked_s"),
    "farskip:collectives": ("FarSkip collectives completed", "count"),
    "farskip:allreduce_bytes": ("Bytes of this rank's messages to FarSkip's all-reduces", "bytes"),
}


class PrometheusCounters:
    """A flush() sink: adds what each (phase, lane) did since the last forward to the counters.
    A handful of increments per forward (prometheus_client's multiprocess values are mmap'ed
    files, about a microsecond each), whatever the number of layers."""

    def __init__(self, labels: dict):
        from prometheus_client import Counter

        self.labels = {k: str(v) for k, v in labels.items()}
        names = [*self.labels, "lane", "phase"]
        self.counters = {field: Counter(name, text, names) for name, (text, field) in METRICS.items()}
        self._children = {}  # (phase, lane) -> {field: the labelled counter}
        self._published = {}  # (phase, lane) -> lane_totals() at the last publish

    def publish(self, totals: dict) -> None:
        for key, now in totals.items():
            before = self._published.get(key)
            if before == now:
                continue
            children = self._children.get(key)
            if children is None:  # first seen: the series appear, at 0 if nothing to add
                phase, lane = key
                children = {f: c.labels(**self.labels, lane=lane, phase=phase) for f, c in self.counters.items()}
                self._children[key] = children
            for field, child in children.items():
                child.inc(now[field] - (before[field] if before else 0))
            self._published[key] = now


def publish_info(labels: dict, mode: str, converted_layers: list[int], comm_backend: str) -> None:
    """farskip:info, 1 per rank, its labels saying what that rank runs: the mode, the converted
    layers (e.g. "1-3"), the all-reduce backend. A rank in another mode than its peers shows as
    a series of its own."""
    from prometheus_client import Gauge

    fields = {"mode": mode, "converted_layers": _ranges(converted_layers), "comm_backend": comm_backend}
    labels = {k: str(v) for k, v in labels.items()}
    info = Gauge("farskip:info", "What FarSkip runs on this rank (value 1; the labels say it)",
                 [*labels, *fields], multiprocess_mode="mostrecent")
    info.labels(**labels, **fields).set(1)


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"; [] -> "none"."""
    out, run = [], []
    for k in sorted(layers):
        if run and k == run[-1] + 1:
            run.append(k)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [k]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


class GpuTiming:
    """CUDA events of one GPU collective: `start`/`end` on the stream that runs it, `reached`
    on the stream that joins it, recorded just before the join."""

    __slots__ = ("start", "end", "reached")

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.reached = None

    def elapsed_ms(self) -> tuple[float, float]:
        """(duration, time the joining stream stalled for it), both in ms."""
        self.end.synchronize()
        self.reached.synchronize()
        return self.start.elapsed_time(self.end), max(0.0, self.reached.elapsed_time(self.end))
