"""Instella-MoE (InstellaMoEForCausalLM: DeepSeek-V3 with q_lora_rank null, one expert group,
two shared experts and a sigmoid gate on the attention output) served by real SGLang servers on
CPU, float32, against reference.py (itself tested against transformers' DeepseekV3 modules with
the gate hooked in, test_reference.py).

Tolerance: as in parity.py, greedy tokens equal and logprobs within 1e-4 (float32 on
both sides, different summation order: absorbed MLA, the FarSkip lane order; measured ~1e-6).
The demo gate's sigmoids spread over ~(0.05, 0.95), so a gate skipped on a path, fed the wrong
input or misaligned with the heads moves logprobs by far more than that.

Layouts: TP=1 (overlap, loaded through --trust-remote-code and the checkpoint's own config
class), `"farskip": false` (stock wiring with the gate), and two nodes on loopback at TP=2/EP=2
(overlap; EP and two-node in one start to bound CI time). Every prompt set covers prefill, an
extend on a cached prefix and decode. TP=2 on one node in overlap mode is served in
test_cpu_mha.py (with the MHA prefill paths, so the gate is proven there too).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_farskip.config import FarSkipConfig
from sglang_farskip.errors import UserError
from sglang_farskip.tools.demo_model import build_checkpoint, ensure_demo_checkpoint, kind_overrides
from sglang_farskip.reference import load_reference

from parity import FLOAT32, LOGPROB_ATOL, ONE_THREAD, PROMPTS, assert_matches_reference, served
from sglang_farskip.testbed.servers import Server, assert_fails, free_port, launch

LAYERS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def instella(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "instella", seed=0,
                            overrides=kind_overrides("instella"))


def variant(src, dst, config_changes: dict | None = None, tensors=None) -> str:
    """A copy of `src` with config.json edited and, if `tensors` is given, the weights
    rewritten by tensors(state) -> state; everything else symlinked."""
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name not in ("config.json", "model.safetensors"):
            os.symlink(entry, dst / entry.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config_changes or {})}))
    if tensors is None:
        os.symlink(src / "model.safetensors", dst / "model.safetensors")
    else:
        state = tensors(load_file(str(src / "model.safetensors")))
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def check_ranks(ranks, mode: str, converted: list[int]) -> None:
    for rank in ranks:
        assert rank["model_class"].endswith(".InstellaMoEForCausalLM"), rank
        assert rank["gated_attention"] is True
        assert rank["mode"] == mode and rank["converted_layers"] == converted


# ------------------------------------------------------------------ servers vs reference
def test_demo_tp1_with_remote_code_matches_reference(tmp_path):
    """`--demo instella`: the launcher builds the tiny Instella into the cache and serves it."""
    cache = tmp_path / "cache"
    with Server(["--demo", "instella", "--trust-remote-code", *FLOAT32],
                env={"SGLANG_FARSKIP_CACHE": str(cache)}) as server:
        server.wait_ready()
        info = server.get("/farskip/info")
        models = server.get("/v1/models")
        results = served(server)
        log = server.log_tail(100000)
    assert info["launcher"]["demo"] is True
    # The OpenAI model id is a name a client types, not the demo's cache path.
    assert [m["id"] for m in models["data"]] == ["farskip-demo-instella"]
    check_ranks(info["ranks"], "overlap", LAYERS)
    assert "InstellaMoEForCausalLM: MLA KV cache, latent 64 + rope 16" in log
    ref = load_reference(str(ensure_demo_checkpoint(cache, kind="instella")))  # the one served
    print(f"TP=1 Instella: max |logprob - reference| = {assert_matches_reference(results, ref):.2e}")


def test_farskip_false_is_stock_wiring_with_the_gate(instella, tmp_path):
    path = variant(instella, tmp_path / "stock", {"farskip": False})
    with Server(["--model-path", path, *FLOAT32]) as server:
        server.wait_ready()
        ranks = server.get("/farskip/info")["ranks"]
        results = served(server)
    check_ranks(ranks, "off", [])
    ref = load_reference(path)
    assert not ref.farskip.enabled
    assert_matches_reference(results, ref)
    farskip_tokens = [load_reference(str(instella)).greedy(p, 8)[0] for p in PROMPTS]
    assert [r[0] for r in results] != farskip_tokens  # the wiring really differs on these weights


def test_two_nodes_tp2_ep2_match_reference(instella):
    addr = f"127.0.0.1:{free_port()}"

    def node(rank: int) -> Server:
        return Server(["--model-path", str(instella), "--tp", "2", "--ep-size", "2", "--nnodes", "2",
                       "--node-rank", str(rank), "--dist-init-addr", addr, "--dist-timeout", "60",
                       *FLOAT32], env=ONE_THREAD)

    with node(0) as node0, node(1) as node1:
        node0.wait_ready()
        (rank0,) = node0.get("/farskip/info")["ranks"]
        results = served(node0)
        assert node1.proc.poll() is None
    check_ranks([rank0], "overlap", LAYERS)
    assert rank0["tp_size"] == 2 and rank0["moe_ep_size"] == 2
    assert_matches_reference(results, load_reference(str(instella)))


def test_a_tensor_the_model_does_not_know_fails_the_load(instella, tmp_path):
    """Upstream's loader only warns and skips an unknown tensor; for Instella that is an error,
    so a mis-named gate can never load as nothing, even with warnings switched off."""
    def add_unknown(state):
        state["model.layers.1.self_attn.attn_gate_extra.weight"] = torch.zeros(4, 4)
        return state

    path = variant(instella, tmp_path / "unknown", tensors=add_unknown)
    with Server(["--model-path", path, "--log-level", "error", *FLOAT32]) as server:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait_ready()
        log = server.log_tail(100000)
    assert "match no parameter of the model" in log and "attn_gate_extra" in log


# ------------------------------------------------------------------ bad input: one error line
def drop_gate(layer: int):
    return lambda state: {k: v for k, v in state.items()
                          if k != f"model.layers.{layer}.self_attn.gate_proj.weight"}


def drop_all_gates(state):
    return {k: v for k, v in state.items() if ".self_attn.gate_proj." not in k}


def truncate_gate(state):
    # A gate of the wrong shape. (A transposed gate is not a shape error here: heads * v_head
    # equals hidden in the demo and in the real model; only the logprob comparisons catch it.)
    key = "model.layers.2.self_attn.gate_proj.weight"
    state[key] = state[key][:128].contiguous()
    return state


@pytest.mark.parametrize("case,config_changes,tensors,fragments", [
    ("missing_gate", None, drop_gate(2), ["no attention gate for layers 2", "re-download"]),
    ("wrong_shape", None, truncate_gate,
     ["model.layers.2.self_attn.gate_proj.weight has shape [128, 256]", "expected [256, 256]"]),
    ("gated_without_gates", None, drop_all_gates, ["\"gated_attention\": true", "no model.layers.K.self_attn"]),
    ("gates_without_flag", {"gated_attention": False}, None, ["does not set \"gated_attention\": true"]),
    ("gate_on_deepseek_v3", {"architectures": ["DeepseekV3ForCausalLM"]}, None,
     ["implemented for InstellaMoEForCausalLM only"]),
])
def test_bad_instella_checkpoint_is_one_error_line(instella, tmp_path, case, config_changes, tensors, fragments):
    path = variant(instella, tmp_path / case, config_changes, tensors)
    proc = launch(["--model-path", path])
    assert_fails(proc, *fragments)
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1


def test_demo_flag_conflicts_with_model_path(instella):
    assert_fails(launch(["--demo", "instella", "--model-path", str(instella)]), "--demo", "--model-path")


# ------------------------------------------------------------------ config values
def test_integral_float_layer_index_is_accepted():
    """AMD's remote config class defaults farskip_end_idx to the float 1e4."""
    assert FarSkipConfig.from_hf_config({"farskip": True, "farskip_end_idx": 1e4}).end_idx == 10000
    for bad in (2.5, "3", True):
        with pytest.raises(UserError, match="farskip_end_idx"):
            FarSkipConfig.from_hf_config({"farskip": True, "farskip_end_idx": bad})


def test_reference_tolerance_is_meaningful(instella, tmp_path):
    """Guards the comparison: a model with its gates removed (sigmoid(0) = 0.5 everywhere would be
    the mildest mistake) differs from the gated reference by far more than LOGPROB_ATOL."""
    gated = load_reference(str(instella))
    halved = variant(instella, tmp_path / "zero", tensors=lambda s: {
        k: (torch.zeros_like(v) if ".gate_proj." in k and "self_attn" in k else v) for k, v in s.items()})
    ungated = load_reference(halved)
    diff = max(abs(a - b) for p in PROMPTS
               for a, b in zip(gated.greedy(p, 4)[1], ungated.greedy(p, 4)[1]))
    assert diff > 100 * LOGPROB_ATOL
    shutil.rmtree(tmp_path / "zero")


def test_remote_config_class_gives_the_float_end_index(instella):
    """What SGLang's workers receive: with --trust-remote-code the checkpoint's own config class
    (farskip_end_idx the float 1e4, as AMD's), without it transformers' DeepseekV3Config (no
    range keys at all); FarSkipConfig reads both as every layer."""
    from transformers import AutoConfig

    remote = AutoConfig.from_pretrained(str(instella), trust_remote_code=True)
    local = AutoConfig.from_pretrained(str(instella), trust_remote_code=False)
    assert type(remote).__name__ == "InstellaMoEConfig" and remote.farskip_end_idx == 1e4
    assert isinstance(remote.farskip_end_idx, float)
    assert type(local).__name__ == "DeepseekV3Config" and not hasattr(local, "farskip_end_idx")
    for cfg in (remote, local):
        assert FarSkipConfig.from_hf_config(cfg).converted_layers(4) == LAYERS
        assert cfg.gated_attention is True and cfg.q_lora_rank is None
