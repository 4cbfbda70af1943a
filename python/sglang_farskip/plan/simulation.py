"""The replay: each run's forward as the compute stream issues it (stock, FarSkip sync, FarSkip
overlap), played on a compute stream and one FIFO communication stream, and the prediction of
the three runs side by side.

Notation
    N        ranks of the TP/EP group (attention TP = MoE EP = N without DP attention)
    dp       DP-attention ranks; attention then runs on T/dp local tokens at TP N/dp
             (docs/dp-attention.md: FarSkip keeps the residual for all T rows on every rank)
    T        tokens of one forward of the whole group: prefill batch x prompt, decode batch
    ctx      attention context of a sequence: the prompt in prefill, the KV length in decode
    A, S, R  attention (to the o_proj partial), shared experts (a dense layer: its whole MLP),
             routed experts with their router;  M  one residual add + RMSNorm
    X(b)     time of an all-reduce of b bytes (the cluster); b = T x hidden x 2 (bf16 sums)
    A lane   AR(a+s) of layer k: launched after S_k, waited before attention k+1
    R lane   AR(r) of layer k: launched after R_k, waited before the MLP of layer k+1
             (under DP attention both are ARs of T x hidden over the group; stock DP instead
             all-gathers the MoE input and reduce-scatters its output, both blocking)
    window   compute the schedule puts between a collective's launch and its wait
    gamma    contention: the fraction of compute throughput lost while a collective is in
             flight (--contention); 0 = perfect overlap
    f        exposed-communication share of the stock step;  bound = 1/(1-f);
             link bound = 1/max(f, 1-f)  (no step is shorter than its compute or its comms)
    ceiling  the overlap step at gamma = 0 (what the schedule allows) and the share of
             communication time that has a window at all (115 of 119 ARs for DeepSeek-V3)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sglang_farskip.errors import UserError
from sglang_farskip.plan.shapes import BF16, Shape


# ================================================================== schedules
@dataclasses.dataclass
class Ins:
    kind: str  # "compute" | "launch" | "wait"
    name: str  # compute: op name; launch: collective label
    us: float = 0.0
    layer: int = -1  # -1: before layer 0 (the DP embedding gather)
    cid: int = -1
    link_bytes: float = 0.0  # launch: bytes through each rank's link (ring algorithm)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int  # N: the TP/EP group
    dp: int  # DP-attention ranks (1: TP attention)
    nodes: int

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp


@dataclasses.dataclass(frozen=True)
class Phase:
    kind: str  # "prefill" | "decode"
    tokens: int  # T
    context: int
    batch: int

    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.batch}x{self.context} tokens"
        return f"decode batch {self.batch}, context {self.context}"


class Program:
    """One forward as the compute stream issues it; collectives get ids at launch."""

    def __init__(self):
        self.ins: list[Ins] = []

    def compute(self, name: str, us: float, layer: int) -> None:
        self.ins.append(Ins("compute", name, us, layer))

    def launch(self, label: str, us: float, layer: int, link_bytes: float = 0.0) -> int:
        cid = sum(1 for i in self.ins if i.kind == "launch")
        self.ins.append(Ins("launch", label, us, layer, cid, link_bytes))
        return cid

    def wait(self, *cids: Optional[int]) -> None:
        for c in cids:
            if c is not None:
                self.ins.append(Ins("wait", "", 0.0, -1, c))

    def blocking(self, label: str, us: float, layer: int, link_bytes: float = 0.0) -> None:
        self.wait(self.launch(label, us, layer, link_bytes))


@dataclasses.dataclass(frozen=True)
class Costs:
    """Every per-layer piece of one forward, in us (T tokens of the whole TP/EP group, T/dp of
    them on one DP-attention rank), and the link bytes of each collective."""

    attn: float  # the T/dp local tokens at attention TP N/dp (all T at TP N without DP)
    shared: float  # all T tokens at TP N: the MoE input holds every DP rank's rows
    routed: float
    dense: float  # all T tokens at TP N
    norm: float  # one add + RMSNorm of the T/dp local rows (stock; all T rows without DP)
    norm_rows: float  # the same on all T rows: FarSkip under DP keeps the residual for the group
    head: float
    ar_layer: float  # AR of a [T, hidden] partial over the whole group (every FarSkip lane, the DP embedding gather)
    ar_attn: float  # stock DP attention: AR of a [T/dp, hidden] partial over the attention TP group
    gather: float  # stock DP attention: all-gather of the MoE input, [T, hidden] in all
    scatter: float  # stock DP attention: reduce-scatter of the MoE output, [T, hidden] in all
    lb_ar: float = 0.0  # bytes through each rank's link, ring algorithm: 2(n-1)/n of the message
    lb_attn: float = 0.0
    lb_gather: float = 0.0  # (n-1)/n of the gathered [T, hidden]
    lb_scatter: float = 0.0  # (n-1)/n of the scattered [T, hidden]


def layer_costs(shape: Shape, layout: Layout, phase: Phase, ops: Callable, comm, gather=None, scatter=None,
                attn_comm=None) -> Costs:
    T, dp, N, A = phase.tokens, layout.dp, layout.tp, layout.attn_tp
    local = T / dp
    attn_op = "attention_prefill" if phase.kind == "prefill" else "attention_decode"
    nbytes = T * shape.hidden * BF16
    sequences = phase.batch  # logits only for each sequence's last token
    return Costs(
        attn=ops(attn_op, local, phase.context, A),
        shared=ops("shared_experts", T, 0, N) if shape.shared else 0.0,
        routed=ops("routed_experts", T, 0, N),
        dense=ops("dense_mlp", T, 0, N),
        norm=ops("norm_add", local, 0, A),
        norm_rows=ops("norm_add", T, 0, N) if dp > 1 else ops("norm_add", local, 0, A),
        head=ops("head", sequences / dp, 0, A),
        ar_layer=comm.us(nbytes),
        ar_attn=(attn_comm or comm).us(nbytes / dp) if dp > 1 and A > 1 else 0.0,
        gather=gather.us(nbytes) if gather else comm.us(nbytes) / 2,
        scatter=scatter.us(nbytes) if scatter else comm.us(nbytes) / 2,
        lb_ar=2 * (N - 1) / N * nbytes,
        lb_attn=2 * (A - 1) / A * nbytes / dp if dp > 1 else 0.0,
        lb_gather=(N - 1) / N * nbytes,
        lb_scatter=(N - 1) / N * nbytes,
    )


def stock_program(shape: Shape, c: Costs, dp: bool) -> Program:
    """Stock DeepSeek-V3 in SGLang: every collective blocks where it is issued. DP attention:
    the attention-TP AR of the local rows (attention TP > 1), the MoE input all-gathered, the
    MoE (or dense MLP) output reduce-scattered back to the DP ranks."""
    p = Program()
    for k in range(shape.layers):
        p.compute("norm", c.norm, k)
        p.compute("attention", c.attn, k)
        if not dp:
            p.blocking("AR(a)", c.ar_layer, k, c.lb_ar)
        elif c.ar_attn:
            p.blocking("AR_attn(a)", c.ar_attn, k, c.lb_attn)
        p.compute("norm", c.norm, k)
        if dp:
            p.blocking("AG(x)", c.gather, k, c.lb_gather)
        if shape.is_moe(k):
            p.compute("shared", c.shared, k)
            p.compute("routed", c.routed, k)
        else:
            p.compute("dense_mlp", c.dense, k)
        if dp:
            p.blocking("RS(s+r)", c.scatter, k, c.lb_scatter)
        else:
            p.blocking("AR(s+r)", c.ar_layer, k, c.lb_ar)
    p.compute("norm", c.norm, shape.layers)
    return p


def farskip_program(shape: Shape, c: Costs, blocking: bool, dp: bool = False) -> Program:
    """The FarSkip forward of schedule.py (layer_step, tests/test_schedule.py checks it): the same launches and waits in the
    same order; `blocking` waits each collective where it is launched (sync).

    `dp` (DP attention, docs/dp-attention.md, parallel.DpRows): the residual holds all T rows of
    the group on every rank, so the program is the same: every lane is one AR of [T, hidden]
    over the group (the attention partial of the local rows, placed in its rows, rides the A
    lane; no attention-TP AR of its own), norms run on all T rows, and one exposed AR gathers
    the embeddings before layer 0."""
    p, fs = Program(), shape.farskip
    X, B = c.ar_layer, c.lb_ar
    issue = (lambda label, us, k: p.blocking(label, us, k, B)) if blocking else \
        (lambda label, us, k: p.launch(label, us, k, B))
    if dp:
        p.blocking("AR(embed)", X, -1, B)  # [T/dp] -> [T] rows: waited before layer 0's norm
    attn_lane = routed_lane = None
    for k in range(shape.layers):
        if fs.attn_skips_prev_routed(k):
            p.wait(attn_lane)  # x = h[k-1] - r[k-1]
        else:
            p.wait(attn_lane, routed_lane)  # the full h[k-1]
            routed_lane = None
        p.compute("norm", c.norm_rows, k)
        p.compute("attention", c.attn, k)
        if fs.mlp_skips_attn(k):
            p.wait(routed_lane)  # MLP input h[k-1]
            label = "AR(a+s)"
        else:
            a = issue("AR(a)", X, k)
            p.wait(routed_lane, a)  # MLP input h[k-1] + a[k]
            label = "AR(s)"
        routed_lane = None
        p.compute("norm", c.norm_rows, k)
        if not shape.is_moe(k):  # the dense output rides the A lane, read by the next attention
            p.compute("dense_mlp", c.dense, k)
            attn_lane = issue(label, X, k)
            continue
        p.compute("shared", c.shared, k)
        attn_lane = issue(label, X, k)
        p.compute("routed", c.routed, k)
        routed_lane = issue("AR(r)", X, k)
    p.wait(attn_lane, routed_lane)  # the final norm reads the full h[L-1]
    p.compute("norm", c.norm_rows, shape.layers)
    return p


# ================================================================== simulation
@dataclasses.dataclass
class Collective:
    cid: int
    label: str
    layer: int
    us: float
    window_us: float = 0.0  # compute issued between launch and wait (no contention)
    window_ops: tuple = ()
    stall_us: float = 0.0  # time the compute stream waited for it
    link_bytes: float = 0.0  # bytes through each rank's link (ring algorithm)


@dataclasses.dataclass
class Run:
    step_us: float
    compute_us: float
    contention_us: float
    collectives: list

    @property
    def comm_us(self) -> float:
        return sum(c.us for c in self.collectives)

    @property
    def exposed_us(self) -> float:
        return sum(c.stall_us for c in self.collectives)

    @property
    def link_bytes(self) -> float:
        return sum(c.link_bytes for c in self.collectives)

    @property
    def hidden(self) -> float:
        return max(0.0, 1 - self.exposed_us / self.comm_us) if self.comm_us else 1.0


def _advance(t: float, work: float, busy: list, keep: float) -> float:
    """End of `work` us of compute started at t, running at `keep` of full speed while a
    collective is in flight (busy: disjoint (start, end) intervals in order)."""
    for start, end in busy:
        if end <= t:
            continue
        if start > t:
            if work <= start - t:
                return t + work
            work -= start - t
            t = start
        capacity = (end - t) * keep
        if work <= capacity:
            return t + work / keep
        work -= capacity
        t = end
    return t + work


def simulate(program: Program, contention: float, extra_us: float = 0.0) -> Run:
    keep = 1.0 - contention
    t = comm_free = compute = 0.0
    busy: list = []
    colls: dict[int, Collective] = {}
    ends: dict[int, float] = {}
    pending: dict[int, list] = {}  # launched, not yet waited: compute ops seen meanwhile
    for ins in program.ins:
        if ins.kind == "compute":
            t_end = _advance(t, ins.us, busy, keep)
            compute += ins.us
            t = t_end
            for ops in pending.values():
                ops.append(ins)
        elif ins.kind == "launch":
            start = max(t, comm_free)
            comm_free = ends[ins.cid] = start + ins.us
            if ins.us > 0:
                busy.append((start, comm_free))
            colls[ins.cid] = Collective(ins.cid, ins.name, ins.layer, ins.us, link_bytes=ins.link_bytes)
            pending[ins.cid] = []
        else:
            c, seen = colls[ins.cid], pending.pop(ins.cid)
            c.window_us = sum(i.us for i in seen)
            c.window_ops = tuple(dict.fromkeys(f"{i.name}[{i.layer}]" for i in seen if i.us > 0))
            c.stall_us = max(0.0, ends[ins.cid] - t)
            t += c.stall_us
    if pending:
        raise AssertionError(f"collectives never waited: {sorted(pending)}")  # a schedule bug
    step = t + extra_us
    stretched = step - compute - extra_us - sum(c.stall_us for c in colls.values())
    return Run(step, compute + extra_us, max(0.0, stretched), sorted(colls.values(), key=lambda c: c.cid))


# ================================================================== plan
@dataclasses.dataclass
class Prediction:
    shape: Shape
    layout: Layout
    phase: Phase
    costs: Costs
    contention: float
    runs: dict  # "stock" | "sync" | "overlap" -> Run
    ideal: Run  # overlap at contention 0
    ops_label: str
    comm_label: str

    @property
    def f(self) -> float:
        s = self.runs["stock"]
        return s.exposed_us / s.step_us

    def speedup(self, of: str = "overlap", over: str = "stock") -> float:
        return self.runs[over].step_us / self.runs[of].step_us

    @property
    def windowed_share(self) -> float:
        """The structural ceiling on the hidden fraction: communication with any window."""
        cs = self.ideal.collectives
        total = sum(c.us for c in cs)
        return sum(c.us for c in cs if c.window_us > 0) / total if total else 1.0

    @property
    def windowed_count(self) -> tuple[int, int]:
        cs = self.ideal.collectives
        return sum(1 for c in cs if c.window_us > 0), len(cs)


def make_plan(shape: Shape, layout: Layout, phase: Phase, ops, comm, contention: float, *,
              overhead_us: float = 0.0, gather=None, scatter=None, attn_comm=None) -> Prediction:
    if not 0 <= contention < 1:
        raise UserError(f"--contention {contention}: must be in [0, 1)")
    c = layer_costs(shape, layout, phase, ops, comm, gather, scatter, attn_comm)
    dp = layout.dp > 1
    extra = c.head + overhead_us
    runs = {"stock": simulate(stock_program(shape, c, dp), contention, extra),
            "sync": simulate(farskip_program(shape, c, True, dp), contention, extra),
            "overlap": simulate(farskip_program(shape, c, False, dp), contention, extra)}
    ideal = runs["overlap"] if contention == 0 else simulate(farskip_program(shape, c, False, dp), 0.0, extra)
    return Prediction(shape, layout, phase, c, contention, runs, ideal, ops.label, f"{comm.name}: {comm.source}")


def calibrate_to_sync_f(plan: Prediction, f: float, ops, comm, overhead_us: float, extra: dict) -> Prediction:
    """Scale every collective by one factor so that the sync run's exposed share is the measured
    f (a sync-mode profile gives it); compute keeps its per-op times. Ratios depend only on these
    proportions, so this predicts overlap/sync from a sync measurement alone."""
    if not 0 < f < 1:
        raise UserError(f"--sync-f {f}: must be in (0, 1)")
    sync = plan.runs["sync"]
    if not sync.comm_us:
        raise UserError("--sync-f: the layout has no collectives to scale")
    factor = f * (sync.step_us - sync.exposed_us) / ((1 - f) * sync.exposed_us)
    scaled = {k: (v.scaled(factor, "") if v else None) for k, v in extra.items()}
    out = make_plan(plan.shape, plan.layout, plan.phase, ops, comm.scaled(factor, f"x{factor:.3g} (sync f {f:g})"),
                    plan.contention, overhead_us=overhead_us, **scaled)
    return out


def check_layout(shape: Shape, layout: Layout) -> None:
    if layout.tp < 1 or layout.dp < 1 or layout.tp % layout.dp:
        raise UserError(f"--dp {layout.dp} must divide --tp {layout.tp}")
    if shape.heads % layout.attn_tp:
        raise UserError(f"{shape.name}: {shape.heads} attention heads do not split over attention TP {layout.attn_tp}")
    if shape.experts % layout.tp:
        raise UserError(f"{shape.name}: {shape.experts} routed experts do not split over EP {layout.tp}")
