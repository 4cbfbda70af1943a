"""comm.py on real collectives: two spawned processes, a gloo group, plain torch (no SGLang)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_farskip.comm import Communicator, Handle, OverlapProfiler

from serverutil import free_port


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
    results[rank] = {
        "bitwise": all(torch.equal(a, b) for a, b in zip(want, got)),
        "backends": (blocking.backend, overlap.backend),
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
        assert r["backends"] == ("blocking", "comm-thread")
        stats = r["profile"]["prefill/0/routed"]
        assert stats["count"] == 1 and stats["min_steps_between"] == 1
        assert stats["comm_s"] >= 0 and stats["blocked_s"] >= 0


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
