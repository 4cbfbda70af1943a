"""FarSkip DeepSeek-V3 inside SGLang 0.5.23: upstream layers and weights, FarSkip wiring.

The FarSkip wiring itself (which sums each sub-block waits for, which collectives it starts,
in which order) is `sglang_farskip.schedule`, the one lane loop the bare GPU check and the
FCSD student run too. This file supplies the ops it runs over (`_ServedLayer`): SGLang's fused
add + RMSNorm, upstream MLA, the shared and routed experts apart; each returns a partial
[T, H] (T tokens, H hidden) that the schedule's lanes all-reduce.

DP attention (`Step.rows`, see parallel.DpRows): x holds the rows of every DP rank's tokens
[T_g, H]; norm_in and attention read this rank's rows [T_d, H] and the partial goes back in
those rows, zero elsewhere, so the schedule's lanes are unchanged. The embeddings are gathered
once; the output is this rank's rows.

Upstream's DeepseekV2Model.forward runs the same sub-modules through SGLang's layer-boundary
framework, which holds one pending sum at a time; FarSkip needs two, so the model's forward is
replaced (only the forward: layers, weights and loading stay upstream's). `sync` and `overlap`
run this one code path; they differ only in the communicator (blocking or async), so both add
the same sums in the same order. Which communicator, and every check of SGLang's settings and
groups, is `parallel.py`'s; this file never touches a process group.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import NamedTuple, Optional

import torch

from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
    is_in_breakable_cuda_graph,
)
from sglang.srt.layers.layer_boundary.adapters.attention import (
    AttentionInputs,
    get_attn_tp_context,
)
from sglang.srt.models.deepseek_v2 import (
    DeepseekV2MoE,
    DeepseekV2Model,
    DeepseekV3ForCausalLM,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import BumpAllocator, use_intel_amx_backend

from sglang_farskip import boundary, options, parallel, schedule
from sglang_farskip.comm import Communicator
from sglang_farskip.config import FarSkipConfig, FarSkipMode, is_moe_layer
from sglang_farskip.models.status import model_report, write_rank_status
from sglang_farskip.profiler import publish_info
from sglang_farskip.schedule import LayerWiring

logger = logging.getLogger("sglang_farskip.model")


class Step(NamedTuple):
    """What every layer of one forward shares."""

    positions: torch.Tensor
    forward_batch: object
    zero_allocator: BumpAllocator
    rows: Optional[parallel.DpRows]  # DP attention: this rank's rows of x; None: x is all local


def _add_norm(norm, x: torch.Tensor, s: Optional[torch.Tensor], rows=None):
    """schedule.AddNorm: (norm(x + s), x + s). SGLang's fused residual add + RMSNorm on
    CUDA/HIP (one kernel, both tensors updated in place), the same float add then the norm
    elsewhere; either way the same code runs in `sync` and `overlap`. `rows` (DP attention,
    the attention input): every row summed, only this rank's normed."""
    if rows is not None:
        x = x if s is None else x + s
        return norm(rows.to_local(x)), x  # [T_g, H] -> [T_d, H]
    if s is None:
        return norm(x), x
    return norm(s, x)


class _ServedLayer:
    """schedule.LayerOps of one upstream decoder layer in one forward."""

    __slots__ = ("layer", "step")

    def __init__(self, layer, step: Step):
        self.layer, self.step = layer, step

    def input_add_norm(self, x, s):
        return _add_norm(self.layer.input_layernorm, x, s, rows=self.step.rows)

    def attention(self, h):
        return _attention(self.layer, h, self.step)

    def post_add_norm(self, x, s):
        return _add_norm(self.layer.post_attention_layernorm, x, s)

    def dense_mlp(self, y):
        return self.layer.mlp(y, self.step.forward_batch)

    def shared_experts(self, y):
        return shared_experts(self.layer.mlp, y)

    def routed_experts(self, y):
        return _routed_experts(self.layer.mlp, y)


class FarSkipDeepseekV2Model(DeepseekV2Model):
    """Upstream's model with the FarSkip forward. Set up by `FarSkipDeepseekV3ForCausalLM`."""

    wiring: list[LayerWiring]
    comm: Communicator

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        if self.comm.profiler is not None:
            self.comm.profiler.phase = "decode" if forward_batch.forward_mode.is_decode() else "prefill"
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        rows = parallel.dp_rows(forward_batch, x.shape[0])
        if rows is not None:  # [T_d, H] -> [T_g, H]: every DP rank's embeddings, on every rank
            x = self.comm.start_all_reduce(rows.to_global(x, replicated=True), lane="gather").wait()
        zero_allocator = BumpAllocator(
            buffer_size=len(self.layers) * 2, dtype=torch.float32, device=positions.device
        )
        step = Step(positions, forward_batch, zero_allocator, rows)
        x, lanes = schedule.run_layers(
            x, (_ServedLayer(layer, step) for layer in self.layers), self.wiring, self.comm,
            # A breakable CUDA graph ends one captured segment at attention and starts the
            # next (docs/gpu-overlap.md): the routed sum is joined before attention.
            graph_breaks=is_in_breakable_cuda_graph(),
            scope=get_global_expert_distribution_recorder().with_current_layer,
        )
        if self.comm.profiler is not None:
            self.comm.profiler.flush()
        if forward_batch.forward_mode.is_idle():
            out = schedule.finish(x, lanes)
        else:
            out = schedule.finish(x, lanes, partial(_add_norm, self.norm))  # the final norm reads the full h[L-1]
        return out if rows is None else rows.to_local(out)  # [T_g, H] -> [T_d, H]


def _attention(layer, h: torch.Tensor, step: Step) -> torch.Tensor:
    """Upstream MLA (prefill or decode path, picked by the attention backend) -> o_proj partial.
    Under DP attention h holds this rank's rows: [T_d, H] -> MLA -> [T_g, H]."""
    if step.rows is None:
        return _local_attention(layer, h, step)
    # attention-TP partials: each rank places its own, the lane sums them
    return step.rows.to_global(_local_attention(layer, h, step), replicated=False)


def _local_attention(layer, h: torch.Tensor, step: Step) -> torch.Tensor:
    ctx = get_attn_tp_context()
    # The boundary framework normally publishes the attention input for the lazy QKV GEMM.
    ctx.set_attn_inputs(AttentionInputs(h, step.forward_batch, layer.self_attn.prepare_qkv_latent))
    try:
        out = layer.self_attn(
            positions=step.positions,
            hidden_states=h,
            forward_batch=step.forward_batch,
            zero_allocator=step.zero_allocator,
        )
    finally:
        ctx.clear_attn_inputs()
    return out[0] if isinstance(out, tuple) else out


def shared_experts(moe: DeepseekV2MoE, y: torch.Tensor) -> torch.Tensor:
    """Shared-expert partial; zeros without shared experts or for an empty batch, because every
    rank must still issue the same collectives."""
    s = moe._forward_shared_experts(y) if moe.shared_experts is not None else None
    return torch.zeros_like(y) if s is None else s


def _routed_experts(moe: DeepseekV2MoE, y: torch.Tensor) -> torch.Tensor:
    """Routed-expert partial with routed_scaling_factor applied, shared experts excluded."""
    if moe.shared_experts is not None and use_intel_amx_backend(moe.shared_experts.gate_up_proj):
        # SGLang's AMX CPU path (sgl-kernel's CPU build): upstream's forward_normal returns
        # forward_cpu()'s tensor there, shared + routed merged by one kernel, and ignores
        # skip_shared_experts and return_moe_output. So the routed half is computed here, as
        # forward_cpu does it up to that kernel, with the scale the merge would apply;
        # shared_experts' MLP runs on that path as it is.
        if y.shape[0] == 0:
            return torch.zeros_like(y)
        topk_output = moe.topk(y, moe.gate(y))
        return moe.experts(hidden_states=y, topk_output=topk_output) * moe.routed_scaling_factor
    # forward_normal, not forward: the dual-stream variant ignores skip_shared_experts.
    out = moe.forward_normal(y, skip_shared_experts=True, return_moe_output=True)
    return out._replace(shared=None).get_merged()


class FarSkipDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """Registered under the architecture name "DeepseekV3ForCausalLM" (SGLang's MLA detection
    keys on that name). With `"farskip": false` in config.json, or `--farskip-mode off`, it is
    upstream's class unchanged."""

    @classmethod
    def _farskip_active(cls, hf_config) -> bool:
        return FarSkipConfig.from_hf_config(hf_config).enabled and options.current().mode is not FarSkipMode.OFF

    @classmethod
    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):
        if cls._farskip_active(hf_config):
            return "FarSkip reduces shared experts apart from routed experts."
        return super().shared_experts_fusion_disable_reason(hf_config, quant_config)

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        farskip = FarSkipConfig.from_hf_config(config)
        farskip.check_layers(config.num_hidden_layers)
        opts = options.current()
        active = farskip.enabled and opts.mode is not FarSkipMode.OFF
        if active:
            parallel.check_server_args(opts)  # before upstream allocates any weight
        super().__init__(config, quant_config, prefix)
        extra_report = self._extend_layers(config)

        tp_rank = get_parallel().tp_rank
        mode, comm_backend = FarSkipMode.OFF, "sglang"
        if active:
            boundary.swap_class(self.model, FarSkipDeepseekV2Model)  # upstream builds it by name
            self.model.wiring = [
                LayerWiring(
                    attn_skips_prev_routed=farskip.attn_skips_prev_routed(k),
                    mlp_skips_attn=farskip.mlp_skips_attn(k),
                    is_moe=is_moe_layer(config, k),
                )
                for k in range(config.num_hidden_layers)
            ]
            parallel.check_layers(self.model.layers, self.model.wiring)
            self.model.comm, mode = parallel.build_communicator(
                parallel.reduction_group(get_parallel()), opts, config.hidden_size, tp_rank
            )
            comm_backend = self.model.comm.backend
        elif farskip.enabled:
            logger.warning(
                "--farskip-mode off: stock DeepSeek-V3 wiring on FarSkip weights. The outputs "
                "are NOT the model's; use this only for A/B timing."
            )

        report = model_report(self, farskip, config.num_hidden_layers, opts.mode, mode, comm_backend,
                              extra_report)
        write_rank_status(report)
        labels = parallel.metric_labels() if opts.metrics == "on" else None
        if labels is not None:  # farskip:info on /metrics
            publish_info(labels, mode.value, report["converted_layers"], comm_backend)
        if tp_rank == 0:
            logger.info(
                "sglang_farskip: %s, mode %s (requested %s), all-reduce %s",
                report["description"], mode.value, opts.mode.value, comm_backend,
            )

    def _extend_layers(self, config) -> dict:
        """Subclasses add their modules here (after upstream's layers exist, before the FarSkip
        wiring and the report); returns extra fields for the rank report."""
        return {}
