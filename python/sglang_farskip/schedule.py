"""The FarSkip lane loop, written once: which partial sums each sub-block waits for, which
collectives it starts. Needs torch alone (no SGLang, no transformers): the served model
(models/deepseek_v3.py), the bare GPU check (python/sglang_farskip/checks/gpu.py) and the FCSD student
(fcsd/student.py) all run this file, each with its own `LayerOps` and communicator.

Notation (decoder layer k, docs/design.md; every tensor [T, H]: T tokens, H hidden; the
student's are [B, T, H]):
    x       the residual, complete except for the sums still in flight
    a       attention output partial (o_proj, not yet all-reduced)
    s       shared-expert partial (a dense layer: its whole MLP output)
    r       routed-expert partial (MoE layers only)
    AR(t)   comm.start_all_reduce(t): a handle now, the sum over the ranks at its wait()
    Lanes   the previous layer's sums still in flight:
            attn_shared = AR(a + s)      (collective lane "attn+shared")
            routed      = AR(r)          (collective lane "routed")

One layer (`layer_step`; the flags are `LayerWiring`'s):
    x += attn_shared                              now x = h[k-1] - r[k-1]
    if not attn_skips_prev_routed: x += routed    attention reads the full h[k-1]
    a = Attn(norm_in(x))
    if mlp_skips_attn:   x += routed                                  x = h[k-1]
    else:                x += routed; x += AR(a) (lane "attn"); a = 0   x = h[k-1] + a
    y = norm_post(x)
    dense:  attn_shared = AR(a + Dense(y)), routed = none
    MoE:    attn_shared = AR(a + Shared(y)), launched before the routed experts run
            routed      = AR(Routed(y))
and after the last layer (`finish`): x += attn_shared; x += routed; out = norm(x).

Why in this order: the routed sum of layer k-1 is read first by layer k's MLP, so it stays in
flight across layer k's attention; the attention+shared sum is launched before the routed
experts, so it runs while they compute. A dense layer's whole output rides the attention lane
because the next attention must read it (docs/design.md: only routed outputs far-skip).

Every wait is where the sum is first read, and every float addition happens in one fixed
order, whatever the communicator: a blocking one (sync) and an asynchronous one (overlap) give
bit-identical results. The last sum before a norm goes to the ops' add+norm (SGLang fuses that
add into its RMSNorm kernel); any earlier one is added here, plainly.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, NamedTuple, Optional, Protocol, Sequence

import torch

Tensor = torch.Tensor


class Handle(Protocol):
    """A started all-reduce (comm.Handle or a test double)."""

    def wait(self) -> Tensor: ...  # the sum, once

    def join(self) -> "Handle": ...  # wait for the sum now, return it later with wait()


class Communicator(Protocol):
    """What the schedule needs of comm.Communicator."""

    def start_all_reduce(self, tensor: Tensor, *, lane: str = "", layer: int = -1) -> Handle: ...

    def mark_compute(self) -> None: ...  # a sub-block of compute ended (the overlap profiler)

    def drain(self) -> None: ...  # wait for every collective launched so far


# (normed, summed) = add_norm(x, s): norm(x + s) and x + s; s None: norm(x) and x. The served
# model's is SGLang's fused residual add + RMSNorm (which may update both tensors in place).
AddNorm = Callable[[Tensor, Optional[Tensor]], "tuple[Tensor, Tensor]"]


def add_then_norm(norm: Callable[[Tensor], Tensor]) -> AddNorm:
    """The AddNorm of a plain (unfused) norm: the add, then the norm."""

    def add_norm(x: Tensor, s: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        x = x if s is None else x + s
        return norm(x), x

    return add_norm


class UnfusedNorms:
    """LayerOps' two add+norms for a layer module holding plain `input_layernorm` and
    `post_attention_layernorm` norms (transformers' names, kept by the bench stack too)."""

    def __init__(self, layer):
        self.layer = layer

    def input_add_norm(self, x: Tensor, s: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return add_then_norm(self.layer.input_layernorm)(x, s)

    def post_add_norm(self, x: Tensor, s: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return add_then_norm(self.layer.post_attention_layernorm)(x, s)


class LayerOps(Protocol):
    """One decoder layer's compute on one rank. Every output is a partial: nothing here reduces."""

    def input_add_norm(self, x: Tensor, s: Optional[Tensor]) -> tuple[Tensor, Tensor]: ...

    def attention(self, h: Tensor) -> Tensor: ...  # normed input -> a (o_proj partial)

    def post_add_norm(self, x: Tensor, s: Optional[Tensor]) -> tuple[Tensor, Tensor]: ...

    def dense_mlp(self, y: Tensor) -> Tensor: ...

    def shared_experts(self, y: Tensor) -> Tensor: ...

    def routed_experts(self, y: Tensor) -> Tensor: ...  # routed_scaling_factor applied


@dataclasses.dataclass(frozen=True)
class LayerWiring:
    attn_skips_prev_routed: bool  # attention reads h[k-1] - r[k-1]
    mlp_skips_attn: bool  # the MLP reads h[k-1], not h[k-1] + a[k]
    is_moe: bool


class Lanes(NamedTuple):
    """The previous layer's sums, still in flight (None: nothing pending on that lane)."""

    attn_shared: Optional[Handle] = None  # AR(a + s); AR(s) alone when a was reduced apart
    routed: Optional[Handle] = None  # AR(r)


class Ready:
    """A handle whose sum is already there: on one rank the sum of a partial is the partial."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

    def wait(self) -> Tensor:
        return self.tensor

    def join(self) -> "Ready":
        return self


class OneRank:
    """The communicator of a single process (a training forward): nothing to reduce, nothing in
    flight, and the tensors keep their autograd history."""

    def start_all_reduce(self, tensor: Tensor, *, lane: str = "", layer: int = -1) -> Ready:
        return Ready(tensor)

    def mark_compute(self) -> None:
        pass

    def drain(self) -> None:
        pass


def _with(x: Tensor, handle: Optional[Handle]) -> Tensor:
    """x plus the sum of a lane, waited for here (where it is first read)."""
    return x if handle is None else x + handle.wait()


def _sum(a: Optional[Tensor], s: Tensor) -> Tensor:
    """The attention lane's payload: a + s, or s alone when a already went on its own lane."""
    return s if a is None else a + s


def _norm_with(add_norm: AddNorm, x: Tensor, *handles: Optional[Handle]) -> tuple[Tensor, Tensor]:
    """(norm(x + sums), x + sums), the sums waited and added in the order given; the last one
    goes to add_norm, so that a fused add+norm kernel adds it."""
    pending = [h for h in handles if h is not None]
    for h in pending[:-1]:
        x = _with(x, h)
    return add_norm(x, pending[-1].wait() if pending else None)


def layer_step(k: int, w: LayerWiring, ops: LayerOps, comm: Communicator, x: Tensor, lanes: Lanes,
               *, graph_breaks: bool = False) -> tuple[Tensor, Lanes]:
    """Layer k: (x, the lanes of layer k-1) -> (x, the lanes of layer k).

    `graph_breaks`: a breakable CUDA graph ends a captured segment at attention, and no sum may
    stay in flight across the break: the routed sum is joined before attention (still added
    after it, as always, so the numbers do not change)."""
    routed = lanes.routed
    if w.attn_skips_prev_routed:
        h, x = _norm_with(ops.input_add_norm, x, lanes.attn_shared)  # x = h[k-1] - r[k-1]
        if graph_breaks and routed is not None:
            routed.join()
    else:
        (h, x), routed = _norm_with(ops.input_add_norm, x, lanes.attn_shared, routed), None  # h[k-1]
    a = ops.attention(h)
    comm.mark_compute()

    if w.mlp_skips_attn:
        y, x = _norm_with(ops.post_add_norm, x, routed)  # x = h[k-1]
    else:
        attn = comm.start_all_reduce(a, lane="attn", layer=k)
        y, x = _norm_with(ops.post_add_norm, x, routed, attn)  # x = h[k-1] + a
        a = None  # already summed: the attention lane then carries s alone

    if not w.is_moe:  # r = 0: the dense output rides the attention lane
        s = ops.dense_mlp(y)
        comm.mark_compute()
        return x, Lanes(attn_shared=comm.start_all_reduce(_sum(a, s), lane="attn+shared", layer=k))

    s = ops.shared_experts(y)
    attn_shared = comm.start_all_reduce(_sum(a, s), lane="attn+shared", layer=k)  # runs during the routed experts
    r = ops.routed_experts(y)
    comm.mark_compute()
    return x, Lanes(attn_shared, comm.start_all_reduce(r, lane="routed", layer=k))


def run_layers(x: Tensor, layers: Iterable[LayerOps], wiring: Sequence[LayerWiring], comm: Communicator,
               *, graph_breaks: bool = False,
               scope: Callable[[int], ContextManager] = lambda k: nullcontext()) -> tuple[Tensor, Lanes]:
    """Every layer in turn: (the input x, no lanes) -> (x, the last layer's lanes), for `finish`.
    `scope(k)` is entered around layer k (the served model's expert-distribution recorder).
    On an exception every launched collective is drained first: none may outlive the tensors
    it reads and writes, nor run into the next forward."""
    lanes = Lanes()
    try:
        for k, (ops, w) in enumerate(zip(layers, wiring, strict=True)):
            with scope(k):
                x, lanes = layer_step(k, w, ops, comm, x, lanes, graph_breaks=graph_breaks)
    except BaseException:
        comm.drain()
        raise
    return x, lanes


def finish(x: Tensor, lanes: Lanes, final_add_norm: Optional[AddNorm] = None) -> Tensor:
    """The final drain: the full h[L-1] = x + attention lane + routed lane, normed by
    `final_add_norm` (the final norm reads every sum); without one, h[L-1] itself."""
    if final_add_norm is None:
        return _with(_with(x, lanes.attn_shared), lanes.routed)
    return _norm_with(final_add_norm, x, lanes.attn_shared, lanes.routed)[0]
