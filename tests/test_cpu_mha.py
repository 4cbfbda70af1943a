"""SGLang's MLA prefill paths on CPU (`--farskip-cpu-attention mha`): MHA prefill, chunked-prefix
prefill (MHA_CHUNKED_KV) and absorbed-MLA decode, for FarSkip DeepSeek-V3 (all layers, a layer
range) and Instella-MoE (the gate on the MHA path), against reference.py, on real servers.

Evidence of the path: each rank's /farskip/info report counts the attention method SGLang chose
for layer 0, once per forward; every request below checks the exact change in those counts, so
a path that silently fell back to absorbed MLA fails the test.

Scaled-down upstream knobs (SGLang's own environment variables): the chunked-prefix threshold
is 32 tokens (8192 by default) and a prefix chunk holds at most 48 tokens (128k by default), so
the 120-token cached prefix below is attended in three chunks (longer than a chunk) and merged
by log-sum-exp, while a 10-token prefix stays below the threshold and goes absorbed, as upstream
decides it on GPUs.

Tolerance: LOGPROB_ATOL = 1e-4, as in parity.py. MHA and absorbed MLA sum in
different orders (MHA decompresses K/V per head like the reference; absorbed folds W_UK into q
and W_UV after attention; the chunked path adds a log-sum-exp merge); all are float32, and the
measured differences are ~1e-5 or below, while a wrong chunk boundary, a dropped chunk or a
missing gate moves logprobs by 1e-2 or more.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_farskip.tools import convert
from sglang_farskip.cpu.attention import attend, merge_state_cpu
from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides
from sglang_farskip.reference import load_reference

from parity import FLOAT32, LOGPROB_ATOL, ONE_THREAD
from sglang_farskip.testbed.servers import Server, assert_fails, free_port, launch

MHA = ["--farskip-cpu-attention", "mha"]
CHUNKING = {"SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD": "32", "SGLANG_MAX_KV_CHUNK_CAPACITY": "48"}
NEW_TOKENS = 8


def steps(seed: int) -> list[tuple[str, list[list[int]], dict, dict]]:
    """(case, prompts sent as one batch, attention methods, prefix-chunk counts) per request, in
    order on a fresh server; the counts are what upstream's rules give: one prefill forward, then
    NEW_TOKENS - 1 decode forwards (absorbed MLA), the batch decoding together."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(2, 4096) for _ in range(n)]

    fresh = ids(120)  # nothing cached starts like it (every other prompt's first token is 0)
    decode = NEW_TOKENS - 1
    return [
        ("no prefix", [fresh], {"MHA": 1, "MLA": decode}, {}),
        # 120 cached tokens in chunks of 48: three chunks
        ("120-token cached prefix", [fresh + ids(9)], {"MHA_CHUNKED_KV": 1, "MLA": decode}, {"3": 1}),
        # below the threshold: upstream keeps absorbed MLA for the prefill too
        ("10-token cached prefix", [fresh[:10] + ids(20)], {"MLA": 1 + decode}, {}),
        # one request with a cached prefix and one without in a batch: the chunk capacity is
        # shared (24 tokens a request, five chunks), the second request's chunks are empty
        ("mixed batch", [fresh + ids(5), ids(40)], {"MHA_CHUNKED_KV": 1, "MLA": decode}, {"5": 1}),
    ]


def _counts(server: Server) -> list[dict]:
    return [{k: r.get(k, {}) for k in ("attention_methods", "prefix_chunks")}
            for r in server.get("/farskip/info")["ranks"]]


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def serve_steps(server: Server, seed: int, absorbed: bool = False):
    """Greedy (tokens, logprobs) per prompt of every step; checks each step's attention methods
    and prefix chunks on every local rank (absorbed: every forward MLA, no chunks)."""
    results = []
    before = _counts(server)
    for case, prompts, methods, chunks in steps(seed):
        out = server.post("/generate", {
            "input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
        for o in out:
            pairs = o["meta_info"]["output_token_logprobs"]
            results.append(([p[1] for p in pairs], [p[0] for p in pairs]))
        after = _counts(server)
        if absorbed:
            methods, chunks = {"MLA": sum(methods.values())}, {}
        for b, a in zip(before, after):
            got = (_delta(b["attention_methods"], a["attention_methods"]),
                   _delta(b["prefix_chunks"], a["prefix_chunks"]))
            assert got == (methods, chunks), f"{case}: methods/chunks {got}, expected {(methods, chunks)}"
        before = after
    return results


def assert_matches_reference(results, reference, seed: int) -> float:
    worst = 0.0
    prompts = [(case, p) for case, batch, _, _ in steps(seed) for p in batch]
    for (case, prompt), (tokens, logprobs) in zip(prompts, results):
        ref_tokens, ref_logprobs = reference.greedy(prompt, NEW_TOKENS)
        assert tokens == ref_tokens, f"{case}: greedy tokens differ from the reference"
        diff = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs))
        assert diff <= LOGPROB_ATOL, (case, diff)
        worst = max(worst, diff)
    return worst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    full = build_checkpoint(root / "full", seed=0)
    assert convert.main([str(full), str(root / "range"), "--start-layer", "2", "--end-layer", "3"]) == 0
    instella = build_checkpoint(root / "instella", seed=0, overrides=kind_overrides("instella"))
    return {"full": full, "range": root / "range", "instella": instella}


# ------------------------------------------------------------------ the two CPU twins, exactly
def test_chunked_attention_with_merge_equals_one_attention():
    """Causal attention of new tokens over [prefix | new], computed as upstream's chunked path
    does (new tokens causally, then each prefix chunk, merged by log-sum-exp) equals one
    softmax over all keys; an empty chunk (a request without prefix there) changes nothing."""
    torch.manual_seed(0)
    H, n, p = 3, 7, 11
    q, k, v = torch.randn(n, H, 16), torch.randn(p + n, H, 16), torch.randn(p + n, H, 8)
    whole, whole_lse = attend(q, k, v, 0.25, causal=True)  # keys: prefix and new, causally
    out, lse = attend(q, k[p:], v[p:], 0.25, causal=True)
    for lo, hi in ((0, 5), (5, 5), (5, 11)):  # chunks of the prefix, one of them empty
        chunk_out, chunk_lse = attend(q, k[lo:hi], v[lo:hi], 0.25, causal=False)
        out, lse = merge_state_cpu(chunk_out, chunk_lse, out, lse, torch.empty_like(out), torch.empty_like(lse))
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-6)  # float32 rounding of exp/log
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-6)
    # and the comparison can fail: a dropped chunk is far outside that tolerance
    out, lse = attend(q, k[p:], v[p:], 0.25, causal=True)
    chunk_out, chunk_lse = attend(q, k[:5], v[:5], 0.25, causal=False)
    out, _ = merge_state_cpu(chunk_out, chunk_lse, out, lse)
    assert (out - whole).abs().max() > 1e-2


# ------------------------------------------------------------------ servers
def test_deepseek_mha_prefill_matches_reference_and_absorbed(checkpoints):
    path = str(checkpoints["full"])
    with Server(["--model-path", path, *MHA, *FLOAT32], env=CHUNKING) as server:
        server.wait_ready()
        mha = serve_steps(server, seed=1)
    with Server(["--model-path", path, "--farskip-cpu-attention", "absorbed", *FLOAT32], env=CHUNKING) as server:
        server.wait_ready()
        ranks = server.get("/farskip/info")["ranks"]
        absorbed = serve_steps(server, seed=1, absorbed=True)
    assert ranks[0]["mode"] == "overlap"
    ref = load_reference(path)
    print(f"DeepSeek-V3 all layers, MHA prefill: max |logprob - reference| = "
          f"{assert_matches_reference(mha, ref, 1):.2e}")
    worst = 0.0
    for (t1, l1), (t2, l2) in zip(mha, absorbed):
        assert t1 == t2
        worst = max(worst, max(abs(a - b) for a, b in zip(l1, l2)))
    assert worst <= LOGPROB_ATOL
    print(f"MHA vs absorbed prefill: max |logprob difference| = {worst:.2e}")


def test_instella_gate_on_mha_paths_tp2_overlap(checkpoints):
    path = str(checkpoints["instella"])
    with Server(["--model-path", path, "--tp", "2", *MHA, *FLOAT32], env={**CHUNKING, **ONE_THREAD}) as server:
        server.wait_ready()
        ranks = server.get("/farskip/info")["ranks"]
        results = serve_steps(server, seed=2)
    assert [r["mode"] for r in ranks] == ["overlap", "overlap"] and ranks[0]["gated_attention"]
    print(f"Instella TP=2, MHA prefill: max |logprob - reference| = "
          f"{assert_matches_reference(results, load_reference(path), 2):.2e}")


def test_layer_range_two_nodes_mha(checkpoints):
    path = str(checkpoints["range"])
    addr = f"127.0.0.1:{free_port()}"

    def node(rank: int) -> Server:
        return Server(["--model-path", path, "--tp", "2", "--nnodes", "2", "--node-rank", str(rank),
                       "--dist-init-addr", addr, "--dist-timeout", "60", *MHA, *FLOAT32],
                      env={**CHUNKING, **ONE_THREAD})

    with node(0) as node0, node(1):
        node0.wait_ready()
        (rank0,) = node0.get("/farskip/info")["ranks"]
        results = serve_steps(node0, seed=3)
    assert rank0["mode"] == "overlap" and rank0["converted_layers"] == [2, 3]
    print(f"layers 2..3 on two nodes, MHA prefill: max |logprob - reference| = "
          f"{assert_matches_reference(results, load_reference(path), 3):.2e}")


# ------------------------------------------------------------------ the flag's refusals
def test_mha_flag_is_for_cpu_runs_only(checkpoints):
    assert_fails(launch(["--model-path", str(checkpoints["full"]), *MHA, "--device", "cuda"]),
                 "CPU runs only", "remove the flag")
