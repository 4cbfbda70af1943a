"""Prefill/decode disaggregation (SGLang's `--disaggregation-mode prefill|decode`) on a CPU.

SGLang moves the KV cache from a prefill server to a decode server with Mooncake's transfer
engine (`--disaggregation-transfer-backend mooncake`, the default). On a machine without a GPU
the launcher sets up what that needs (`pd_environment`, applied with setdefault semantics like
the rest of the CPU environment), and the plugin fixes one CUDA-only call (`host_indices_without_device`):

- Mooncake's TCP transport (`MC_FORCE_TCP=1`): the CPU wheel (`mooncake-transfer-engine-non-cuda`)
  is tested here over TCP only. SGLang's default protocol is "rdma"; with no RDMA device Mooncake
  logs "Found 0 HCAs" and falls back to TCP by itself, but a CPU host *with* an HCA would then
  register host memory for RDMA, which nobody has tried with this build. The variable is what
  SGLang's own `--disaggregation-transfer-backend mooncake_tcp` sets
  (sglang/srt/arg_groups/pd_disaggregation_hook.py), and SGLang then skips HCA selection
  (distributed/device_communicators/mooncake_transfer_engine.py).
- `SGLANG_HOST_IP` = the loopback address, when the server listens on loopback only (SGLang's
  default `--host 127.0.0.1`): otherwise SGLang picks the address of a network interface
  (utils/network.py `get_local_ip_auto`), binds its KV manager's socket there and advertises it,
  and Mooncake's session name, to the peer server, so a server the user kept on loopback would
  exchange KV control messages over an outside interface (seen here: 192.0.2.2 without it,
  127.0.0.1 with it). Mooncake's own listeners bind every interface either way.
- `SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0` (prefill only reads it): upstream's switch
  for sending a request's cached-prefix KV before its forward. Under overlap scheduling that
  path records `torch.cuda.Event()` on the forward stream (disaggregation/prefill.py
  `maybe_send_cached_prefix_chunk`), which on CPU is a `torch.cpu.Stream`: every request with a
  cache hit crashed the prefill server. With the switch off, the prefix's KV goes out with the
  rest of the request's KV after its forward (the ordinary send, which covers the whole prompt
  from its first token): results are the same, only the overlap of that transfer with the
  forward is lost. A hook there could only skip the event by hiding the scheduler's
  `enable_overlap` for the call, which other code reads; the switch is upstream's own.

Mooncake's handshake and transport ports are left to Mooncake (random, in 15000-17000 seen
here); `MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT` bound them where a firewall or other servers need it
(docs/pd.md). The tests do so inside a block of testbed/ports.py.
"""

from __future__ import annotations

import ipaddress
import logging

from sglang_farskip.errors import UserError

logger = logging.getLogger("sglang_farskip.cpu")

PD_MODES = ("prefill", "decode")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: leave address detection to SGLang
        return False


def pd_environment(mode: str, host: str, dist_init_addr: str | None = None) -> dict[str, str]:
    """What a CPU server in PD `mode` needs in its environment (empty outside PD). The host IP
    only when the server and its other nodes (--dist-init-addr) are all on loopback: a node
    rank > 0 serves no HTTP, so its --host is often left at the default while its peers are on
    other hosts, which a loopback address would cut off."""
    if mode not in PD_MODES:
        return {}
    env = {"MC_FORCE_TCP": "1", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
    peers_local = dist_init_addr is None or is_loopback(dist_init_addr.rsplit(":", 1)[0].strip("[]"))
    if is_loopback(host) and peers_local:
        env["SGLANG_HOST_IP"] = "127.0.0.1" if host == "localhost" else host
    return env


def check(resolved) -> None:
    """Refuse, before anything starts, what SGLang's PD path cannot do on CPU."""
    if resolved.disaggregation_mode not in PD_MODES:
        return
    if resolved.disaggregation_enable_kv_checksum:
        # disaggregation/checksum.py asserts `.is_cuda` on the page indices (a CUDA kernel
        # computes the digest); the server would crash at its first request instead.
        raise UserError("--disaggregation-enable-kv-checksum computes its checksum with a CUDA kernel, "
                        "which a CPU server does not have: drop the flag (on both servers)")


def host_indices_without_device(result, sender, *args, **kwargs):
    """AFTER MooncakeKVSender.__init__, on CPU: this sender takes the page indices as a numpy array.

    Mooncake's sender declares `supports_host_tensor_indices`, so the prefill scheduler hands it
    each KV chunk's page indices as a tensor being copied off the GPU: into pinned memory
    (`pin_memory=True`), with a `torch.cuda.Event` the transfer thread waits on
    (disaggregation/prefill.py `send_kv_chunk`). On CPU both fail ("Found no NVIDIA driver"),
    and there is no copy to wait for: the indices are host memory already. Without the
    capability the scheduler converts them at once (`kv_to_page_indices`), the path of the other
    transfer backends. Chosen over SGLang's SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1, which
    also skips that branch but means "every context-parallel rank sends its share", is read by
    the decode server as well (which prefill CP ranks to pull from) and so must agree between
    the two servers: a CPU-only side effect has no business changing that protocol."""
    sender.supports_host_tensor_indices = False
    return result
