"""Bare GPU check of FarSkip's overlap path: torch + NCCL and this repository, nothing else.

    PYTHONPATH=python python -m sglang_farskip.checks.gpu [--json OUT] [--ops-json OUT] [--items side-stream,priority,memory,stack,ops]
    PYTHONPATH=python python -m sglang_farskip.checks.gpu --cpu [--world 2] [--json OUT]          # the CPU-runnable parts

Runs with the machine's own Python (no install, no SGLang, sgl_kernel or FlashInfer, nothing
downloaded): PYTHONPATH=python finds this package in the checkout. One PASS/FAIL line per item, a
summary, exit 1 if any item failed; `--json` writes every figure. Estimated 3-4 minutes on one
H200 (an estimate: it has never run on a GPU), most of it the stack's weights (the TP=8
shard in bf16 and in fp32: about 26 GB) and its fp32 runs.

side-stream  FarSkip's own NCCL communicator (`comm.nccl_all_reduce_`, one rank) through the
             real `SideStreamAllReduce` and `Communicator`, wrapped in the fork/join probe
             (double, sleep, reduce, halve: at one rank only the probe can make a missing fork
             or join show). Eager; full CUDA graphs at 1, 3, 64 and 256 tokens replayed in
             shuffled order; eager launches between replays on the same communicator and
             event ring. Bitwise against plain compute.
priority     How long a small kernel on the side stream waits behind queued DeepSeek-V3-sized
             GEMMs at normal and at high priority, and what it costs the GEMMs. PASS if high
             priority is not slower.
memory       Device memory NCCL keeps after `warm_up` (1, 256 and 4096 tokens x 7168), and
             that the first 58.7 MB all-reduce afterwards takes nothing more (<= 2 MiB).
stack        A FarSkip DeepSeek-V3 stack from reference.py's modules (MLA, RMSNorm, SwiGLU
             MLPs, the noaux_tc router) at DeepSeek-V3 widths, as one rank of TP=8 and of
             TP=16 holds it (heads, dense/shared intermediate and routed experts split 8 or 16
             ways; EP = TP), one dense layer then MoE layers, seeded unit-scale weights, bf16,
             run through `Communicator`:
               - the schedule in fp32 (blocking) equals reference.py's layer formula in fp32
                 (1e-4): the wiring is the spec's;
               - sync and overlap (side stream + probe) eager, and sync and overlap captured in
                 full CUDA graphs at several token counts and replayed shuffled: overlap ==
                 sync bitwise (same kernels, same order: the schedule promises it), each
                 within TOL of the fp32 spec, TOL = TOL_FACTOR x the sync-eager bf16 error;
               - broken-lane controls, eager overlap: `drop-partial` (layer 1's attention +
                 shared sum never added) and `skip-join` (read without the join, the probe's
                 sleep made long): each must FAIL the same comparison, or the check has no
                 power and the item fails. `--break-lane` puts the break into the main runs instead
                 (then the item must FAIL: a test of the check itself).
ops          Per-op GPU times for the planner's --ops (schema below): attention prefill and absorbed
             MLA decode at several batch/context sizes, shared experts, routed experts with
             balanced routing (EP 8 and 16 shards), the dense MLP, RMSNorm + residual add.
             Plain PyTorch kernels (cuBLAS GEMMs, torch SDPA, einsum decode attention), not
             SGLang's fused ones: upper bounds of what a served model spends. PASS if every op
             was timed.

--cpu runs `stack` at tiny widths (same proportions) on the CPU, with the identity backend at
--world 1 or the gloo comm thread over a 2-rank gloo world (`--world 2`, two processes, the
partials really summed, and the spec is the unsharded model); the probe there is a sleep in
the comm thread's all-reduce. tests/test_bare_gpu_check.py runs it in a torch-only venv.

Per-op JSON (`ops`, also in --json under "ops"):
    {"source": "<device, date, dtype>", "dtype": "bf16",
     "per_op_us": [{"op": ..., "tokens": int, "context": int, "tp": int, "us": float}, ...]}
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sglang_farskip import reference as R  # noqa: E402
from sglang_farskip import schedule  # noqa: E402
from sglang_farskip.schedule import LayerWiring  # noqa: E402
from sglang_farskip.comm import (Communicator, SideStreamAllReduce, fork_join_probe,  # noqa: E402
                                 nccl_all_reduce_)

ITEMS = ("side-stream", "priority", "memory", "stack", "ops")
BROKEN = ("none", "drop-partial", "skip-join")
BROKEN_LAYER = 1  # the first MoE layer: its attention lane (a + s) is the one the controls break
TOL_FACTOR = 4.0  # graphs and overlap may round differently from eager sync, not by 4x
WIRING_TOL = 1e-4  # fp32 schedule vs fp32 spec: only summation order differs
# bf16 sync eager vs the fp32 spec, a few unit-scale layers: ~1e-2. Far above it the baseline
# itself is wrong (e.g. --break-lane in the main runs), and TOL_FACTOR x it would mean nothing.
BF16_BOUND = 0.05
PROBE_CYCLES = 2_000_000  # ~1 ms at H200 clocks
CONTROL_CYCLES = 100_000_000  # ~50 ms: the read without a join surely lands inside the sleep


@dataclasses.dataclass(frozen=True)
class Widths:
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    moe_inter: int
    inter: int
    experts: int
    topk: int
    n_group: int
    topk_group: int


DSV3 = Widths(7168, 128, 1536, 512, 128, 64, 128, 2048, 18432, 256, 8, 8, 4)
TINY = Widths(64, 16, 32, 16, 8, 8, 8, 16, 96, 64, 8, 8, 4)  # divides by 16 like DeepSeek-V3


def model_args(w: Widths, tp: int) -> R.ModelArgs:
    """One rank's attention: heads split tp ways; the latent projections stay replicated."""
    return R.ModelArgs(
        hidden_size=w.hidden, intermediate_size=w.inter, moe_intermediate_size=w.moe_inter,
        num_attention_heads=w.heads // tp, q_lora_rank=w.q_lora, kv_lora_rank=w.kv_lora,
        qk_nope_head_dim=w.nope, qk_rope_head_dim=w.rope, v_head_dim=w.v,
        n_routed_experts=w.experts, num_experts_per_tok=w.topk, n_group=w.n_group,
        topk_group=w.topk_group, rope={"rope_type": "default", "rope_theta": 10000.0},
    )


# ----------------------------------------------------------------------------------- the stack
_REPLICATED = ("input_layernorm", "post_attention_layernorm", "router", "q_a_proj",
               "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "final_norm")


class Layer(torch.nn.Module):
    """One rank's share of a DeepSeek-V3 layer; returns partial sums, never reduces."""

    def __init__(self, w: Widths, tp: int, rank: int, moe: bool):
        super().__init__()
        args = model_args(w, tp)
        self.moe = moe
        self.input_layernorm = R.RMSNorm(w.hidden, args.rms_norm_eps)
        self.post_attention_layernorm = R.RMSNorm(w.hidden, args.rms_norm_eps)
        self.self_attn = R.MLA(args)
        if moe:
            self.router = R.Router(args)  # replicated: every rank routes every token alike
            local = w.experts // tp
            self.first = rank * local
            self.experts = torch.nn.ModuleList(R.MLP(w.hidden, w.moe_inter) for _ in range(local))
            self.shared = R.MLP(w.hidden, w.moe_inter // tp)
        else:
            self.dense = R.MLP(w.hidden, w.inter // tp)

    def routed(self, y: torch.Tensor) -> torch.Tensor:
        """Routed partial: every local expert on every token, weighted by the router (0 where
        not picked): no host sync, so it captures."""
        idx, weights = self.router(y)
        mix = torch.zeros(y.shape[0], self.router.args.n_routed_experts, dtype=weights.dtype,
                          device=y.device).scatter_add_(1, idx, weights)
        mix = mix[:, self.first:self.first + len(self.experts)].to(y.dtype)
        r = torch.zeros_like(y)
        for e, expert in enumerate(self.experts):
            r = r + expert(y) * mix[:, e:e + 1]
        return r

    # The spec's view (spec_forward): each sub-block on its un-normed input.
    def attention(self, x, cos, sin):
        return self.self_attn(self.input_layernorm(x), cos, sin)

    def mlp(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(shared or dense partial, routed partial or None)."""
        y = self.post_attention_layernorm(x)
        if not self.moe:
            return self.dense(y), None
        return self.shared(y), self.routed(y)


class ShardOps(schedule.UnfusedNorms):
    """schedule.LayerOps of one `Layer` for one forward (cos, sin: that forward's rope)."""

    def __init__(self, layer: Layer, cos, sin):
        super().__init__(layer)
        self.cos, self.sin = cos, sin

    def attention(self, h):
        return self.layer.self_attn(h, self.cos, self.sin)

    def dense_mlp(self, y):
        return self.layer.dense(y)

    def shared_experts(self, y):
        return self.layer.shared(y)

    def routed_experts(self, y):
        return self.layer.routed(y)


class Stack(torch.nn.Module):
    def __init__(self, w: Widths, tp: int, rank: int, layers: int):
        super().__init__()
        self.w, self.tp, self.rank = w, tp, rank
        self.layers = torch.nn.ModuleList(Layer(w, tp, rank, moe=k > 0) for k in range(layers))
        self.final_norm = R.RMSNorm(w.hidden, 1e-6)
        # Every layer converted (full FarSkip), as the spec_forward below computes.
        self.wiring = [LayerWiring(attn_skips_prev_routed=True, mlp_skips_attn=True, is_moe=layer.moe)
                       for layer in self.layers]
        inv_freq, _ = R.rope_frequencies(model_args(w, tp))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, tokens: int, dtype, device):
        angles = torch.arange(tokens, dtype=torch.float32, device=device)[:, None] * self.inv_freq.to(device)
        return angles.cos().to(dtype), angles.sin().to(dtype)


@torch.no_grad()
def init_stack(stack: Stack, seed: int) -> Stack:
    """Seeded unit-scale weights: N(0, 1/fan_in) matrices (unit-scale activations), norms
    1 + N(0, 0.1). Replicated weights get one seed for all ranks, sharded ones one per rank,
    so the ranks of a world hold the shards of one model."""
    for name, p in sorted(stack.named_parameters()):
        shared = any(part in _REPLICATED for part in name.split("."))
        g = torch.Generator(device=p.device)
        g.manual_seed(hash_seed(seed, name, -1 if shared else stack.rank))
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) / math.sqrt(fan_in))
    return stack


def hash_seed(seed: int, name: str, rank: int) -> int:
    h = seed * 1_000_003 + rank * 7919
    for ch in name:
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h


def build(w: Widths, tp: int, rank: int, layers: int, seed: int, dtype, device) -> Stack:
    with torch.device(device):
        stack = Stack(w, tp, rank, layers)
    return init_stack(stack, seed).to(dtype).eval()


@torch.no_grad()
def spec_forward(shards: list[Stack], x: torch.Tensor) -> torch.Tensor:
    """reference.py's FarSkip layer, with each partial summed over the given shards right
    away (the unsharded model, or one rank's shard alone): a = Attn(norm(h - r_prev)),
    s, r = MLP(norm(h)), h = h + a + s + r."""
    cos, sin = shards[0].rope(x.shape[0], x.dtype, x.device)
    h, r_prev = x, torch.zeros_like(x)
    for k in range(len(shards[0].layers)):
        a = sum(s.layers[k].attention(h - r_prev, cos, sin) for s in shards)
        parts = [s.layers[k].mlp(h) for s in shards]
        shared = sum(p[0] for p in parts)
        routed = sum(p[1] for p in parts) if parts[0][1] is not None else torch.zeros_like(h)
        h, r_prev = h + a + shared + routed, routed
    return shards[0].final_norm(h)


@torch.no_grad()
def farskip_forward(stack: Stack, x: torch.Tensor, comm: Communicator, broken: str = "none") -> torch.Tensor:
    """The served FarSkip schedule (sglang_farskip.schedule, as models/deepseek_v3.py runs it)
    on this rank's shard. `broken` (test only) breaks layer BROKEN_LAYER's attention lane
    through the communicator (`BrokenLane`), outside the schedule."""
    cos, sin = stack.rope(x.shape[0], x.dtype, x.device)
    if broken != "none":
        comm = BrokenLane(comm, broken)
    layers = [ShardOps(layer, cos, sin) for layer in stack.layers]
    x, lanes = schedule.run_layers(x, layers, stack.wiring, comm)
    return schedule.finish(x, lanes, schedule.add_then_norm(stack.final_norm))


class BrokenLane:
    """A communicator whose layer-BROKEN_LAYER "attn+shared" sum misbehaves at its wait:
    `drop-partial` joins it and hands back zeros (the a + s never reaches the residual);
    `skip-join` reads the tensor before the join (on a GPU the side stream may still be writing
    it; on the CPU the probe holds it doubled). The attention lane, because its a + s is never
    zero, while at one rank of EP=16 a token's routed part often is (none of its 8 experts
    local), which would leave a broken routed lane invisible."""

    def __init__(self, comm: Communicator, broken: str):
        assert broken in BROKEN[1:], broken
        self.comm, self.broken = comm, broken

    def start_all_reduce(self, tensor, *, lane: str = "", layer: int = -1):
        handle = self.comm.start_all_reduce(tensor, lane=lane, layer=layer)
        if (lane, layer) != ("attn+shared", BROKEN_LAYER):
            return handle
        return _DroppedSum(handle) if self.broken == "drop-partial" else _UnjoinedRead(handle)

    def mark_compute(self) -> None:
        self.comm.mark_compute()

    def drain(self) -> None:
        self.comm.drain()


class _DroppedSum:
    def __init__(self, handle):
        self.handle = handle

    def wait(self):
        return torch.zeros_like(self.handle.wait())  # joined, then left out of the residual


class _UnjoinedRead:
    def __init__(self, handle):
        self.handle = handle

    def wait(self):
        early = self.handle._tensor.clone()  # noqa: SLF001 - the missing join, on purpose
        self.handle.wait()  # joined after the read, so no stream is left forked
        return early


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over tokens of |out - ref| / |ref| per token. A median, because bf16 rounding can
    flip a near-tie in a token's expert choice (a large change in that token alone); a broken
    lane changes every token."""
    out, ref = out.double(), ref.double()
    per_token = (out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return float(per_token.median())


# ------------------------------------------------------------------------ communicators
class _OneRank:
    world_size = 1


def gpu_comm(dev, mode: str, cycles: int = PROBE_CYCLES):
    if mode == "sync":
        return Communicator(None, asynchronous=False), None
    side = SideStreamAllReduce(fork_join_probe(nccl_all_reduce_(None, dev), cycles), device=dev)
    comm = Communicator(_OneRank(), asynchronous=True, side_stream=side)
    assert comm.backend == "side-stream", comm.backend
    return comm, side


class GlooGroup:
    """What Communicator needs of a group, over a gloo world; the all-reduce is the CPU probe:
    double, sleep, sum, halve (exact), so a read without a join sees doubled values."""

    def __init__(self, probe_s: float):
        import torch.distributed as dist

        self.device_group = dist.group.WORLD
        self.world_size = dist.get_world_size()
        self.probe_s = probe_s

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t.mul_(2)
        time.sleep(self.probe_s)
        dist.all_reduce(t, group=self.device_group)
        return t.mul_(0.5)


def cpu_comm(mode: str, world: int, probe_s: float = 0.002):
    if world == 1:
        return Communicator(None, asynchronous=False)  # identity: overlap at one rank too
    return Communicator(GlooGroup(probe_s), asynchronous=(mode == "overlap"))


# ------------------------------------------------------------------------------------ items
def item_side_stream(dev, figures: dict) -> tuple[bool, str]:
    comm, side = gpu_comm(dev, "overlap")
    g = torch.Generator(device=dev).manual_seed(0)
    H = DSV3.hidden
    wt = torch.randn(H, H, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(H)
    sizes = (1, 3, 64, 256)
    inputs = {n: torch.randn(n, H, device=dev, dtype=torch.bfloat16, generator=g) for n in sizes}

    def step(x):  # a partial still being written when its launch is enqueued, then other work
        torch.cuda._sleep(PROBE_CYCLES // 2)
        handle = comm.start_all_reduce(x @ wt, lane="routed")
        return torch.tanh(x @ wt.t()) + handle.wait()

    want = {n: torch.tanh(x @ wt.t()) + x @ wt for n, x in inputs.items()}
    bad = [f"eager {n}" for n, x in inputs.items() if not torch.equal(step(x), want[n])]
    warm = torch.cuda.Stream(device=dev)
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for x in inputs.values():
            step(x)
    torch.cuda.current_stream().wait_stream(warm)
    graphs, outs, pool = {}, {}, torch.cuda.graph_pool_handle()
    for n, x in inputs.items():
        graphs[n] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[n], pool=pool):
            outs[n] = step(x)
    order = [n for n in sizes for _ in range(5)]
    random.Random(0).shuffle(order)
    interleaved = 0
    for i, n in enumerate(order):
        graphs[n].replay()
        if i % 3 == 0:  # eager use of the one communicator and event ring between replays
            interleaved += 1
            if not torch.equal(step(inputs[n]), want[n]):
                bad.append(f"interleaved eager {n}")
        torch.cuda.synchronize()
        if not torch.equal(outs[n], want[n]):
            bad.append(f"graph {n} replay {i}")
    figures.update(sizes=list(sizes), replays=len(order), interleaved_eager=interleaved,
                   ring=len(side.events), failures=bad)
    detail = (f"eager + graphs at {'/'.join(map(str, sizes))} tokens, {len(order)} shuffled replays, "
              f"{interleaved} eager launches between them, ring of {len(side.events)} events")
    return not bad, detail if not bad else "wrong numbers: " + ", ".join(bad[:6])


def item_priority(dev, figures: dict) -> tuple[bool, str]:
    g = torch.Generator(device=dev).manual_seed(2)
    a = torch.randn(4096, DSV3.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(DSV3.hidden, DSV3.inter, device=dev, dtype=torch.bfloat16, generator=g)
    small = torch.randn(256, DSV3.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    main = torch.cuda.current_stream()

    def run(side):
        """(ms per GEMM, ms from 'ready' to the side kernel's end)."""
        start, end, ready, done = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        start.record(main)
        for i in range(8):
            a @ b
            if i == 1:
                ready.record(main)
        if side is not None:
            side.wait_event(ready)
            with torch.cuda.stream(side):
                small.add_(1).sub_(1)
                done.record()
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 8, ready.elapsed_time(done) if side is not None else None

    run(None)
    alone = min(run(None)[0] for _ in range(3))
    lo, hi = torch.cuda.Stream.priority_range()
    normal = min((run(torch.cuda.Stream(device=dev, priority=lo)) for _ in range(3)), key=lambda r: r[1])
    high = min((run(torch.cuda.Stream(device=dev, priority=hi)) for _ in range(3)), key=lambda r: r[1])
    figures.update(gemm_ms_alone=alone, gemm_ms_with_normal=normal[0], gemm_ms_with_high=high[0],
                   side_wait_ms_normal=normal[1], side_wait_ms_high=high[1], priority_range=[lo, hi])
    ok = high[1] <= normal[1] * 1.1 + 0.05
    return ok, (f"side kernel done {normal[1]:.3f} ms after ready at normal priority, {high[1]:.3f} ms "
                f"at high; GEMM {alone:.3f} ms alone, {normal[0]:.3f} / {high[0]:.3f} ms beside it")


def item_memory(dev, figures: dict) -> tuple[bool, str]:
    comm, side = gpu_comm(dev, "overlap", cycles=0)
    mib = 2**20
    kept = side.warm_up([DSV3.hidden, 256 * DSV3.hidden, 4096 * DSV3.hidden], torch.bfloat16)
    t = torch.ones(4096, DSV3.hidden, device=dev, dtype=torch.bfloat16)  # 58.7 MB
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(dev)[0]
    out = comm.start_all_reduce(t).wait()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    later = free_before - torch.cuda.mem_get_info(dev)[0]
    figures.update(warm_up_kept_mib=kept / mib, first_big_all_reduce_mib=later / mib)
    ok = abs(later) <= 2 * mib and bool(torch.equal(out, torch.ones_like(out)))
    return ok, (f"warm-up kept {kept / mib:.1f} MiB; the first 58.7 MB all-reduce after it "
                f"{later / mib:+.1f} MiB (bound 2 MiB)")


def _judge(results: dict, broken: str) -> tuple[bool, list[str]]:
    """The stack's verdict from its comparisons (see the module docstring)."""
    bad = []
    tol = results["tol"]
    if results["wiring_err"] > WIRING_TOL:
        bad.append(f"fp32 schedule vs spec {results['wiring_err']:.2e} > {WIRING_TOL:g}")
    if results["runs"]["sync-eager"]["err"] > BF16_BOUND:
        bad.append(f"sync-eager bf16 vs fp32 spec {results['runs']['sync-eager']['err']:.2e} > {BF16_BOUND:g}")
    for name, run in results["runs"].items():
        if run["err"] > tol:
            bad.append(f"{name} err {run['err']:.2e} > tol {tol:.2e}")
        if run.get("bitwise_vs") and not run["bitwise"]:
            bad.append(f"{name} != {run['bitwise_vs']} bitwise")
    for name, ctl in results["controls"].items():
        if not ctl["detected"]:
            bad.append(f"control {name} went unnoticed (err {ctl['err']:.2e} <= tol {tol:.2e}): no power")
    return not bad, bad


def _stack_runs(stack, spec32, x, comms: dict, graphs: dict | None, broken: str, controls: dict) -> dict:
    """Every comparison for one shard and one input: comms maps mode -> Communicator;
    graphs: mode -> callable that captures and replays (GPU) or None (CPU)."""
    base = rel_err(farskip_forward(stack, x, comms["sync"], broken), spec32)
    tol = max(TOL_FACTOR * base, 1e-6)
    runs = {"sync-eager": {"err": base}}
    eager = {m: farskip_forward(stack, x, c, broken) for m, c in comms.items()}
    runs["overlap-eager"] = {"err": rel_err(eager["overlap"], spec32), "bitwise_vs": "sync-eager",
                             "bitwise": bool(torch.equal(eager["overlap"], eager["sync"]))}
    if graphs is not None:
        outs = {m: graphs[m](broken) for m in comms}
        for m, out in outs.items():
            runs[f"{m}-graph"] = {"err": rel_err(out, spec32),
                                  "eager_bitwise": bool(torch.equal(out, eager[m]))}
        runs["overlap-graph"].update(bitwise_vs="sync-graph",
                                     bitwise=bool(torch.equal(outs["overlap"], outs["sync"])))
    ctl = {}
    for name, (comm, drain) in controls.items():
        out = farskip_forward(stack, x, comm, name)
        drain()
        err = rel_err(out, spec32)
        ctl[name] = {"err": err, "detected": err > tol}
    return {"tol": tol, "runs": runs, "controls": ctl}


def item_stack(dev, figures: dict, *, layers: int = 4, tps=(8, 16), broken: str = "none",
               tokens=(1, 8, 64, 256), graph_tokens=(1, 8, 64)) -> tuple[bool, str]:
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 spec must be fp32
    comms = {m: gpu_comm(dev, m)[0] for m in ("sync", "overlap")}
    ctl_comm, ctl_side = gpu_comm(dev, "overlap", cycles=CONTROL_CYCLES)
    controls = {name: (ctl_comm, torch.cuda.synchronize) for name in BROKEN[1:]}
    ok_all, lines = True, []
    try:
        for tp in tps:
            stack32 = build(DSV3, tp, 0, layers, seed=tp, dtype=torch.float32, device=dev)
            stack = build(DSV3, tp, 0, layers, seed=tp, dtype=torch.bfloat16, device=dev)
            g = torch.Generator(device=dev).manual_seed(100 + tp)
            per_tp = figures.setdefault(f"tp{tp}", {})
            for n in tokens:
                x32 = torch.randn(n, DSV3.hidden, device=dev, generator=g)
                spec32 = spec_forward([stack32], x32)
                wiring = rel_err(farskip_forward(stack32, x32, comms["sync"]), spec32)
                x = x32.to(torch.bfloat16)
                graphs = ({m: _graph_runner(stack, x, c) for m, c in comms.items()}
                          if n in graph_tokens else None)
                res = _stack_runs(stack, spec32, x, comms, graphs, broken, controls)
                res["wiring_err"] = wiring
                ok, bad = _judge(res, broken)
                per_tp[str(n)] = {**res, "ok": ok, "problems": bad}
                ok_all &= ok
                if not ok:
                    lines.append(f"TP{tp} {n} tokens: " + "; ".join(bad[:3]))
            del stack32, stack
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    worst = max((r["err"] for t in figures.values() if isinstance(t, dict)
                 for v in t.values() for r in v["runs"].values()), default=float("nan"))
    summary = (f"TP {'/'.join(map(str, tps))} shards, {layers} layers, {len(tokens)} token counts "
               f"(graphs at {'/'.join(map(str, graph_tokens))}), worst rel err {worst:.2e}; "
               f"controls {'/'.join(BROKEN[1:])} detected")
    return ok_all, summary if ok_all else "; ".join(lines[:4])


def _graph_runner(stack, x, comm):
    """A callable (broken) -> output of replays of `stack` captured in a full CUDA graph:
    captured once per `broken`, replayed 3 times in a row, the last one returned."""
    cache = {}

    def run(broken: str):
        if broken not in cache:
            static = x.clone()
            warm = torch.cuda.Stream(device=x.device)
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                farskip_forward(stack, static, comm, broken)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=_POOL.setdefault("pool", torch.cuda.graph_pool_handle())):
                out = farskip_forward(stack, static, comm, broken)
            cache[broken] = (graph, out)
        graph, out = cache[broken]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    return run


_POOL: dict = {}


# ---------------------------------------------------------------------------------- per-op
def _time_us(fn, iters: int = 20) -> float:
    """Median of `iters` timed calls (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    times.sort()
    return times[len(times) // 2]


def item_ops(dev, figures: dict) -> tuple[bool, str]:
    bf, w = torch.bfloat16, DSV3
    g = torch.Generator(device=dev).manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf, generator=g)

    entries = []

    def add(op, tokens, context, tp, us):
        entries.append({"op": op, "tokens": tokens, "context": context, "tp": tp, "us": round(us, 3)})

    for tp in (8, 16):
        nh = w.heads // tp
        with torch.device(dev):
            mla = R.MLA(model_args(w, tp)).to(bf)
            shared = R.MLP(w.hidden, w.moe_inter // tp).to(bf)
            dense = R.MLP(w.hidden, w.inter // tp).to(bf)
            norm = R.RMSNorm(w.hidden, 1e-6).to(bf)
        for p in mla.parameters():
            p.data.normal_(0, 0.02, generator=g)
        inv_freq, _ = R.rope_frequencies(model_args(w, tp))
        for tokens, context in ((512, 512), (2048, 2048), (4096, 4096), (1024, 8192)):
            # Projections on the new tokens, SDPA of them against the whole context.
            x = rnd(tokens, w.hidden)
            q = rnd(1, nh, tokens, w.nope + w.rope)
            k = rnd(1, nh, context, w.nope + w.rope)
            v = rnd(1, nh, context, w.v)
            mask = torch.ones(tokens, context, dtype=torch.bool, device=dev).tril(context - tokens)
            ang = torch.arange(tokens, device=dev, dtype=torch.float32)[:, None] * inv_freq.to(dev)
            cos, sin = ang.cos().to(bf), ang.sin().to(bf)
            kv_b = rnd(context, w.kv_lora)

            def prefill():
                mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x)))
                mla.kv_a_proj_with_mqa(x)
                mla.kv_b_proj(kv_b)  # the whole context's keys and values, as MHA prefill does
                R.apply_rope(q[0, :, :, w.nope:].transpose(0, 1), cos, sin, True)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=mla.scale)
                mla.o_proj(o[0].transpose(0, 1).reshape(tokens, nh * w.v))

            add("attention_prefill", tokens, context, tp, _time_us(prefill, 10))
        for batch, context in ((1, 1024), (1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 4096)):
            # Absorbed MLA decode: queries in the latent space against a latent + rope cache.
            x = rnd(batch, w.hidden)
            w_uk = rnd(nh, w.nope, w.kv_lora)
            w_uv = rnd(nh, w.kv_lora, w.v)
            cache = rnd(batch, context, w.kv_lora + w.rope)

            def decode():
                qf = mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x))).view(batch, nh, -1)
                mla.kv_a_proj_with_mqa(x)
                q_lat = torch.einsum("bhd,hdl->bhl", qf[..., :w.nope], w_uk)
                qq = torch.cat([q_lat, qf[..., w.nope:]], -1)  # [b, h, latent + rope]
                probs = (torch.einsum("bhl,bcl->bhc", qq, cache).float() * mla.scale).softmax(-1).to(bf)
                o = torch.einsum("bhc,bcl->bhl", probs, cache[..., :w.kv_lora])
                mla.o_proj(torch.einsum("bhl,hlv->bhv", o, w_uv).reshape(batch, nh * w.v))

            add("attention_decode", batch, context, tp, _time_us(decode))
        local = w.experts // tp
        gate_up = rnd(local, w.hidden, 2 * w.moe_inter) * 0.02
        down = rnd(local, w.moe_inter, w.hidden) * 0.02
        for tokens in (1, 8, 64, 256, 1024, 4096, 8192):
            x = rnd(tokens, w.hidden)
            add("shared_experts", tokens, 0, tp, _time_us(lambda: shared(x)))
            add("dense_mlp", tokens, 0, tp, _time_us(lambda: dense(x)))
            # Balanced routing: this rank gets tokens*8/EP of the token slots, spread evenly
            # over its 256/EP experts (fewer slots than experts: one each, the rest idle);
            # gather, two batched GEMMs, weighted scatter-add.
            slots = max(1, tokens * w.topk // tp)
            active, per = (local, slots // local) if slots >= local else (slots, 1)
            rows = torch.arange(active * per, device=dev) % tokens
            weights = torch.rand(active * per, 1, device=dev, dtype=bf, generator=g)

            def routed():
                xs = x.index_select(0, rows).view(active, per, w.hidden)
                gu = torch.bmm(xs, gate_up[:active])
                act = F.silu(gu[..., :w.moe_inter]) * gu[..., w.moe_inter:]
                out = torch.bmm(act, down[:active]).view(-1, w.hidden) * weights
                torch.zeros_like(x).index_add_(0, rows, out)

            add("routed_experts", tokens, 0, tp, _time_us(routed))
            res, part = rnd(tokens, w.hidden), rnd(tokens, w.hidden)
            add("norm_add", tokens, 0, tp, _time_us(lambda: norm(res + part)))
    name = torch.cuda.get_device_name(dev)
    figures.update({"source": f"{name}, {datetime.date.today().isoformat()}, bf16 (python/sglang_farskip/checks/gpu.py, "
                              "plain PyTorch kernels)", "dtype": "bf16", "per_op_us": entries})
    ok = all(math.isfinite(e["us"]) and e["us"] > 0 for e in entries)
    return ok, f"{len(entries)} op timings (attention prefill/decode, experts, dense MLP, norm+add at TP 8/16)"


# ------------------------------------------------------------------------------------- CPU
def cpu_stack(world: int, rank: int, broken: str, layers: int = 3, tokens=(1, 5, 17)) -> dict:
    """The stack at TINY widths on the CPU, as rank `rank` of `world` (gloo already set up
    when world > 1). Returns the results and the verdict."""
    tp = world if world > 1 else 8
    shards = [build(TINY, tp, r, layers, seed=1, dtype=torch.float32, device="cpu")
              for r in (range(world) if world > 1 else [0])]
    stack32 = shards[rank if world > 1 else 0]
    stack = build(TINY, tp, rank if world > 1 else 0, layers, seed=1, dtype=torch.bfloat16, device="cpu")
    comms = {m: cpu_comm(m, world) for m in ("sync", "overlap")}
    ctl_comm = cpu_comm("overlap", world, probe_s=0.05)
    # At one rank the identity backend has no join to skip: only dropping a sum can show.
    names = BROKEN[1:] if world > 1 else ("drop-partial",)
    controls = {name: (ctl_comm, ctl_comm.drain) for name in names}
    g = torch.Generator().manual_seed(7)
    out, ok_all = {}, True
    for n in tokens:
        x32 = torch.randn(n, TINY.hidden, generator=g)
        spec32 = spec_forward(shards, x32)  # the unsharded model: the ranks' sums must give it
        wiring = rel_err(farskip_forward(stack32, x32, comms["sync"]), spec32)
        res = _stack_runs(stack, spec32, x32.to(torch.bfloat16), comms, None, broken, controls)
        res["wiring_err"] = wiring
        ok, bad = _judge(res, broken)
        out[str(n)] = {**res, "ok": ok, "problems": bad}
        ok_all &= ok
    for c in (*comms.values(), ctl_comm):
        c.drain()
    return {"ok": ok_all, "world": world, "backends": {m: c.backend for m, c in comms.items()},
            "tokens": out}


def _cpu_rank(rank: int, world: int, port: int, broken: str, path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = cpu_stack(world, rank, broken)
        Path(f"{path}.{rank}").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def item_stack_cpu(world: int, broken: str, figures: dict) -> tuple[bool, str]:
    if world == 1:
        res = [cpu_stack(1, 0, broken)]
    else:
        import socket

        import torch.multiprocessing as mp

        # fork: the ranks inherit the imported torch (an import is seconds on a loaded CPU);
        # the parent has run no torch op yet, so no thread pool is forked half-way.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank")
            mp.start_processes(_cpu_rank, args=(world, port, broken, path), nprocs=world,
                               start_method="fork")
            res = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]
    figures.update(ranks=res)
    ok = all(r["ok"] for r in res)
    problems = [p for r in res for t in r["tokens"].values() for p in t["problems"]]
    ctl = sorted({n for r in res for t in r["tokens"].values() for n in t["controls"]})
    worst = max(run["err"] for r in res for t in r["tokens"].values() for run in t["runs"].values())
    detail = (f"CPU, world {world} ({res[0]['backends']['overlap']} backend), tiny widths, "
              f"worst rel err {worst:.2e}, controls {'/'.join(ctl)} detected")
    return ok, detail if ok else "; ".join(list(dict.fromkeys(problems))[:4])  # ranks repeat


# -------------------------------------------------------------------------------------- main
def summary(results: list[tuple[str, bool, str]]) -> tuple[str, bool]:
    failed = [name for name, ok, _ in results if not ok]
    ok = not failed
    return ("SUMMARY PASS: every item passed" if ok else f"SUMMARY FAIL: {', '.join(failed)}"), ok


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (or docs/gpu-overlap.md) for the items.")
    p.add_argument("--items", default=",".join(ITEMS),
                   help=f"comma-separated subset of {','.join(ITEMS)} (GPU)")
    p.add_argument("--json", metavar="OUT", help="write every figure here")
    p.add_argument("--ops-json", metavar="OUT", help="write the per-op times alone, in the planner's --ops schema")
    p.add_argument("--cpu", action="store_true", help="run the CPU-runnable parts (the stack at tiny widths)")
    p.add_argument("--world", type=int, default=1, choices=(1, 2),
                   help="--cpu: 1 (identity backend) or 2 (a 2-rank gloo world, comm thread)")
    p.add_argument("--break-lane", choices=BROKEN, default="none",
                   help="test only: break layer 1's attention lane in the main runs; the check must then FAIL")
    p.add_argument("--layers", type=int, default=4, help="stack depth (one dense layer, then MoE)")
    args = p.parse_args(argv)
    args.items = [i for i in args.items.split(",") if i]
    unknown = set(args.items) - set(ITEMS)
    if unknown:
        p.error(f"unknown items {sorted(unknown)}; choose from {','.join(ITEMS)}")
    if args.layers < 2:
        p.error("--layers must be at least 2 (a dense layer and the MoE layer the controls break)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    figures: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "torch": torch.__version__}
    results = []

    def run(name, fn):
        t = time.time()
        fig = figures.setdefault(name, {})
        try:
            ok, detail = fn(fig)
        except Exception as e:  # noqa: BLE001 - one broken item must not hide the others
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            fig["traceback"] = traceback.format_exc()
        fig.update(ok=ok, detail=detail, seconds=round(time.time() - t, 2))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail} ({time.time() - t:.1f} s)", flush=True)
        results.append((name, ok, detail))

    if args.cpu:
        torch.set_num_threads(1)  # tiny ops: more threads only contend for a shared CPU
        run("stack", lambda fig: item_stack_cpu(args.world, args.break_lane, fig))
    elif not torch.cuda.is_available():
        print("FAIL gpu: torch sees no GPU; use --cpu for the CPU-runnable parts", flush=True)
        results.append(("gpu", False, "no GPU"))
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        figures["device"] = torch.cuda.get_device_name(dev)
        items = {
            "side-stream": lambda fig: item_side_stream(dev, fig),
            "priority": lambda fig: item_priority(dev, fig),
            "memory": lambda fig: item_memory(dev, fig),
            "stack": lambda fig: item_stack(dev, fig, layers=args.layers, broken=args.break_lane),
            "ops": lambda fig: item_ops(dev, fig),
        }
        for name in args.items:
            run(name, items[name])
    line, ok = summary(results)
    figures.update(ok=ok, seconds=round(time.time() - t0, 1))
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    if args.ops_json and figures.get("ops", {}).get("per_op_us"):
        Path(args.ops_json).write_text(json.dumps(
            {k: figures["ops"][k] for k in ("source", "dtype", "per_op_us")}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
