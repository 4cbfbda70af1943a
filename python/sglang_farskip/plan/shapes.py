"""The model a plan is for: the config.json keys the cost model reads, and the two built-in
checkpoints' shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from sglang_farskip.config import FarSkipConfig, is_moe_layer
from sglang_farskip.errors import UserError
from sglang_farskip.formats import fp8

BF16 = 2  # bytes per element of every partial sum the collectives carry


@dataclasses.dataclass(frozen=True)
class Shape:
    """The config.json keys the cost model reads (DeepSeek-V3 family)."""

    name: str
    hidden: int
    layers: int
    first_dense: int
    experts: int
    top_k: int
    moe_inter: int
    dense_inter: int
    shared: int
    q_lora: Optional[int]
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    heads: int
    vocab: int
    gated_attention: bool
    moe_layer_freq: int
    farskip: FarSkipConfig
    farskip_assumed: bool  # the config is not FarSkip: planned as if every layer were converted
    mtp_layers: int  # num_nextn_predict_layers: weights only (memory.py), never in the step
    tied_embeddings: bool
    weight_format: str  # "bf16" | "fp8": the checkpoint's (fp8.weight_format), --dtype's default

    def is_moe(self, k: int) -> bool:
        return is_moe_layer({"n_routed_experts": self.experts, "first_k_dense_replace": self.first_dense,
                             "moe_layer_freq": self.moe_layer_freq}, k)


_REQUIRED = ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "qk_rope_head_dim",
             "qk_nope_head_dim", "v_head_dim", "num_attention_heads")


def shape_from_config(cfg: dict, name: str) -> Shape:
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise UserError(f"{name}: config.json lacks {', '.join(missing)} (a DeepSeek-V3-family config is needed)")
    try:
        farskip = FarSkipConfig.from_hf_config(cfg)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None
    try:
        weight_format = fp8.weight_format(cfg)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None
    assumed = not farskip.enabled
    if assumed:  # planning a conversion: the default range converts every layer
        farskip = dataclasses.replace(farskip, enabled=True)
    return Shape(
        name=name, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
        first_dense=cfg.get("first_k_dense_replace") or 0, experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"], moe_inter=cfg["moe_intermediate_size"],
        dense_inter=cfg["intermediate_size"], shared=cfg.get("n_shared_experts") or 0,
        q_lora=cfg.get("q_lora_rank"), kv_lora=cfg["kv_lora_rank"], rope=cfg["qk_rope_head_dim"],
        nope=cfg["qk_nope_head_dim"], v_head=cfg["v_head_dim"], heads=cfg["num_attention_heads"],
        vocab=cfg.get("vocab_size") or 129280, gated_attention=bool(cfg.get("gated_attention")),
        moe_layer_freq=cfg.get("moe_layer_freq") or 1, farskip=farskip, farskip_assumed=assumed,
        mtp_layers=cfg.get("num_nextn_predict_layers") or 0, tied_embeddings=bool(cfg.get("tie_word_embeddings")),
        weight_format=weight_format,
    )


# The two built-in checkpoints' shapes (DeepSeek-V3's config.json; AMD's config.json of
# Instella-MoE-16B-A3B, docs/instella-moe.md), both with FarSkip on every layer and without a
# quantization_config (their weight format is bf16 unless --dtype says otherwise).
# DeepSeek-V3 ships one MTP layer (num_nextn_predict_layers 1): memory.py counts its weights.
BUILTIN_MODELS = {
    "deepseek-v3": dict(
        hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432, n_shared_experts=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        num_attention_heads=128, vocab_size=129280, num_nextn_predict_layers=1, farskip=True),
    "instella-moe": dict(
        hidden_size=2048, num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=1408, intermediate_size=10944, n_shared_experts=2,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=96, v_head_dim=128,
        num_attention_heads=16, vocab_size=128896, gated_attention=True, farskip=True),
}


def load_shape(spec: str) -> Shape:
    if spec in BUILTIN_MODELS:
        return shape_from_config(BUILTIN_MODELS[spec], spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {spec}: not a built-in name ({', '.join(BUILTIN_MODELS)}) "
                        f"and not a readable config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--model {spec}: config.json is not a JSON object")
    return shape_from_config(cfg, path.parent.name or str(path))
