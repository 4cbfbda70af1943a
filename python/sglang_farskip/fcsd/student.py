"""The FarSkip student: transformers' own DeepSeek-V3 modules, rewired, trainable.

Parameters and their names are exactly `DeepseekV3ForCausalLM`'s (the teacher's checkpoint loads
unchanged); only the decoder layer's forward differs: it runs `sglang_farskip.schedule`, the
lane loop the served model runs, on one rank (`schedule.OneRank`: every "all-reduce" is its
input, autograd flows through). So the student adds the same partial sums in the same order
as the server that will serve it. Between layers it carries two residual streams [B, T, H]:

    u = h[k-1] - r[k-1]      the residual without the previous layer's routed-expert output
    r = r[k-1]               that output (None after a dense layer and before layer 0)

kept apart (u + r = h) instead of subtracting r from h, which would cancel in bf16. They are
the schedule's state between two layers with the attention lane already added (its next step
adds that lane first in every wiring, so adding it at the end of the layer is the same sum).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3MoE,
    DeepseekV3Model,
)

from .. import schedule
from ..config import FarSkipConfig

ONE_RANK = schedule.OneRank()


class _StudentOps(schedule.UnfusedNorms):
    """schedule.LayerOps of one transformers decoder layer, for one forward."""

    def __init__(self, layer: DeepseekV3DecoderLayer, position_embeddings, attention_mask):
        super().__init__(layer)
        self.rope, self.mask = position_embeddings, attention_mask

    def attention(self, h):
        return self.layer.self_attn(h, self.rope, self.mask)[0]

    def dense_mlp(self, y):
        return self.layer.mlp(y)

    def shared_experts(self, y):
        return self.layer.mlp.shared_experts(y)

    def routed_experts(self, y):
        # DeepseekV3MoE.forward returns s + r summed; FarSkip needs them apart.
        moe = self.layer.mlp
        _, weights, experts = moe.gate(y)
        return moe.experts(y.view(-1, y.shape[-1]), experts, weights).view_as(y)  # [B*T, H] -> [B, T, H]


def _routed_lane(r: Optional[torch.Tensor]) -> schedule.Lanes:
    """The lanes between two student layers: the routed sum r, the attention lane already added."""
    return schedule.Lanes(routed=None if r is None else schedule.Ready(r))


class FarSkipDecoderLayer(DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.layer_idx = layer_idx
        # The stock layer until FarSkipStudent.set_farskip rewires it.
        self.wiring = schedule.LayerWiring(attn_skips_prev_routed=False, mlp_skips_attn=False,
                                           is_moe=isinstance(self.mlp, DeepseekV3MoE))

    def forward(self, u, r: Optional[torch.Tensor], position_embeddings, attention_mask):
        """(h[k-1] - r[k-1], r[k-1]) -> (h[k] - r[k], r[k]). Positional tensors, so that
        transformers' gradient checkpointing (GradientCheckpointingLayer.__call__) applies."""
        ops = _StudentOps(self, position_embeddings, attention_mask)
        x, lanes = schedule.layer_step(self.layer_idx, self.wiring, ops, ONE_RANK, u, _routed_lane(r))
        u_next = x + lanes.attn_shared.wait()  # what the next step would add first
        return u_next, None if lanes.routed is None else lanes.routed.wait()


class FarSkipDeepseekV3Model(DeepseekV3Model):
    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(FarSkipDecoderLayer(config, k) for k in range(config.num_hidden_layers))
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (every row a packed window, positions 0..T-1) -> final-norm hidden [B, T, H]."""
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # [1, T]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=positions
        )
        rope = self.rotary_emb(h, positions)
        u, r = h, None  # nothing routed before layer 0
        for layer in self.layers:
            u, r = layer(u, r, rope, mask)
        # the final norm reads the full residual: norm(u + r)
        return schedule.finish(u, _routed_lane(r), schedule.add_then_norm(self.norm))


class FarSkipStudent(DeepseekV3ForCausalLM):
    """`from_pretrained(teacher_dir)` gives the untrained student (init = the teacher's weights)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = FarSkipDeepseekV3Model(config)
        self.post_init()
        self.set_farskip(FarSkipConfig.from_hf_config(config))

    def set_farskip(self, farskip: FarSkipConfig) -> None:
        farskip.check_layers(self.config.num_hidden_layers)
        self.farskip = farskip
        for k, layer in enumerate(self.model.layers):
            layer.wiring = dataclasses.replace(layer.wiring, attn_skips_prev_routed=farskip.attn_skips_prev_routed(k),
                                               mlp_skips_attn=farskip.mlp_skips_attn(k))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]. Training never calls this (see loss.py)."""
        return self.lm_head(self.model(input_ids))


# transformers applies its checkpoint renames (per-expert tensors <-> fused 3-D experts) only to its
# own classes; a subclass defined here has to be registered to load and save the same files.
register_checkpoint_conversion_mapping(
    FarSkipStudent.__name__, get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True
)


def stock_hidden(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher: stock transformers forward up to the final norm, [B, T] -> [B, T, H]."""
    return model.model(input_ids=input_ids, use_cache=False).last_hidden_state
