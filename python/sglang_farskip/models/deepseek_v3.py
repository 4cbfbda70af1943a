"""FarSkip DeepSeek-V3 inside SGLang 0.5.23: upstream layers and weights, FarSkip wiring.

Notation (per decoder layer k, all [T, H] on the residual stream, T tokens, H hidden):
    x       the residual, complete except for the sums still in flight
    a       attention output partial (o_proj without its all-reduce)      [T, H]
    s       shared-expert partial (a dense layer's whole MLP output)     [T, H]
    r       routed-expert partial (MoE layers only)                      [T, H]
    A lane  AR(a + s) of the previous layer      R lane  AR(r) of the previous layer

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

Upstream's DeepseekV2Model.forward runs the same sub-modules through SGLang's layer-boundary
framework, which holds one pending sum at a time; FarSkip needs two, so the model's forward is
replaced (only the forward: layers, weights and loading stay upstream's). `sync` and `overlap`
run this one code path; they differ only in the communicator (blocking or async), so both add
the same sums in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import nullcontext
from typing import Optional

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
from sglang.srt.runtime_context import get_parallel, get_server_args
from sglang.srt.utils import BumpAllocator

from sglang_farskip import SGLANG_VERSION
from sglang_farskip.comm import (
    Communicator,
    Handle,
    OverlapProfiler,
    SideStreamAllReduce,
    fork_join_probe,
    nccl_all_reduce_,
)
from sglang_farskip.compat import unsupported, uses_side_stream
from sglang_farskip.config import FarSkipConfig, FarSkipConfigError, FarSkipMode, is_moe_layer
from sglang_farskip.status import write_rank_status

logger = logging.getLogger("sglang_farskip.model")


@dataclasses.dataclass(frozen=True)
class LayerWiring:
    attn_skips_prev_routed: bool  # attention reads h[k-1] - r[k-1]
    mlp_skips_attn: bool  # the MLP reads h[k-1], not h[k-1] + a[k]
    is_moe: bool


def _add(x: torch.Tensor, handle: Optional[Handle]) -> torch.Tensor:
    return x if handle is None else x + handle.wait()


def _add_norm(norm, x: torch.Tensor, *handles: Optional[Handle]):
    """(norm(x + sums), x + sums). The norm adds the last sum itself: SGLang's fused residual
    add + RMSNorm on CUDA/HIP (one kernel, both tensors updated in place), the same float add
    then the norm elsewhere. Either way the same code runs in `sync` and `overlap`."""
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
        zero_allocator = BumpAllocator(
            buffer_size=len(self.layers) * 2, dtype=torch.float32, device=positions.device
        )
        # Under a breakable CUDA graph, attention ends one captured segment and starts the
        # next; a sum must not stay in flight across that (README, "GPU overlap").
        breaks = is_in_breakable_cuda_graph()
        pend_a = pend_r = None
        try:
            for k, layer in enumerate(self.layers):
                with get_global_expert_distribution_recorder().with_current_layer(k):
                    x, pend_a, pend_r = self._layer(
                        k, layer, x, pend_a, pend_r, positions, forward_batch, zero_allocator, breaks
                    )
        except BaseException:
            self.comm.drain()  # no collective outlives the tensors it reads and writes
            raise
        if self.comm.profiler is not None:
            self.comm.profiler.flush()
        if forward_batch.forward_mode.is_idle():
            return _add(_add(x, pend_a), pend_r)
        return _add_norm(self.norm, x, pend_a, pend_r)[0]  # the final norm reads the full h[L-1]

    def _layer(self, k, layer, x, pend_a, pend_r, positions, forward_batch, zero_allocator,
               breaks=False):
        w, comm = self.wiring[k], self.comm
        if w.attn_skips_prev_routed:
            h, x = _add_norm(layer.input_layernorm, x, pend_a)  # x = h[k-1] - r[k-1]
            if breaks and pend_r is not None:
                pend_r.join()  # summed in this segment, added after the attention as always
        else:
            (h, x), pend_r = _add_norm(layer.input_layernorm, x, pend_a, pend_r), None  # h[k-1]
        a = _attention(layer, h, positions, forward_batch, zero_allocator)
        comm.mark_compute()

        if w.mlp_skips_attn:
            y, x = _add_norm(layer.post_attention_layernorm, x, pend_r)  # x = h[k-1]
        else:
            pend_attn = comm.start_all_reduce(a, lane="attn", layer=k)
            y, x = _add_norm(layer.post_attention_layernorm, x, pend_r, pend_attn)  # h[k-1] + a
            a = None
        pend_r = None

        if not w.is_moe:  # a dense MLP's output rides the attention lane (r = 0)
            s = layer.mlp(y, forward_batch)
            comm.mark_compute()
            return x, comm.start_all_reduce(s if a is None else a + s, lane="attn+shared", layer=k), None

        s = layer.mlp._forward_shared_experts(y) if layer.mlp.shared_experts is not None else None
        if s is None:  # no shared expert, or an empty batch: ranks still issue the same collectives
            s = torch.zeros_like(y)
        pend_a = comm.start_all_reduce(s if a is None else a + s, lane="attn+shared", layer=k)
        r = _routed_experts(layer.mlp, y)
        comm.mark_compute()
        return x, pend_a, comm.start_all_reduce(r, lane="routed", layer=k)


def _attention(layer, h, positions, forward_batch, zero_allocator) -> torch.Tensor:
    """Upstream MLA (prefill or decode path, picked by the attention backend) -> o_proj partial."""
    ctx = get_attn_tp_context()
    # The boundary framework normally publishes the attention input for the lazy QKV GEMM.
    ctx.set_attn_inputs(AttentionInputs(h, forward_batch, layer.self_attn.prepare_qkv_latent))
    try:
        out = layer.self_attn(
            positions=positions,
            hidden_states=h,
            forward_batch=forward_batch,
            zero_allocator=zero_allocator,
        )
    finally:
        ctx.clear_attn_inputs()
    return out[0] if isinstance(out, tuple) else out


def _routed_experts(moe: DeepseekV2MoE, y: torch.Tensor) -> torch.Tensor:
    """Routed-expert partial with routed_scaling_factor applied, shared experts excluded."""
    # forward_normal, not forward: the dual-stream variant ignores skip_shared_experts.
    out = moe.forward_normal(y, skip_shared_experts=True, return_moe_output=True)
    return out._replace(shared=None).get_merged()


def _mode_from_config(config) -> FarSkipMode:
    return FarSkipMode.parse(getattr(config, "farskip_mode", None) or FarSkipMode.OVERLAP.value)


class FarSkipDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """Registered under the architecture name "DeepseekV3ForCausalLM" (SGLang's MLA detection
    keys on that name). With `"farskip": false` in config.json, or `--farskip-mode off`, it is
    upstream's class unchanged."""

    @classmethod
    def _farskip_active(cls, hf_config) -> bool:
        return (
            FarSkipConfig.from_hf_config(hf_config).enabled
            and _mode_from_config(hf_config) is not FarSkipMode.OFF
        )

    @classmethod
    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):
        if cls._farskip_active(hf_config):
            return "FarSkip reduces shared experts apart from routed experts."
        return super().shared_experts_fusion_disable_reason(hf_config, quant_config)

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        farskip = FarSkipConfig.from_hf_config(config)
        farskip.check_layers(config.num_hidden_layers)
        requested = _mode_from_config(config)
        active = farskip.enabled and requested is not FarSkipMode.OFF
        if active:
            _check_server_args(config, requested)
        super().__init__(config, quant_config, prefix)
        extra_report = self._extend_layers(config)

        parallel = get_parallel()
        effective = requested if farskip.enabled else FarSkipMode.OFF
        comm_backend = "sglang"
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
            _check_layers(self.model.layers, self.model.wiring)
            self.model.comm, effective = _build_communicator(
                _single_reduction_group(parallel), requested, config, parallel.tp_rank
            )
            comm_backend = self.model.comm.backend
        elif farskip.enabled:
            logger.warning(
                "--farskip-mode off: stock DeepSeek-V3 wiring on FarSkip weights. The outputs "
                "are NOT the model's; use this only for A/B timing."
            )

        report = {
            "model_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "inner_model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "farskip": farskip.to_hf_keys(),
            "requested_mode": requested.value,
            "mode": effective.value,
            "converted_layers": farskip.converted_layers(config.num_hidden_layers)
            if active
            else [],
            "num_layers": config.num_hidden_layers,
            "description": farskip.describe(config.num_hidden_layers) if active else
            "stock DeepSeek-V3 wiring",
            "comm_backend": comm_backend,
            "tp_rank": parallel.tp_rank,
            "tp_size": parallel.tp_size,
            "moe_ep_size": parallel.moe_ep_size,
            "pid": os.getpid(),
            "sglang_version": SGLANG_VERSION,
            **extra_report,
        }
        write_rank_status(report)
        if parallel.tp_rank == 0:
            logger.info(
                "sglang_farskip: %s, mode %s (requested %s), all-reduce %s",
                report["description"], effective.value, requested.value, comm_backend,
            )

    def _extend_layers(self, config) -> dict:
        """Subclasses add their modules here (after upstream's layers exist, before the FarSkip
        wiring and the report); returns extra fields for the rank report."""
        return {}


def _check_server_args(config, requested: FarSkipMode) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    args = resolving_view(get_server_args())
    overlap = requested is FarSkipMode.OVERLAP
    problems = unsupported(
        args, overlap=overlap,
        side_stream=overlap and uses_side_stream(args, config),
        gpu_profiling=bool(getattr(config, "farskip_profile_dir", None)) and str(args.device) != "cpu",
    )
    if problems:
        raise FarSkipConfigError(
            "FarSkip cannot run with these settings:\n  " + "\n  ".join(problems)
        )


def _single_reduction_group(parallel):
    """FarSkip adds the attention partial to the shared-expert partial and reduces both at
    once; that is only a valid sum if attention and MoE reduce over the same group."""
    from sglang.srt.layers.moe.utils import post_experts_reduction_group

    group = parallel.tp_group
    for name, other in (
        ("attention TP", parallel.attn_tp_group),
        ("MoE output", post_experts_reduction_group()),
    ):
        if other.world_size != group.world_size:
            raise FarSkipConfigError(
                f"FarSkip needs the {name} reduction over the whole TP group "
                f"({other.world_size} != {group.world_size} ranks): use --ep-size equal to "
                f"--tp-size or 1, and no --moe-dense-tp-size"
            )
    return group


def _build_communicator(group, requested: FarSkipMode, config, tp_rank: int):
    """The communicator for `requested` on this device, and the mode that really runs."""
    side_stream = None
    force_side = bool(getattr(config, "farskip_force_side_stream", False))
    asynchronous = requested is FarSkipMode.OVERLAP and (group.world_size > 1 or force_side)
    if asynchronous and (force_side or not Communicator.supports_cpu_async(group)):
        if getattr(config, "farskip_gpu_overlap", False):
            side_stream = _gpu_side_stream(group, config, force_side)
        else:
            logger.warning(
                "FarSkip overlap on %s: the side-stream all-reduce has not been validated on "
                "hardware yet, so the FarSkip wiring runs with blocking all-reduce (sync mode). "
                "Opt in with --farskip-gpu-overlap.", group.device,
            )
            asynchronous = False
    comm = Communicator(group, asynchronous=asynchronous, side_stream=side_stream)
    profile_dir = getattr(config, "farskip_profile_dir", None)
    if profile_dir:
        comm.profiler = OverlapProfiler(os.path.join(profile_dir, f"profile-rank{tp_rank}.json"))
    overlapping = requested is FarSkipMode.OVERLAP and (asynchronous or group.world_size == 1)
    return comm, FarSkipMode.OVERLAP if overlapping else FarSkipMode.SYNC


def _gpu_side_stream(group, config, force: bool) -> SideStreamAllReduce:
    """FarSkip's own NCCL/RCCL communicator on a high-priority side stream, connected and
    warmed up with the largest message now, before SGLang sizes the KV pool."""
    max_ctas = getattr(config, "farskip_side_max_ctas", None)
    all_reduce_ = nccl_all_reduce_(group.cpu_group, group.device, max_ctas=max_ctas)
    if force:
        # Test-only (bench/device_check.py): at TP=1 the sum is the identity, so a missing
        # fork or join could not show; the probe makes it show.
        all_reduce_ = fork_join_probe(all_reduce_)
    side = SideStreamAllReduce(all_reduce_, device=group.device)
    args = get_server_args()
    tokens = max(args.chunked_prefill_size or 0, args.max_prefill_tokens or 0, 1)
    # NCCL picks its protocol by message size and connects each on first use: one token, one
    # decode-sized and the largest prefill message connect what serving will use.
    sizes = sorted({1, min(tokens, 256), tokens})
    kept = side.warm_up([n * config.hidden_size for n in sizes], torch.get_default_dtype())
    logger.info(
        "FarSkip side-stream all-reduce over %d rank(s)%s: warmed up up to %d tokens x %d, NCCL "
        "kept %.1f MiB of device memory%s", group.world_size,
        f", at most {max_ctas} CTAs" if max_ctas else "", tokens, config.hidden_size,
        kept / 2**20, " (forced with the fork/join probe: test only)" if force else "",
    )
    return side


def _check_layers(layers, wiring: list[LayerWiring]) -> None:
    for k, (layer, w) in enumerate(zip(layers, wiring)):
        if w.is_moe != isinstance(layer.mlp, DeepseekV2MoE):
            raise FarSkipConfigError(f"layer {k}: config and SGLang disagree on MoE vs dense")
        if w.is_moe and layer.mlp.num_fused_shared_experts:
            raise FarSkipConfigError(
                f"layer {k}: shared experts are fused into the routed kernel; FarSkip needs them "
                "separate: pass --disable-shared-experts-fusion"
            )
        if w.is_moe and getattr(layer.mlp, "_shared_expert_tp1", False):
            raise FarSkipConfigError(
                f"layer {k}: replicated (TP1) shared experts would be summed tp_size times on "
                "FarSkip's attention lane: unset SGLANG_SHARED_EXPERT_TP1"
            )
