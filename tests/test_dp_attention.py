"""FarSkip under DP attention (`--tp 2 --dp 2 --enable-dp-attention`): each DP rank attends
over its own requests, the MoE runs on the tokens of both (parallel.DpRows).

Every server gets the prompts twice: one at a time (the DP controller sends each request to
one DP rank; the other runs idle forwards and must still join every collective), then all at
once, so both DP ranks hold tokens in the same forwards. Both passes must equal reference.py
(greedy tokens, logprobs within parity.LOGPROB_ATOL; test_server_parity shows TP=1 equals the
reference on these prompts, so this is also equality with TP=1). Layouts: DeepSeek-V3 all
layers (overlap and sync), a layer range with EP=2 and the MHA prefill path, Instella-MoE with
EP=2 (AMD's layout), two node processes with one rank each (and node 0 giving up on a node 1
that never comes), and the stock wiring.

overlap vs sync: bit-identical one at a time, as under TP attention (test_parallel): each
forward's batch is then fixed by the request alone. All at once, which requests share a forward
depends on when each scheduler picks them up, so the MoE's GEMM shapes differ between two
servers and only the tokens must agree (both logprobs are held to the reference).
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

from sglang_farskip.config import FarSkipConfig
from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides
from sglang_farskip.reference import load_reference

from parity import FLOAT32, ONE_THREAD, PROMPTS, full_and_range, assert_matches_reference, served
from sglang_farskip.testbed.servers import Server, free_port, side_by_side

# Each prompt is sent to a chosen DP rank (not left to SGLang's load balancing, whose choice
# depends on how many readiness polls it dispatched): which rank holds a request decides where
# its rows sit among the MoE's, and with them the shapes of the expert GEMMs, so a bitwise
# comparison needs the same placement. The last prompt (the cached-prefix extend again) goes
# to the rank that prefilled its prefix (prompt 2).
DP = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
EP = ["--ep-size", "2"]
DP_PROMPTS = PROMPTS + [PROMPTS[3]]
DP_RANKS = [0, 1, 0, 1, 0]
# SGLang's own knobs, scaled down as in test_cpu_mha: a cached prefix of 32 tokens or more
# (prompt 4's is 121) takes the chunked-prefix MHA path, in chunks of at most 48.
CHUNKED_PREFIX = {"SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD": "32", "SGLANG_MAX_KV_CHUNK_CAPACITY": "48"}
# A DP-attention server runs five SGLang processes (HTTP, DP controller, two schedulers,
# detokenizer); two of them starting side by side on 2 cores take 2-4 minutes.
DP_START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    instella = build_checkpoint(root / "instella", seed=0, overrides=kind_overrides("instella"))
    return {**full_and_range(root), "instella": instella}


def serve_both_ways(server: Server) -> dict:
    """The prompts one at a time, then all at once; and the rank reports."""
    # Readiness polling (/health_generate, input [0]) leaves token 0, the first token of every
    # prompt, cached on whichever DP ranks the polls reached, a number that depends on start
    # timing; a cached token turns a prefill into an extend. Start from empty caches.
    server.admin("/flush_cache")
    one_at_a_time = served(server, DP_PROMPTS, dp_ranks=DP_RANKS)
    with concurrent.futures.ThreadPoolExecutor(len(DP_PROMPTS)) as pool:
        at_once = [f.result()[0] for f in [pool.submit(served, server, [p], dp_ranks=[r])
                                           for p, r in zip(DP_PROMPTS, DP_RANKS)]]
    return {"one_at_a_time": one_at_a_time, "at_once": at_once,
            "ranks": server.get("/farskip/info")["ranks"], "log": server.log_path.read_text()}


def assert_both_match(result: dict, reference) -> float:
    return max(assert_matches_reference(result["one_at_a_time"], reference, DP_PROMPTS),
               assert_matches_reference(result["at_once"], reference, DP_PROMPTS))


def assert_dp_layout(ranks: list[dict], mode: str, ep: int = 1) -> None:
    assert [r["attn_dp_rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["tp_size"], r["attn_dp_size"], r["attn_tp_size"], r["moe_ep_size"]) == (2, 2, 1, ep), r
        assert r["mode"] == mode, r


def both_dp_ranks_prefilled(log: str) -> set[str]:
    """The DP ranks whose scheduler logged a prefill batch (SGLang prefixes lines "DPn TPm")."""
    return set(re.findall(r"\[[^\]]*(DP\d) TP\d[^\]]*\] Prefill batch", log))


# ------------------------------------------------------------------ all layers, overlap and sync
@pytest.fixture(scope="module")
def all_layers(checkpoints, tmp_path_factory):
    path = str(checkpoints["full"])
    profile = tmp_path_factory.mktemp("profile")
    runs = {
        "overlap": {"args": ["--model-path", path, *DP, "--farskip-profile-dir", str(profile), *FLOAT32],
                    "env": ONE_THREAD},
        "sync": {"args": ["--model-path", path, *DP, "--farskip-mode", "sync", *FLOAT32], "env": ONE_THREAD},
    }
    with side_by_side(runs, DP_START_TIMEOUT_S) as servers:
        results = {name: serve_both_ways(s) for name, s in servers.items()}
        info = servers["overlap"].get("/farskip/info")["launcher"]
    results["launcher"], results["profile"] = info, profile
    return results


def test_all_layers_match_reference_with_both_dp_ranks_busy_and_idle(checkpoints, all_layers):
    overlap = all_layers["overlap"]
    assert_dp_layout(overlap["ranks"], "overlap")
    assert {r["comm_backend"] for r in overlap["ranks"]} == {"comm-thread"}
    assert all_layers["launcher"]["attn_dp_size"] == 2
    assert both_dp_ranks_prefilled(overlap["log"]) == {"DP0", "DP1"}
    worst = assert_both_match(overlap, load_reference(str(checkpoints["full"])))
    print(f"DP attention, all layers, overlap: max |logprob - reference| = {worst:.1e}")


def test_sync_matches_the_reference_and_overlap_bit_for_bit(checkpoints, all_layers):
    sync, overlap = all_layers["sync"], all_layers["overlap"]
    assert_dp_layout(sync["ranks"], "sync")
    assert_both_match(sync, load_reference(str(checkpoints["full"])))
    # Same tokens, chosen and top-k logprobs exactly equal: the two modes add the same sums in
    # the same order. This failed (differences of 2e-6 to 4e-6) while the idle DP rank's
    # padded row carried stale values into the MoE's routing (parallel.DpRows says how).
    assert sync["one_at_a_time"] == overlap["one_at_a_time"]
    assert [t for t, _, _ in sync["at_once"]] == [t for t, _, _ in overlap["at_once"]]


def test_overlap_defers_waits_under_dp_attention(all_layers):
    for rank in (0, 1):
        stats = json.loads((all_layers["profile"] / f"profile-rank{rank}.json").read_text())
        for phase in ("prefill", "decode"):
            # As in test_parallel: MoE layers 1..3; the last routed sum is drained by the final norm.
            for lane, layers in (("attn+shared", (1, 2, 3)), ("routed", (1, 2))):
                rows = [stats[f"{phase}/{k}/{lane}"] for k in layers]
                assert min(r["min_steps_between"] for r in rows) >= 1, (rank, phase, lane, rows)


# ------------------------------------------------------------------ EP, a layer range, MHA; Instella
@pytest.fixture(scope="module")
def with_ep(checkpoints):
    runs = {
        "range_mha": {"args": ["--model-path", str(checkpoints["range"]), *DP, *EP,
                               "--farskip-cpu-attention", "mha", *FLOAT32],
                      "env": {**ONE_THREAD, **CHUNKED_PREFIX}},
        "instella": {"args": ["--model-path", str(checkpoints["instella"]), *DP, *EP, *FLOAT32],
                     "env": ONE_THREAD},
    }
    with side_by_side(runs, DP_START_TIMEOUT_S) as servers:
        return {name: serve_both_ways(s) for name, s in servers.items()}


def test_layer_range_with_ep_and_mha_prefill_matches_reference(checkpoints, with_ep):
    result = with_ep["range_mha"]
    assert_dp_layout(result["ranks"], "overlap", ep=2)
    assert [r["converted_layers"] for r in result["ranks"]] == [[2, 3]] * 2
    rank0, rank1 = (r["attention_methods"] for r in result["ranks"])
    assert {"MHA", "MHA_CHUNKED_KV", "MLA"} <= set(rank0), rank0  # prompt 4 extends prompt 2's prefix
    assert {"MHA", "MLA"} <= set(rank1), rank1
    worst = assert_both_match(result, load_reference(str(checkpoints["range"])))
    print(f"DP attention, layers 2..3, EP=2, MHA prefill: max |logprob - reference| = {worst:.1e}")


def test_instella_with_ep_matches_reference(checkpoints, with_ep):
    result = with_ep["instella"]
    assert_dp_layout(result["ranks"], "overlap", ep=2)
    assert all(r["gated_attention"] for r in result["ranks"])
    worst = assert_both_match(result, load_reference(str(checkpoints["instella"])))
    print(f"DP attention, Instella-MoE, EP=2: max |logprob - reference| = {worst:.1e}")


# ------------------------------------------------------------------ two nodes; stock wiring
def two_node_args(path: str, rank: int, addr: str, dist_timeout: int = 60) -> list[str]:
    return ["--model-path", path, *DP, *EP, "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", addr, "--dist-timeout", str(dist_timeout), *FLOAT32]


def test_two_node_processes_match_reference(checkpoints):
    """Node 1 starts first. Under DP attention every node derives its ZMQ ports from
    --dist-init-addr and checks that they are free on its own host
    (sglang/srt/server_args.py:866-880): on two hosts they are, but here both nodes share one,
    and a node 1 that checks after node 0 has bound them fails ("detokenizer_port ... is used
    by a process already"; CI saw it). Node 1 binds none of them, and its data-parallel
    controller starts only after its check, so node 0 starts once that process exists."""
    path = str(checkpoints["full"])
    addr = f"127.0.0.1:{free_port()}"
    with Server(two_node_args(path, 1, addr), env=ONE_THREAD) as node1:
        node1.wait_for_process("sglang::data_parallel_controller", DP_START_TIMEOUT_S)
        with Server(two_node_args(path, 0, addr), env=ONE_THREAD) as node0:
            node0.wait_ready(DP_START_TIMEOUT_S)
            result = serve_both_ways(node0)
    (rank0,) = result["ranks"]  # node 0 reports its own rank
    assert (rank0["attn_dp_rank"], rank0["attn_dp_size"], rank0["mode"]) == (0, 2, "overlap")
    worst = assert_both_match(result, load_reference(path))
    print(f"DP attention, two nodes, EP=2: max |logprob - reference| = {worst:.1e}")


def test_node0_gives_up_on_a_node_that_never_comes(checkpoints):
    """Upstream's node 0 waits for the other nodes' DP-attention handshake with no timeout
    (serve/timeouts.py); ours fails after --dist-timeout with a message that says what to check.
    Bound: the start up to the handshake (~15 s alone here, a minute or two on a busy CI
    machine) plus the 10 s timeout; without the fix the server never exits."""
    addr = f"127.0.0.1:{free_port()}"
    with Server(two_node_args(str(checkpoints["full"]), 0, addr, dist_timeout=10),
                env=ONE_THREAD) as node0:
        node0.proc.wait(timeout=DP_START_TIMEOUT_S)
        log = node0.log_path.read_text(errors="replace")
    assert node0.proc.returncode != 0
    assert "node 0 waited 10 s (--dist-timeout) for the other 1 node(s)" in log, log[-3000:]
    assert "--dist-init-addr's plus 13" in log


def test_stock_wiring_with_ep_matches_the_stock_reference(checkpoints):
    path = str(checkpoints["full"])
    with Server(["--model-path", path, *DP, *EP, "--farskip-mode", "off", *FLOAT32], env=ONE_THREAD) as server:
        server.wait_ready(DP_START_TIMEOUT_S)
        result = serve_both_ways(server)
    assert [r["mode"] for r in result["ranks"]] == ["off", "off"]
    assert_both_match(result, load_reference(path, farskip=FarSkipConfig(enabled=False)))
