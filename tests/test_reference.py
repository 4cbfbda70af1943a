"""The plain-PyTorch reference (sglang_farskip.reference) against transformers' DeepseekV3, and its
FarSkip switch against the FarSkip equations computed by hand from transformers' own sub-modules.

Tiny random models, float32, CPU. Weights are re-drawn at unit scale (transformers' init is
std 0.02 with a zero router and zero correction bias, which makes attention nearly uniform and
routing nearly arbitrary, so rope, softmax-scale and routing bugs would hide)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from sglang_farskip.config import FarSkipConfig
from sglang_farskip.errors import UserError
from sglang_farskip.reference import load_reference

# fp32 on a model this small: reference and transformers differ only in summation order
# (einsum vs sdpa/eager matmuls, per-expert index_add order, KV-cached decode in generate), which
# measures ~1e-6 of the logit scale. 1e-4 of the logit scale leaves ~100x headroom yet is far below
# what a real bug costs (a missing YaRN mscale, a wrong rope pairing or a routing slip moves logits
# by >1e-2 of their scale).
REL_TOL = 1e-4

BASE = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
VARIANTS = {
    "yarn_qlora": {},
    # no query compression, NeoX rope layout, unnormalised top-k weights, tied embeddings, and
    # mscale != mscale_all_dim so YaRN's cos/sin factor is not 1
    "no_qlora": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, tie_word_embeddings=True,
                     rope_scaling={**BASE["rope_scaling"], "factor": 8.0, "mscale_all_dim": 0.8}),
    # plain RoPE, more groups, top-3
    "plain_rope": dict(rope_scaling=None, n_group=4, topk_group=2, num_experts_per_tok=3),
}
PROMPTS = [[5, 17, 300], [7, 1000, 22, 4000, 9, 31, 2048, 3], list(range(100, 2000, 150))]


@torch.no_grad()
def randomise(model: torch.nn.Module) -> None:
    H = model.config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith("embed_tokens.weight"):  # tied: it is lm_head too, keep logits O(1)
            p.normal_(std=H**-0.5 if model.config.tie_word_embeddings else 1.0)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(std=2 / H**0.5)  # router logits ~N(0, 4): sharp, input-dependent sigmoid scores
        else:  # every projection, 2-D [out, in] or fused experts 3-D [E, out, in]: unit-scale outputs
            p.normal_(std=p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(std=0.3)  # large enough to change which experts win, as in a trained model


def make_checkpoint(path: str, **overrides) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    # deepcopy: transformers edits the rope dict in place
    cfg = transformers.DeepseekV3Config(**copy.deepcopy({**BASE, **overrides}))
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    randomise(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{variant: (checkpoint dir, transformers model with the same weights)}."""
    out = {}
    for name, overrides in VARIANTS.items():
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_checkpoint(path, **overrides))
    return out


@pytest.fixture(scope="module")
def main(ckpts):
    return ckpts["yarn_qlora"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def ids_of(prompt) -> torch.Tensor:
    return torch.tensor(prompt, dtype=torch.long)


# ------------------------------------------------------------------ FarSkip off == transformers
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(ckpts, variant):
    path, hf = ckpts[variant]
    ref = load_reference(path)
    assert not ref.farskip.enabled
    torch.manual_seed(1)
    for ids in [ids_of(p) for p in PROMPTS] + [torch.randint(0, 4096, (300,))]:  # 300: YaRN's slow dims turn
        with torch.no_grad():
            expect = hf(ids[None]).logits[0]
        got = ref(ids)
        assert got.shape == expect.shape
        assert rel_err(got, expect) <= REL_TOL, (variant, len(ids), rel_err(got, expect))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_generate(ckpts, variant):
    path, hf = ckpts[variant]
    ref = load_reference(path)
    for prompt in PROMPTS:
        out = hf.generate(ids_of(prompt)[None], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
        expect = out.sequences[0, len(prompt):].tolist()
        tokens, logprobs = ref.greedy(prompt, 8)
        assert tokens == expect, (variant, prompt)
        expect_lp = [float(s[0].float().log_softmax(-1)[t]) for s, t in zip(out.scores, expect)]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expect_lp), atol=1e-4, rtol=0)


def test_routing_is_nontrivial(main):
    """Guard the fixture itself: the correction bias and the group limit both change the chosen
    experts, so a routing bug cannot pass the comparisons above by luck."""
    path, _ = main
    ref = load_reference(path)
    gate = ref.model.layers[1].mlp.gate
    x = ref.model.layers[1].post_attention_layernorm(torch.randn(64, 256))
    idx, _ = gate(x)
    scores = torch.nn.functional.linear(x, gate.weight).sigmoid()
    assert (scores.topk(2).indices.sort().values != idx.sort().values).any()  # bias and groups matter
    bias_only = (scores + gate.e_score_correction_bias).topk(2).indices
    assert (bias_only.sort().values != idx.sort().values).any()  # groups matter on their own


# ------------------------------------------------------------------ FarSkip equations by hand
def farskip_by_hand(hf, ids: torch.Tensor, fs: FarSkipConfig) -> torch.Tensor:
    """The FarSkip equations, written out per layer from transformers' own sub-modules."""
    m = hf.model
    T = len(ids)
    h = m.embed_tokens(ids[None])  # h[-1]
    rope = m.rotary_emb(h, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def attn(layer, x):
        return layer.self_attn(layer.input_layernorm(x), position_embeddings=rope, attention_mask=mask)[0]

    def mlp(layer, x):  # (s, r)
        x = layer.post_attention_layernorm(x)
        if not isinstance(layer.mlp, hf_ds.DeepseekV3MoE):
            return layer.mlp(x), torch.zeros_like(x)
        _, weights, idx = layer.mlp.gate(x)
        r = layer.mlp.experts(x.view(T, -1), idx, weights).view_as(x)
        return layer.mlp.shared_experts(x), r

    r_prev = torch.zeros_like(h)
    for k, layer in enumerate(m.layers):
        if not fs.converted(k):  # standard layer
            a = attn(layer, h)
            mid = h + a
            s, r = mlp(layer, mid)
            h = mid + s + r
        else:
            attn_in = h if fs.mlp_only else h - r_prev
            a = attn(layer, attn_in)
            s, r = mlp(layer, h if not fs.attn_only else h + a)
            h = h + a + s + r
        r_prev = r  # 0 after a dense layer
    return hf.lm_head(m.norm(h))[0]


FARSKIP_CASES = {
    "all": FarSkipConfig(enabled=True),
    "range_2_3": FarSkipConfig(enabled=True, start_idx=2, end_idx=3),  # layer 2 reads r[1] of an unconverted layer
    "range_1_1": FarSkipConfig(enabled=True, start_idx=1, end_idx=1),  # r[0] of a dense layer is 0
    "attn_only": FarSkipConfig(enabled=True, attn_only=True),
    "mlp_only": FarSkipConfig(enabled=True, mlp_only=True),
    "mlp_only_from_2": FarSkipConfig(enabled=True, start_idx=2, mlp_only=True),
}


@pytest.mark.parametrize("case", list(FARSKIP_CASES))
def test_farskip_matches_hand_computation(main, case):
    path, hf = main
    fs = FARSKIP_CASES[case]
    ref = load_reference(path, farskip=fs)
    ids = ids_of(PROMPTS[2])
    with torch.no_grad():
        expect = farskip_by_hand(hf, ids, fs)
    assert rel_err(ref(ids), expect) <= REL_TOL, case


def test_farskip_variants_all_differ(main):
    path, _ = main
    ref = load_reference(path)
    ids = ids_of(PROMPTS[2])
    logits = {}
    for name, fs in {"off": FarSkipConfig(), **FARSKIP_CASES}.items():
        ref.set_farskip(fs)
        logits[name] = ref(ids)
    names = list(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert rel_err(logits[a], logits[b]) > 1e-2, f"FarSkip {a} and {b} give the same logits"


def test_farskip_read_from_config_json(main, tmp_path):
    """No override: the wiring comes from the checkpoint's farskip keys."""
    path, _ = main
    fs = FarSkipConfig(enabled=True, start_idx=2, end_idx=3, attn_only=True)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, **fs.to_hf_keys()}, open(tmp_path / "config.json", "w"))
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    ref = load_reference(str(tmp_path))
    assert ref.farskip == fs
    ids = ids_of(PROMPTS[1])
    assert torch.equal(ref(ids), load_reference(path, farskip=fs)(ids))
    # and an explicit override beats the file
    assert not load_reference(str(tmp_path), farskip=FarSkipConfig()).farskip.enabled


def test_farskip_start_beyond_layers_raises(main, tmp_path):
    path, _ = main
    with pytest.raises(UserError, match="farskip_start_idx"):
        load_reference(path, farskip=FarSkipConfig(enabled=True, start_idx=4))
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "farskip": True, "farskip_start_idx": 7}, open(tmp_path / "config.json", "w"))
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="farskip_start_idx"):
        load_reference(str(tmp_path))
    load_reference(path, farskip=FarSkipConfig(enabled=True, start_idx=3))  # the last layer is fine


# ------------------------------------------------------------------ checkpoint layouts
def test_fused_experts_and_sharded_checkpoint(main, tmp_path):
    """transformers 5.19 saves per-expert tensors (experts.{e}.{gate,up,down}_proj.weight, as DeepSeek's
    own checkpoints do), but holds them fused in memory ([E, 2I, H] gate_up_proj, [E, H, I] down_proj);
    both layouts, across index-json shards, load to the same model."""
    path, _ = main
    state = load_file(os.path.join(path, "model.safetensors"))
    shards = [{}, {}]
    for layer in range(1, 4):  # the MoE layers: fuse their experts
        pre = f"model.layers.{layer}.mlp.experts"
        E = 8
        gate_up = [torch.cat([state.pop(f"{pre}.{e}.gate_proj.weight"), state.pop(f"{pre}.{e}.up_proj.weight")])
                   for e in range(E)]
        state[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{pre}.down_proj"] = torch.stack([state.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    for i, name in enumerate(sorted(state)):
        shards[i % 2][name] = state[name].contiguous()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(shard, tmp_path / fname)
        weight_map.update({n: fname for n in shard})
    json.dump({"weight_map": weight_map}, open(tmp_path / "model.safetensors.index.json", "w"))
    json.dump(json.load(open(os.path.join(path, "config.json"))), open(tmp_path / "config.json", "w"))
    ids = ids_of(PROMPTS[1])
    assert torch.equal(load_reference(str(tmp_path))(ids), load_reference(path)(ids))


def test_bf16_load_runs(main):
    path, _ = main
    ref = load_reference(path, dtype=torch.bfloat16)
    assert ref.lm_head.weight.dtype == torch.bfloat16
    assert ref.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    tokens, logprobs = ref.greedy(PROMPTS[0], 2)
    assert len(tokens) == len(logprobs) == 2 and all(lp <= 0 for lp in logprobs)


# ------------------------------------------------------------------ Instella-MoE: the attention gate
# Instella's shape differences at test scale: no query compression, one expert group, a 2-wide
# shared MLP, v_head_dim != qk_nope_head_dim (so a gate sized by the wrong head dim fails).
INSTELLA = dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, num_experts_per_tok=3,
                qk_nope_head_dim=48, v_head_dim=64)


def gate_transformers_attention(hf, gates: dict[int, torch.Tensor]) -> None:
    """Add Instella's gate around transformers' own attention modules: remember each attention
    call's input x, and scale o_proj's input by sigmoid(x @ gate^T)."""
    for k, layer in enumerate(hf.model.layers):
        attn, seen = layer.self_attn, {}

        def remember(_module, args, kwargs, seen=seen):
            seen["x"] = args[0] if args else kwargs["hidden_states"]

        def scale(_module, args, seen=seen, gate=gates[k]):
            return (args[0] * torch.sigmoid(seen["x"] @ gate.T),)

        attn.register_forward_pre_hook(remember, with_kwargs=True)
        attn.o_proj.register_forward_pre_hook(scale)


@pytest.fixture(scope="module")
def instella(tmp_path_factory):
    """(checkpoint dir, gated transformers model, ungated transformers model): the same weights."""
    path = str(tmp_path_factory.mktemp("instella"))
    hf = make_checkpoint(path, **INSTELLA)
    plain = make_checkpoint(str(tmp_path_factory.mktemp("instella_plain")), **INSTELLA)
    torch.manual_seed(2)
    H, width = BASE["hidden_size"], BASE["num_attention_heads"] * INSTELLA["v_head_dim"]
    gates = {k: torch.randn(width, H) * 1.5 / H**0.5 for k in range(BASE["num_hidden_layers"])}
    state = load_file(os.path.join(path, "model.safetensors"))
    state.update({f"model.layers.{k}.self_attn.gate_proj.weight": g for k, g in gates.items()})
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(architectures=["InstellaMoEForCausalLM"], gated_attention=True)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    gate_transformers_attention(hf, gates)
    return path, hf, plain


def test_instella_gate_matches_transformers(instella):
    """FarSkip off: reference.py == transformers' DeepseekV3 with the gate hooked in; FarSkip on:
    == the FarSkip equations by hand on the same gated modules."""
    path, hf, plain = instella
    ref = load_reference(path)
    assert ref.args.gated_attention and ref.args.q_lora_rank is None
    for ids in [ids_of(p) for p in PROMPTS]:
        with torch.no_grad():
            expect, ungated = hf(ids[None]).logits[0], plain(ids[None]).logits[0]
        assert rel_err(ref(ids), expect) <= REL_TOL
        assert rel_err(expect, ungated) > 1e-2  # the gate really changes the model
    for fs in (FarSkipConfig(enabled=True), FarSkipConfig(enabled=True, start_idx=2)):
        ref.set_farskip(fs)
        ids = ids_of(PROMPTS[2])
        with torch.no_grad():
            expect = farskip_by_hand(hf, ids, fs)
        assert rel_err(ref(ids), expect) <= REL_TOL, fs
