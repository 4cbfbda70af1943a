"""The planner's prefill/decode (PD) disaggregation view: TTFT and ITL of a deployment that
prefills on one layout and decodes on another, next to a colocated server on each layout.

    python -m sglang_farskip.plan --pd                  # the paper's layouts: prefill EP8/TP8 on one
                                                        # node, decode EP16/TP16 on two
    python -m sglang_farskip.plan --pd --gpu H200 --dtype fp8 --prefill 4096 --batch 1 \\
        --decode 64 --context 4096 --prefill-cluster h200_1node.txt --decode-cluster nv-ib

Per mode (stock, FarSkip overlap), with step times from simulation.make_plan, the replay every
other plan uses:

    colocated on layout X     TTFT = prefill step on X              ITL = decode step on X
    PD, prefill P, decode D   TTFT = prefill step on P + transfer   ITL = decode step on D

The first token is sampled by the prefill forward in both cases (SGLang's decode server emits
it from the transferred request without a forward), so TTFT has no decode step.

KV transfer, as SGLang 0.5.23 moves it (python/sglang/srt/disaggregation/):

- When: after the forward that completes a request, all layers at once
  (process_batch_result_disagg_prefill -> send_kv_chunk(last_chunk=True), prefill.py:1073),
  queued to transfer threads (mooncake/conn.py:2488). A chunk of a longer prompt is sent after
  that chunk's forward (prefill.py:1125, :1444). Nothing is sent layer by layer inside a
  forward, so for a batch that is one forward (the planner's phase; SGLang with
  --chunked-prefill-size -1, as the paper ran, or a batch within one chunk: 8192 tokens on
  80-160 GB cards, 16384 above, arg_groups/memory_hook.py:139-167) the transfer adds to TTFT in
  full. With chunking, earlier chunks' KV moves while later chunks compute: this model then
  overstates TTFT by up to the transfer of all but the last chunk.
- What: MLA keeps the whole latent of every token on each attention-TP rank, and every decode
  rank pulls one full copy from one prefill rank (_resolve_rank_mapping, common/conn.py:1432):
  with decode TP d >= prefill TP p each prefill rank serves d/p decode ranks (:1457-1466), one
  after the other (mooncake/conn.py:2580); with d < p one prefill rank of every p/d sends
  (:1485).
- Over: each GPU's own RDMA NIC (GPUDirect; H100, H200 and MI300X nodes carry one 400 Gb/s NIC
  per GPU). The busiest NIC is a prefill rank's, carrying max(1, d/p) copies:

      transfer = batch x prompt x KV bytes per token x max(1, d/p) x 8 / (--kv-link-gbps x 1e9) s

  KV bytes per token is memory.kv_bytes_per_token (MLA latent, bf16: 70,272 B for DeepSeek-V3).

Not modelled: queueing, the router, the bootstrap handshake, prefill batching policy and
chunked prefill's overlap, the decode server's wait for its current step before it picks a
request up, prefill interference in the colocated server's ITL, DP attention (each DP rank
then holds its own requests' KV), the link's efficiency (pass an achieved rate).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

from sglang_farskip.errors import UserError
from sglang_farskip.plan import memory
from sglang_farskip.plan.flags import (GPUS_PER_NODE, cluster_for, default_cluster, default_nodes, dtype_source,
                                      make_ops, sizes)
from sglang_farskip.plan.hardware import BUILTIN_GPUS
from sglang_farskip.plan.report import PAPER, plan_json
from sglang_farskip.plan.shapes import Shape, load_shape
from sglang_farskip.plan.simulation import Layout, Phase, Prediction, check_layout, make_plan

MODES = ("stock", "overlap")  # the paper's baseline and the FarSkip schedule the server runs
KV_LINK_GBPS = 400.0  # per GPU: one 400 Gb/s RDMA NIC per GPU, as on the paper's nodes (8 x 400 Gb/s)
_PREFILL_CASE, _DECODE_CASE = PAPER  # the paper's two runs: its layouts are --pd's defaults


@dataclasses.dataclass(frozen=True)
class Server:
    """One SGLang server: TP = EP over `tp` GPUs of `gpu` on `nodes` nodes, all-reduce table `cluster`."""

    tp: int
    nodes: int
    gpu: str
    cluster: str

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, 1, self.nodes)

    def label(self) -> str:
        return f"EP{self.tp}/TP{self.tp} {self.nodes} node{'s' if self.nodes > 1 else ''}"


# ================================================================== KV transfer
def kv_copies(prefill_tp: int, decode_tp: int) -> int:
    """Copies of a request's KV through the busiest NIC (the module docstring's rank mapping)."""
    if decode_tp % prefill_tp and prefill_tp % decode_tp:
        raise UserError(f"--prefill-tp {prefill_tp} and --decode-tp {decode_tp}: one must divide the other "
                        "(SGLang maps decode ranks onto prefill ranks by that ratio)")
    return max(1, decode_tp // prefill_tp)


def transfer_us(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9) * 1e6


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The KV cache of one prefill forward's `batch` requests of `prompt` tokens, prefill -> decode."""

    kv_token: int  # bytes per token, all layers
    prompt: int
    batch: int
    copies: int
    gbps: float  # per GPU

    @property
    def request_bytes(self) -> int:
        return self.prompt * self.kv_token

    @property
    def link_bytes(self) -> int:
        """Through the busiest NIC: the whole batch shares it, as its sends follow one forward."""
        return self.batch * self.request_bytes * self.copies

    @property
    def us(self) -> float:
        return transfer_us(self.link_bytes, self.gbps)


# ================================================================== rows
@dataclasses.dataclass
class Row:
    name: str
    prefill: Prediction  # the forward behind TTFT
    decode: Prediction  # the step behind ITL
    transfer: Optional[Transfer] = None  # PD only

    def ttft_us(self, mode: str) -> float:
        return self.prefill.runs[mode].step_us + (self.transfer.us if self.transfer else 0.0)

    def itl_us(self, mode: str) -> float:
        return self.decode.runs[mode].step_us

    def ttft_speedup(self) -> float:
        return self.ttft_us("stock") / self.ttft_us("overlap")

    def itl_speedup(self) -> float:
        return self.itl_us("stock") / self.itl_us("overlap")


Step = Callable[[Server, Phase], Prediction]


def predict(pre: Server, dec: Server, prefill: Phase, decode: Phase, transfer: Transfer,
            step: Step) -> list[Row]:
    """Colocated on the prefill layout, colocated on the decode layout, and PD across them;
    each (server, phase) is planned once and shared by the rows that read it."""
    plans: dict = {}

    def at(server, phase):
        key = (server, phase)
        if key not in plans:
            plans[key] = step(server, phase)
        return plans[key]

    return [Row(f"colocated {pre.label()}", at(pre, prefill), at(pre, decode)),
            Row(f"colocated {dec.label()}", at(dec, prefill), at(dec, decode)),
            Row(f"PD {pre.label()} -> {dec.label()}", at(pre, prefill), at(dec, decode), transfer)]


# ================================================================== memory per side
def kv_need_line(fit: memory.Fit, prefill: Phase, decode: Phase) -> str:
    """Whether the layout's KV room holds each phase's tokens: a colocated server needs both."""
    need = {"the prefill batch": prefill.tokens, "the decode batch": decode.batch * decode.context}
    held = [f"{what} needs {n:,} ({'held' if n <= fit.tokens else 'NOT held'})" for what, n in need.items()]
    return f"    KV room {fit.tokens:,} tokens: " + "; ".join(held)


def memory_lines(shape: Shape, dtype: str, sides: list[tuple[str, Server]], prefill: Phase,
                 decode: Phase) -> tuple[list[str], list[dict]]:
    lines, records = [], []
    for role, server in sides:
        gpu = BUILTIN_GPUS[server.gpu]
        fit = memory.fit(shape, dtype, gpu.name, gpu.hbm_bytes, server.tp)
        lines += [f"  {role} ({server.label()}): {fit.verdict()}", kv_need_line(fit, prefill, decode)]
        records.append(dict(fit.as_json(), role=role, layout=server.label()))
    return lines, records


# ================================================================== output
def _ms(us: float) -> str:
    return f"{us / 1000:.1f}"


def format_table(shape: Shape, rows: list[Row], transfer: Transfer) -> list[str]:
    p, d = rows[-1].prefill, rows[-1].decode
    W = max(len(r.name) for r in rows)
    out = [f"{shape.name}: prefill/decode disaggregation against a colocated server on each layout",
           f"  prefill {p.phase.batch} x {p.phase.context} tokens (one forward); decode batch {d.phase.batch}, "
           f"context {d.phase.context}; contention {p.contention:.2f}",
           f"  per-op times: {p.ops_label}" + ("" if p.ops_label == d.ops_label else f"; decode side {d.ops_label}"),
           f"  all-reduce: prefill side {p.comm_label}", f"              decode side {d.comm_label}",
           f"  {'':<{W}} {'TTFT ms':-^28} {'ITL ms':-^26} {'KV MB':>8} {'transfer':>9}",
           f"  {'layout':<{W}} {'stock':>10} {'FarSkip':>9} {'x':>7} {'stock':>9} {'FarSkip':>8} {'x':>7} "
           f"{'/request':>8} {'ms':>9}"]
    for r in rows:
        kv = (f"{r.transfer.request_bytes / 1e6:>8.1f} {r.transfer.us / 1000:>9.2f}" if r.transfer
              else f"{'-':>8} {'-':>9}")
        out.append(f"  {r.name:<{W}} {_ms(r.ttft_us('stock')):>10} {_ms(r.ttft_us('overlap')):>9} "
                   f"{r.ttft_speedup():>6.2f}x {_ms(r.itl_us('stock')):>9} {_ms(r.itl_us('overlap')):>8} "
                   f"{r.itl_speedup():>6.2f}x {kv}")
    pd = rows[-1]
    out += [f"  KV: {transfer.kv_token:,} B per token (MLA latent, bf16) x {transfer.prompt} tokens = "
            f"{transfer.request_bytes / 1e6:.1f} MB per request; the busiest NIC carries {transfer.copies} "
            f"cop{'y' if transfer.copies == 1 else 'ies'} of the KV of the forward's {transfer.batch} "
            f"request{'s' if transfer.batch > 1 else ''} ({transfer.link_bytes / 1e6:.1f} MB) at {transfer.gbps:g} "
            "Gbit/s per GPU",
            f"  PD: TTFT = prefill step + transfer (sent after the forward, not layer by layer); the prefill step "
            f"alone gains {pd.prefill.speedup():.2f}x (as colocated {rows[0].name.split(' ', 1)[1]}), the "
            f"transfer dilutes it to {pd.ttft_speedup():.2f}x; ITL is the decode layout's"]
    return out


def rows_json(rows: list[Row], transfer: Transfer) -> dict:
    return {
        "transfer": dict(dataclasses.asdict(transfer), request_bytes=transfer.request_bytes,
                         link_bytes=transfer.link_bytes, us=transfer.us),
        "rows": [{"name": r.name, "ttft_us": {m: r.ttft_us(m) for m in MODES}, "itl_us": {m: r.itl_us(m) for m in MODES},
                  "ttft_speedup": r.ttft_speedup(), "itl_speedup": r.itl_speedup(),
                  "prefill_layout": dataclasses.asdict(r.prefill.layout),
                  "decode_layout": dataclasses.asdict(r.decode.layout),
                  "transfer_us": r.transfer.us if r.transfer else 0.0} for r in rows],
    }


# ================================================================== CLI
def add_arguments(p) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (--pd; docs/planner.md)")
    g.add_argument("--pd", action="store_true", help="a PD deployment next to a colocated server on each layout")
    for side, case in (("prefill", _PREFILL_CASE), ("decode", _DECODE_CASE)):
        g.add_argument(f"--{side}-tp", type=int, help=f"--pd: the {side} server's TP = EP (default {case['tp']})")
        g.add_argument(f"--{side}-nodes", type=int, help=f"--pd: its nodes (default tp/{GPUS_PER_NODE})")
        g.add_argument(f"--{side}-cluster", help="--pd: its all-reduce table or file (default as --cluster's)")
        g.add_argument(f"--{side}-gpu", choices=sorted(BUILTIN_GPUS), help="--pd: its GPU (default --gpu)")
    g.add_argument("--kv-link-gbps", type=float, help=f"--pd: each GPU's RDMA link for the KV transfer, Gbit/s "
                   f"(default {KV_LINK_GBPS:g})")


# Flags of a plain plan with no meaning under --pd: refused rather than ignored.
_NOT_WITH_PD = ("tp", "nodes", "cluster", "link_mbit", "sync_f", "plot", "gather_cluster", "scatter_cluster",
                "attn_cluster")
_PD_ONLY = ("prefill_tp", "prefill_nodes", "prefill_cluster", "prefill_gpu", "decode_tp", "decode_nodes",
            "decode_cluster", "decode_gpu", "kv_link_gbps")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flags(args) -> None:
    """Without --pd, no PD flag; with it, none that it would ignore (cli.run calls this first)."""
    if not args.pd:
        given = [_flag(d) for d in _PD_ONLY if getattr(args, d) is not None]
        if given:
            raise UserError(f"{', '.join(given)}: only with --pd")
        return
    given = [_flag(d) for d in _NOT_WITH_PD if getattr(args, d) is not None] + (["--dp"] if args.dp != 1 else [])
    given += [_flag(d) for d in ("paper", "fit", "list") if getattr(args, d)]
    if given:
        raise UserError(f"--pd with {', '.join(given)}: not used by a PD prediction (its layouts take "
                        "--prefill-tp/--decode-tp, --prefill-nodes/--decode-nodes, --prefill-cluster/--decode-cluster; "
                        "DP attention, --link-mbit, --sync-f and --plot are not modelled under --pd)")


def _one(text: Optional[str], flag: str, default: int) -> int:
    if text is None:
        return default
    values = sizes(text, flag)
    if len(values) != 1:
        raise UserError(f"--pd {flag} {text!r}: one value (a PD prediction is one prompt and one decode batch)")
    return values[0]


def phases(args) -> tuple[Phase, Phase]:
    """The prompt, batch, decode batch and context given, the rest from the paper's two runs."""
    pre, dec = _PREFILL_CASE["phase"], _DECODE_CASE["phase"]
    prompt = _one(args.prefill, "--prefill", pre.context)
    batch = pre.batch if args.batch is None else args.batch
    decode = _one(args.decode, "--decode", dec.batch)
    context = dec.context if args.context is None else args.context
    if batch < 1 or context < 1:
        raise UserError(f"--batch {batch}, --context {context}: must be positive")
    return Phase("prefill", batch * prompt, prompt, batch), Phase("decode", decode, context, decode)


def servers(args) -> tuple[Server, Server]:
    out = []
    for side, case in (("prefill", _PREFILL_CASE), ("decode", _DECODE_CASE)):
        tp, nodes = getattr(args, f"{side}_tp"), getattr(args, f"{side}_nodes")
        tp = case["tp"] if tp is None else tp
        if tp < 1 or (nodes is not None and nodes < 1):
            raise UserError(f"--{side}-tp {tp}" + (f", --{side}-nodes {nodes}" if nodes is not None else "")
                            + ": must be positive")
        nodes = default_nodes(tp) if nodes is None else nodes
        cluster = getattr(args, f"{side}_cluster") or default_cluster(nodes)
        out.append(Server(tp, nodes, getattr(args, f"{side}_gpu") or args.gpu, cluster))
    return out[0], out[1]


def run(args) -> int:
    shape = load_shape(args.model)
    dtype = args.dtype or shape.weight_format
    pre, dec = servers(args)
    for s in (pre, dec):
        check_layout(shape, s.layout)
    if args.ops and pre.gpu != dec.gpu:
        raise UserError(f"--ops with --prefill-gpu {pre.gpu} and --decode-gpu {dec.gpu}: one per-op file "
                        "times one GPU")
    gbps = KV_LINK_GBPS if args.kv_link_gbps is None else args.kv_link_gbps
    if gbps <= 0:
        raise UserError(f"--kv-link-gbps {gbps:g}: must be positive")
    prefill, decode = phases(args)
    transfer = Transfer(memory.kv_bytes_per_token(shape), prefill.context, prefill.batch,
                        kv_copies(pre.tp, dec.tp), gbps)
    ops = {g: make_ops(args.ops, shape, BUILTIN_GPUS[g], dtype) for g in {pre.gpu, dec.gpu}}

    def step(server: Server, phase: Phase) -> Prediction:
        comm = cluster_for(server.cluster, args.ar_column, server.layout)
        return make_plan(shape, server.layout, phase, ops[server.gpu], comm, args.contention,
                              overhead_us=args.overhead_us)

    rows = predict(pre, dec, prefill, decode, transfer, step)
    mem, mem_json = memory_lines(shape, dtype, [("prefill server", pre), ("decode server", dec)], prefill, decode)
    head = f"memory, {dtype} weights ({dtype_source(args.dtype, shape)}), per layout (the colocated rows use the same):"
    print("\n".join(format_table(shape, rows, transfer) + [head] + mem))
    if args.json:
        doc = dict(rows_json(rows, transfer), memory=mem_json,
                   plans=[plan_json(p) for p in {id(p): p for r in rows for p in (r.prefill, r.decode)}.values()])
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0
