"""Overlap measurement: how long each collective took and how long the model waited for it.

Off unless `--farskip-profile-dir` is given; then `parallel.py` attaches an `OverlapProfiler` to
the communicator and each rank writes `profile-rank{R}.json` after every forward.

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
    __slots__ = ("key", "t_start", "t_done", "steps_at_start", "blocked_in_start")

    def __init__(self, key, steps_at_start):
        self.key = key
        self.t_start = time.perf_counter()
        self.t_done = None
        self.steps_at_start = steps_at_start
        self.blocked_in_start = 0.0  # a blocking collective blocks the caller at launch


class OverlapProfiler:
    """Accumulates per-(phase, layer, lane) timings of collectives and of waits on them."""

    def __init__(self, out_path: Optional[str] = None):
        self.out_path = out_path  # where flush() writes the cumulative snapshot (JSON)
        self.phase = "prefill"
        self.compute_steps = 0
        self._inflight = []  # (record, Work) of async collectives not yet seen complete
        self._lock = threading.Lock()
        self._gpu_pending = []  # (key, steps, GpuTiming) joined but not yet read
        self.stats = defaultdict(lambda: {"count": 0, "comm_s": 0.0, "blocked_s": 0.0,
                                          "min_steps_between": None})

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

    def on_start(self, lane: str, layer: int) -> _Record:
        return _Record((self.phase, layer, lane), self.compute_steps)

    def on_wait(self, rec: _Record, blocked_s: float, t_end: float) -> None:
        done = rec.t_done if rec.t_done is not None else t_end
        self._add(rec.key, max(0.0, done - rec.t_start), blocked_s + rec.blocked_in_start,
                  self.compute_steps - rec.steps_at_start)

    def on_gpu_wait(self, rec: _Record, events: "GpuTiming") -> None:
        """A GPU collective joined: its events are read at the next flush()."""
        self._gpu_pending.append((rec.key, self.compute_steps - rec.steps_at_start, events))

    def _add(self, key, comm_s: float, blocked_s: float, steps: int) -> None:
        with self._lock:
            s = self.stats[key]
            s["count"] += 1
            s["comm_s"] += comm_s
            s["blocked_s"] += blocked_s
            if s["min_steps_between"] is None or steps < s["min_steps_between"]:
                s["min_steps_between"] = steps

    def resolve_gpu(self) -> None:
        pending, self._gpu_pending = self._gpu_pending, []
        for key, steps, ev in pending:
            comm_ms, blocked_ms = ev.elapsed_ms()
            self._add(key, comm_ms / 1e3, blocked_ms / 1e3, steps)

    def snapshot(self) -> dict:
        with self._lock:
            return {f"{p}/{layer}/{lane}": dict(v) for (p, layer, lane), v in self.stats.items()}

    def flush(self) -> None:
        """Write the cumulative snapshot (after every forward: a reader subtracts two)."""
        self.resolve_gpu()
        if self.out_path is None:
            return
        tmp = f"{self.out_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, self.out_path)


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
