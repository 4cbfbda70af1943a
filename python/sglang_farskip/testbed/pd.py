"""A prefill/decode (PD) deployment on one machine, for tests and benchmarks: one prefill server
and one decode server (one node, or several node processes) through our launcher, started with
servers.side_by_side, and SGLang's router in front (router.Router). Only SGLang's own PD flags
are given (`--disaggregation-mode`, `--disaggregation-bootstrap-port`): the launcher sets up
the rest on CPU (cpu/pd.py).

Ports: every port comes from ports.py (HTTP, bootstrap, --dist-init-addr), and so does a block
for Mooncake's listeners (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), which otherwise takes random ports
in 15000-17000, inside the range ports.py hands out to other servers.
"""

from __future__ import annotations

from sglang_farskip.testbed.ports import PORT_STRIDE, free_port
from sglang_farskip.testbed.router import Router

DECODE_DIST_TIMEOUT_S = "60"  # a decode node whose peer never comes fails, not hangs


def mooncake_ports() -> dict[str, str]:
    first = free_port()
    return {"MC_MIN_RPC_PORT": str(first), "MC_MAX_RPC_PORT": str(first + PORT_STRIDE - 1)}


def pd_runs(name: str, common: list[str], *, prefill: list[str] = (), decode: list[str] = (),
            decode_nodes: int = 1, env: dict | None = None) -> tuple[dict, int]:
    """side_by_side runs named `NAME/prefill` and `NAME/decodeR` (one per decode node process),
    and the prefill server's bootstrap port. `common` (the checkpoint, dtype, FarSkip flags) goes
    to both servers, `prefill` and `decode` to one each; `env` to every process."""
    bootstrap = free_port()
    runs = {f"{name}/prefill": dict(args=[*common, *prefill, "--disaggregation-mode", "prefill",
                                          "--disaggregation-bootstrap-port", str(bootstrap)],
                                    env={**(env or {}), **mooncake_ports()})}
    addr = f"127.0.0.1:{free_port()}"
    for rank in range(decode_nodes):
        nodes = (["--nnodes", str(decode_nodes), "--node-rank", str(rank), "--dist-init-addr", addr,
                  "--dist-timeout", DECODE_DIST_TIMEOUT_S] if decode_nodes > 1 else [])
        runs[f"{name}/decode{rank}"] = dict(args=[*common, *decode, "--disaggregation-mode", "decode", *nodes],
                                            env={**(env or {}), **mooncake_ports()})
    return runs, bootstrap


def serving(runs: dict) -> list[str]:
    """What answers HTTP: every server but the decode node ranks above 0."""
    return [name for name in runs if not (name.rsplit("/", 1)[-1].startswith("decode")
                                          and not name.endswith("/decode0"))]


def router(servers: dict, name: str, bootstrap: int, **kwargs) -> Router:
    """The PD router over `name`'s prefill server and decode node 0 (not yet waited for);
    `kwargs` go to Router."""
    return Router([(servers[f"{name}/prefill"].url, bootstrap)], [servers[f"{name}/decode0"].url], **kwargs)
