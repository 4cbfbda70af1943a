"""Instella-MoE (AMD's FarSkip-native DeepSeek-V3 derivative) inside SGLang 0.5.23.

The same model as FarSkipDeepseekV3ForCausalLM (MLA with q_lora_rank null, MoE, FarSkip wiring,
all three modes) plus a gate on every attention output:

    x      = input_layernorm(attention input)                                  [T, H]
    g      = sigmoid(gate_proj(x))                                             [T, heads*v_head]
    out    = o_proj(MLA(x) * g)         MLA(x) reshaped head-major             [T, heads*v_head] -> [T, H]

On an attention-TP rank both MLA(x) and g hold that rank's heads, [T, heads/TP * v_head], so
gate_proj is column-parallel with the same contiguous split as q_proj and kv_b_proj.

Every DeepSeek attention method of 0.5.23 (MHA prefill, chunked-KV and one-shot prefill,
absorbed-MLA decode, the CPU and ROCm variants) ends in `self.o_proj(attn_output)`; which one
runs is chosen per batch inside the attention module. So the gate is computed when the
attention's prepare step starts and multiplied in at o_proj's input, the one point all of them pass
through, rather than in each method (AMD's own port gates only some of them). Upstream's
`prepare_attention_output_gate` hook exists only on the absorbed path and is deliberately not
used.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterable, Optional

import torch

from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

from sglang_farskip import boundary
from sglang_farskip.errors import UserError
from sglang_farskip.checkpoint import GATE_KEY, gate_problems, gated_attention
from sglang_farskip.models.deepseek_v3 import FarSkipDeepseekV3ForCausalLM

logger = logging.getLogger("sglang_farskip.model")

# SGLang's DeepSeek loader maps any name containing "gate_proj" to the MLP's fused gate_up_proj,
# so the checkpoint's self_attn.gate_proj is loaded under a name without that substring.
CKPT_GATE = ".self_attn.gate_proj."
PARAM_GATE = ".self_attn.attn_gate."


class GatedOProj(RowParallelLinear):
    """o_proj that first scales its input by the gate its attention module left for it."""

    gate: Optional[torch.Tensor] = None

    def forward(self, input_, *args, **kwargs):
        gate, self.gate = self.gate, None  # one gate per attention call: never reuse a stale one
        if gate is None:
            raise RuntimeError("gated attention: o_proj was called without a gate from its attention module")
        if isinstance(input_, tuple):  # (fp8/mxfp4 values, scales) from the ROCm quantised paths
            raise NotImplementedError(
                "gated attention with a quantised o_proj input is not supported: serve Instella-MoE in bf16"
            )
        return super().forward(input_ * gate, *args, **kwargs)


class GatedMLA(DeepseekV2AttentionMLA):
    """Upstream MLA; its prepare step (the entry of `forward` and of two-batch overlap's
    `op_prepare` alike) computes the gate of this call for o_proj."""

    attn_gate: ColumnParallelLinear
    o_proj: GatedOProj

    def forward_prepare(self, positions, hidden_states, forward_batch, zero_allocator,
                        input_on_attn_tp_slices: bool = False, **kwargs):
        if input_on_attn_tp_slices:  # the gate must see the gathered tokens the heads see
            raise NotImplementedError(
                "gated attention (Instella-MoE) with attention input scattered over attention-TP "
                "ranks: remove --enable-attn-tp-input-scattered"
            )
        if isinstance(hidden_states, tuple):  # (fp8 values, scales) from a fused norm+quant
            raise NotImplementedError(
                "gated attention (Instella-MoE) with a quantised attention input: serve it in bf16 "
                "(no --quantization)"
            )
        gate, _ = self.attn_gate(hidden_states)  # [T, H] -> [T, heads/TP * v_head]
        self.o_proj.gate = torch.sigmoid(gate)
        return super().forward_prepare(positions, hidden_states, forward_batch, zero_allocator,
                                       input_on_attn_tp_slices=input_on_attn_tp_slices, **kwargs)


def _add_gate(attn: DeepseekV2AttentionMLA, config, prefix: str) -> None:
    # Unquantised whatever --quantization says: a [heads*v_head, H] GEMM, and its sigmoid
    # output scales every head's value channels.
    attn.attn_gate = ColumnParallelLinear(
        config.hidden_size,
        attn.num_heads * attn.v_head_dim,
        bias=False,
        quant_config=None,
        prefix=prefix,
        parallel_group="attn_tp",  # the heads' split: q_proj, kv_b_proj and o_proj use it too
    )
    # Upstream builds both by name; only these instances change (boundary/table.csv says why).
    boundary.swap_class(attn.o_proj, GatedOProj)
    boundary.swap_class(attn, GatedMLA)


class InstellaMoEForCausalLM(FarSkipDeepseekV3ForCausalLM):
    """Registered under "InstellaMoEForCausalLM". FarSkip wiring and modes as for DeepSeek-V3;
    `"gated_attention": true` adds the gate on every layer."""

    def _extend_layers(self, config) -> dict:
        self.gated = gated_attention(config)  # raises UserError on a non-bool
        if self.gated:
            for k, layer in enumerate(self.model.layers):
                if not hasattr(layer, "self_attn"):  # PPMissingLayer: another stage's layer
                    raise UserError(
                        "gated attention (Instella-MoE) with pipeline parallelism is not supported: "
                        "remove --pp-size"
                    )
                _add_gate(layer.self_attn, config, f"model.layers.{k}.self_attn.attn_gate")
        return {"gated_attention": self.gated}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], is_nextn: bool = False):
        """Upstream's loader, with the gate renamed, and the rules of sglang_farskip.checkpoint
        enforced: every gate present with its shape, and no checkpoint tensor skipped."""
        gate_shapes: dict[int, tuple[int, ...]] = {}

        def renamed():
            for name, tensor in weights:
                m = GATE_KEY.match(name)
                if m:
                    gate_shapes[int(m.group(1))] = tuple(tensor.shape)
                    problems = gate_problems(self.config, gate_shapes)
                    wrong_now = [p for p in problems if "has shape" in p or "does not set" in p]
                    if wrong_now:  # before upstream's loader asserts without a message
                        raise UserError(wrong_now[0])
                    name = name.replace(CKPT_GATE, PARAM_GATE)
                yield name, tensor

        with _skipped_tensors_are_errors():
            super().load_weights(renamed(), is_nextn=is_nextn)
        problems = gate_problems(self.config, gate_shapes)
        if problems:
            raise UserError("; ".join(problems))


class _SkippedTensors(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "not found in params_dict" in message:
            self.messages.append(message)


@contextmanager
def _skipped_tensors_are_errors():
    """Upstream's DeepSeek loader logs a warning and skips a tensor it has no parameter for; a
    mis-named tensor (an attention gate most of all) would load as nothing. Turn that into an
    error naming the tensors. The logger is opened up meanwhile: `--log-level error` would
    otherwise drop the warning, and the tensor with it."""
    loader_log = logging.getLogger("sglang.srt.models.deepseek_common.deepseek_weight_loader")
    handler = _SkippedTensors()
    level, disabled = loader_log.level, loader_log.disabled
    loader_log.setLevel(logging.WARNING)
    loader_log.disabled = False
    loader_log.addHandler(handler)
    try:
        yield
    finally:
        loader_log.removeHandler(handler)
        loader_log.setLevel(level)
        loader_log.disabled = disabled
    if handler.messages:
        raise UserError(
            f"{len(handler.messages)} checkpoint tensor(s) match no parameter of the model "
            f"({'; '.join(handler.messages[:3])}): the checkpoint does not match its config.json"
        )
