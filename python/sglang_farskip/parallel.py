"""FarSkip's parallel set-up inside SGLang: which group reduces, which communicator runs, checks.

The model file holds the math; this module turns SGLang's process groups and the runtime
options into the one `comm.Communicator` the forward is handed:
- `unsupported`: the SGLang settings FarSkip cannot run, each rule naming the flag that breaks
  it; the launcher asks it before SGLang starts, `check_server_args` again in each model rank
  before any weight is allocated;
- `reduction_group`: the one group both lanes reduce over (FarSkip sums the attention and
  shared-expert partials in one collective, which is only valid over the same ranks);
- `DpRows`: under DP attention, where this rank's own tokens sit among the MoE group's (the
  residual is kept for all of them; see its docstring);
- `check_layers`: what SGLang built agrees with the wiring (MoE vs dense, shared experts apart);
- `build_communicator`: identity, blocking, the gloo comm thread, or the GPU side stream
  (waited at launch in `blocking` mode), and the mode that really runs (it can fall back to
  `sync`, and says so);
- `gpu_side_stream`: FarSkip's own NCCL/RCCL communicator on a high-priority stream, warmed up
  with the largest message before SGLang sizes the KV pool.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from sglang_farskip.comm import Communicator, SideStreamAllReduce, fork_join_probe, nccl_all_reduce_
from sglang_farskip.config import FarSkipMode
from sglang_farskip.errors import UserError
from sglang_farskip.options import RuntimeOptions
from sglang_farskip.profiler import OverlapProfiler

logger = logging.getLogger("sglang_farskip.parallel")

# ---------------------------------------------------------------- settings FarSkip cannot run
# FarSkip's schedule keeps two partial sums in flight across a layer boundary and reduces the
# attention partial together with the shared-expert partial. That needs: one tensor-parallel
# group for the MoE and for attention (or DP attention, whose partials join the MoE group's
# sums; no context parallel, no pipeline stages), an all-reduce MoE (no all-to-all dispatch),
# separate shared experts, and a plain token layout.

# (attribute on SGLang's resolved server args, predicate "is unsupported", problem, fix)
_RULES = [
    ("pp_size", lambda v: (v or 1) > 1,
     "pipeline parallelism hands a residual with pending sums across stages",
     "use --pp-size 1"),
    ("attn_cp_size", lambda v: (v or 1) > 1,
     "context-parallel attention changes the reduction groups",
     "use --attn-cp-size 1"),
    ("enable_prefill_cp", bool,
     "prefill context parallelism changes the reduction groups",
     "drop --enable-prefill-cp"),
    ("enable_two_batch_overlap", bool,
     "two-batch overlap runs SGLang's own per-op schedule, not FarSkip's",
     "drop --enable-two-batch-overlap"),
    ("enable_single_batch_overlap", bool,
     "single-batch overlap is wired into the DeepEP MoE path",
     "drop --enable-single-batch-overlap"),
    ("moe_a2a_backend", lambda v: str(getattr(v, "value", v) or "none") != "none",
     "an all-to-all MoE backend (DeepEP etc.) combines expert outputs itself; FarSkip needs "
     "the all-reduce MoE path",
     "use --moe-a2a-backend none"),
    ("enforce_shared_experts_fusion", bool,
     "fused shared experts cannot be separated from the routed output, and FarSkip reduces "
     "them on a different lane",
     "drop --enforce-shared-experts-fusion"),
    ("enable_attn_tp_input_scattered", bool,
     "input-scattered attention replaces the all-reduce with reduce-scatter/all-gather",
     "drop --enable-attn-tp-input-scattered"),
    ("enable_layernorm_sp", bool,
     "sequence-parallel layernorm replaces the all-reduce with reduce-scatter/all-gather",
     "drop --enable-layernorm-sp"),
    ("enable_lora", bool,
     "LoRA adapters are not wired into the FarSkip forward",
     "drop --enable-lora / --lora-paths"),
    ("speculative_algorithm", lambda v: v is not None and _algorithm(v) not in SPECULATIVE_ALGORITHMS,
     "with the FarSkip wiring, speculative decoding is tested with EAGLE (DeepSeek's NextN layer "
     "as the draft) and NGRAM only",
     "use --speculative-algorithm EAGLE or NGRAM, or --farskip-mode off"),
]

# SGLang's names (NEXTN is its alias of EAGLE for DeepSeek's MTP layer).
SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN", "NGRAM")


def _algorithm(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


# Settings that break FarSkip only with asynchronous all-reduce (`--farskip-mode overlap`):
# (attribute, predicate, problem, fix), as above.
_OVERLAP_RULES = [
    ("enable_torch_compile", bool,
     "torch.compile would trace FarSkip's in-flight collectives (handles, streams, the comm "
     "thread), which it cannot",
     "drop --enable-torch-compile, or use --farskip-mode sync"),
    ("dcp_size", lambda v: (v or 1) > 1,
     "decode context parallelism runs collectives inside attention while FarSkip's "
     "all-reduce is still in flight on the same ranks",
     "use --dcp-size 1, or --farskip-mode sync"),
]

# ... and only with the GPU side stream (FarSkip's own NCCL communicator).
_SIDE_STREAM_RULES = [
    ("enable_deterministic_inference", bool,
     "deterministic inference needs SGLang's batch-invariant all-reduce; FarSkip's own NCCL "
     "communicator picks its algorithm by message size",
     "drop --enable-deterministic-inference, or use --farskip-mode sync"),
]


def graph_backends(args: Any) -> tuple[str, ...]:
    """The resolved CUDA-graph backend of each phase (decode, prefill)."""
    cfg = getattr(args, "cuda_graph_config", None)
    return tuple(str(getattr(getattr(cfg, phase, None), "backend", "disabled") or "disabled")
                 for phase in ("decode", "prefill"))


def _dense_mlp_replicated(args: Any) -> bool:
    return getattr(args, "moe_dense_tp_size", None) == 1 and (getattr(args, "tp_size", 1) or 1) > 1


def uses_side_stream(args: Any, options: Any) -> bool:
    """Whether `overlap` runs on the GPU side stream, given the resolved server args and the
    runtime options (`options.RuntimeOptions`); `build_communicator` decides the same."""
    return (
        str(getattr(args, "device", "cuda")) != "cpu"
        and (args.tp_size > 1 or options.force_side_stream)
        and options.gpu_overlap
    )


def unsupported(server_args: Any, *, overlap: bool = False, side_stream: bool = False,
                gpu_profiling: bool = False) -> list[str]:
    """Problems with `server_args` (SGLang's resolved view, or anything with the same
    attributes), each one line naming the cause and the flag to change. Empty if fine.
    `overlap`: asynchronous all-reduce; `side_stream`: on the GPU side stream; `gpu_profiling`:
    --farskip-profile-dir on a GPU."""
    rules = _RULES + (_OVERLAP_RULES if overlap else []) + (_SIDE_STREAM_RULES if side_stream else [])
    problems = []
    for attr, bad, problem, fix in rules:
        if hasattr(server_args, attr) and bad(getattr(server_args, attr)):
            problems.append(f"{problem} ({attr}={getattr(server_args, attr)!r}): {fix}")
    if _dense_mlp_replicated(server_args):
        problems.append(
            "a replicated dense MLP already holds its full output on every rank, and FarSkip "
            f"would all-reduce it {server_args.tp_size} times over (moe_dense_tp_size=1): "
            "drop --moe-dense-tp-size"
        )
    if overlap and "tc_piecewise" in graph_backends(server_args):
        # SGLang 0.5.23 itself rejects the value at parsing; other versions accept it.
        problems.append(
            "tc_piecewise CUDA graphs compile the forward with torch.compile, which would trace "
            "FarSkip's in-flight collectives as --enable-torch-compile would (cuda graph backend "
            "'tc_piecewise'): use --cuda-graph-backend-prefill breakable, full or disabled, or "
            "--farskip-mode sync"
        )
    if gpu_profiling and any(b != "disabled" for b in graph_backends(server_args)):
        problems.append(
            "--farskip-profile-dir on a GPU times collectives with CUDA events, which a graph "
            "capture cannot record and a graph replay (no Python runs) would not: add "
            "--disable-cuda-graph while profiling, or drop --farskip-profile-dir"
        )
    return problems


def check_server_args(options: RuntimeOptions) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.runtime_context import get_server_args

    args = resolving_view(get_server_args())
    overlap = options.mode.own_communicator
    problems = unsupported(
        args, overlap=overlap,
        side_stream=overlap and uses_side_stream(args, options),
        gpu_profiling=bool(options.profile_dir) and str(args.device) != "cpu",
    )
    if problems:
        raise UserError("FarSkip cannot run with these settings:\n  " + "\n  ".join(problems))


def reduction_group(parallel):
    """The TP group, if attention and MoE both reduce over all of it. Under DP attention the
    attention partial is placed among the group's tokens first (`DpRows`), so only the MoE
    has to reduce over the whole group."""
    from sglang.srt.layers.moe.utils import post_experts_reduction_group

    group = parallel.tp_group
    others = [("MoE output", post_experts_reduction_group())]
    if parallel.attn_dp_size == 1:
        others.insert(0, ("attention TP", parallel.attn_tp_group))
    for name, other in others:
        if other.world_size != group.world_size:
            raise UserError(
                f"FarSkip needs the {name} reduction over the whole TP group "
                f"({other.world_size} != {group.world_size} ranks): use --ep-size equal to "
                f"--tp-size or 1, and no --moe-dense-tp-size"
            )
    return group


def check_layers(layers, wiring) -> None:
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    for k, (layer, w) in enumerate(zip(layers, wiring)):
        if w.is_moe != isinstance(layer.mlp, DeepseekV2MoE):
            raise UserError(f"layer {k}: config and SGLang disagree on MoE vs dense")
        if w.is_moe and layer.mlp.num_fused_shared_experts:
            raise UserError(
                f"layer {k}: shared experts are fused into the routed kernel; FarSkip needs them "
                "separate: pass --disable-shared-experts-fusion"
            )
        if w.is_moe and getattr(layer.mlp, "_shared_expert_tp1", False):
            raise UserError(
                f"layer {k}: replicated (TP1) shared experts would be summed tp_size times on "
                "FarSkip's attention lane: unset SGLANG_SHARED_EXPERT_TP1"
            )


def build_communicator(group, options: RuntimeOptions, hidden_size: int, tp_rank: int
                       ) -> tuple[Communicator, FarSkipMode]:
    """The communicator for `options.mode` on this device, and the mode that really runs."""
    side_stream = None
    force_side = options.force_side_stream
    asynchronous = options.mode.own_communicator and (group.world_size > 1 or force_side)
    if asynchronous and (force_side or not Communicator.supports_cpu_async(group)):
        if options.gpu_overlap:
            side_stream = gpu_side_stream(group, options, hidden_size)
        else:
            logger.warning(
                "FarSkip %s on %s: the side-stream all-reduce has not been validated on "
                "hardware yet, so the FarSkip wiring runs with blocking all-reduce (sync mode). "
                "Opt in with --farskip-gpu-overlap.", options.mode.value, group.device,
            )
            asynchronous = False
    comm = Communicator(group, asynchronous=asynchronous, side_stream=side_stream,
                        wait_at_launch=options.mode is FarSkipMode.BLOCKING, drop=options.dropped_collective())
    if comm.drop is not None:
        logger.warning("test only: collective %s of layer %d sums zeros (--farskip-test-drop-partial): "
                       "outputs are wrong on purpose", *comm.drop)
    sinks = _metric_sinks(options, group)
    if options.profile_dir or sinks:
        path = os.path.join(options.profile_dir, f"profile-rank{tp_rank}.json") if options.profile_dir else None
        comm.profiler = OverlapProfiler(path, sinks=sinks)
    own = options.mode.own_communicator and (asynchronous or group.world_size == 1)
    return comm, options.mode if own else FarSkipMode.SYNC


def metric_labels() -> dict | None:
    """This rank's labels on /metrics, as SGLang labels its scheduler's series
    (observability/metrics_collector.py), plus the node; None when SGLang's metrics are off."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import (get_disagg, get_observability, get_parallel,
                                            get_server_args, get_serving)

    args = get_server_args()
    if not args.enable_metrics:
        return None
    parallel = get_parallel()
    disagg = get_disagg()
    labels = {
        "model_name": get_serving().served_model_name,
        "engine_type": "dynamic" if disagg.enable_pd_role_switch
        else DisaggregationMode.to_engine_type(disagg.disaggregation_mode),
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(get_observability().extra_metric_labels or {})
    labels["node"] = args.node_rank
    return labels


def _metric_sinks(options: RuntimeOptions, group) -> tuple:
    """FarSkip's counters on /metrics, when SGLang's metrics are on (and not --farskip-metrics
    off). On a GPU with CUDA graphs they cannot count: a graph replay runs no Python, so no
    collective of a replayed forward would be seen (farskip:info still says what runs)."""
    labels = metric_labels() if options.metrics == "on" else None
    if labels is None:
        return ()
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.runtime_context import get_server_args

    if str(group.device) != "cpu" and any(b != "disabled" for b in graph_backends(resolving_view(get_server_args()))):
        logger.info("FarSkip's collective counters are off on /metrics: CUDA graph replays run "
                    "no Python to count them (--disable-cuda-graph, or the profile, to measure)")
        return ()
    from sglang_farskip.profiler import PrometheusCounters

    return (PrometheusCounters(labels),)


def gpu_side_stream(group, options: RuntimeOptions, hidden_size: int) -> SideStreamAllReduce:
    """FarSkip's own NCCL/RCCL communicator on a high-priority side stream, connected and
    warmed up with the largest message now, before SGLang sizes the KV pool."""
    from sglang.srt.runtime_context import get_server_args

    max_ctas = options.side_max_ctas
    all_reduce_ = nccl_all_reduce_(group.cpu_group, group.device, max_ctas=max_ctas)
    if options.force_side_stream:
        # Test only (python/sglang_farskip/checks/device.py): at TP=1 the sum is the identity, so a missing
        # fork or join could not show; the probe makes it show.
        all_reduce_ = fork_join_probe(all_reduce_)
    side = SideStreamAllReduce(all_reduce_, device=group.device)
    args = get_server_args()
    tokens = max(args.chunked_prefill_size or 0, args.max_prefill_tokens or 0, 1)
    # NCCL picks its protocol by message size and connects each on first use: one token, one
    # decode-sized and the largest prefill message connect what serving will use.
    sizes = sorted({1, min(tokens, 256), tokens})
    kept = side.warm_up([n * hidden_size for n in sizes], torch.get_default_dtype())
    logger.info(
        "FarSkip side-stream all-reduce over %d rank(s)%s: warmed up up to %d tokens x %d, NCCL "
        "kept %.1f MiB of device memory%s", group.world_size,
        f", at most {max_ctas} CTAs" if max_ctas else "", tokens, hidden_size,
        kept / 2**20, " (forced with the fork/join probe: test only)" if options.force_side_stream else "",
    )
    return side


class DpRows:
    """DP attention: this rank's tokens among the tokens of the whole MoE group.

    Notation: T_g rows of the group's buffer (every DP rank's batch, in DP-rank order, padded
    as SGLang pads them for the MLP), of which this rank owns T_d rows starting at `start`.

    FarSkip keeps the residual for all T_g rows on every rank: each lane is then one all-reduce
    over the group, as with TP attention, and the routed sum of layer k-1 needs no gather
    before layer k's MoE (the all-reduce already left it on every rank). The attention runs on
    the own rows only, and its partial enters the attention lane placed in its rows, zero
    elsewhere: the lane's sum then adds the attention-TP partials of each DP rank into that
    rank's rows, together with the shared-expert partials of every row. docs/dp-attention.md
    has the trade-off (twice the bytes of SGLang's gather + reduce-scatter, none of it waited
    before a MoE).

    Built per forward from SGLang's own DP bookkeeping (`layers/dp_attention.py`), whose
    row copies also run on a GPU with device-side offsets (graph capture).
    """

    def __init__(self, forward_batch, local_len: int, attn_tp_rank: int):
        from sglang.srt.layers import dp_attention as dpa

        self._dpa = dpa
        self.local_len = local_len  # T_d: the local batch as SGLang padded it
        self.global_len = dpa.get_global_dp_buffer_len()
        self.start, self.count = dpa.get_dp_local_info(forward_batch)
        self.first_of_attn_tp = attn_tp_rank == 0
        # SGLang pads every DP rank's batch (under MAX_LEN padding to the longest, an idle rank
        # to a fabricated row), and `count` includes the padding, whose attention output is
        # whatever the padded batch computed (NaN and stale rows, seen on CPU). Padding never
        # enters a real row's math, but the native CPU MoE runs one GEMM per expert over the
        # rows routed to it, so a padded row routed by stale values changes the real rows' GEMM
        # shapes, and their last bits, from run to run. On CPU only the real rows are written
        # (SGLang's own count of them, taken before padding; a verify step's draft tokens
        # included), so padding stays zero and routes the same way every time. On a GPU the
        # device-side count stays: graph replay updates it, where a host count would be
        # captured as a constant.
        self.real_count = forward_batch.global_num_token_non_padded_cpu

    def to_global(self, local: torch.Tensor, *, replicated: bool) -> torch.Tensor:
        """[T_d, H] -> [T_g, H]: `local` in this rank's rows, zero elsewhere. `replicated`:
        every attention-TP rank holds the same rows (one of them writes, so the sum counts them
        once); otherwise each holds a partial and all write."""
        full = local.new_zeros(self.global_len, *local.shape[1:])
        if local.shape[0] and (self.first_of_attn_tp or not replicated):
            count = self.count  # a device tensor: no host sync, graph-capturable
            if local.is_cpu and self.real_count is not None:
                count = min(self.real_count, local.shape[0])
            self._dpa.memcpy(full, local.contiguous(), 0, self.start, count, False)
        return full

    def to_local(self, full: torch.Tensor) -> torch.Tensor:
        """[T_g, H] -> [T_d, H]."""
        local = full.new_zeros(self.local_len, *full.shape[1:])
        if self.local_len:
            self._dpa.memcpy(local, full, 0, self.start, self.count, True)
        return local


def dp_rows(forward_batch, local_len: int) -> "DpRows | None":
    """This forward's `DpRows` under DP attention (`local_len`: the rows of its batch), else None."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if parallel.attn_dp_size == 1:
        return None
    return DpRows(forward_batch, local_len, parallel.attn_tp_rank)
