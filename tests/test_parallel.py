"""FarSkip on several ranks (gloo on CPU): TP=2, TP=2/EP=2, TP=4/EP=4 and two "nodes" on
loopback.

- overlap vs sync on the same ranks: the same gloo all-reduces of the same partials, added in
  the same order (one code path; only where wait() is called differs). A two-rank sum is one
  commutative float add; at four ranks gloo's reduction order is fixed by the group and the
  message size, which both modes share. So logprobs must be bit-identical, not merely close;
  `blocking` (overlap's comm thread, each sum waited at its launch) too, at TP=2;
- every layout (TP=2, TP=2/EP=2, TP=4/EP=4, two nodes) x every conversion (all layers, layers
  2..3; TP=4 all layers only, two nodes layers 2..3 only) against reference.py: greedy tokens equal and logprobs within
  LOGPROB_ATOL (see parity.py for why 1e-4). test_server_parity.py shows TP=1 equals the
  reference on the same prompts, so equality here is also equality with TP=1;
- the overlap instrumentation shows real deferral: on both lanes, at least one sub-block of
  compute ran between each launch and its wait, in prefill and in decode (and none in
  `blocking`);
- killing one node mid-request makes the other exit with an error, not hang.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from sglang_farskip.reference import load_reference

from parity import FLOAT32, ONE_THREAD, PROMPTS, full_and_range, assert_matches_reference, served
from sglang_farskip.testbed.servers import Server, free_port, side_by_side


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return full_and_range(tmp_path_factory.mktemp("ckpt"))


def test_tp2_overlap_is_bit_identical_to_sync_and_blocking_and_defers_waits(checkpoints, tmp_path):
    """overlap, sync and blocking (overlap's comm thread, waited at launch) side by side: the
    same bits, and only overlap has compute between a launch and its wait."""
    path = str(checkpoints["full"])
    runs = {mode: {"args": ["--model-path", path, "--tp", "2", "--farskip-mode", mode,
                            "--farskip-profile-dir", str(tmp_path / mode), *FLOAT32],
                   "env": ONE_THREAD}
            for mode in ("overlap", "sync", "blocking")}
    with side_by_side(runs) as servers:
        ranks = {mode: s.get("/farskip/info")["ranks"] for mode, s in servers.items()}
        results = {mode: served(s) for mode, s in servers.items()}
    for mode, backend in (("overlap", "comm-thread"), ("sync", "blocking"), ("blocking", "comm-thread")):
        assert [(r["mode"], r["comm_backend"]) for r in ranks[mode]] == [(mode, backend)] * 2, ranks[mode]

    for rank in (0, 1):
        profiles = {mode: json.loads((tmp_path / mode / f"profile-rank{rank}.json").read_text())
                    for mode in ("overlap", "blocking")}
        for phase in ("prefill", "decode"):
            for lane in ("attn+shared", "routed"):
                # MoE layers only (1..3): the dense layer 0's output must reach layer 1's
                # attention input (docs/design.md), so its sum is waited right away; and the
                # final norm drains the last layer's routed sum, so that one cannot overlap.
                layers = (1, 2, 3) if lane == "attn+shared" else (1, 2)
                rows = [profiles["overlap"][f"{phase}/{k}/{lane}"] for k in layers]
                # The attention-lane sum is launched before the routed experts and waited at
                # the next layer; the routed sum is waited after the next attention.
                assert min(r["min_steps_between"] for r in rows) >= 1, (phase, lane, rows)
                # blocking: the same collectives, each waited before any compute follows
                rows = [profiles["blocking"][f"{phase}/{k}/{lane}"] for k in layers]
                assert max(r["min_steps_between"] for r in rows) == 0, (phase, lane, rows)
    assert results["overlap"] == results["sync"] == results["blocking"]
    assert_matches_reference(results["overlap"], load_reference(path))


LAYOUTS = {"tp2": ["--tp", "2"], "tp2-ep2": ["--tp", "2", "--ep-size", "2"]}
CONVERTED = {"full": [0, 1, 2, 3], "range": [2, 3]}


# TP=2 on the full checkpoint is already served (and compared) by the test above.
@pytest.mark.parametrize("layout,conversion", [("tp2", "range"), ("tp2-ep2", "full"),
                                               ("tp2-ep2", "range")])
def test_layout_matches_reference(checkpoints, layout, conversion):
    path = str(checkpoints[conversion])
    with Server(["--model-path", path, *LAYOUTS[layout], *FLOAT32], env=ONE_THREAD) as server:
        server.wait_ready()
        ranks = server.get("/farskip/info")["ranks"]
        results = served(server)
    assert [r["mode"] for r in ranks] == ["overlap", "overlap"]
    assert [r["moe_ep_size"] for r in ranks] == [2 if "ep2" in layout else 1] * 2
    assert [r["converted_layers"] for r in ranks] == [CONVERTED[conversion]] * 2
    assert_matches_reference(results, load_reference(path))


# ------------------------------------------------------------------ TP=4 / EP=4
# The demo model's 4 attention heads at TP=4 leave one head per rank, which is what
# Instella-MoE's 16 heads have at TP=16 (its two-node layout): per-rank head slicing of q, the
# latent up-projections and o_proj with nothing left to average over. Four ranks on 2 cores are
# slow (a start took 100-190 s here on an idle machine), so each mode is served once, shared by
# the tests below, on three short prompts: a 2-token prefill, a 16-token prefill, and an extend
# on that cached 16-token prefix; each decodes NEW_TOKENS.
TP4 = ["--tp", "4", "--ep-size", "4"]
TP4_START_TIMEOUT_S = 600  # testbed.servers' 240 s is for one or two ranks; four share 2 cores
TP4_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[1] + [7, 99, 512, 1023, 2047, 3000]]


def _serve_tp4(path: str, mode: str) -> dict:
    started = time.monotonic()
    with Server(["--model-path", path, *TP4, "--farskip-mode", mode, *FLOAT32], env=ONE_THREAD) as server:
        server.wait_ready(TP4_START_TIMEOUT_S)
        ready = time.monotonic() - started
        ranks = server.get("/farskip/info")["ranks"]
        results = served(server, TP4_PROMPTS)
    print(f"TP=4/EP=4 {mode}: ready after {ready:.0f} s, "
          f"{time.monotonic() - started - ready:.0f} s to serve the prompts")
    return {"ranks": ranks, "results": results}


@pytest.fixture(scope="module")
def tp4_overlap(checkpoints):
    return _serve_tp4(str(checkpoints["full"]), "overlap")


@pytest.fixture(scope="module")
def tp4_sync(checkpoints):
    return _serve_tp4(str(checkpoints["full"]), "sync")


def test_tp4_ep4_one_head_per_rank_matches_reference(checkpoints, tp4_overlap):
    path = str(checkpoints["full"])
    heads = json.loads((checkpoints["full"] / "config.json").read_text())["num_attention_heads"]
    assert heads == 4  # one head per rank
    ranks = tp4_overlap["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1, 2, 3]
    for rank in ranks:
        assert (rank["tp_size"], rank["moe_ep_size"]) == (4, 4), rank
        assert rank["mode"] == "overlap" and rank["comm_backend"] == "comm-thread", rank
        assert rank["converted_layers"] == CONVERTED["full"], rank
    worst = assert_matches_reference(tp4_overlap["results"], load_reference(path), TP4_PROMPTS)
    print(f"TP=4/EP=4 overlap: max |logprob - reference| = {worst:.1e}")


def test_tp4_ep4_overlap_is_bit_identical_to_sync(tp4_overlap, tp4_sync):
    assert [r["mode"] for r in tp4_sync["ranks"]] == ["sync"] * 4
    assert [(r["tp_size"], r["moe_ep_size"]) for r in tp4_sync["ranks"]] == [(4, 4)] * 4
    assert tp4_overlap["results"] == tp4_sync["results"]


# Layers 2..3 only: two nodes on all layers are compared with TP=1 (and killed while serving)
# in test_deploy_two_nodes.py, and with the reference in test_instella.py (TP=2/EP=2).
def test_two_nodes_on_loopback_match_reference_and_fail_fast_when_a_node_dies(checkpoints):
    conversion = "range"
    path = str(checkpoints[conversion])
    addr = f"127.0.0.1:{free_port()}"

    def node(rank: int) -> Server:
        return Server(["--model-path", path, "--tp", "2", "--nnodes", "2", "--node-rank", str(rank),
                       "--dist-init-addr", addr, "--dist-timeout", "60", *FLOAT32], env=ONE_THREAD)

    with node(0) as node0, node(1) as node1:
        node0.wait_ready()
        (rank0,) = node0.get("/farskip/info")["ranks"]  # node 0 reports its own rank only
        assert rank0["tp_size"] == 2 and rank0["mode"] == "overlap"
        assert rank0["converted_layers"] == CONVERTED[conversion]
        assert_matches_reference(served(node0), load_reference(path))

        # A long request is in flight when node 1 dies.
        outcome = {}

        def long_request():
            try:
                outcome["reply"] = node0.post("/generate", {
                    "input_ids": list(range(2, 200)),
                    "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
                }, timeout=300)
            except Exception as e:  # noqa: BLE001 - any error is the expected outcome
                outcome["error"] = repr(e)

        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(3)
        os.killpg(node1.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        node0.proc.wait(timeout=120)  # bound: SGLang's 5 s crash diagnostics + teardown
        exit_after = time.monotonic() - killed_at
        client.join(timeout=60)
    assert node0.proc.returncode != 0
    assert "error" in outcome, f"client got a reply instead of an error: {outcome}"
    assert exit_after < 120
    print(f"node 0 exited {exit_after:.1f} s after node 1 was killed; client saw {outcome['error'][:120]}")
