"""DeepSeek-V3 in plain PyTorch, with the FarSkip switch: the project's executable spec.

One sequence, full causal recompute, no KV cache, no parallelism. Reads a Hugging Face checkpoint
directory (config.json + *.safetensors); parameter names are HF's, so the module tree below mirrors
`DeepseekV3ForCausalLM` (model.embed_tokens, model.layers.N.{self_attn,mlp,...}, model.norm, lm_head).

Notation for layer k (see config.py): h[k] residual after layer k (h[-1] = embeddings), a[k] attention
output, s[k] shared-expert output (a dense layer's whole MLP output), r[k] routed-expert output
(0 for a dense layer). Every layer computes

    a    = Attn(norm_in(h[k-1] - r[k-1]  if attn_skips_prev_routed(k) else  h[k-1]))
    s, r = MLP(norm_post(h[k-1]          if mlp_skips_attn(k)         else  h[k-1] + a))
    h[k] = h[k-1] + a + s + r

With both switches off this is exactly the stock layer (m = h + a; h' = m + MoE(norm(m))).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .checkpoint import per_expert, shard_files
from .config import FarSkipConfig, is_moe_layer
from .formats import fp8


# ----------------------------------------------------------------------------------------- config
@dataclasses.dataclass
class ModelArgs:
    """The config.json keys the math needs; defaults are transformers' DeepseekV3Config defaults."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int | None = 8
    topk_group: int | None = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_interleave: bool = True  # DeepSeek's checkpoints pair rope dims as (x0,x1),(x2,x3),...
    gated_attention: bool = False  # Instella-MoE: attention output * sigmoid(gate_proj(x)) before o_proj
    rope: dict = dataclasses.field(default_factory=dict)  # rope_parameters / rope_scaling + rope_theta
    raw: dict = dataclasses.field(default_factory=dict, repr=False)  # all of config.json

    @classmethod
    def from_json(cls, cfg: dict) -> "ModelArgs":
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={cfg['hidden_act']!r}: only silu is supported")
        if (cfg.get("scoring_func") or "sigmoid") != "sigmoid" or (cfg.get("topk_method") or "noaux_tc") != "noaux_tc":
            raise NotImplementedError("only DeepSeek-V3 routing (sigmoid scores, noaux_tc) is supported")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "raw"}
        # a null key takes the default, except q_lora_rank where null means "no query compression"
        args = cls(**{k: cfg[k] for k in names if k in cfg and (cfg[k] is not None or k == "q_lora_rank")})
        # transformers 5 writes `rope_parameters` (theta inside); DeepSeek's own config.json writes
        # `rope_scaling` (null for plain RoPE) next to a top-level `rope_theta`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
        if rope["rope_type"] not in ("default", "yarn"):
            raise NotImplementedError(f"rope type {rope['rope_type']!r}: only default and yarn")
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        return dataclasses.replace(args, rope=rope, raw=cfg)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_factor(args: ModelArgs) -> float:
    rope = args.rope  # transformers derives a missing factor from the two context lengths
    return rope.get("factor") or args.raw["max_position_embeddings"] / rope["original_max_position_embeddings"]


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin magnitude (YaRN's attention factor)."""
    d, base, rope = args.qk_rope_head_dim, args.rope["rope_theta"], args.rope
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if rope["rope_type"] == "default":
        return inv_freq, 1.0
    # YaRN: keep the fast (high-frequency) dims, divide the slow ones by `factor`, ramp in between.
    orig, factor = rope["original_max_position_embeddings"], yarn_factor(args)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_of(rotations):  # the dim whose wavelength fits `rotations` times into `orig` positions
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attn_factor = rope.get("attention_factor")
    if attn_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return inv_freq, float(attn_factor)


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's correction
    for the flatter attention of interpolated positions; applies to nope and rope dims alike)."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    if args.rope["rope_type"] != "default" and args.rope.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn_factor(args), args.rope["mscale_all_dim"]) ** 2
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [T, n, d] by per-position angles (cos/sin [T, d/2]). interleave: pair i is (x[2i], x[2i+1])
    (DeepSeek's layout); else pair i is (x[i], x[i+d/2]) (GPT-NeoX). The output keeps x's layout;
    transformers de-interleaves q and k alike, which leaves every q.k dot product unchanged."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, d/2] -> [T, 1, d/2]
    if interleave:
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # [T, n, d] -> 2 x [T, n, d/2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


# ----------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: a dense layer's MLP, one routed expert, or the shared experts (width n_shared * moe_inter)."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLA(nn.Module):
    """Multi-head latent attention. Queries: q_proj, or low-rank q_a_proj -> RMSNorm -> q_b_proj.
    Keys/values: one shared latent (kv_lora_rank) plus one shared rope key (qk_rope_head_dim) per
    token, expanded per head by kv_b_proj. Only the rope dims are rotated. With gated_attention
    (Instella-MoE) every head's output channel is scaled by sigmoid(gate_proj(x)) of the attention's
    own input x before o_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        a, H, nh = args, args.hidden_size, args.num_attention_heads
        self.args, self.nh, self.qk_dim = a, nh, a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)  # transformers uses its default eps here
            self.q_b_proj = nn.Linear(a.q_lora_rank, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, a.kv_lora_rank + a.qk_rope_head_dim, bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, nh * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * a.v_head_dim, H, bias=a.attention_bias)
        if a.gated_attention:
            self.gate_proj = nn.Linear(H, nh * a.v_head_dim, bias=False)
        self.scale = softmax_scale(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, T, nh = self.args, x.shape[0], self.nh
        q = self.q_proj(x) if a.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, nh, self.qk_dim)  # [T, nh*(nope+rope)] -> [T, nh, nope+rope]
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(T, nh, -1)  # [T, nh*(nope+v)] -> [T, nh, nope+v]
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, a.rope_interleave)
        k_rope = apply_rope(k_rope[:, None, :], cos, sin, a.rope_interleave)  # [T, rope] -> [T, 1, rope]
        q = torch.cat([q_nope, q_rope], -1)
        k = torch.cat([k_nope, k_rope.expand(T, nh, -1)], -1)  # one rope key shared by all heads
        scores = torch.einsum("thd,shd->hts", q, k).float() * self.scale  # [nh, T(query), T(key)]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(v.dtype)
        out = torch.einsum("hts,shd->thd", probs, v)  # [T, nh, v_head_dim]
        out = out.reshape(T, nh * a.v_head_dim)  # [T, nh, v] -> [T, nh*v], head-major like the gate
        if a.gated_attention:
            out = out * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(out)


class Router(nn.Module):
    """DeepSeek-V3 noaux_tc gate. The correction bias only steers *which* experts are picked
    (load balancing); the mixing weights come from the unbiased sigmoid scores."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        bias = torch.zeros(args.n_routed_experts, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, T = self.args, x.shape[0]
        n_group = a.n_group or 1
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E], routing always in fp32
        biased = scores + self.e_score_correction_bias.float()
        # keep the topk_group groups whose two best biased scores sum highest, then top-k experts in them
        group_score = biased.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, E] -> [T, G, E/G] -> [T, G]
        top_groups = group_score.topk(a.topk_group or n_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
        expert_mask = group_mask.repeat_interleave(a.n_routed_experts // n_group, dim=1)  # [T, G] -> [T, E]
        idx = biased.masked_fill(~expert_mask, float("-inf")).topk(a.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, idx)  # [T, top_k]
        if a.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * a.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        H, inter = args.hidden_size, args.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(H, inter) for _ in range(args.n_routed_experts))
        self.shared_experts = MLP(H, inter * (args.n_shared_experts or 0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (s, r): shared-expert output and routed-expert output, kept apart for FarSkip."""
        idx, weights = self.gate(x)
        r = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # tokens routed to e, and in which top-k slot
            if tok.numel():
                r.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None].to(x.dtype))
        return self.shared_experts(x), r


class DenseMLP(MLP):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = super().forward(x)
        return s, torch.zeros_like(s)  # a dense layer has no routed part: all of it is s


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, k: int):
        super().__init__()
        self.self_attn = MLA(args)
        if is_moe_layer(args.raw, k):  # honours moe_layer_freq (transformers 5.19 ignores it)
            self.mlp = MoE(args)
        else:
            self.mlp = DenseMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h, r_prev, cos, sin, attn_skips_prev_routed: bool, mlp_skips_attn: bool):
        """h = h[k-1], r_prev = r[k-1]; returns (h[k], r[k]). Both flags off = stock DeepSeek-V3."""
        attn_in = h - r_prev if attn_skips_prev_routed else h
        a = self.self_attn(self.input_layernorm(attn_in), cos, sin)
        mlp_in = h if mlp_skips_attn else h + a
        s, r = self.mlp(self.post_attention_layernorm(mlp_in))
        return h + a + s + r, r


class DeepseekV3Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, k) for k in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class ReferenceModel(nn.Module):
    def __init__(self, args: ModelArgs, farskip: FarSkipConfig):
        super().__init__()
        self.args = args
        self.model = DeepseekV3Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.set_farskip(farskip)

    def set_farskip(self, farskip: FarSkipConfig) -> None:
        """Rewire the same weights (tests run every FarSkip variant on one checkpoint)."""
        farskip.check_layers(self.args.num_hidden_layers)
        self.farskip = farskip

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (one sequence, positions 0..T-1) -> logits [T, vocab]."""
        T, fs = input_ids.shape[0], self.farskip
        inv_freq, attn_factor = rope_frequencies(self.args)
        pos = torch.arange(T, dtype=torch.float32, device=input_ids.device)
        angles = pos[:, None] * inv_freq.to(input_ids.device)  # [T, rope/2]
        dtype = self.lm_head.weight.dtype
        cos, sin = (angles.cos() * attn_factor).to(dtype), (angles.sin() * attn_factor).to(dtype)
        h = self.model.embed_tokens(input_ids)  # h[-1]
        r = torch.zeros_like(h)  # r[-1] = 0: nothing routed before layer 0
        for k, layer in enumerate(self.model.layers):
            h, r = layer(h, r, cos, sin, fs.attn_skips_prev_routed(k), fs.mlp_skips_attn(k))
        return self.lm_head(self.model.norm(h))  # the final norm reads the full residual h[L-1]

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy decoding by full recompute; never stops early (no EOS check). Returns the new
        tokens and, per step, the float32 log-softmax of the chosen token."""
        ids, tokens, logprobs = list(prompt_ids), [], []
        for _ in range(max_new_tokens):
            logp = self.forward(torch.tensor(ids, dtype=torch.long))[-1].float().log_softmax(-1)
            tok = int(logp.argmax())
            ids.append(tok)
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
        return tokens, logprobs


# ----------------------------------------------------------------------------------------- loading
def _read_checkpoint(path: str, num_layers: int, cpu_kv_b_tp: int = 0):
    """Yield (name, tensor) over every shard, under per-expert names (checkpoint.per_expert),
    dropping layers past num_hidden_layers (DeepSeek-V3's MTP layer 61). Block-FP8 weights come
    dequantized to float32 (fp8.dequantize); `cpu_kv_b_tp` > 0: kv_b_proj as SGLang's CPU loader
    keeps it for absorbed MLA at that TP size (fp8.as_cpu_loader_stores_kv_b)."""
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if (layer and int(layer.group(1)) >= num_layers) or name.endswith(fp8.SCALE_SUFFIX):
                    continue
                t = f.get_tensor(name)
                if t.dtype == fp8.DTYPE:
                    scale = f.get_tensor(name + fp8.SCALE_SUFFIX)
                    kv_b = cpu_kv_b_tp and name.endswith("self_attn.kv_b_proj.weight")
                    t = fp8.as_cpu_loader_stores_kv_b(t, scale, cpu_kv_b_tp) if kv_b else fp8.dequantize(t, scale)
                yield from per_expert(name, t)


def load_reference(
    path: str, dtype: torch.dtype = torch.float32, farskip: FarSkipConfig | None = None,
    cpu_kv_b_tp: int = 0,
) -> ReferenceModel:
    """Load a DeepSeek-V3 checkpoint directory, bf16 or block FP8 (dequantized). FarSkip wiring
    comes from config.json's farskip keys unless `farskip` overrides it. `cpu_kv_b_tp` > 0: an FP8
    kv_b_proj requantized per TP shard as SGLang's CPU loader does at that TP size (formats/fp8.py), for
    comparing with a CPU server."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    args = ModelArgs.from_json(cfg)
    farskip = farskip if farskip is not None else FarSkipConfig.from_hf_config(cfg)
    with torch.device("meta"):
        model = ReferenceModel(args, farskip)
    state = {}
    for name, t in _read_checkpoint(path, args.num_hidden_layers, cpu_kv_b_tp):
        # transformers keeps the correction bias in fp32 whatever the model dtype
        state[name] = t.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype).contiguous()
    if args.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True, assign=True)  # any missing/unexpected name raises
    return model.eval()
