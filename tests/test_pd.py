"""Prefill/decode disaggregation with FarSkip on CPU: a prefill server, a decode server, the KV
cache moved between them by Mooncake (TCP), and SGLang's router in front (PD mode). Real
servers through our launcher with SGLang's own flags only (`--disaggregation-mode`,
`--disaggregation-bootstrap-port`): the launcher sets up the rest (cpu/pd.py). Float32, greedy.

Parity, as in parity.py (tokens equal, logprobs within LOGPROB_ATOL of reference.py), through
the router for:
- the paper's shape scaled down: FarSkip DeepSeek-V3, every layer, prefill at TP=2 on one node,
  decode at TP=2 as two node processes; `overlap`, and `sync` in the same layout, whose tokens
  and logprobs must equal `overlap`'s bit for bit (the decode server computes every token after
  the first, so a decode-side wiring or transfer mistake changes them); a prompt that extends a
  cached one (the prefill server's radix cache sends the cached prefix's KV too); six requests
  in flight together, equal to the same prompts one at a time; the decode server runs no
  prefill batch (the KV really came from the prefill server);
- a FarSkip layer range (layers 2-3) and Instella-MoE, TP=1 each;
- EAGLE (DeepSeek's MTP layer as the draft) on both servers, TP=1: SGLang's decode server
  drafts from the hidden states the prefill server sends with the KV; the demo's predictable
  MTP layer makes the drafts mostly accepted;
- and the paper-shape answers against a plain (not disaggregated) TP=1 server.

Deployments start through testbed/pd.py (its docstring says how ports are chosen, Mooncake's
included: the only variable the tests give; the launcher needs none).

Servers start in groups side by side (at most four rank processes at once on two cores), each
group in a module fixture that collects the answers and stops its servers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_farskip.cpu.pd import pd_environment
from sglang_farskip.reference import load_reference
from sglang_farskip.testbed import pd
from sglang_farskip.testbed.servers import assert_fails, launch, side_by_side
from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides, predictable_mtp

from parity import (FLOAT32, LOGPROB_ATOL, ONE_THREAD, PROMPTS, assert_matches_reference,
                    full_and_range, served)
from speculative import SPEC_FLAGS

START_TIMEOUT_S = 600  # four ranks starting side by side on 2 cores
TP2 = ["--tp", "2"]
CONCURRENT = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    paths = full_and_range(root)
    paths["instella"] = build_checkpoint(root / "instella", seed=0, overrides=kind_overrides("instella"))
    paths["mtp"] = predictable_mtp(paths["full"], root / "mtp")
    return paths


# ------------------------------------------------------------------ starting a PD deployment
def pd_runs(name: str, model, *, prefill: list[str] = (), decode: list[str] = (),
            decode_nodes: int = 1, flags: list[str] = ()) -> tuple[dict, int]:
    """testbed.pd.pd_runs for `model` in float32, one thread per rank; `flags` go to both servers."""
    return pd.pd_runs(name, ["--model-path", str(model), *FLOAT32, *flags], prefill=prefill, decode=decode,
                      decode_nodes=decode_nodes, env=ONE_THREAD)


def prefill_batches(server) -> int:
    return server.log_path.read_text(errors="replace").count("Prefill batch")


def ask_together(router, prompts) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [r[0] for r in pool.map(lambda p: served(router, [p]), prompts)]


def accept_lengths(router) -> list[float]:
    """SGLang's speculative accept length of each of PROMPTS (tokens per verify step)."""
    return [router.post("/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})["meta_info"]["spec_accept_length"]
        for p in PROMPTS]


def collect(router, servers: dict, name: str, together: bool = False, speculative: bool = False) -> dict:
    out = {"sequential": served(router),
           "info": {role: servers[f"{name}/{role}"].get("/farskip/info") for role in ("prefill", "decode0")}}
    if speculative:
        out["accept"] = accept_lengths(router)
    if together:
        # Both sides' radix caches hold PROMPTS by now: the same prompts again, six at once.
        out["prompts"] = [PROMPTS[i % len(PROMPTS)] for i in range(CONCURRENT)]
        out["together"] = ask_together(router, out["prompts"])
    out["prefill_batches"] = {role: prefill_batches(servers[f"{name}/{role}"]) for role in ("prefill", "decode0")}
    return out


def run_group(groups: dict[str, tuple[dict, int]], extra_runs: dict | None = None, together=(),
              speculative=()) -> dict:
    runs = {name: kwargs for group_runs, _ in groups.values() for name, kwargs in group_runs.items()}
    runs.update(extra_runs or {})
    with side_by_side(runs, timeout=START_TIMEOUT_S, serving=pd.serving(runs)) as servers:
        started = {name: pd.router(servers, name, port) for name, (_, port) in groups.items()}
        try:
            for router in started.values():
                router.wait_ready()
            results = {name: collect(router, servers, name, name in together, name in speculative) for name, router in started.items()}
            for name in extra_runs or {}:
                results[name] = {"sequential": served(servers[name])}
            return results
        finally:
            for router in started.values():
                router.stop()


# ------------------------------------------------------------------ the deployments
@pytest.fixture(scope="module")
def paper(checkpoints):
    """FarSkip DeepSeek-V3, prefill TP=2 (one node), decode TP=2 (two nodes): overlap, then sync."""
    out = {}
    for mode in ("overlap", "sync"):
        group = pd_runs(mode, checkpoints["full"], prefill=TP2, decode=TP2, decode_nodes=2,
                        flags=["--farskip-mode", mode])
        out.update(run_group({mode: group}, together={"overlap"}))
    return out


@pytest.fixture(scope="module")
def small(checkpoints):
    """TP=1 pairs: the layer range, Instella-MoE."""
    return run_group({"range": pd_runs("range", checkpoints["range"]),
                      "instella": pd_runs("instella", checkpoints["instella"])})


@pytest.fixture(scope="module")
def eagle(checkpoints):
    """TP=1 pair, EAGLE on both servers, and a plain server of the full checkpoint."""
    spec = SPEC_FLAGS["eagle_tree"]
    group = pd_runs("eagle", checkpoints["mtp"], flags=spec)
    plain = {"plain": dict(args=["--model-path", str(checkpoints["full"]), *FLOAT32], env=ONE_THREAD)}
    return run_group({"eagle": group}, extra_runs=plain, speculative={"eagle"})


# ------------------------------------------------------------------ the checks
def check_roles(info: dict, tp: int, mode: str, converted: list[int]) -> None:
    for role, served_info in info.items():
        want = "prefill" if role == "prefill" else "decode"
        assert served_info["launcher"]["pd_role"] == want, served_info["launcher"]
        for rank in served_info["ranks"]:
            assert rank["pd_role"] == want and rank["tp_size"] == tp, rank
            assert rank["mode"] == mode and rank["converted_layers"] == converted, rank


def check_disaggregated(result: dict) -> None:
    batches = result["prefill_batches"]
    assert batches["prefill"] > 0 and batches["decode0"] == 0, batches


def test_paper_shape_overlap_matches_reference(paper, checkpoints):
    result = paper["overlap"]
    worst = assert_matches_reference(result["sequential"], load_reference(str(checkpoints["full"])))
    check_roles(result["info"], tp=2, mode="overlap", converted=[0, 1, 2, 3])
    assert result["info"]["decode0"]["launcher"]["nnodes"] == 2
    check_disaggregated(result)
    print(f"PD prefill TP=2 -> decode TP=2 on two nodes, overlap: max |logprob - reference| = {worst:.1e}")


def test_paper_shape_sync_equals_overlap_bit_for_bit(paper):
    check_roles(paper["sync"]["info"], tp=2, mode="sync", converted=[0, 1, 2, 3])
    check_disaggregated(paper["sync"])
    assert paper["sync"]["sequential"] == paper["overlap"]["sequential"]


def test_requests_in_flight_together_equal_one_at_a_time(paper):
    result = paper["overlap"]
    alone = {tuple(p): r for p, r in zip(PROMPTS, result["sequential"])}
    worst = 0.0
    for prompt, (tokens, chosen, _top) in zip(result["prompts"], result["together"]):
        want_tokens, want_chosen, _ = alone[tuple(prompt)]
        assert tokens == want_tokens, f"prompt of {len(prompt)} tokens"
        worst = max(worst, max(abs(a - b) for a, b in zip(chosen, want_chosen)))
    assert worst <= LOGPROB_ATOL, worst
    print(f"{CONCURRENT} requests together vs one at a time: max |logprob difference| = {worst:.1e}")


def test_layer_range_and_instella_match_reference(small, checkpoints):
    check_roles(small["range"]["info"], tp=1, mode="overlap", converted=[2, 3])
    check_roles(small["instella"]["info"], tp=1, mode="overlap", converted=[0, 1, 2, 3])
    for name in ("range", "instella"):
        check_disaggregated(small[name])
        worst = assert_matches_reference(small[name]["sequential"], load_reference(str(checkpoints[name])))
        print(f"PD {name}, TP=1: max |logprob - reference| = {worst:.1e}")


def test_eagle_on_both_servers_matches_reference(eagle, checkpoints):
    result = eagle["eagle"]
    check_roles(result["info"], tp=1, mode="overlap", converted=[0, 1, 2, 3])
    check_disaggregated(result)
    worst = assert_matches_reference(result["sequential"], load_reference(str(checkpoints["mtp"])))
    print(f"PD EAGLE, TP=1: max |logprob - reference| = {worst:.1e}")


def test_eagle_drafts_are_accepted_on_the_decode_server(eagle):
    lengths = eagle["eagle"]["accept"]
    print(f"PD EAGLE accept length per prompt: {[round(x, 2) for x in lengths]}")
    assert min(lengths) > 2.0, lengths  # the predictable MTP layer's drafts


def test_paper_shape_equals_a_plain_server(paper, eagle):
    plain, pd = eagle["plain"]["sequential"], paper["overlap"]["sequential"]
    assert [r[0] for r in pd] == [r[0] for r in plain]
    worst = max(abs(a - b) for p, q in zip(pd, plain) for a, b in zip(p[1], q[1]))
    assert worst <= LOGPROB_ATOL, worst


# ------------------------------------------------------------------ what the launcher sets and refuses
def test_environment_of_a_cpu_pd_server():
    env = pd_environment("prefill", "127.0.0.1")
    assert env == {"MC_FORCE_TCP": "1", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
                   "SGLANG_HOST_IP": "127.0.0.1"}
    assert "SGLANG_HOST_IP" not in pd_environment("decode", "0.0.0.0")  # SGLang's detection decides
    assert pd_environment("decode", "127.0.0.1", "127.0.0.1:5000")["SGLANG_HOST_IP"] == "127.0.0.1"
    assert "SGLANG_HOST_IP" not in pd_environment("decode", "127.0.0.1", "10.0.0.1:5000")  # a peer elsewhere
    assert pd_environment("null", "127.0.0.1") == {}


def test_kv_checksum_is_refused_on_cpu(checkpoints):
    proc = launch(["--model-path", str(checkpoints["full"]), *FLOAT32, "--disaggregation-mode", "prefill",
                   "--disaggregation-enable-kv-checksum"])
    assert_fails(proc, "--disaggregation-enable-kv-checksum", "CUDA")
