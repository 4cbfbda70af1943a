"""testbed/ports.py: the port blocks test servers get are free, and no two live processes on one
host get the same block (each claims its blocks with an flock held until it exits)."""

from __future__ import annotations

import socket
import subprocess
import sys

from sglang_farskip.testbed import ports

_OTHER = "from sglang_farskip.testbed import ports; ports._next_block[0] = {block}; print(ports.free_port())"


def _other_process_takes(block: int) -> int:
    out = subprocess.run([sys.executable, "-c", _OTHER.format(block=block)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_live_process_keeps_its_block_from_another():
    ports._next_block[0] = 3
    mine = ports.free_port()
    start = (mine - ports._port_range()[0]) // ports.PORT_STRIDE
    theirs = _other_process_takes(start)  # starts at my block: must skip it
    assert theirs != mine and theirs % ports.PORT_STRIDE == mine % ports.PORT_STRIDE


def test_a_block_is_free_again_once_its_process_has_exited():
    low = ports._port_range()[0]
    first = _other_process_takes(20)
    assert _other_process_takes((first - low) // ports.PORT_STRIDE) == first


def test_a_bound_port_is_skipped():
    ports._next_block[0] = 30
    expected = ports._port_range()[0] + 30 * ports.PORT_STRIDE
    with socket.socket() as s:
        s.bind(("0.0.0.0", expected + 233))  # a port SGLang derives (DP attention's ZMQ block)
        assert ports.free_port() != expected


def test_a_process_wraps_around_its_own_blocks():
    """More calls than blocks (test_pd asks for dozens): the range wraps onto this process's own
    claims, as before claims existed."""
    low, high = ports._port_range()
    got = [ports.free_port() for _ in range(3 * (high - low) // ports.PORT_STRIDE)]
    assert len(set(got)) <= (high - low) // ports.PORT_STRIDE
    # ...and holds only its newest claims, so a child process it starts (a bench run by a test,
    # under the same xdist worker's range) still gets a block of its own.
    theirs = _other_process_takes((got[-1] - low) // ports.PORT_STRIDE)
    assert theirs not in got[-((high - low) // ports.PORT_STRIDE // 2):]
