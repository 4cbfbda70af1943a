"""python -m sglang_farskip.plan: the parser and the run of a plain plan, --list, --fit, --paper;
--pd hands over to pd.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from sglang_farskip.errors import ArgumentParser, UserError, run_main
from sglang_farskip.plan import memory, pd
from sglang_farskip.plan.collectives import LinkModel, load_cluster
from sglang_farskip.plan.flags import cluster_for, default_cluster, default_nodes, dtype_source, make_ops, sizes
from sglang_farskip.plan.hardware import BUILTIN_GPUS
from sglang_farskip.plan.report import fit_table, format_plan, listing, paper_report, plan_json, plot_plans
from sglang_farskip.plan.shapes import BUILTIN_MODELS, load_shape
from sglang_farskip.plan.simulation import Layout, Phase, calibrate_to_sync_f, check_layout, make_plan

# A plain plan's defaults, applied in run() rather than by argparse: --pd has its own (pd.py)
# and must tell a flag left out from one given.
DEFAULT_TP, DEFAULT_BATCH, DEFAULT_CONTEXT = 16, 1, 2048


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m sglang_farskip.plan", description="Predict stock, FarSkip-sync and FarSkip-overlap step times on a cluster.",
        epilog="docs/planner.md: inputs, assumptions, how to measure a cluster, validation.")
    p.add_argument("--model", default="deepseek-v3",
                   help=f"built-in ({', '.join(BUILTIN_MODELS)}) or a config.json / checkpoint folder")
    p.add_argument("--tp", type=int, help=f"TP = EP group size N (default {DEFAULT_TP}; 8 or 16 for the paper's layouts)")
    p.add_argument("--dp", type=int, default=1, help="DP-attention ranks (attention TP = tp/dp); docs/dp-attention.md")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default tp/8, at least 1): picks the default cluster")
    p.add_argument("--prefill", help="prompt length(s), comma-separated, e.g. 1024,2048,4096,8192")
    p.add_argument("--decode", help="decode batch size(s), comma-separated, e.g. 1,16,256,1024 (not with --prefill, "
                   "but under --pd)")
    p.add_argument("--batch", type=int, help=f"prefill: prompts in the forward (tokens = batch x prompt; default "
                   f"{DEFAULT_BATCH})")
    p.add_argument("--context", type=int, help=f"decode: KV length per sequence (default {DEFAULT_CONTEXT})")
    p.add_argument("--cluster", help="all_reduce_perf output file or a built-in table (--list); "
                   "default mi300x-xgmi on one node, amd-good on two")
    p.add_argument("--ar-column", choices=["in", "out", "min"], default="in",
                   help="which all_reduce_perf time to use: in-place (default), out-of-place, or the smaller")
    p.add_argument("--link-mbit", type=float, help="instead of a table: a link of this many Mbit/s (CPU testbed)")
    p.add_argument("--link-latency-us", type=float, default=0.0, help="with --link-mbit: fixed cost per collective")
    p.add_argument("--gather-cluster", help="--dp, stock: all_gather_perf output (default: half the all-reduce time)")
    p.add_argument("--scatter-cluster", help="--dp, stock: reduce_scatter_perf output (default: half the all-reduce time)")
    p.add_argument("--attn-cluster", help="--dp, stock: all_reduce_perf of the attention TP group (default: --cluster)")
    p.add_argument("--ops", help="per-op JSON of the bare GPU check (default: roofline of --gpu/--dtype)")
    p.add_argument("--gpu", choices=sorted(BUILTIN_GPUS), default="MI300X",
                   help="roofline GPU, and the GPU of the memory figure")
    p.add_argument("--dtype", choices=memory.FORMATS,
                   help="weight format: the roofline's GEMM precision and the memory figure (default: the "
                   "checkpoint's, fp8 for DeepSeek's block-FP8 quantization_config, else bf16)")
    p.add_argument("--contention", type=float, default=0.0,
                   help="fraction of compute throughput lost while a collective is in flight (0.15 = 15%%)")
    p.add_argument("--overhead-us", type=float, default=0.0,
                   help="per-step time outside the layers (scheduler, sampling), the same in every mode")
    p.add_argument("--sync-f", type=float, help="scale the collectives so that FarSkip-sync's exposed share is this "
                   "measured f (e.g. from overlap_bench.py's sync profile)")
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="step-time bars per mode and the per-layer exposed time")
    p.add_argument("--paper", action="store_true", help="the paper's two headline layouts next to its figures")
    p.add_argument("--list", action="store_true", help="built-in models, clusters and GPUs")
    p.add_argument("--fit", action="store_true",
                   help="does --model fit on 8xH200, 2x8xH100, 8xMI300X, ... in bf16 and fp8 (weights, KV cache)")
    pd.add_arguments(p)
    return p


def _comm_for(args, layout: Layout):
    if args.link_mbit:
        if args.cluster:
            raise UserError("--cluster and --link-mbit: pick one")
        return LinkModel(f"link {args.link_mbit:g} Mbit/s", f"ring model, {args.link_latency_us:g} us per collective",
                         layout.tp, args.link_mbit, args.link_latency_us)
    return cluster_for(args.cluster or default_cluster(layout.nodes), args.ar_column, layout)


def run(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    pd.check_flags(args)
    if args.pd:
        return pd.run(args)
    if args.list:
        print(listing())
        return 0
    if args.fit:
        text, fits = fit_table(load_shape(args.model))
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps([f.as_json() for f in fits], indent=1))
        return 0
    if args.paper:
        text, records = paper_report()
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1))
        return 0
    shape = load_shape(args.model)
    if args.prefill and args.decode:
        raise UserError("--prefill and --decode: pick one (both only with --pd)")
    tp = DEFAULT_TP if args.tp is None else args.tp
    layout = Layout(tp, args.dp, args.nodes or default_nodes(tp))
    check_layout(shape, layout)
    comm = _comm_for(args, layout)
    extra = {k: load_cluster(v, args.ar_column) if v else None for k, v in
             (("gather", args.gather_cluster), ("scatter", args.scatter_cluster), ("attn_comm", args.attn_cluster))}
    dtype = args.dtype or shape.weight_format
    gpu = BUILTIN_GPUS[args.gpu]
    ops = make_ops(args.ops, shape, gpu, dtype)
    context = DEFAULT_CONTEXT if args.context is None else args.context
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    if args.decode:
        phases = [Phase("decode", b, context, b) for b in sizes(args.decode, "--decode")]
    else:
        phases = [Phase("prefill", batch * n, n, batch) for n in sizes(args.prefill or "2048", "--prefill")]
    plans = [make_plan(shape, layout, ph, ops, comm, args.contention, overhead_us=args.overhead_us, **extra)
             for ph in phases]
    if args.sync_f is not None:
        plans = [calibrate_to_sync_f(p, args.sync_f, ops, comm, args.overhead_us, extra) for p in plans]
    print("\n\n".join(format_plan(p) for p in plans))
    fit = memory.fit(shape, dtype, gpu.name, gpu.hbm_bytes, layout.tp, layout.dp)
    print("\n" + "\n".join(fit.report(dtype_source(args.dtype, shape))))
    if getattr(ops, "extrapolated", None):
        print(f"warning: per-op times extrapolated beyond the measured sizes: {', '.join(sorted(ops.extrapolated))}",
              file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(plan_json(p), memory=fit.as_json()) for p in plans], indent=1))
    if args.plot:
        plot_plans(plans, args.plot)
    return 0


def main(argv: Optional[list] = None) -> int:
    return run_main(run, argv)
