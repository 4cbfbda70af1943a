"""serve/timeouts.py on SGLang's own process groups: two spawned ranks, gloo, no server.

A gloo send is a rendezvous: it completes only once the peer has posted the receive. So rank 0,
the root of the request broadcast every scheduler step runs on the TP group's CPU group,
waits on a peer that has gone silent. With `--dist-timeout` given, that wait must end after
the timeout, as every device-group collective does; upstream's CPU groups wait 120 minutes.
"""

from __future__ import annotations

import time

import torch.multiprocessing as mp

from sglang_farskip.testbed.servers import free_port

DIST_TIMEOUT_S = 3
SILENT_S = 30  # the longest rank 1 stays alive without posting a receive


def _rank(rank: int, port: int, results, done) -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.utils import broadcast_pyobj

    from sglang_farskip import boundary

    boundary.install("every")  # what plugin.register() does in every process SGLang starts
    HookRegistry.apply_hooks()
    ps.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    timeout=DIST_TIMEOUT_S)
    # The TP group as initialize_model_parallel builds it (which reads a whole server's layout
    # from SGLang's runtime context); CPU here, so no NCCL and no custom all-reduce.
    tp = ps.init_model_parallel_group([[0, 1]], rank, "gloo", use_pynccl=False,
                                      use_custom_allreduce=False, group_name="tp")
    # Both ranks present: a request list goes across, as in the scheduler's recv_requests.
    got = broadcast_pyobj(["req-0"] if rank == 0 else None, rank, tp.cpu_group, src=0)
    results[f"both_{rank}"] = got
    if rank == 1:
        done.wait(SILENT_S)  # alive, connected, silent: what a cut link looks like to rank 0
        return
    start = time.monotonic()
    try:
        broadcast_pyobj(["req-1"], 0, tp.cpu_group, src=0)
        results["error"] = None
    except RuntimeError as e:
        results["error"] = str(e)
    results["waited_s"] = time.monotonic() - start
    done.set()


def test_a_silent_peer_ends_the_request_broadcast_after_dist_timeout():
    manager = mp.Manager()
    shared, done = manager.dict(), manager.Event()
    mp.spawn(_rank, args=(free_port(), shared, done), nprocs=2, join=True)
    results = dict(shared)
    assert results["both_0"] == results["both_1"] == ["req-0"], results
    # Gloo's own message, within the timeout plus 10 s of slack for a busy 2-core machine.
    # Without the hook, rank 0 waits until rank 1 exits (SILENT_S) and then reports the
    # connection closed instead.
    assert results["error"] and "timed out" in results["error"].lower(), results
    assert results["waited_s"] < DIST_TIMEOUT_S + 10, results
