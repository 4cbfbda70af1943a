"""DeepSeek's block-FP8 checkpoints served with FarSkip on CPU (cpu/fp8.py), against the
dequantized weights and the reference.

The checkpoint is the FP8 demo (`--demo deepseek-v3-fp8`: the demo at 128-aligned widths,
requantized by sglang_farskip.formats.quantize). SGLang computes FP8 in bf16 on CPU, so logprobs cannot
meet the suite's float32 tolerance against the reference; the checks are a chain instead:

1. overlap == sync, bit for bit, at TP=1 and TP=2/EP=2 (the same sums in the same order);
2. the FP8 server == SGLang's own bf16 path on the dequantized weights (kv_b_proj requantized
   per TP shard, as SGLang's CPU loader does: fp8.as_cpu_loader_stores_kv_b), bit for bit, at
   TP=1 and TP=2/EP=2: the torch-native FP8 methods compute exactly the dequantized model, and
   the reference's emulation of the loader is exact;
3. those dequantized weights served in float32 match the reference loading the FP8 checkpoint
   (parity.LOGPROB_ATOL, 1e-4): the weights are what reference.py computes with;
4. two node processes (TP=2/EP=2 across them) == one node at TP=2/EP=2, bit for bit;
5. EAGLE, drafting with the checkpoint's FP8 MTP layer, == no speculation, bit for bit.

And, stated for users, the direct comparison of the FP8 server (bf16) with the float32 reference
on the served tokens (parity.teacher_forced_errors). Its noise floor is bf16 arithmetic itself:
the dequantized weights served in bf16 show the same figures (check 2 makes them equal). Measured
on these weights: |dlogprob| mean 0.039, max 0.52 (one step of the 2-token prompt, where the
random model is most sensitive), every served token the reference's argmax. Tolerances: mean 0.1,
max 1.0, served token within 0.25 of the reference's best logprob: about 2.5x the mean and 2x the
max, still far below a broken layer (a wrong scale block moves logprobs by several units).
"""

from __future__ import annotations

import statistics

import pytest

from sglang_farskip.reference import load_reference
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.servers import Server, side_by_side
from sglang_farskip.tools.demo_model import build_checkpoint, ensure_demo_checkpoint, kind_overrides

from speculative import SPEC_FLAGS

from parity import FLOAT32, ONE_THREAD, assert_matches_reference, dequantized_copy, served, teacher_forced_errors

BF16 = ["--dtype", "bfloat16"]
MEAN_TOL, MAX_TOL, GAP_TOL = 0.1, 1.0, 0.25
EP2 = ["--tp", "2", "--ep-size", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def checkpoints(cache):
    fp8 = ensure_demo_checkpoint(cache, kind="deepseek-v3-fp8")  # what `--demo deepseek-v3-fp8` serves
    source = build_checkpoint(cache.parent / "bf16-source", overrides=kind_overrides("deepseek-v3-fp8"))
    return {"fp8": fp8, "source": source, **{f"dequantized_tp{tp}": dequantized_copy(fp8, cache.parent / f"dequantized-tp{tp}", tp)
                           for tp in (1, 2)}}


@pytest.fixture(scope="module")
def tp1(checkpoints, cache):
    """TP=1: the demo flag in the default mode, sync, the dequantized weights in bf16 and float32,
    and EAGLE drafting with the checkpoint's FP8 MTP layer."""
    fp8, deq = str(checkpoints["fp8"]), str(checkpoints["dequantized_tp1"])
    runs = {
        "demo": {"args": ["--demo", "deepseek-v3-fp8"], "env": {**ONE_THREAD, "SGLANG_FARSKIP_CACHE": str(cache)}},
        "sync": {"args": ["--model-path", fp8, *BF16, "--farskip-mode", "sync"], "env": ONE_THREAD},
        "dequantized": {"args": ["--model-path", deq, *BF16], "env": ONE_THREAD},
        "dequantized_f32": {"args": ["--model-path", deq, *FLOAT32], "env": ONE_THREAD},
        "eagle": {"args": ["--model-path", fp8, *BF16, *SPEC_FLAGS["eagle_chain"]], "env": ONE_THREAD},
    }
    with side_by_side(runs) as servers:
        return {name: (s.get("/farskip/info"), served(s)) for name, s in servers.items()}


@pytest.fixture(scope="module")
def tp2(checkpoints):
    fp8, deq = str(checkpoints["fp8"]), str(checkpoints["dequantized_tp2"])
    runs = {
        "overlap": {"args": ["--model-path", fp8, *BF16, *EP2], "env": ONE_THREAD},
        "sync": {"args": ["--model-path", fp8, *BF16, *EP2, "--farskip-mode", "sync"], "env": ONE_THREAD},
        "dequantized": {"args": ["--model-path", deq, *BF16, *EP2], "env": ONE_THREAD},
    }
    with side_by_side(runs) as servers:
        return {name: (s.get("/farskip/info"), served(s)) for name, s in servers.items()}


def test_demo_serves_fp8_with_farskip_in_the_default_mode(tp1):
    info, _ = tp1["demo"]
    assert info["launcher"]["weight_format"] == "fp8"
    (rank,) = info["ranks"]
    assert rank["weight_format"] == "fp8" and rank["mode"] == "overlap"
    assert rank["converted_layers"] == [0, 1, 2, 3]
    assert rank["linear_method"] == "sglang_farskip.cpu.fp8.Fp8LinearMethod"  # the torch-native path ran
    assert tp1["dequantized"][0]["ranks"][0]["weight_format"] == "bf16"


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_overlap_equals_sync_and_the_dequantized_model_bit_for_bit(layout, tp1, tp2):
    runs = {"tp1": {**tp1, "overlap": tp1["demo"]}, "tp2": tp2}[layout]
    overlap = runs["overlap"][1]
    assert overlap == runs["sync"][1]
    assert overlap == runs["dequantized"][1]
    if layout == "tp2":
        (r0, r1) = sorted(runs["overlap"][0]["ranks"], key=lambda r: r["tp_rank"])
        assert r0["moe_ep_size"] == 2 and r0["weight_format"] == "fp8"


# bf16 logprobs of a verify batch against a one-token decode: bit for bit where the CPU's bf16
# GEMMs round both shapes alike (Intel with AMX tiles, every run there); on an AMD EPYC
# (AVX512-BF16, no AMX) they round apart: max 0.080 over the 4 prompts' chosen and top-5
# logprobs, about 4 bf16 steps at |logprob| ~ 2-4, with every token equal. 2.5x that; a verify
# step on the wrong KV or position moves logprobs by units (the FP8 tolerances above).
EAGLE_ATOL = 0.2


def test_eagle_with_the_fp8_mtp_layer_is_exact(tp1):
    """SGLang's NextN draft model loads the MTP layer in FP8 (through the same methods); speculative
    decoding must not change a greedy token, nor a logprob beyond bf16 rounding (EAGLE_ATOL)."""
    assert len(tp1["eagle"][1]) == len(tp1["demo"][1])
    for (tokens, chosen, top), (want_tokens, want_chosen, want_top) in zip(tp1["eagle"][1], tp1["demo"][1]):
        assert tokens == want_tokens
        diffs = [abs(a - b) for a, b in zip(chosen, want_chosen)]
        diffs += [abs(a - b) for step, want in zip(top, want_top) for a, b in zip(step, want)]
        assert max(diffs) <= EAGLE_ATOL, max(diffs)


def test_dequantized_weights_are_the_references(tp1, checkpoints):
    """Float32, the suite's tolerance: reference.py's FP8 loading (dequantized, kv_b_proj as the
    CPU loader keeps it) computes with what the FP8 server computes with."""
    _, results = tp1["dequantized_f32"]
    assert_matches_reference(results, load_reference(str(checkpoints["fp8"]), cpu_kv_b_tp=1))


def test_fp8_server_is_within_bf16_noise_of_the_reference(tp1, tp2, checkpoints):
    for tp, results in ((1, tp1["demo"][1]), (2, tp2["overlap"][1])):
        errors = teacher_forced_errors(results, load_reference(str(checkpoints["fp8"]), cpu_kv_b_tp=tp))
        diffs = [d for d, _ in errors]
        assert statistics.mean(diffs) <= MEAN_TOL and max(diffs) <= MAX_TOL, (statistics.mean(diffs), max(diffs))
        assert max(gap for _, gap in errors) <= GAP_TOL


def test_requantized_demo_stays_near_its_bf16_source(tp1, checkpoints):
    """The requantizer's output (the FP8 demo is quantize.py's output from this source) served,
    against the float32 reference of the source. Quantization moves each weight by 2.7% RMS, and
    these random weights amplify that (a 2% change of kv_b_proj alone moves logprobs by 0.4):
    measured mean |dlogprob| 0.15, 26 of 32 served tokens the source's argmax. Bounds: mean 0.3,
    two thirds of the tokens; a quantizer that swapped or dropped scales lands far outside."""
    errors = teacher_forced_errors(tp1["demo"][1], load_reference(str(checkpoints["source"])))
    assert statistics.mean(d for d, _ in errors) <= 0.3
    assert sum(gap == 0 for _, gap in errors) >= len(errors) * 2 / 3


def test_two_nodes_equal_one_node(tp2, checkpoints):
    addr = f"127.0.0.1:{free_port()}"

    def node(rank: int) -> Server:
        return Server(["--model-path", str(checkpoints["fp8"]), *BF16, *EP2, "--nnodes", "2",
                       "--node-rank", str(rank), "--dist-init-addr", addr, "--dist-timeout", "60"],
                      env=ONE_THREAD)

    with node(0) as node0, node(1) as node1:
        node0.wait_ready()
        (rank0,) = node0.get("/farskip/info")["ranks"]
        results = served(node0)
        assert node1.proc.poll() is None
    assert rank0["weight_format"] == "fp8" and rank0["mode"] == "overlap" and rank0["tp_size"] == 2
    assert results == tp2["overlap"][1]
