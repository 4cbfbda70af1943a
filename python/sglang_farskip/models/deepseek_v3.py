"""FarSkip DeepSeek-V3 inside SGLang 0.5.23: upstream layers and weights, FarSkip wiring.

Notation (per decoder layer k, all [T, H] on the residual stream, T tokens, H hidden):
    x       the residual, complete except for the sums still in flight
    a       attention output partial (o_proj without its all-reduce)      [T, H]
    s       shared-expert partial (a dense layer's whole MLP output)     [T, H]
    r       routed-expert partial (MoE layers only)                      [T, H]
    Lanes   the previous layer's sums still in flight:
            A lane = AR(a + s),  R lane = AR(r)   (AR: the all-reduce of comm.py, a Handle)

A layer (DESIGN.md section 1; `FarSkipConfig` decides per layer):
    x += A lane                                   # now x = h[k-1] - r[k-1]
    if attention reads full h:  x += R lane
    a = Attn(norm_in(x))
    if the MLP skips a:  x += R lane;  mlp_in = x            (h[k-1])
    else:                x += R lane;  x += AR(a); mlp_in = x (h[k-1] + a)
    s = Shared(norm_post(mlp_in));  A lane = AR(a + s)   (just AR(s) if a was reduced)
    r = Routed(norm_post(mlp_in));  R lane = AR(r)
and after the last layer x += A lane; x += R lane; out = norm(x).

A dense layer (r = 0) sends its whole MLP output on the A lane: the next attention must read
it (DESIGN section 1), so that one sum is waited at once; only MoE layers overlap both lanes.

DP attention (`Step.rows`, see parallel.DpRows): x holds the rows of every DP rank's tokens
[T_g, H]; norm_in and attention read this rank's rows [T_d, H] and the partial goes back in
those rows, zero elsewhere, so the lanes above are unchanged. The embeddings are gathered
once; the output is this rank's rows.

Upstream's DeepseekV2Model.forward runs the same sub-modules through SGLang's layer-boundary
framework, which holds one pending sum at a time; FarSkip needs two, so the model's forward is
replaced (only the forward: layers, weights and loading stay upstream's). `sync` and `overlap`
run this one code path; they differ only in the communicator (blocking or async), so both add
the same sums in the same order. Which communicator, and every check of SGLang's settings and
groups, is `parallel.py`'s; this file never touches a process group.
"""

from __future__ import annotations

import dataclasses
import logging
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
from sglang.srt.utils import BumpAllocator

from sglang_farskip import options, parallel
from sglang_farskip.comm import Communicator, Handle
from sglang_farskip.config import FarSkipConfig, FarSkipMode, is_moe_layer
from sglang_farskip.serve.status import model_report, write_rank_status

logger = logging.getLogger("sglang_farskip.model")


@dataclasses.dataclass(frozen=True)
class LayerWiring:
    attn_skips_prev_routed: bool  # attention reads h[k-1] - r[k-1]
    mlp_skips_attn: bool  # the MLP reads h[k-1], not h[k-1] + a[k]
    is_moe: bool


class Lanes(NamedTuple):
    """The previous layer's partial sums, still in flight (None: nothing pending)."""

    attn: Optional[Handle] = None  # A lane: AR(a + s)
    routed: Optional[Handle] = None  # R lane: AR(r)


class Step(NamedTuple):
    """What every layer of one forward shares."""

    positions: torch.Tensor
    forward_batch: object
    zero_allocator: BumpAllocator
    graph_breaks: bool  # under a breakable CUDA graph: no sum may stay in flight across attention
    rows: Optional[parallel.DpRows]  # DP attention: this rank's rows of x; None: x is all local


def _add(x: torch.Tensor, handle: Optional[Handle]) -> torch.Tensor:
    return x if handle is None else x + handle.wait()


def _add_norm(norm, x: torch.Tensor, *handles: Optional[Handle], rows=None):
    """(norm(x + sums), x + sums). The norm adds the last sum itself: SGLang's fused residual
    add + RMSNorm on CUDA/HIP (one kernel, both tensors updated in place), the same float add
    then the norm elsewhere. Either way the same code runs in `sync` and `overlap`.
    `rows` (DP attention, the attention input): every row summed, only this rank's normed."""
    if rows is not None:
        for h in handles:
            x = _add(x, h)
        return norm(rows.to_local(x)), x  # [T_g, H] -> [T_d, H]
    *first, last = [h for h in handles if h is not None] or [None]
    for h in first:
        x = _add(x, h)
    if last is None:
        return norm(x), x
    return norm(last.wait(), x)


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
        # A breakable CUDA graph ends one captured segment at attention and starts the next
        # (docs/gpu-overlap.md); the model then joins the routed sum before attention.
        step = Step(positions, forward_batch, zero_allocator, is_in_breakable_cuda_graph(), rows)
        lanes = Lanes()
        try:
            for k, layer in enumerate(self.layers):
                with get_global_expert_distribution_recorder().with_current_layer(k):
                    x, lanes = self._layer(k, layer, x, lanes, step)
        except BaseException:
            self.comm.drain()  # no collective outlives the tensors it reads and writes
            raise
        if self.comm.profiler is not None:
            self.comm.profiler.flush()
        if forward_batch.forward_mode.is_idle():
            out = _add(_add(x, lanes.attn), lanes.routed)
        else:
            out = _add_norm(self.norm, x, lanes.attn, lanes.routed)[0]  # the final norm reads the full h[L-1]
        return out if rows is None else rows.to_local(out)  # [T_g, H] -> [T_d, H]

    def _layer(self, k: int, layer, x: torch.Tensor, lanes: Lanes, step: Step) -> tuple[torch.Tensor, Lanes]:
        w, comm = self.wiring[k], self.comm
        routed = lanes.routed
        if w.attn_skips_prev_routed:
            h, x = _add_norm(layer.input_layernorm, x, lanes.attn, rows=step.rows)  # x = h[k-1] - r[k-1]
            if step.graph_breaks and routed is not None:
                routed.join()  # summed in this segment, added after the attention as always
        else:
            (h, x), routed = _add_norm(layer.input_layernorm, x, lanes.attn, routed, rows=step.rows), None  # h[k-1]
        a = _attention(layer, h, step)
        comm.mark_compute()

        if w.mlp_skips_attn:
            y, x = _add_norm(layer.post_attention_layernorm, x, routed)  # x = h[k-1]
        else:
            attn = comm.start_all_reduce(a, lane="attn", layer=k)
            y, x = _add_norm(layer.post_attention_layernorm, x, routed, attn)  # h[k-1] + a
            a = None  # already summed: the A lane then carries s alone

        if not w.is_moe:  # a dense MLP's output rides the attention lane (r = 0)
            s = layer.mlp(y, step.forward_batch)
            comm.mark_compute()
            return x, Lanes(attn=comm.start_all_reduce(_plus(a, s), lane="attn+shared", layer=k))

        s = _shared_experts(layer.mlp, y)
        attn_shared = comm.start_all_reduce(_plus(a, s), lane="attn+shared", layer=k)
        r = _routed_experts(layer.mlp, y)
        comm.mark_compute()
        return x, Lanes(attn_shared, comm.start_all_reduce(r, lane="routed", layer=k))


def _plus(a: Optional[torch.Tensor], s: torch.Tensor) -> torch.Tensor:
    return s if a is None else a + s


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


def _shared_experts(moe: DeepseekV2MoE, y: torch.Tensor) -> torch.Tensor:
    """Shared-expert partial; zeros without shared experts or for an empty batch, because every
    rank must still issue the same collectives."""
    s = moe._forward_shared_experts(y) if moe.shared_experts is not None else None
    return torch.zeros_like(y) if s is None else s


def _routed_experts(moe: DeepseekV2MoE, y: torch.Tensor) -> torch.Tensor:
    """Routed-expert partial with routed_scaling_factor applied, shared experts excluded."""
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
            self.model.__class__ = FarSkipDeepseekV2Model
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
        if tp_rank == 0:
            logger.info(
                "sglang_farskip: %s, mode %s (requested %s), all-reduce %s",
                report["description"], mode.value, opts.mode.value, comm_backend,
            )

    def _extend_layers(self, config) -> dict:
        """Subclasses add their modules here (after upstream's layers exist, before the FarSkip
        wiring and the report); returns extra fields for the rank report."""
        return {}
