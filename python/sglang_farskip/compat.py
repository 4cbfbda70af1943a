"""Which SGLang settings FarSkip can run correctly, checked before any weight is loaded.

FarSkip's schedule keeps two partial sums in flight across a layer boundary and reduces the
attention partial together with the shared-expert partial. That needs: one tensor-parallel
group for attention and MoE (no DP attention, no context parallel, no pipeline stages), an
all-reduce MoE (no all-to-all dispatch), separate shared experts, and a plain token layout.
Each rule names the flag that breaks it.
"""

from __future__ import annotations

from typing import Any

# (attribute on SGLang's resolved server args, predicate "is unsupported", problem, fix)
_RULES = [
    ("attn_dp_size", lambda v: (v or 1) > 1,
     "DP attention splits attention and MoE groups",
     "drop --attn-dp-size / --enable-dp-attention"),
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
    ("speculative_algorithm", lambda v: v is not None,
     "speculative decoding drafts are not FarSkip-aware",
     "drop --speculative-algorithm"),
]


def unsupported(server_args: Any) -> list[str]:
    """Problems with `server_args` (SGLang's resolved view, or anything with the same
    attributes), each one line naming the cause and the flag to change. Empty if fine."""
    problems = []
    for attr, bad, problem, fix in _RULES:
        if hasattr(server_args, attr) and bad(getattr(server_args, attr)):
            problems.append(f"{problem} ({attr}={getattr(server_args, attr)!r}): {fix}")
    return problems
