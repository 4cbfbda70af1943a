"""Which SGLang settings FarSkip can run correctly, checked before any weight is loaded.

FarSkip's schedule keeps two partial sums in flight across a layer boundary and reduces the
attention partial together with the shared-expert partial. That needs: one tensor-parallel
group for the MoE and for attention (or DP attention, whose partials join the MoE group's
sums; no context parallel, no pipeline stages), an all-reduce MoE (no all-to-all dispatch),
separate shared experts, and a plain token layout.
Each rule names the flag that breaks it.
"""

from __future__ import annotations

from typing import Any

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
    runtime options (`options.RuntimeOptions`); `parallel.build_communicator` decides the same."""
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
