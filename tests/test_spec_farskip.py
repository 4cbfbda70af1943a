"""Speculative decoding with the FarSkip wiring: the target model is ours (every FarSkip layer,
`overlap` or `sync`), the draft is SGLang's own (DeepSeek's NextN layer for EAGLE, the n-gram
store for NGRAM). Real servers, float32, greedy, CPU.

Exact means: the greedy tokens of every request equal the reference's non-speculative greedy
decoding (reference.py, the FarSkip wiring of each checkpoint), one request at a time and all
at once, and the chosen logprobs are within parity.LOGPROB_ATOL (parity.py says why 1e-4). A
verify step runs the target on several draft tokens per request, and an accepted draft skips
target steps, so a wrong verify (a lane read one position late, a stale residual in the
extend) changes the tokens.

- all layers, TP=1 `overlap`: EAGLE top-2 tree (a real tree mask) and NGRAM;
- layers 2..3, TP=1 `sync`: an EAGLE chain with the demo's random MTP layer, whose drafts are
  mostly rejected (exactness when verify throws drafts away);
- Instella-MoE (no MTP layer): NGRAM;
- TP=2/EP=2 `overlap` EAGLE tree, TP=2 `overlap` NGRAM;
- two node processes (TP=2 across them, loopback): EAGLE tree and NGRAM;
- DP attention (`--tp 2 --dp 2 --enable-dp-attention`): EAGLE tree `overlap`, and an EAGLE
  chain `sync` with EP=2 (SGLang itself refuses NGRAM under DP attention). The requests sent all
  at once land on both DP ranks, so prefills, verify steps and draft extends of the two ranks
  meet in one MLP-sync batch, padded to the same size: the padded requests of a verify or draft
  extend crashed the CPU attention before cpu_mha/cpu_spec handled them (2 and 3 of 3 such
  servers crashed in two tries).
Accept lengths are asserted: the EAGLE drafts of the predictable MTP layer (tests/speculative.py)
and the n-gram drafts on the repeated prompt are mostly accepted. The load harness
(bench/run_load.py) runs against one EAGLE server over both endpoints and must report the accept
length the server's per-request counts give.
"""

from __future__ import annotations

import json
import sys

import pytest

from sglang_farskip.config import FarSkipConfig
from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides, predictable_mtp

from parity import FLOAT32, ONE_THREAD
from sglang_farskip.testbed.servers import REPO, free_port, run_load, side_by_side
from speculative import SPEC_FLAGS, ask_all, assert_greedy_equal, reference_greedy, spec_prompts

START_TIMEOUT_S = 600  # several servers side by side on 2 cores
TP2 = ["--tp", "2"]
DP = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]

# name: (checkpoint, layout flags, FarSkip mode, algorithm)
RUNS = {
    "tp1_eagle_tree": ("mtp", [], "overlap", "eagle_tree"),
    "tp1_ngram": ("mtp", [], "overlap", "ngram"),
    "range_sync_eagle_chain": ("range", [], "sync", "eagle_chain"),
    "instella_ngram": ("instella", [], "overlap", "ngram"),
    "tp2_ep2_eagle_tree": ("mtp", [*TP2, "--ep-size", "2"], "overlap", "eagle_tree"),
    "tp2_ngram": ("mtp", TP2, "overlap", "ngram"),
    "two_nodes_eagle_tree": ("mtp", "two nodes", "overlap", "eagle_tree"),
    "two_nodes_ngram": ("mtp", "two nodes", "overlap", "ngram"),
    "dp_eagle_tree": ("mtp", DP, "overlap", "eagle_tree"),
    "dp_ep2_sync_eagle_chain": ("mtp", [*DP, "--ep-size", "2"], "sync", "eagle_chain"),
}
# Started in these groups (each side by side): one rank each, two ranks each, two nodes.
GROUPS = [
    ["tp1_eagle_tree", "tp1_ngram", "range_sync_eagle_chain", "instella_ngram"],
    ["tp2_ep2_eagle_tree", "tp2_ngram"],
    ["two_nodes_eagle_tree", "two_nodes_ngram"],
    ["dp_eagle_tree", "dp_ep2_sync_eagle_chain"],
]
CONVERTED = {"mtp": [0, 1, 2, 3], "range": [2, 3], "instella": [0, 1, 2, 3]}
# The load harness runs against this server (drafts mostly accepted), once per endpoint.
LOAD_RUN = "tp1_eagle_tree"
LOAD_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-farskip")
    return {
        "mtp": predictable_mtp(build_checkpoint(root / "base", seed=0), root / "mtp"),
        "range": build_checkpoint(root / "range", seed=0,
                                  farskip=FarSkipConfig(enabled=True, start_idx=2, end_idx=3)),
        "instella": build_checkpoint(root / "instella", seed=0, overrides=kind_overrides("instella")),
    }


def _server_runs(name: str, path: str) -> dict:
    """side_by_side's runs for one RUNS entry (two for two nodes: node 1 has no HTTP server)."""
    _, layout, mode, algorithm = RUNS[name]
    common = ["--model-path", path, "--farskip-mode", mode, *SPEC_FLAGS[algorithm], *FLOAT32]
    if layout != "two nodes":
        return {name: {"args": [*common, *layout], "env": ONE_THREAD}}
    addr = f"127.0.0.1:{free_port()}"
    return {f"{name}/node{rank}": {"args": [*common, *TP2, "--nnodes", "2", "--node-rank", str(rank),
                                             "--dist-init-addr", addr, "--dist-timeout", "120"],
                                    "env": ONE_THREAD}
            for rank in (0, 1)}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """{run: (rank reports, sequential answers, concurrent answers)}, group by group; and under
    "load", {endpoint: the output directory of a bench/run_load.py run against LOAD_RUN}."""
    prompts = spec_prompts()
    out = {"load": {}}
    for group in GROUPS:
        runs = {}
        for name in group:
            runs.update(_server_runs(name, str(checkpoints[RUNS[name][0]])))
        http = [key for key in runs if not key.endswith("/node1")]
        with side_by_side(runs, timeout=START_TIMEOUT_S, serving=http) as servers:
            for key in http:
                server = servers[key]
                out[key.removesuffix("/node0")] = (server.get("/farskip/info")["ranks"], *ask_all(server, prompts))
                if key == LOAD_RUN:
                    for endpoint in ("completions", "generate"):
                        load = tmp_path_factory.mktemp(f"load-{endpoint}")
                        r = run_load("--url", server.url, "--endpoint", endpoint, "--concurrency", "2",
                                     "--requests", "4", "--max-tokens", str(LOAD_TOKENS), "--input-len", "24",
                                     "--warmup", "1", "--out", str(load))
                        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
                        out["load"][endpoint] = load
    return out


@pytest.fixture(scope="module")
def expected(checkpoints):
    """The reference's greedy (tokens, logprobs) per checkpoint, after the servers are gone."""
    prompts = spec_prompts()
    return {kind: reference_greedy(path, prompts) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("run", list(RUNS))
def test_speculative_farskip_equals_reference(served, expected, run):
    kind, layout, mode, algorithm = RUNS[run]
    ranks, sequential, concurrent = served[run]
    for rank in ranks:
        assert rank["mode"] == mode and rank["converted_layers"] == CONVERTED[kind], rank
    if layout[:1] == DP[:1] and "--enable-dp-attention" in layout:
        assert [r["attn_dp_rank"] for r in ranks] == [0, 1], ranks
    worst = assert_greedy_equal(sequential, concurrent, expected[kind])
    lengths = [round(meta["spec_accept_length"], 2) for meta in sequential]
    print(f"{run}: largest chosen-logprob difference {worst:.1e}; accept length per prompt {lengths}")
    assert all(length >= 1.0 for length in lengths), lengths
    if kind == "mtp" and algorithm.startswith("eagle"):
        assert min(lengths) > 2.0, lengths  # the predictable MTP layer's drafts are accepted
    if algorithm == "ngram":
        assert lengths[-1] > 2.0, lengths  # the repeated prompt, asked the second time


def test_load_harness_reports_the_accept_length(served):
    """The harness asks for SGLang's per-request verify counts (its sglext chunk on
    /v1/completions, meta_info on /generate) and reports output tokens per verify step."""
    from sglang_farskip.loadtest import loadstats

    draft_tokens = int(SPEC_FLAGS["eagle_tree"][SPEC_FLAGS["eagle_tree"].index("--speculative-num-draft-tokens") + 1])
    for endpoint, out in served["load"].items():
        results = json.loads((out / "results.json").read_text())
        (level,) = results["levels"]
        records = loadstats.read_records(out / level["records"])
        assert len(records) == 4 and all(r["ok"] for r in records), endpoint
        for r in records:
            # The prefill makes the first token; each verify step then makes 1..draft_tokens.
            steps = r["spec_verify_ct"]
            assert steps is not None and -(-(LOAD_TOKENS - 1) // draft_tokens) <= steps <= LOAD_TOKENS, (endpoint, r)
        pooled = sum(r["output_tokens"] for r in records) / sum(r["spec_verify_ct"] for r in records)
        reported = level["client"]["spec_accept_length"]
        assert reported == pytest.approx(pooled, rel=1e-12), endpoint
        assert reported > 2.0, (endpoint, reported)  # the predictable MTP layer's drafts
        report = (out / "report.md").read_text()
        assert "accept length |" in report and f"{reported:.2f} |" in report, endpoint
        assert "speculative decoding EAGLE (steps 2, top-k 2, draft tokens 4)" in report, endpoint
        print(f"load harness, {endpoint}: accept length {reported:.2f}, verify steps "
              f"{[r['spec_verify_ct'] for r in records]}")
