"""Every collective of the project: start an all-reduce, get a handle, wait for it later.

    handle = comm.start_all_reduce(partial, lane="routed", layer=k)   # the sum starts now
    ...                                                               # work that does not read it
    full = handle.wait()                                              # right before the add

A handle is a value: it is returned, passed along, and waited exactly once (a second wait is
a schedule bug and raises). Until wait() returns, the caller must neither read nor write the
tensor it passed in (every backend may reduce it in place).

Backends, chosen once per communicator (`parallel.build_communicator` decides which):
- identity (world size 1): the "sum" is the input.
- blocking: the group's own all-reduce inside start_all_reduce (on GPU SGLang's
  GroupCoordinator picks custom AR / pynccl / NCCL). FarSkip's `sync` mode.
  (`blocking` mode is the comm thread or side stream below, joined inside start_all_reduce.)
- comm thread (CPU, gloo): one dedicated thread runs the group's blocking all-reduce for
  every launch, strictly in launch order; wait() blocks on that launch's future. One thread in
  program order is what the GPU side stream does too, so the routed sum never shares the wire
  with the attention-lane sum the next layer needs first; gloo's `async_op=True` may run two
  at once, and left a node hanging on a cut link (bench/README.md has the measurements). Only
  FarSkip's collectives are in flight between the embedding and the final norm, so no other
  collective on the group can interleave with the thread's.
- side stream (CUDA/HIP): see `SideStreamAllReduce`. Stream/event semantics:
    start: the side stream waits on the current stream (fork: the partial was produced
           there), the all-reduce is enqueued on the side stream, and one of a fixed ring of
           events is recorded after it.
    wait:  the *current* stream waits on that event (join). The host never blocks.
  Fork and join are stream-to-stream edges, so a launch and its wait inside one CUDA/HIP
  graph capture are captured as graph dependencies; the events are created once and reused
  (fresh events per layer exhaust ROCm's HSA signal pool). All collectives of one
  communicator go through its one side stream in program order, so every rank issues them in
  the same order and the communicator never runs concurrently with itself. The side stream
  has high priority, so its all-reduce kernels are scheduled ahead of queued compute blocks
  (a long GEMM would otherwise hold the SMs and turn overlap into serialisation).

Exceptions: a launched collective may still be reading or writing its tensor. `drain()` makes
the caller wait for every launched collective (the model calls it when a forward raises), so
no collective outlives the forward that launched it and the next forward starts clean.

Timing (`profiler.OverlapProfiler`) is off unless attached; with none attached the only cost
is one `is None` test per call.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sglang_farskip.profiler import GpuTiming, OverlapProfiler


class _CommThread:
    """Runs `all_reduce` (blocking, returns the sum) for each launch on one thread, FIFO."""

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        self._all_reduce = all_reduce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="farskip-comm")
        self._last: Optional[Future] = None

    def start(self, tensor: torch.Tensor) -> "_Pending":
        self._last = self._pool.submit(self._all_reduce, tensor)
        return _Pending(self._last)

    def drain(self) -> None:
        """Block until every launch so far has finished (FIFO: the last one finishes last)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def idle(self) -> bool:
        return self._last is None or self._last.done()


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

    __slots__ = ("_tensor", "_work", "_event", "_timing", "_waited", "_joined", "_record",
                 "_profiler")

    def __init__(self, tensor, work=None, event=None, record=None, profiler=None, timing=None):
        self._tensor = tensor
        self._work = work  # _Pending launch on the comm thread (CPU async)
        self._event = event  # torch.cuda.Event recorded on the side stream
        self._timing = timing  # GpuTiming when a profiler is attached on a GPU
        self._waited = False
        self._joined = False
        self._record = record
        self._profiler = profiler

    def wait(self) -> torch.Tensor:
        if self._waited:
            raise RuntimeError("all-reduce handle waited twice: the FarSkip schedule is wrong")
        self._waited = True
        if not self._joined:
            self._join()
        tensor, self._tensor = self._tensor, None
        return tensor

    def join(self) -> "Handle":
        """Wait for the sum now and return it later with wait(), for a caller that must not
        keep the collective in flight across some point (a CUDA-graph break)."""
        if self._waited or self._joined:
            raise RuntimeError("all-reduce handle joined after a join or wait: the FarSkip schedule is wrong")
        self._join()
        return self

    def _join(self) -> None:
        self._joined = True
        rec = self._record
        t0 = time.perf_counter() if rec is not None else 0.0
        if self._work is not None:
            if rec is not None and rec.t_done is None and self._work.is_completed():
                rec.t_done = t0  # finished since the last poll
            self._work.wait()
            if self._work.result is not None:
                self._tensor = self._work.result
        if self._event is not None:
            if self._timing is not None:
                self._timing.reached = torch.cuda.Event(enable_timing=True)
                self._timing.reached.record()
            torch.cuda.current_stream().wait_event(self._event)
        if rec is not None:
            if self._timing is not None:
                self._profiler.on_gpu_wait(rec, self._timing)
            else:
                t1 = time.perf_counter()
                self._profiler.on_wait(rec, t1 - t0, t1)
        self._work, self._event, self._timing = None, None, None


class SideStreamAllReduce:
    """All-reduce on a dedicated high-priority CUDA/HIP stream with a persistent ring of events.

    `all_reduce_` reduces a tensor in place on the *current* stream (`nccl_all_reduce_`, or
    `torch.distributed.all_reduce` on an NCCL group in plain torch); this class makes that the
    side stream. Needs only torch.
    """

    def __init__(self, all_reduce_: Callable[[torch.Tensor], None], device=None, ring: int = 8):
        self.all_reduce_ = all_reduce_
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        _, highest = torch.cuda.Stream.priority_range()
        self.stream = torch.cuda.Stream(device=self.device, priority=highest)
        # More events than collectives that can be in flight at once (FarSkip: two lanes).
        self.events = [torch.cuda.Event() for _ in range(ring)]
        self._next = 0

    def start(self, tensor: torch.Tensor, timing: Optional[GpuTiming] = None) -> torch.cuda.Event:
        if not tensor.is_contiguous():
            # NCCL reduces data_ptr() .. data_ptr() + numel(): a strided view would mix in
            # bytes that are not the tensor's.
            raise ValueError(
                f"side-stream all-reduce needs a contiguous tensor (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}): call .contiguous() before start_all_reduce"
            )
        self.stream.wait_stream(torch.cuda.current_stream())  # fork
        with torch.cuda.stream(self.stream):
            if timing is not None:
                timing.start.record()
            self.all_reduce_(tensor)
            if timing is not None:
                timing.end.record()
        event = self.events[self._next]
        self._next = (self._next + 1) % len(self.events)
        event.record(self.stream)
        return event

    def warm_up(self, numels: list[int], dtype: torch.dtype) -> int:
        """All-reduces of the given sizes, so NCCL sets up its buffers for them now: before
        SGLang sizes the KV pool from free memory (a first big prefill could otherwise run out
        of memory). Returns the device bytes this kept."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for numel in numels:
            t = torch.zeros(numel, dtype=dtype, device=self.device)
            torch.cuda.current_stream(self.device).wait_event(self.start(t))
            torch.cuda.synchronize(self.device)
            del t
        torch.cuda.empty_cache()
        return free_before - torch.cuda.mem_get_info(self.device)[0]


def fork_join_probe(all_reduce_: Callable[[torch.Tensor], None], sleep_cycles: int = 2_000_000
                    ) -> Callable[[torch.Tensor], None]:
    """Test only: the same sum, but the stream running it doubles the tensor, sleeps (~1 ms),
    reduces, and halves it (exact in binary floating point). Without the fork the doubling
    races the kernel still writing the tensor (the result comes out halved); without the join
    the reader sees the doubled values. At world size 1, where the sum itself is the identity,
    either shows as wrong numbers."""

    def probe(t: torch.Tensor) -> None:
        t.mul_(2)
        torch.cuda._sleep(sleep_cycles)
        all_reduce_(t)
        t.mul_(0.5)

    return probe


def nccl_all_reduce_(cpu_group, device, *, max_ctas: Optional[int] = None
                     ) -> Callable[[torch.Tensor], None]:
    """In-place sum on the current stream over a NCCL/RCCL communicator of FarSkip's own.

    Never SGLang's group communicators (other code drives them concurrently). Built on
    `sglang_farskip.nccl`, the project's own ctypes binding (needs torch and the NCCL/RCCL
    library only; that module says why not torch's ProcessGroupNCCL). `cpu_group`: a gloo group
    to agree on the NCCL id (None: one rank, as the device checks run it). `max_ctas`: ncclConfig
    maxCTAs, the SMs one all-reduce may take from overlapped compute (None: NCCL's default;
    refused on a NCCL older than 2.17).
    """
    from sglang_farskip.nccl import NcclComm  # ctypes and the library load only when used

    return NcclComm.from_group(cpu_group, device, max_ctas=max_ctas).all_reduce_


class Communicator:
    """All-reduce over one process group: identity, blocking, or asynchronous.

    `group` is SGLang's GroupCoordinator or anything with `world_size`, `all_reduce(t)` (returns
    the sum) and `device_group`; it is passed in explicitly, model code never looks it up.
    `side_stream` is a SideStreamAllReduce for the GPU async backend; given one, the side
    stream is used even at world size 1 (where the sum is the identity), which is how the
    device check runs the real launch/fork/join path on one GPU.
    """

    def __init__(self, group, *, asynchronous: bool, side_stream: Optional[SideStreamAllReduce] = None,
                 wait_at_launch: bool = False, drop: Optional[tuple[str, int]] = None):
        self.group = group
        # Test only: the (lane, layer) collective that sums zeros instead of this rank's
        # partial, a broken lane for checks to prove they can see one.
        self.drop = drop
        # `blocking` mode: the asynchronous backend, joined inside start_all_reduce, so that an
        # A/B against overlap changes nothing but where the waits are.
        self.wait_at_launch = wait_at_launch
        self.world_size = group.world_size if group is not None else 1
        self.side_stream = side_stream
        self.asynchronous = asynchronous and (self.world_size > 1 or side_stream is not None)
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
        if self.side_stream is not None and self.asynchronous:
            return "side-stream"
        if self.world_size == 1:
            return "identity"
        return "comm-thread" if self.asynchronous else "blocking"

    def start_all_reduce(self, tensor: torch.Tensor, *, lane: str = "", layer: int = -1) -> Handle:
        if self.drop is not None and (lane, layer) == self.drop:
            tensor = torch.zeros_like(tensor)
        prof = self.profiler
        record = prof.on_start(lane, layer, tensor.numel() * tensor.element_size()) if prof is not None else None
        timing = GpuTiming() if record is not None and tensor.is_cuda else None
        if self.asynchronous:
            if self.side_stream is not None:
                event = self.side_stream.start(tensor, timing)
                handle = Handle(tensor, event=event, record=record, profiler=prof, timing=timing)
            else:
                work = self._thread.start(tensor)
                if record is not None:
                    prof.track(record, work)
                handle = Handle(tensor, work=work, record=record, profiler=prof)
            return handle.join() if self.wait_at_launch else handle
        if timing is not None:
            timing.start.record()
        out = tensor if self.world_size == 1 else self.group.all_reduce(tensor)
        if timing is not None:  # the stream ran it in line: it stalled for all of it
            timing.end.record()
            timing.reached = timing.start
        elif record is not None:
            record.t_done = time.perf_counter()  # completed before returning
            record.blocked_in_start = record.t_done - record.t_start
        return Handle(out, record=record, profiler=prof, timing=timing)

    def drain(self) -> None:
        """Wait for every collective launched so far: after an exception between a launch and
        its wait, so that none outlives its tensors or overlaps the next forward's."""
        # A graph capture that raised is discarded: none of its work ever runs.
        if self.side_stream is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.side_stream.device).wait_stream(self.side_stream.stream)
        if self._thread is not None:
            self._thread.drain()

    def in_flight(self) -> bool:
        """Whether a launched collective may still be running (host view; CPU backends)."""
        return self._thread is not None and not self._thread.idle()
