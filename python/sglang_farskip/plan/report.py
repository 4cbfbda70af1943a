"""What the planner prints and writes: a plan as text and JSON, its plot, the built-in listing,
the fit table (--fit) and the paper's two layouts (--paper)."""

from __future__ import annotations

import dataclasses

from sglang_farskip.plan import memory
from sglang_farskip.plan.collectives import BUILTIN_CLUSTERS
from sglang_farskip.plan.hardware import BUILTIN_GPUS, Roofline
from sglang_farskip.plan.shapes import BUILTIN_MODELS, Shape, load_shape
from sglang_farskip.plan.simulation import Collective, Layout, Phase, Prediction, make_plan


# ================================================================== output
def _ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us >= 10000 else f"{us / 1000:.3f}"


def _verdict(c: Collective, is_last: bool) -> str:
    if c.label == "AR(embed)":
        return "exposed: gathers every DP rank's embeddings before layer 0, once per forward"
    if c.window_us <= 0:
        return "exposed: the last routed collective, nothing left to hide behind" if is_last else "exposed: waited at once"
    if c.stall_us <= 1e-9:
        return "hidden"
    if c.window_us < c.us:
        return f"window shorter than the collective: {c.stall_us:.0f} us exposed"
    return f"{c.stall_us:.0f} us exposed (queued behind the previous collective or slowed compute)"


def shape_is_moe(plan: Prediction, layer: int) -> bool:
    return 0 <= layer < plan.shape.layers and plan.shape.is_moe(layer)


def layer_view(plan: Prediction) -> list[dict]:
    """One row per group of consecutive layers whose collectives fare alike (overlap run)."""
    run, last = plan.runs["overlap"], plan.runs["overlap"].collectives[-1].cid
    by_layer: dict[int, list] = {}
    for c in run.collectives:
        by_layer.setdefault(c.layer, []).append(c)
    rows: list[dict] = []
    for k in sorted(by_layer):
        items = tuple((c.label, round(c.us, 1), "+".join(sorted({o.split("[")[0] for o in c.window_ops})) or "-",
                       round(c.window_us, 1), round(c.stall_us, 1), _verdict(c, c.cid == last))
                      for c in by_layer[k])
        if rows and rows[-1]["items"] == items and rows[-1]["last"] == k - 1:
            rows[-1]["last"] = k
        else:
            rows.append({"first": k, "last": k, "items": items})
    return rows


def format_plan(plan: Prediction) -> str:
    s, L = plan.shape, plan.layout
    out = [f"{s.name}, {plan.phase.label()}, TP/EP {L.tp}" + (f" (DP attention {L.dp}, attention TP {L.attn_tp})" if L.dp > 1 else "")
           + f", {L.nodes} node{'s' if L.nodes > 1 else ''}, contention {plan.contention:.2f}",
           f"  per-op times: {plan.ops_label}", f"  all-reduce:   {plan.comm_label}"]
    if s.farskip_assumed:
        out.append("  note: the config is not FarSkip; planned as if every layer were converted")
    c, dp = plan.costs, L.dp > 1
    if dp:
        T = plan.phase.tokens
        out.append(f"  per layer, us: attention ({T / L.dp:g} local rows) {c.attn:.1f}  shared {c.shared:.1f}  routed "
                   f"{c.routed:.1f}  dense MLP {c.dense:.1f}  norm+add {c.norm:.1f} ({T / L.dp:g} rows), "
                   f"{c.norm_rows:.1f} ({T} rows)")
        out.append(f"  collectives, us: FarSkip AR of {T} x hidden over {L.tp} ranks {c.ar_layer:.1f};  stock "
                   + (f"AR_attn of {T / L.dp:g} x hidden over {L.attn_tp} {c.ar_attn:.1f}, " if c.ar_attn else "")
                   + f"AG(x) {c.gather:.1f}, RS {c.scatter:.1f}")
    else:
        out.append(f"  per layer, us: attention {c.attn:.1f}  shared {c.shared:.1f}  routed {c.routed:.1f}  dense MLP "
                   f"{c.dense:.1f}  norm+add {c.norm:.1f}  AR {c.ar_layer:.1f}")
    out.append(f"  {'mode':<8} {'step ms':>9} {'compute':>9} {'exposed':>9} {'contention':>10} {'collectives':>11} "
               f"{'hidden':>7} {'MB/rank':>8}")
    for mode, r in plan.runs.items():
        out.append(f"  {mode:<8} {_ms(r.step_us):>9} {_ms(r.compute_us):>9} {_ms(r.exposed_us):>9} "
                   f"{_ms(r.contention_us):>10} {len(r.collectives):>11} {r.hidden:>6.1%} {r.link_bytes / 1e6:>8.1f}")
    n_win, n_all = plan.windowed_count
    out.append(f"  speed-up overlap/stock {plan.speedup():.3f}x, overlap/sync {plan.speedup(over='sync'):.3f}x, "
               f"sync/stock {plan.speedup('sync', 'stock'):.3f}x")
    out.append(f"  stock f {plan.f:.3f}: bound 1/(1-f) {1 / (1 - plan.f):.3f}x, link bound "
               f"{1 / max(plan.f, 1 - plan.f):.3f}x; schedule ceiling (contention 0) "
               f"{plan.runs['stock'].step_us / plan.ideal.step_us:.3f}x")
    out.append(f"  windows: {n_win} of {n_all} collectives ({n_win / n_all:.1%}); ceiling on hidden "
               f"{plan.windowed_share:.1%} of communication time")
    if dp:
        fs, st = plan.runs["overlap"], plan.runs["stock"]
        out.append(f"  DP attention: FarSkip moves {fs.link_bytes / st.link_bytes:.2f}x stock's link bytes "
                   f"(collectives {fs.comm_us / 1000:.3f} ms a step, stock's {st.comm_us / 1000:.3f} ms, every one "
                   f"exposed); overlap floor max(compute, collectives) {_ms(max(fs.compute_us, fs.comm_us))} ms")
        stock_moe = [x for x in st.collectives if shape_is_moe(plan, x.layer)]
        per = {}
        for x in stock_moe:
            per.setdefault(x.label, x.us)
        out.append("  stock DP, every MoE layer (all blocking, nothing hidden): "
                   + " + ".join(f"{lab} {us:.1f}" for lab, us in per.items()) + " us")
        out.append("  FarSkip DP, per layer: A lane = AR(attention partial in own rows + shared) hides behind the "
                   "routed experts; R lane = AR(routed) behind the next layer's norm + attention (local rows)")
    out.append("  per layer (overlap): collective us | window (compute between launch and wait) us | exposed us | verdict")
    for row in layer_view(plan):
        span = "embeddings" if row["first"] < 0 else f"layer {row['first']}" if row["first"] == row["last"] else \
            f"layers {row['first']}-{row['last']} ({row['last'] - row['first'] + 1})"
        for i, (label, us, ops, win, stall, verdict) in enumerate(row["items"]):
            out.append(f"    {span if i == 0 else '':<20} {label:<13} {us:>9.1f} | {ops:<16} {win:>9.1f} | {stall:>8.1f} | {verdict}")
    return "\n".join(out)


def plan_json(plan: Prediction) -> dict:
    n_win, n_all = plan.windowed_count
    return {
        "model": plan.shape.name, "farskip": plan.shape.farskip.to_hf_keys(),
        "farskip_assumed": plan.shape.farskip_assumed,
        "layout": dataclasses.asdict(plan.layout), "phase": dataclasses.asdict(plan.phase),
        "contention": plan.contention, "per_op_source": plan.ops_label, "comm_source": plan.comm_label,
        "costs_us": dataclasses.asdict(plan.costs),
        "modes": {m: {"step_us": r.step_us, "compute_us": r.compute_us, "exposed_comm_us": r.exposed_us,
                      "contention_us": r.contention_us, "comm_us": r.comm_us, "collectives": len(r.collectives),
                      "hidden": r.hidden, "link_bytes_per_rank": r.link_bytes} for m, r in plan.runs.items()},
        "speedup_overlap_vs_stock": plan.speedup(), "speedup_overlap_vs_sync": plan.speedup(over="sync"),
        "f_stock": plan.f, "bound": 1 / (1 - plan.f), "link_bound": 1 / max(plan.f, 1 - plan.f),
        "schedule_ceiling": plan.runs["stock"].step_us / plan.ideal.step_us,
        "windowed": [n_win, n_all], "hidden_ceiling": plan.windowed_share,
        "per_collective": [dataclasses.asdict(c) for c in plan.runs["overlap"].collectives],
    }


def plot_plans(plans: list[Prediction], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{p.phase.kind[0]}{p.phase.tokens if p.phase.kind == 'prefill' else p.phase.batch}" for p in plans]
    width = 0.27
    for j, mode in enumerate(("stock", "sync", "overlap")):
        xs = [i + (j - 1) * width for i in range(len(plans))]
        comp = [p.runs[mode].compute_us / 1000 for p in plans]
        expo = [p.runs[mode].exposed_us / 1000 for p in plans]
        cont = [p.runs[mode].contention_us / 1000 for p in plans]
        left.bar(xs, comp, width, color=f"C{j}", label=f"{mode} compute")
        left.bar(xs, expo, width, bottom=comp, color=f"C{j}", alpha=0.45, hatch="//", label=f"{mode} exposed comm")
        left.bar(xs, cont, width, bottom=[a + b for a, b in zip(comp, expo)], color="grey", alpha=0.6,
                 label="contention" if j == 2 else None)
    left.set_xticks(range(len(plans)), names)
    left.set_ylabel("step time, ms")
    left.set_title(f"{plans[0].shape.name}, TP/EP {plans[0].layout.tp}")
    left.legend(fontsize=7)
    p = plans[-1]
    run = p.runs["overlap"]
    layers = sorted({c.layer for c in run.collectives})
    routed = {"AR(r)"}
    r_lane = [sum(c.stall_us for c in run.collectives if c.layer == k and c.label in routed) / 1000 for k in layers]
    others = [sum(c.stall_us for c in run.collectives if c.layer == k and c.label not in routed) / 1000 for k in layers]
    right.bar(layers, r_lane, color="C3", label="R lane exposed")
    right.bar(layers, others, bottom=r_lane, color="C0", label="other collectives exposed")
    right.set_xlabel("layer")
    right.set_ylabel("exposed communication, ms")
    right.set_title(f"overlap, {names[-1]}: {p.speedup():.2f}x vs stock, hidden {run.hidden:.0%}")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================== the paper's layouts
PAPER = [
    {"title": "DeepSeek-V3 prefill (TTFT), EP8/TP8 one node, batch 32 x 2048 tokens",
     "published": "up to 1.34x (v2, Fig. 6); 1.326x (v3 abstract, '32.6%'); 97.3% of prefill communication hidden",
     "claim": 1.34,
     "tp": 8, "nodes": 1, "phase": Phase("prefill", 32 * 2048, 2048, 32),
     "hardware": [("MI300X", "bf16"), ("MI325X", "bf16"), ("MI300X", "fp8")],
     "clusters": [("mi300x-xgmi", 1.0)]},
    {"title": "DeepSeek-V3 decode (ITL), EP16/TP16 two nodes, batch 1024, context 258",
     "published": "up to 1.25x (v2, Fig. 7)",
     "claim": 1.25,
     "tp": 16, "nodes": 2, "phase": Phase("decode", 1024, 258, 1024),
     "hardware": [("MI300X", "bf16"), ("MI300X", "fp8")],
     "clusters": [("amd-good", 1.0), ("amd-poor", 1.0), ("amd-good", 0.5)]},
]


def paper_report(contentions=(0.0, 0.15, 0.30)) -> tuple[str, list]:
    shape = load_shape("deepseek-v3")
    lines, records = [], []
    for case in PAPER:
        layout = Layout(case["tp"], 1, case["nodes"])
        lines += [case["title"], f"  published: {case['published']}",
                  f"  {'GPU dtype':<13} {'all-reduce table':<22} {'X us':>6} {'stock ms':>9} "
                  + " ".join(f"{'g=' + format(g, '.2f'):>7}" for g in contentions) + f" {'f':>6} {'hidden':>7}"]
        inside = []
        for gpu, dtype in case["hardware"]:
            ops = Roofline(shape, BUILTIN_GPUS[gpu], dtype)
            for cname, factor in case["clusters"]:
                comm = BUILTIN_CLUSTERS[cname]
                comm = comm if factor == 1.0 else comm.scaled(factor, f"x{factor:g}")
                plans = [make_plan(shape, layout, case["phase"], ops, comm, g) for g in contentions]
                x = plans[0].costs.ar_layer
                lines.append(f"  {gpu + ' ' + dtype:<13} {comm.name:<22} {x:>6.0f} {_ms(plans[0].runs['stock'].step_us):>9} "
                             + " ".join(f"{p.speedup():>6.2f}x" for p in plans)
                             + f" {plans[0].f:>6.3f} {plans[0].runs['overlap'].hidden:>6.1%}")
                records.append({"case": case["title"], "gpu": gpu, "dtype": dtype, "cluster": comm.name,
                                "ar_us": x, "stock_ms": plans[0].runs["stock"].step_us / 1000, "f": plans[0].f,
                                "hidden": plans[0].runs["overlap"].hidden,
                                "speedup": {str(g): p.speedup() for g, p in zip(contentions, plans)}})
                if min(p.speedup() for p in plans) <= case["claim"] <= max(p.speedup() for p in plans):
                    inside.append(f"{gpu} {dtype} / {comm.name}")
        lines.append(f"  {case['claim']:.2f}x lies between g=0 and g={contentions[-1]:.2f} for: "
                     + ("; ".join(inside) if inside else "none of these rows"))
        lines.append("")
    lines.append("Speed-up = stock step / FarSkip-overlap step (the paper's baseline is the stock model), per-op "
                 "times from the roofline of docs/planner.md, g = contention (overlapped compute keeps 1-g "
                 "of its speed). 'hidden' is at g = 0; the ceiling is 115 of 119 ARs (96.6%).")
    return "\n".join(lines), records


def listing() -> str:
    out = ["models: " + ", ".join(BUILTIN_MODELS), "clusters (all_reduce us at 14 KB ... 940 MB):"]
    out += [f"  {c.name:<12} {c.ranks} ranks  {', '.join(f'{t:g}' for _, t in c.points)}\n      {c.source}"
            for c in BUILTIN_CLUSTERS.values()]
    out += ["GPUs (roofline peaks; memory):"] + [
        f"  {g.name:<7} {g.tflops_bf16:g}/{g.tflops_fp8:g} TFLOP/s bf16/fp8, {g.tbs:g} TB/s ({g.source}); "
        f"{g.hbm_gb} GB datasheet, {memory.size(g.hbm_bytes)} counted ({g.hbm_source})" for g in BUILTIN_GPUS.values()]
    return "\n".join(out)


# The layouts of issue 35's question, and one node of H100 and of MI325X beside them.
FIT_LAYOUTS = (("H200", 8), ("H100", 16), ("MI300X", 8), ("H100", 8), ("MI325X", 8))


def fit_table(shape: Shape) -> tuple[str, list[memory.Fit]]:
    fits = [memory.fit(shape, fmt, gpu, BUILTIN_GPUS[gpu].hbm_bytes, n)
            for gpu, n in FIT_LAYOUTS for fmt in memory.FORMATS]
    w = {f.weights.fmt: f.weights for f in fits}
    out = [f"{shape.name}: {w['bf16'].params_text()}; weights bf16 {memory.size(w['bf16'].nbytes)}, fp8 (DeepSeek's "
           f"block FP8) {memory.size(w['fp8'].nbytes)}; KV cache {fits[0].kv_token:,} B per token (MLA latent, bf16)",
           f"  {'GPUs':<12} {'format':<6} {'weights/GPU':>11} {'usable/GPU':>10} {'KV/GPU':>9} {'KV tokens':>10}  verdict"]
    for f in fits:
        kv = (memory.size(f.kv_per_gpu), f"{f.tokens:,}") if f.fits else ("-", "-")
        out.append(f"  {f'{f.gpus} x {f.gpu}':<12} {f.weights.fmt:<6} {memory.size(f.per_gpu):>11} "
                   f"{memory.size(f.usable):>10} {kv[0]:>9} {kv[1]:>10}  "
                   f"{'fits' if f.fits else 'does not fit'}")
    out.append(f"Usable = {1 - memory.HEADROOM:.0%} of each GPU's memory (--list: sizes, sources); weights split "
               "evenly over the GPUs, MTP included; KV tokens under TP attention (each rank holds every token's "
               "latent). docs/planner.md, Memory.")
    return "\n".join(out), fits
