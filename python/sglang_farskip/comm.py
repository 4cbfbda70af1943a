"""Every collective of the project: start an all-reduce, get a handle, wait for it later.

    handle = comm.start_all_reduce(partial, lane="routed", layer=k)   # the sum starts now
    ...                                                               # work that does not read it
    full = handle.wait()                                              # right before the add

A handle is a value: it is returned, passed along, and waited exactly once (a second wait is
a schedule bug and raises). Until wait() returns, the caller must neither read nor write the
tensor it passed in (every backend may reduce it in place).

Backends, chosen once per communicator:
- identity (world size 1): the "sum" is the input.
- blocking: the group's own all-reduce inside start_all_reduce (on GPU SGLang's
  GroupCoordinator picks custom AR / pynccl / NCCL). FarSkip's `sync` mode.
- comm thread (CPU, gloo): one dedicated thread runs the group's blocking all-reduce for
  every launch, strictly in launch order; wait() blocks on that launch's future. Why not
  `all_reduce(async_op=True)`: gloo may run two async collectives at once, and on a
  bandwidth-bound link the routed sum then shares the wire with the attention-lane sum that
  the next layer needs first (a first measurement said so, but its emulated link was flawed;
  quiet re-measurements favour async_op, which however left a node hanging on a cut link:
  see bench/README.md). One
  thread in program order is what the GPU side stream does too. Only FarSkip's collectives
  are in flight between the embedding and the final norm, so no other collective on the
  group can interleave with the thread's.
- side stream (CUDA/HIP): see `SideStreamAllReduce`. Stream/event semantics:
    start: the side stream waits on the current stream (fork: the partial was produced
           there), the all-reduce is enqueued on the side stream, and one of a fixed ring of
           events is recorded after it.
    wait:  the *current* stream waits on that event (join). The host never blocks.
  Fork and join are stream-to-stream edges, so a launch and its wait inside one CUDA/HIP
  graph capture are captured as graph dependencies; the events are created once and reused
  (fresh events per layer exhaust ROCm's HSA signal pool). All collectives of one
  communicator go through its one side stream in program order, so every rank issues them in
  the same order and the communicator never runs concurrently with itself.

Overlap measurement (`OverlapProfiler`, off unless attached): per (phase, layer, lane), the
collective's duration (start to completion) and how long the caller was blocked in wait(),
giving the fraction of communication hidden = 1 - blocked / duration. Completion of an async
collective is observed by polling at each `mark_compute()` (after every sub-block of compute)
and at wait(), not by a completion callback: a Python callback on gloo's thread must take the
GIL from the computing thread and doubled decode step time here. So a duration is exact when
the caller had to block, and otherwise an upper bound by at most one sub-block; the hidden
fraction is correspondingly an upper bound. It also counts compute steps between a launch and
its wait. With no profiler attached the only cost is one `is None` test per call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist


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
        steps = self.compute_steps - rec.steps_at_start
        with self._lock:
            s = self.stats[rec.key]
            s["count"] += 1
            s["comm_s"] += max(0.0, done - rec.t_start)
            s["blocked_s"] += blocked_s + rec.blocked_in_start
            if s["min_steps_between"] is None or steps < s["min_steps_between"]:
                s["min_steps_between"] = steps

    def snapshot(self) -> dict:
        with self._lock:
            return {f"{p}/{layer}/{lane}": dict(v) for (p, layer, lane), v in self.stats.items()}

    def flush(self) -> None:
        """Write the cumulative snapshot (after every forward: a reader subtracts two)."""
        if self.out_path is None:
            return
        tmp = f"{self.out_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, self.out_path)


class _CommThread:
    """Runs `all_reduce` (blocking, returns the sum) for each launch on one thread, FIFO."""

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        self._all_reduce = all_reduce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="farskip-comm")

    def start(self, tensor: torch.Tensor) -> "_Pending":
        return _Pending(self._pool.submit(self._all_reduce, tensor))


class _Pending:
    """A launch on the comm thread, with the `wait()` / `is_completed()` of a c10d Work."""

    __slots__ = ("_future", "result")

    def __init__(self, future: Future):
        self._future = future
        self.result = None

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self.result = self._future.result()  # re-raises a failed collective here


class Handle:
    """A started all-reduce. `wait()` returns the reduced tensor, once."""

    __slots__ = ("_tensor", "_work", "_event", "_waited", "_record", "_profiler")

    def __init__(self, tensor, work=None, event=None, record=None, profiler=None):
        self._tensor = tensor
        self._work = work  # _Pending launch on the comm thread (CPU async)
        self._event = event  # torch.cuda.Event recorded on the side stream
        self._waited = False
        self._record = record
        self._profiler = profiler

    def wait(self) -> torch.Tensor:
        if self._waited:
            raise RuntimeError("all-reduce handle waited twice: the FarSkip schedule is wrong")
        self._waited = True
        t0 = time.perf_counter() if self._record is not None else 0.0
        if self._work is not None:
            if self._record is not None and self._record.t_done is None and self._work.is_completed():
                self._record.t_done = t0  # finished since the last poll
            self._work.wait()
            if self._work.result is not None:
                self._tensor = self._work.result
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        if self._record is not None:
            t1 = time.perf_counter()
            self._profiler.on_wait(self._record, t1 - t0, t1)
        tensor, self._tensor, self._work, self._event = self._tensor, None, None, None
        return tensor


class SideStreamAllReduce:
    """All-reduce on a dedicated CUDA/HIP stream with a persistent ring of events.

    `all_reduce_` reduces a tensor in place on the *current* stream (SGLang's dedicated
    PyNcclCommunicator, or `torch.distributed.all_reduce` on an NCCL group in plain torch);
    this class makes that the side stream. Needs only torch.
    """

    def __init__(self, all_reduce_: Callable[[torch.Tensor], None], device=None, ring: int = 8):
        self.all_reduce_ = all_reduce_
        self.stream = torch.cuda.Stream(device=device)
        # More events than collectives that can be in flight at once (FarSkip: two lanes).
        self.events = [torch.cuda.Event() for _ in range(ring)]
        self._next = 0

    def start(self, tensor: torch.Tensor) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream())  # fork
        with torch.cuda.stream(self.stream):
            self.all_reduce_(tensor)
        event = self.events[self._next]
        self._next = (self._next + 1) % len(self.events)
        event.record(self.stream)
        return event


class Communicator:
    """All-reduce over one process group: identity, blocking, or asynchronous.

    `group` is SGLang's GroupCoordinator or anything with `world_size`, `all_reduce(t)` (returns
    the sum) and `device_group`; it is passed in explicitly, model code never looks it up.
    `side_stream` is a SideStreamAllReduce for the GPU async backend.
    """

    def __init__(self, group, *, asynchronous: bool, side_stream: Optional[SideStreamAllReduce] = None):
        self.group = group
        self.world_size = group.world_size if group is not None else 1
        self.side_stream = side_stream
        self.asynchronous = asynchronous and self.world_size > 1
        if self.asynchronous and side_stream is None and not self.supports_cpu_async(group):
            raise NotImplementedError(
                "asynchronous all-reduce on this device needs a side-stream communicator; "
                "use --farskip-mode sync"
            )
        self.profiler: Optional[OverlapProfiler] = None
        self._thread = None
        if self.asynchronous and side_stream is None:
            self._thread = _CommThread(lambda t: group.all_reduce(t))

    def mark_compute(self) -> None:
        if self.profiler is not None:
            self.profiler.mark_compute()

    @staticmethod
    def supports_cpu_async(group) -> bool:
        return dist.get_backend(group.device_group) == "gloo"

    @property
    def backend(self) -> str:
        if self.world_size == 1:
            return "identity"
        if not self.asynchronous:
            return "blocking"
        return "side-stream" if self.side_stream is not None else "comm-thread"

    def start_all_reduce(self, tensor: torch.Tensor, *, lane: str = "", layer: int = -1) -> Handle:
        prof = self.profiler
        record = prof.on_start(lane, layer) if prof is not None else None
        if self.world_size == 1:
            out = Handle(tensor, record=record, profiler=prof)
        elif not self.asynchronous:
            out = Handle(self.group.all_reduce(tensor), record=record, profiler=prof)
        elif self.side_stream is not None:
            out = Handle(tensor, event=self.side_stream.start(tensor), record=record, profiler=prof)
        else:
            work = self._thread.start(tensor)
            if record is not None:
                prof.track(record, work)
            out = Handle(tensor, work=work, record=record, profiler=prof)
        if record is not None and out._work is None and out._event is None:
            record.t_done = time.perf_counter()  # completed before returning
            record.blocked_in_start = record.t_done - record.t_start
        return out
