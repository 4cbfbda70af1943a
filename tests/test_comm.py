"""comm.py on real collectives: two spawned processes, a gloo group, plain torch (no SGLang)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_farskip.comm import Communicator, Handle, SideStreamAllReduce
from sglang_farskip.profiler import GpuTiming, OverlapProfiler

from sglang_farskip.testbed.servers import free_port


class TorchGroup:
    """The three things Communicator needs from a group, over a plain torch.distributed group."""

    def __init__(self, group):
        self.device_group = group
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.device_group)
        return t


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = TorchGroup(dist.group.WORLD)
    blocking = Communicator(group, asynchronous=False)
    overlap = Communicator(group, asynchronous=True)
    overlap.profiler = OverlapProfiler()
    torch.manual_seed(rank)
    parts = [torch.randn(64, 32) for _ in range(3)]

    # Same inputs, same gloo reduction: the async path must give the same bits.
    want = [blocking.start_all_reduce(p.clone()).wait() for p in parts]
    handles = [overlap.start_all_reduce(p.clone(), lane="routed", layer=i) for i, p in enumerate(parts)]
    overlap.mark_compute()  # work between launch and wait, as the model does
    got = [h.wait() for h in handles]

    # `blocking` mode: the comm thread, joined at launch. Nothing may be in flight when
    # start_all_reduce returns, whatever compute follows; the bits are the same.
    waited = Communicator(group, asynchronous=True, wait_at_launch=True)
    waited.profiler = OverlapProfiler()
    at_launch, idle_after_start = [], []
    for i, p in enumerate(parts):
        h = waited.start_all_reduce(p.clone(), lane="routed", layer=i)
        idle_after_start.append(not waited.in_flight())
        waited.mark_compute()
        at_launch.append(h.wait())
    results[rank] = {
        "bitwise": all(torch.equal(a, b) for a, b in zip(want, got)),
        "waited_bitwise": all(torch.equal(a, b) for a, b in zip(want, at_launch)),
        "idle_after_start": idle_after_start,
        "waited_profile": waited.profiler.snapshot(),
        "backends": (blocking.backend, overlap.backend, waited.backend),
        "profile": overlap.profiler.snapshot(),
        "sum_ok": torch.allclose(got[0], sum(torch.randn(64, 32, generator=torch.Generator().manual_seed(r)) for r in range(2))),
    }
    dist.destroy_process_group()


def test_async_equals_blocking_on_two_gloo_ranks():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=True)
    for rank in range(2):
        r = results[rank]
        assert r["bitwise"] and r["sum_ok"]
        assert r["backends"] == ("blocking", "comm-thread", "comm-thread")
        stats = r["profile"]["prefill/0/routed"]
        assert stats["count"] == 1 and stats["min_steps_between"] == 1
        assert stats["comm_s"] >= 0 and stats["blocked_s"] >= 0
        # wait_at_launch: same bits, nothing in flight after a launch, no step between
        assert r["waited_bitwise"] and r["idle_after_start"] == [True] * 3
        assert [r["waited_profile"][f"prefill/{i}/routed"]["min_steps_between"] for i in range(3)] == [0] * 3


def test_world_size_one_is_identity_and_double_wait_raises():
    class One:
        world_size = 1

    comm = Communicator(One(), asynchronous=True)
    t = torch.ones(3)
    h = comm.start_all_reduce(t)
    assert comm.backend == "identity" and h.wait() is t
    with pytest.raises(RuntimeError, match="waited twice"):
        h.wait()


def test_blocking_collective_counts_as_fully_blocked():
    class One:
        world_size = 1

    comm = Communicator(One(), asynchronous=False)
    comm.profiler = OverlapProfiler()
    comm.start_all_reduce(torch.ones(2), lane="attn", layer=3).wait()
    s = comm.profiler.snapshot()["prefill/3/attn"]
    assert s["min_steps_between"] == 0 and s["blocked_s"] >= s["comm_s"] * 0.99


def _exception_worker(rank: int, port: int, results) -> None:
    """Both ranks launch two sums, then the forward raises (as a shared error such as a bad
    batch would on every rank). Rank 1 enters its collectives late, so rank 0's are provably
    still running when it raises."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = Communicator(TorchGroup(dist.group.WORLD), asynchronous=True)
    parts = [torch.full((1024,), float(rank + 1) * (i + 1)) for i in range(2)]
    in_flight_at_raise = None
    try:
        if rank == 1:
            time.sleep(1.0)
        handles = [comm.start_all_reduce(p, lane="routed", layer=i) for i, p in enumerate(parts)]
        in_flight_at_raise = comm.in_flight()
        raise RuntimeError("mid-forward failure")
    except RuntimeError:
        comm.drain()  # what FarSkipDeepseekV2Model.forward does on any exception
    drained = not comm.in_flight()
    # The dropped handles' tensors hold the completed sums: 1+2 and 2+4.
    dropped = [float(h._tensor[0]) for h in handles]
    nxt = comm.start_all_reduce(torch.full((8,), float(rank + 10))).wait()
    results[rank] = {"in_flight_at_raise": in_flight_at_raise, "drained": drained,
                     "dropped": dropped, "next": nxt.tolist()}
    dist.destroy_process_group()


def test_exception_mid_forward_leaves_no_collective_running():
    results = mp.Manager().dict()
    mp.spawn(_exception_worker, args=(free_port(), results), nprocs=2, join=True)
    assert results[0]["in_flight_at_raise"] is True  # rank 1 had not joined yet
    for rank in range(2):
        r = results[rank]
        assert r["drained"], r
        assert r["dropped"] == [3.0, 6.0], r
        assert r["next"] == [21.0] * 8, r  # 10 + 11: the next sum is the right one


PEER_TIMEOUT_S = 3  # the lost-peer test's collective timeout: short, so the test takes seconds


def _lost_peer_worker(rank: int, port: int, results) -> None:
    """Rank 1 joins the group and then never enters a collective (a node gone, a link cut).
    Rank 0 queues three sums on the comm thread: the first waits out the group's timeout, and
    the two behind it must fail at once (gloo closes the pair on a timeout) instead of each
    waiting it out again, so that drain() after the forward's exception returns after one
    timeout, not three, and the server exits with the first error."""
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
    if rank == 1:
        time.sleep(4 * PEER_TIMEOUT_S)  # alive (no connection reset) but silent
        return
    comm = Communicator(TorchGroup(dist.group.WORLD), asynchronous=True)
    t0 = time.monotonic()
    handles = [comm.start_all_reduce(torch.ones(1024), lane="routed", layer=i) for i in range(3)]
    errors = []
    try:
        handles[0].wait()
    except RuntimeError as e:
        errors.append(str(e))
        comm.drain()
    drained_s = time.monotonic() - t0
    for h in handles[1:]:
        try:
            h.wait()
        except RuntimeError as e:
            errors.append(str(e))
    results[rank] = {"errors": errors, "drained_s": drained_s, "in_flight": comm.in_flight()}


def test_a_failed_collective_fails_the_queued_ones_at_once():
    results = mp.Manager().dict()
    mp.spawn(_lost_peer_worker, args=(free_port(), results), nprocs=2, join=True)
    r = results[0]
    assert len(r["errors"]) == 3 and not r["in_flight"], r
    assert "Timed out" in r["errors"][0], r
    # One timeout, with room for a slow start; three would be 3 x PEER_TIMEOUT_S.
    assert r["drained_s"] < 2 * PEER_TIMEOUT_S, r


def test_join_then_wait_returns_the_sum_once():
    class One:
        world_size = 1

    h = Communicator(One(), asynchronous=False).start_all_reduce(torch.ones(2))
    assert torch.equal(h.join().wait(), torch.ones(2))
    with pytest.raises(RuntimeError, match="waited twice"):
        h.wait()
    h2 = Communicator(One(), asynchronous=False).start_all_reduce(torch.ones(2))
    h2.join()
    with pytest.raises(RuntimeError, match="joined after"):
        h2.join()


def test_side_stream_refuses_a_strided_tensor_before_touching_a_stream():
    # NCCL would reduce data_ptr() .. + numel(): a transposed view is other bytes. The check
    # runs first, so it is exercised here without a GPU.
    side = object.__new__(SideStreamAllReduce)
    with pytest.raises(ValueError, match="contiguous"):
        side.start(torch.zeros(4, 3).t())


class _FakeGpuEvent:
    """A CUDA event's timestamp, in ms, for the profiler's arithmetic on a CPU."""

    def __init__(self, t_ms: float):
        self.t_ms = t_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_FakeGpuEvent") -> float:
        return end.t_ms - self.t_ms


def _gpu_timing(start, end, reached):
    timing = object.__new__(GpuTiming)
    timing.start, timing.end, timing.reached = (_FakeGpuEvent(t) for t in (start, end, reached))
    return timing


def test_gpu_profile_counts_only_the_stall_at_the_join():
    prof = OverlapProfiler()
    # Ran 2..7 ms; the main stream reached the join at 5 ms: stalled 2 of its 5 ms.
    prof.on_gpu_wait(prof.on_start("routed", 1), _gpu_timing(2.0, 7.0, 5.0))
    # Ran 0..3 ms, joined at 4 ms: fully hidden.
    prof.on_gpu_wait(prof.on_start("routed", 1), _gpu_timing(0.0, 3.0, 4.0))
    assert prof.snapshot() == {}  # read only at flush: the events may not have completed
    prof.flush()
    s = prof.snapshot()["prefill/1/routed"]
    assert s["count"] == 2
    assert abs(s["comm_s"] - 8e-3) < 1e-12 and abs(s["blocked_s"] - 2e-3) < 1e-12
