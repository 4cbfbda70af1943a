"""The FarSkip student: transformers' own DeepSeek-V3 modules, rewired, trainable.

Parameters and their names are exactly `DeepseekV3ForCausalLM`'s (the teacher's checkpoint loads
unchanged); only the decoder layer's forward differs. Each layer carries two residual streams:

    h = h[k-1]               the full residual
    u = h[k-1] - r[k-1]      the same sum without the previous layer's routed-expert output

kept as separate sums (u + r = h) instead of subtracting r from h, which would cancel in bf16.
Layer k (flags from config.FarSkipConfig, math as in reference.py):

    a    = Attn(norm_in(u            if attn_skips_prev_routed(k) else  h))
    s, r = MLP(norm_post(h           if mlp_skips_attn(k)         else  h + a))
    u'   = h + a + s,   h' = u' + r
"""

from __future__ import annotations

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

from ..config import FarSkipConfig


class FarSkipDecoderLayer(DeepseekV3DecoderLayer):
    # Set by FarSkipDeepseekV3ForCausalLM.set_farskip; both False = the stock layer.
    attn_skips_prev_routed = False
    mlp_skips_attn = False

    def forward(self, h, u, position_embeddings, attention_mask):
        """(h[k-1], h[k-1] - r[k-1]) -> (h[k], h[k] - r[k]). Positional tensors, so that
        transformers' gradient checkpointing (GradientCheckpointingLayer.__call__) applies."""
        attn_in = u if self.attn_skips_prev_routed else h
        a, _ = self.self_attn(self.input_layernorm(attn_in), position_embeddings, attention_mask)
        x = self.post_attention_layernorm(h if self.mlp_skips_attn else h + a)
        if not isinstance(self.mlp, DeepseekV3MoE):  # a dense layer: all of it is "shared"
            u_next = h + a + self.mlp(x)
            return u_next, u_next
        # DeepseekV3MoE.forward returns s + r summed; FarSkip needs them apart.
        _, weights, experts = self.mlp.gate(x)
        r = self.mlp.experts(x.view(-1, x.shape[-1]), experts, weights).view_as(x)  # [B*T, H] -> [B, T, H]
        u_next = h + a + self.mlp.shared_experts(x)
        return u_next + r, u_next


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
        u = h  # nothing routed before layer 0
        for layer in self.layers:
            h, u = layer(h, u, rope, mask)
        return self.norm(h)  # the final norm reads the full residual


class FarSkipDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
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
            layer.attn_skips_prev_routed = farskip.attn_skips_prev_routed(k)
            layer.mlp_skips_attn = farskip.mlp_skips_attn(k)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]. Training never calls this (see loss.py)."""
        return self.lm_head(self.model(input_ids))


# transformers applies its checkpoint renames (per-expert tensors <-> fused 3-D experts) only to its
# own classes; a subclass defined here has to be registered to load and save the same files.
register_checkpoint_conversion_mapping(
    FarSkipDeepseekV3ForCausalLM.__name__, get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True
)


def stock_hidden(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher: stock transformers forward up to the final norm, [B, T] -> [B, T, H]."""
    return model.model(input_ids=input_ids, use_cache=False).last_hidden_state
