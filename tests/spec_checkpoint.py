"""A tiny DeepSeek-V3 checkpoint with a multi-token-prediction (MTP, "NextN") layer, for EAGLE
tests: the demo builder's output plus DeepSeek's layer `model.layers.{L}.*` (L =
num_hidden_layers) and `num_nextn_predict_layers: 1`, the layout SGLang's
DeepseekV3ForCausalLMNextN loads (`models/deepseek_common/deepseek_weight_loader.py`: `enorm`,
`hnorm`, `eh_proj`, `shared_head.norm` under the layer, the rest as one decoder layer; it takes
`embed_tokens` and `shared_head.head` from the target, they are written anyway, as real
checkpoints have them).

A random MTP layer proposes tokens the target never confirms, which checks exactness but not
the handling of accepted drafts. `predictable=True` makes drafts right most of the time: every
sub-block's output projection (`o_proj`, every `down_proj`) is scaled down, so the target's
next token depends mostly on the current token (a bigram model: head(norm(embed(t)))), and the
MTP layer computes that same bigram (`eh_proj` = [I, 0] passes the token's normalised embedding
through, its decoder layer adds little, `shared_head.norm` = the target's final norm).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SMALL_OUTPUT_SCALE = 0.05
_OUTPUT_PROJECTIONS = re.compile(r"\.(self_attn\.o_proj|(mlp\.)?(experts\.\d+\.|shared_experts\.)?down_proj)\.weight$")


def add_mtp_layer(src: Path, dst: Path, *, predictable: bool, seed: int = 0) -> Path:
    """Copy the checkpoint at `src` (one model.safetensors, as demo_model.build_checkpoint
    writes) to `dst` with an MTP layer appended; returns `dst`."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    L = config["num_hidden_layers"]
    H = config["hidden_size"]
    tensors = load_file(str(src / "model.safetensors"))
    if predictable:
        for name in tensors:
            if _OUTPUT_PROJECTIONS.search(name):
                tensors[name] = tensors[name] * SMALL_OUTPUT_SCALE
    # The decoder layer: a copy of the last (MoE) layer, so its shapes and expert layout are
    # the real ones; with `predictable` already scaled down like the target's.
    last = f"model.layers.{L - 1}."
    mtp = f"model.layers.{L}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last):]] = tensors[name].clone()
    gen = torch.Generator().manual_seed(seed)
    if predictable:
        eh_proj = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # [H, 2H]: the token's half
    else:
        eh_proj = torch.randn(H, 2 * H, generator=gen) * H ** -0.5
        for name in [n for n in tensors if n.startswith(mtp) and n.endswith("proj.weight")]:
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * tensors[name].std()
    tensors[mtp + "eh_proj.weight"] = eh_proj
    tensors[mtp + "enorm.weight"] = torch.ones(H)
    tensors[mtp + "hnorm.weight"] = torch.ones(H)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
