"""A node waiting for its peers gives up after `--dist-timeout`, as the rendezvous does.

Upstream has one unbounded wait in a multi-node start: under DP attention, node 0's
data-parallel controller sends its schedulers' ZMQ ports to the other nodes before any torch
rendezvous begins (`DataParallelController._broadcast_ports_as_server`,
sglang/srt/managers/data_parallel_controller.py:530), and it waits for each node on a ZMQ REP
socket with no receive timeout. A node 1 that never comes (wrong address, died on start) left
node 0 waiting forever, healthy-looking and never ready; CI saw exactly that. Node 1's side of
the handshake already gives up after 600 s (`_receive_ports_as_client`).

The hook gives the REP socket the same bound as the collectives (`--dist-timeout`, or torch's
default when unset) through the controller's ZMQ context, whose default options apply to
sockets created while they are set. The timeout then surfaces as upstream's own start failure
(the controller logs it and signals the launcher, which stops every process and exits non-zero).

The second wait is in every scheduler, while serving. SGLang gives the gloo CPU group of each
of its process groups a fixed 120-minute timeout, whatever `--dist-timeout` says
(`GroupCoordinator.__init__`'s `gloo_timeout`, sglang/srt/distributed/parallel_state.py:308,
which no caller passes). Rank 0 broadcasts the new requests on that group at every step, and a
gloo send is a rendezvous: the data leaves only once the peer has posted its receive. A link
cut at that moment left node 0 blocked for two hours, ended only by the deployment's watchdog;
a cut anywhere else timed out after `--dist-timeout`. The hook gives the CPU groups the
timeout SGLang already gives the device groups (`_MODEL_PARALLEL_GROUP_TIMEOUT`, set from
`--dist-timeout`), and changes nothing when `--dist-timeout` is unset. SGLang's wait for a rank
that loads its weights late has its own bound (`monitored_barrier`, 480 s) and keeps it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_farskip.serve.timeouts")

_bound_logged = False  # per process: its first group logs the bound


def _wait_bound_s() -> float:
    from sglang.srt.runtime_context import get_parallel
    from torch.distributed.constants import default_pg_timeout

    timeout = get_parallel().dist_timeout
    return float(timeout) if timeout else default_pg_timeout.total_seconds()


def bounded_port_broadcast(original, controller, endpoint, expected_clients, *args, **kwargs):
    """AROUND hook: upstream's handshake, with a receive timeout on the socket it opens."""
    import zmq

    bound_s = _wait_bound_s()
    controller.context.setsockopt(zmq.RCVTIMEO, int(bound_s * 1000))
    try:
        return original(controller, endpoint, expected_clients, *args, **kwargs)
    except zmq.Again:
        raise RuntimeError(
            f"node 0 waited {bound_s:.0f} s (--dist-timeout) for the other {expected_clients} "
            f"node(s) to ask for their DP-attention ports on {endpoint}, and not all came. Start "
            "every node within --dist-timeout of node 0, with the same --dist-init-addr, "
            "--nnodes and --tp/--dp, and check that each reaches that address "
            "(the port is --dist-init-addr's plus 13, SGLang's DP_ATTENTION_HANDSHAKE_PORT_DELTA)."
        ) from None
    finally:
        controller.context.setsockopt(zmq.RCVTIMEO, -1)


def cpu_group_bounded_by_dist_timeout(original, coordinator, *args, **kwargs):
    """AROUND hook: upstream's group set-up, its gloo CPU group under `--dist-timeout` too."""
    from sglang.srt.distributed import parallel_state

    global _bound_logged
    timeout = parallel_state._MODEL_PARALLEL_GROUP_TIMEOUT  # a timedelta, or None when unset
    if timeout is not None and "gloo_timeout" not in kwargs:
        kwargs["gloo_timeout"] = timeout
        if not _bound_logged:
            _bound_logged = True
            logger.info("sglang_farskip: SGLang's gloo CPU groups wait at most %.0f s for a peer "
                        "(--dist-timeout)", timeout.total_seconds())
    return original(coordinator, *args, **kwargs)
