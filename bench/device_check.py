"""GPU check of comm.py's side-stream backend: plain torch, one GPU, no SGLang, no network.

    python bench/device_check.py          # < 1 minute on an H200; prints results, exit 1 on failure

1. A real NCCL all-reduce (world size 1) through SideStreamAllReduce on its own stream,
   while a long matmul runs on the main stream: compares eager serial vs overlapped time.
2. The same launch / matmul / wait captured in one CUDA graph (fork and join inside the
   capture); replay must equal the eager result.
3. The persistent event ring: many more launches than events, all results correct.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from sglang_farskip.comm import Communicator, SideStreamAllReduce  # noqa: E402


class NcclGroup:
    def __init__(self):
        self.device_group = dist.group.WORLD
        self.world_size = dist.get_world_size()

    def all_reduce(self, t):
        dist.all_reduce(t)
        return t


def timed(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    assert torch.cuda.is_available(), "needs a GPU"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    dev = torch.device("cuda:0")
    side = SideStreamAllReduce(lambda t: dist.all_reduce(t), device=dev)
    # World size 1 would short-circuit to identity; force the side-stream path on purpose.
    comm = Communicator(NcclGroup(), asynchronous=True, side_stream=side)
    comm.world_size, comm.asynchronous = 2, True
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}")

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    buf = torch.randn(64 * 1024 * 1024, device=dev, dtype=torch.bfloat16)  # 128 MiB

    t_mm = timed(lambda: a @ b)
    t_ar = timed(lambda: dist.all_reduce(buf))
    t_serial = timed(lambda: (dist.all_reduce(buf), a @ b))

    def overlapped():
        h = comm.start_all_reduce(buf)
        c = a @ b
        h.wait()
        return c

    t_overlap = timed(overlapped)
    hidden = (t_serial - t_overlap) / min(t_mm, t_ar)
    print(f"matmul {t_mm:.2f} ms, all-reduce {t_ar:.2f} ms, serial {t_serial:.2f} ms, "
          f"side-stream overlapped {t_overlap:.2f} ms -> hidden {100 * hidden:.0f}% of the shorter")

    # Graph capture: fork and join inside one capture; replay equals eager.
    x = torch.randn(4096, 4096, device=dev)
    w = torch.randn(4096, 4096, device=dev)
    part = torch.randn(1 << 20, device=dev)

    def step():
        p = part.clone()
        h = comm.start_all_reduce(p)
        y = x @ w
        return y.sum() + h.wait().sum()

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on a side stream, as torch recommends before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    ok_graph = torch.allclose(out, eager, rtol=1e-5, atol=1e-3)
    print(f"graph replay == eager: {ok_graph} ({out.item():.4f} vs {eager.item():.4f})")

    # More launches than ring events.
    ok_ring = True
    for i in range(3 * len(side.events)):
        t = torch.full((1024,), float(i), device=dev)
        ok_ring &= bool(torch.equal(comm.start_all_reduce(t).wait(), torch.full_like(t, float(i))))
    torch.cuda.synchronize()
    print(f"event ring reuse: {ok_ring}")
    dist.destroy_process_group()
    return 0 if ok_graph and ok_ring else 1


if __name__ == "__main__":
    sys.exit(main())
