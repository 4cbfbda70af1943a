"""Free ports for servers and rendezvous, below the ephemeral range (why: below)."""

from __future__ import annotations

import fcntl
import os
import random
import socket

# Ports for servers and rendezvous come from below Linux's ephemeral range (32768-60999 by
# default), where connect() never hands out a client port. Why: SGLang derives more ports from
# the ones it is given and checks that they are free: under DP attention the HTTP port + 233 ..
# + 240 on one node (ZMQ_TCP_PORT_DELTA, sglang/srt/server_args.py ~820), --dist-init-addr's
# port + 1 .. + 7 across nodes. From an ephemeral HTTP port, that block is ephemeral too, and a
# server started beside it (its gloo, ZMQ and HTTP client sockets) can hold one of those ports
# for the whole start: CI saw a DP-attention server exit with 1 that way. SGLang's own picks
# (the NCCL port) come from 22000-29999, so ours stay under 22000. Test servers are not left to
# that pick: SGLang checks its random NCCL port free in the launcher and the scheduler binds it
# seconds later, and two servers starting side by side can pick the same one (CI: a DP-attention
# server's TCPStore failed with EADDRINUSE on 25093). servers.Server passes
# --nccl-port = its port + NCCL_PORT_OFFSET, inside the block it claimed. Each call takes the next
# block of PORT_STRIDE ports, so blocks handed out in one run do not overlap until the range
# wraps (44 blocks, far more than the servers alive at once); pytest-xdist workers take
# disjoint halves.
#
# Two test processes on one host that are not xdist workers of one run (two terminals, or a
# developer's run beside CI's) would still pick blocks from the same range. Each block handed out
# is therefore claimed with an flock on a file of its own, held until this process exits (the
# kernel drops it then, however the process ends); another process skips claimed blocks. Seen
# without it: a test's launcher asked /health on its new port and got a 200 from another
# process's server there. A claim guards the window between the pick and the server's bind
# (after that the bind check above sees the port taken), so a process keeps only its newest
# claims, at most half its range: a pytest worker hands out hundreds of ports in a run, and
# claiming every block for good left none for the benches its tests start as child processes
# (CI: "no free block of 250 ports" in such a child, late in the run).
PORT_RANGE = (10000, 21000)
_CLAIMS = "/tmp/sglang-farskip-ports"
_claimed: dict[int, int] = {}  # port -> open descriptor of this process's claim, oldest first
PORT_STRIDE = 250
NCCL_PORT_OFFSET = 10
_DERIVED_OFFSETS = (0, *range(1, 8), NCCL_PORT_OFFSET, *range(233, 241))
_next_block = [None]


def _port_range() -> tuple[int, int]:
    low, high = PORT_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        width = (high - low) // max(workers, 1)
        low += int(worker[2:]) * width
        high = low + width
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _claim(port: int, keep: int) -> bool:
    """Claim `port`'s block; False if another live process holds it. A block this process
    claimed before is its own to hand out again when the range wraps. The process holds its
    `keep` newest claims (until it exits); older ones are dropped."""
    if port in _claimed:
        _claimed[port] = _claimed.pop(port)  # the newest claim again
        return True
    os.makedirs(_CLAIMS, mode=0o777, exist_ok=True)
    fd = os.open(f"{_CLAIMS}/{port}", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _claimed[port] = fd
    while len(_claimed) > keep:
        os.close(_claimed.pop(next(iter(_claimed))))  # closing the descriptor drops its flock
    return True


def free_port() -> int:
    """A free port below the ephemeral range whose SGLang-derived ports are free too."""
    low, high = _port_range()
    blocks = (high - low) // PORT_STRIDE
    if _next_block[0] is None:
        _next_block[0] = random.randrange(blocks)
    for _ in range(blocks):
        port = low + _next_block[0] * PORT_STRIDE
        _next_block[0] = (_next_block[0] + 1) % blocks
        if all(_bindable(port + offset) for offset in _DERIVED_OFFSETS) and _claim(port, max(1, blocks // 2)):
            return port
    raise RuntimeError(f"no free block of {PORT_STRIDE} ports in {low}-{high} on this host")
