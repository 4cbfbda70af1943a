"""The tiny demo checkpoint: deterministic, loadable by transformers, non-degenerate, cached."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors import safe_open

from sglang_farskip.tools import demo_model
from sglang_farskip.config import FarSkipConfig, is_moe_layer
from sglang_farskip.tools.demo_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_checkpoint,
    default_demo_dir,
    demo_checkpoint_name,
    ensure_demo_checkpoint,
)

SENTENCE = "The quick brown fox jumps over the lazy dog. Hello world! 2025 tokens, café."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def test_same_seed_gives_identical_files(ckpt, tmp_path):
    again = build_checkpoint(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (ckpt / name).read_bytes(), name


def test_other_seed_gives_other_weights(ckpt, tmp_path):
    other = build_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()


def test_config(config):
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3"
    assert FarSkipConfig.from_hf_config(config) == FarSkipConfig(enabled=True)
    for key, value in demo_model.TINY.items():
        if key != "rope_parameters":
            assert config[key] == value, key
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == 10000.0
    # SGLang's DeepseekV2MoE reads these; transformers' DeepseekV3Config has no defaults for them.
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"


def test_weights_stored_in_float32_config_says_bfloat16(ckpt, config):
    # SGLang's `--dtype auto` follows config.json (float32 there would mean float16); the
    # float32 tensors keep `--dtype float32` exact.
    assert config["dtype"] == "bfloat16"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in f.keys()  # per-expert layout


def test_build_info(ckpt):
    info = json.loads((ckpt / "BUILD_INFO.json").read_text())
    assert info["seed"] == 0 and info["builder_version"] == demo_model.BUILDER_VERSION
    assert info["farskip"]["farskip"] is True


def test_farskip_none_writes_no_farskip_keys(tmp_path):
    path = build_checkpoint(tmp_path / "plain", farskip=None, overrides={"num_hidden_layers": 2})
    cfg = json.loads((path / "config.json").read_text())
    assert "farskip" not in cfg and cfg["num_hidden_layers"] == 2


def test_tokenizer(tokenizer, config):
    ids = tokenizer(SENTENCE)["input_ids"]
    assert ids[0] == config["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert tokenizer.decode(ids, skip_special_tokens=True) == SENTENCE
    assert len(ids) < len(SENTENCE) / 2  # BPE merged English into real subwords
    # Every id the model can emit is a token the tokenizer can decode.
    assert len(tokenizer) == config["vocab_size"]


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith(BOS_TOKEN) and "Hi there" in text and text.endswith("<|assistant|>\n")


def test_transformers_loads_and_runs(hf_model, tokenizer, config):
    ids = tokenizer(SENTENCE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = hf_model(ids).logits[0]
    assert logits.shape == (ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()
    # Greedy decoding must not hinge on float noise: top-2 gaps clearly above 1e-3.
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() >= 0.9, gaps


def test_router_is_not_left_at_hf_init(ckpt, config):
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for layer in range(config["num_hidden_layers"]):
            if not is_moe_layer(config, layer):
                continue
            bias = f.get_tensor(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
            assert bias.abs().max() > 0.01, layer  # transformers leaves it at zero
            gate = f.get_tensor(f"model.layers.{layer}.mlp.gate.weight")
            assert gate.std() > 0.05, layer  # transformers uses std 0.02


def test_routing_differs_between_tokens(hf_model, tokenizer, config):
    chosen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        if is_moe_layer(config, i):
            hook = lambda mod, inp, out, i=i: chosen.__setitem__(i, out[2])  # (logits, weights, ids)
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    ids = tokenizer(SENTENCE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hf_model(ids)
    for h in hooks:
        h.remove()
    assert chosen, "no MoE layer ran"
    for layer, experts in chosen.items():
        sets = {tuple(sorted(row.tolist())) for row in experts}
        # Every layer, not just one: the last MoE layer is where routing collapses first.
        assert len(sets) >= 4, (layer, sets)


def test_refuses_nonempty_destination(ckpt):
    with pytest.raises(FileExistsError, match="not empty"):
        build_checkpoint(ckpt)


def test_crashed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(demo_model, "_build_into", boom)
    with pytest.raises(RuntimeError):
        build_checkpoint(tmp_path / "crashed")
    assert list(tmp_path.iterdir()) == []


def test_default_demo_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_FARSKIP_CACHE", str(tmp_path / "explicit"))
    assert default_demo_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SGLANG_FARSKIP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_dir() == tmp_path / "xdg" / "sglang-farskip"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == tmp_path / "home" / ".cache" / "sglang-farskip"


def test_checkpoint_name_tracks_builder_version(monkeypatch):
    name = demo_checkpoint_name(0)
    assert name.startswith("tiny-dsv3-farskip-s0-") and name != demo_checkpoint_name(1)
    monkeypatch.setattr(demo_model, "BUILDER_VERSION", demo_model.BUILDER_VERSION + "-changed")
    assert demo_checkpoint_name(0) != name


def test_ensure_reuses_cache(tmp_path, monkeypatch):
    first = ensure_demo_checkpoint(cache_dir=tmp_path)
    assert first.parent == tmp_path and first.name == demo_checkpoint_name(0)
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(demo_model, "build_checkpoint", no_rebuild)
    second = ensure_demo_checkpoint(cache_dir=tmp_path)
    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_builds_once_under_concurrency(tmp_path, monkeypatch):
    calls = []
    real_build = demo_model.build_checkpoint

    def counting_build(*args, **kwargs):
        calls.append(1)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(demo_model, "build_checkpoint", counting_build)
    # Leftovers of a crashed build are cleaned up by the next one.
    stale = tmp_path / f".{demo_checkpoint_name(0)}.tmp-crashed"
    stale.mkdir(parents=True)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_demo_checkpoint(cache_dir=tmp_path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert len(calls) == 1
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [results[0].name]
    assert os.access(results[0] / "model.safetensors", os.R_OK)


def test_v3_bench_has_deepseek_v3_proportions():
    """The bench model's ratios must carry over to DeepSeek-V3 (its own config.json, `v3` below):
    the dense share of layers, experts per token, and each TP=2 shard a whole number of heads
    and columns. A demo-shaped bench (1 dense layer of 4, top-2) would not."""
    from sglang_farskip.tools.demo_model import V3_BENCH, demo_config, kind_overrides

    cfg = demo_config(kind_overrides("v3-bench"))
    v3 = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "num_experts_per_tok": 8}
    dense_share = cfg["first_k_dense_replace"] / cfg["num_hidden_layers"]
    assert abs(dense_share - v3["first_k_dense_replace"] / v3["num_hidden_layers"]) < 0.01
    assert cfg["num_experts_per_tok"] == v3["num_experts_per_tok"]
    assert cfg["n_routed_experts"] // cfg["n_group"] >= 2 and cfg["topk_group"] < cfg["n_group"]
    for key in ("num_attention_heads", "moe_intermediate_size", "intermediate_size"):
        assert cfg[key] % 2 == 0, key
    assert {k: cfg[k] for k in V3_BENCH} == V3_BENCH
