"""Write a run's outputs: results.json (everything), results.csv (one row per label and level),
ab_ratios.csv (A/B only: one row per compared pair and level), ttft.png and itl.png, and
report.md that ties them together, opened by its note (the machine, the targets compared, the
workload)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sglang_farskip.loadtest import plots, routers

CLIENT_COLUMNS = [
    f"{m}_{k}" for m in ("ttft", "itl", "tpot", "e2e")
    for k in ("mean_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms") + (("max_ms",) if m == "itl" else ())
]
SERVER_COLUMNS = [f"server_{m}_{k}" for m in ("ttft", "itl", "e2e") for k in ("count", "mean_ms", "p50_ms", "p99_ms")]
CSV_COLUMNS = ["label", "concurrency", "requests", "completed", "failed", "duration_s",
               "request_throughput", "output_throughput", "spec_accept_length", *CLIENT_COLUMNS,
               *SERVER_COLUMNS]
# What an A/B ratio table compares (A / B: below 1 means A is faster, except throughput).
RATIO_KEYS = [("ttft", "p50_ms"), ("ttft", "p90_ms"), ("ttft", "p99_ms"), ("itl", "p50_ms"),
              ("itl", "p90_ms"), ("itl", "p99_ms"), ("tpot", "p50_ms"), ("e2e", "p50_ms")]


def csv_row(level: dict) -> dict:
    s = level["client"]
    row = {"label": level["label"], "concurrency": level["concurrency"]}
    for key in ("requests", "completed", "failed", "duration_s", "request_throughput", "output_throughput"):
        row[key] = s[key]
    row["spec_accept_length"] = s.get("spec_accept_length")  # absent in runs saved before it
    for col in CLIENT_COLUMNS:
        metric, stat = col.split("_", 1)
        row[col] = s[metric][stat]
    server = level.get("server") or {}
    for col in SERVER_COLUMNS:
        _, metric, stat = col.split("_", 2)
        row[col] = (server.get(metric) or {}).get(stat)
    return row


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def ab_ratios(levels: list[dict], a: str, b: str) -> list[dict]:
    by_key = {(lv["label"], lv["concurrency"]): lv["client"] for lv in levels}
    rows = []
    for c in sorted({lv["concurrency"] for lv in levels}):
        sa, sb = by_key.get((a, c)), by_key.get((b, c))
        if sa is None or sb is None:
            continue  # a saved run without this level: nothing to compare
        row = {"concurrency": c}
        for metric, stat in RATIO_KEYS:
            row[f"{metric}_{stat.removesuffix('_ms')}"] = _ratio(sa[metric][stat], sb[metric][stat])
        row["output_throughput"] = _ratio(sa["output_throughput"], sb["output_throughput"])
        rows.append(row)
    return rows


def _fmt(v, digits=1):
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _client_table(levels: list[dict]) -> list[str]:
    # Accept length only where a server decodes speculatively: one column more, not a "-" per row.
    spec = any(lv["client"].get("spec_accept_length") for lv in levels)
    lines = ["| label | conc | done/failed | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 / max ms | TPOT p50 ms | E2E p50 ms |"
             + (" accept length |" if spec else ""),
             "|---|---:|---:|---:|---|---|---:|---:|" + ("---:|" if spec else "")]
    for lv in levels:
        s = lv["client"]
        t, i = s["ttft"], s["itl"]
        lines.append(
            f"| {lv['label']} | {lv['concurrency']} | {s['completed']}/{s['failed']} | {_fmt(s['output_throughput'])} "
            f"| {_fmt(t['p50_ms'])} / {_fmt(t['p90_ms'])} / {_fmt(t['p99_ms'])} "
            f"| {_fmt(i['p50_ms'])} / {_fmt(i['p90_ms'])} / {_fmt(i['p99_ms'])} / {_fmt(i['max_ms'])} "
            f"| {_fmt(s['tpot']['p50_ms'])} | {_fmt(s['e2e']['p50_ms'])} |"
            + (f" {_fmt(s.get('spec_accept_length'), 2)} |" if spec else ""))
    if spec:
        lines += ["", "Accept length: output tokens per verify step, pooled over the level's requests "
                  "(SGLang's per-request definition, completion tokens / verify steps)."]
    return lines


def _server_table(levels: list[dict]) -> list[str]:
    phases = any(ps["metrics"] for lv in levels for ps in lv.get("phase_servers") or [])
    if not any(lv.get("server") for lv in levels):
        if phases:
            return _phase_table(levels)
        return ["Server histograms: not available (start the servers with `--enable-metrics`)."]
    lines = ["Server-side `/metrics` histograms over the same interval (mean exact; p50 interpolated "
             "inside histogram buckets, so only as fine as the buckets):", "",
             "| label | conc | TTFT mean / p50 ms (client p50) | ITL mean / p50 ms (client mean / p50) | E2E mean ms (client mean) |",
             "|---|---:|---|---|---|"]
    for lv in levels:
        sv, s = lv.get("server"), lv["client"]
        if lv.get("phase_servers"):
            continue  # a router target: its servers' rows follow, in the next table
        if not sv:
            lines.append(f"| {lv['label']} | {lv['concurrency']} | - | - | - |")
            continue
        lines.append(
            f"| {lv['label']} | {lv['concurrency']} "
            f"| {_fmt(sv['ttft']['mean_ms'])} / {_fmt(sv['ttft']['p50_ms'])} ({_fmt(s['ttft']['p50_ms'])}) "
            f"| {_fmt(sv['itl']['mean_ms'])} / {_fmt(sv['itl']['p50_ms'])} ({_fmt(s['itl']['mean_ms'])} / {_fmt(s['itl']['p50_ms'])}) "
            f"| {_fmt(sv['e2e']['mean_ms'])} ({_fmt(s['e2e']['mean_ms'])}) |")
    if phases:
        lines += [""] + _phase_table(levels)
    return lines


def _hist(h: dict | None) -> str:
    if not h or not h["count"]:
        return "-"
    return f"{h['count']} / {_fmt(h['mean_ms'])} / {_fmt(h['p50_ms'])}"


def _phase_table(levels: list[dict]) -> list[str]:
    """A router target's servers, each with its own histograms: in PD mode the prefill server's
    and the decode server's, beside the client figure of the phase each one runs."""
    lines = ["Servers behind a router, each one's own `/metrics` over the same interval (count / mean / "
             "p50 ms; p50 inside histogram buckets). In PD mode the client's TTFT is the prefill phase, "
             "its ITL the decode phase:", "",
             "| label | conc | role | server | TTFT | ITL | E2E | client figure of its phase, p50 ms |",
             "|---|---:|---|---|---|---|---|---|"]
    for lv in levels:
        s = lv["client"]
        for ps in lv.get("phase_servers") or []:
            m = ps["metrics"] or {}
            # The client figure the server's phase accounts for (both on a plain router's servers).
            owned = [metric for metric, role in routers.PHASES.items() if ps["role"] in (role, "none")]
            client = ", ".join(f"{metric.upper()} {_fmt(s[metric]['p50_ms'])}" for metric in owned)
            lines.append(f"| {lv['label']} | {lv['concurrency']} | {ps['role']} | {ps['url']} "
                         f"| {_hist(m.get('ttft'))} | {_hist(m.get('itl'))} | {_hist(m.get('e2e'))} | {client} |")
    return lines


def _ratio_table(ab: dict) -> list[str]:
    keys = [f"{m}_{s.removesuffix('_ms')}" for m, s in RATIO_KEYS] + ["output_throughput"]
    lines = [f"Ratios {ab['a']} / {ab['b']} (below 1: {ab['a']} is faster; for output_throughput, above 1 is better):",
             "", "| conc | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    for row in ab["ratios"]:
        lines.append(f"| {row['concurrency']} | " + " | ".join(_fmt(row[k], 3) for k in keys) + " |")
    return lines


def describe_target(label: str, facts: dict) -> str:
    if facts.get("router"):
        return routers.describe(label, facts) + _speculative(facts)
    mode = facts.get("farskip_mode")
    if not mode:
        what = "not a sglang-farskip server (no /farskip/info)"
    elif mode == "off" or not facts.get("farskip"):
        what = f"FarSkip mode `{mode}`"
    else:
        what = f"FarSkip mode `{mode}` ({facts['farskip']})"
    return (f"**{label}** = {facts['url']}: {what}{_speculative(facts)}, SGLang {facts.get('version', '?')}, "
            f"model `{facts.get('model_path', '?')}`")


def _speculative(facts: dict) -> str:
    algorithm = facts.get("speculative_algorithm")
    if not algorithm:
        return ""
    shape = ", ".join(f"{name} {facts[key]}" for name, key in (
        ("steps", "speculative_num_steps"), ("top-k", "speculative_eagle_topk"),
        ("draft tokens", "speculative_num_draft_tokens")) if facts.get(key) is not None)
    return f", speculative decoding {algorithm}" + (f" ({shape})" if shape else "")


def make_note(machine: dict, targets: dict, args_line: str, extra: str = "") -> str:
    m = machine
    lines = [f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, GPU {m['gpu']}; {m['os']}, Python {m['python']}.",
             "Compared: " + "; ".join(describe_target(lbl, f) for lbl, f in targets.items()) + ".",
             f"Workload: {args_line}; temperature 0, ignore_eos, streaming."]
    paths = {f.get("model_path") for f in targets.values()}
    if len(targets) >= 2 and len(paths) > 1:
        lines.append("WARNING: the servers load different checkpoints, so this is not a same-weights A/B.")
    if extra:
        lines.append(extra)
    return "  \n".join(lines)


def write_all(results: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    levels = results["levels"]
    paths = {"json": out / "results.json", "csv": out / "results.csv", "report": out / "report.md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for lv in levels:
            w.writerow(csv_row(lv))
    comparisons = results.get("comparisons") or []
    if comparisons:
        paths["ab_csv"] = out / "ab_ratios.csv"
        rows = [{"a": ab["a"], "b": ab["b"], **row} for ab in comparisons for row in ab["ratios"]]
        with open(paths["ab_csv"], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["a", "b", "concurrency"])
            w.writeheader()
            w.writerows(rows)
    series: dict[str, list] = {}
    for lv in levels:
        series.setdefault(lv["label"], []).append((lv["concurrency"], lv["client"]))
    subtitle = results.get("workload_line", "")
    for metric in ("ttft", "itl"):
        paths[metric] = plots.plot_percentiles(series, metric, out / f"{metric}.png", subtitle)
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")

    md = [f"# {results.get('title') or 'Load test'}", "", results["note"], "",
          "Client-side latencies are computed from every request's raw samples "
          "(`requests/*.jsonl`), with the definitions of `sglang.benchmark.serving`.", ""]
    md += _client_table(levels) + [""]
    for ab in comparisons:
        md += _ratio_table(ab) + [""]
    md += _server_table(levels) + [""]
    md += ["![TTFT percentiles against concurrency](ttft.png)", "",
           "![ITL percentiles against concurrency](itl.png)", ""]
    notes = [f"- {lv['label']} c={lv['concurrency']}: {lv['note']}" for lv in levels if lv.get("note")]
    if notes:
        md += ["Notes:", "", *notes, ""]
    errors = [(lv["label"], lv["concurrency"], lv["client"]["first_error"]) for lv in levels if lv["client"]["failed"]]
    if errors:
        md += ["Failures (first error of each level):", ""]
        md += [f"- {label} c={c}: {err}" for label, c, err in errors] + [""]
    paths["report"].write_text("\n".join(md))
    return paths
