"""The cross-check's verdict (bench/crosscheck_sglang.py): does our load harness agree with
sglang.benchmark.serving on the same server, within the noise the sample sizes allow?"""

from __future__ import annotations

import random

from sglang_farskip.loadtest import loadstats


def median_ms(xs: list[float]) -> float | None:
    return 1000.0 * loadstats.percentile(xs, 50) if xs else None


def bootstrap_interval(a: list, b: list, pooled: bool, n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of median(a) - median(b) in ms, resampling whole requests (an ITL sample
    is a request's list of gaps: gaps of one request are not independent). It shows how much
    of a difference the sample sizes alone can produce."""
    rng = random.Random(seed)

    def med(xs):
        flat = [g for req in xs for g in req] if pooled else xs
        return loadstats.percentile(flat, 50) if flat else 0.0
    diffs = sorted(1000.0 * (med(rng.choices(a, k=len(a))) - med(rng.choices(b, k=len(b)))) for _ in range(n))
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def _explained_by_server(metric: str, ref: dict | None, band: float, sglang_median: float) -> bool:
    """Did the server's own histograms move with the clients? Each tool against the server in
    its own run (server_referenced) cancels drift between runs: if those agree, a gap between
    the medians is the machine changing speed, not the tools measuring differently."""
    if not ref:
        return False
    h, s = ref["harness"], ref["sglang"]
    if metric == "ttft":
        return abs(h["ttft_client_minus_server_ms"] - s["ttft_client_minus_server_ms"]) <= band
    return abs(h["itl_client_over_server"] - s["itl_client_over_server"]) <= band / sglang_median


def compare(res: dict, rel_tol: float, abs_tol_ms: float, ref: dict | None = None) -> tuple[list[dict], str]:
    """Per median: 'agree' (difference within tolerance); 'inconclusive' (outside it, but
    sampling alone could explain that - its bootstrap interval reaches the tolerance - or the
    server's own histograms moved just as much between the two runs: a noisy machine, not a
    measurement difference); otherwise 'disagree'."""
    rows = []
    for metric in ("ttft", "itl", "tpot", "e2e"):
        checked = metric in ("ttft", "itl")  # the criterion; TPOT and E2E are shown alongside
        if metric == "ttft":
            h, s = median_ms(res["harness"]["ttft"]), median_ms(res["sglang"]["ttft"])
        elif metric == "itl":
            h, s = (median_ms([g for req in res[t]["itl_by_request"] for g in req]) for t in ("harness", "sglang"))
        else:  # the mean of each run's median (sglang reports no per-request E2E)
            h, s = (sum(res[t][f"{metric}_p50_ms"]) / len(res[t][f"{metric}_p50_ms"]) for t in ("harness", "sglang"))
        diff = None if h is None or s is None else h - s
        row = {"metric": f"{metric} p50", "harness_ms": h, "sglang_ms": s, "diff_ms": diff,
               "diff_rel": diff / s if diff is not None and s else None, "checked": checked, "verdict": None}
        if checked and diff is None:
            row["verdict"] = "disagree"  # a tool produced no samples at all
        elif checked:
            key = "ttft" if metric == "ttft" else "itl_by_request"
            lo, hi = bootstrap_interval(res["harness"][key], res["sglang"][key], metric == "itl")
            band = max(abs_tol_ms, rel_tol * s)
            row["diff_ci95_ms"] = (lo, hi)
            if abs(diff) <= band:
                row["verdict"] = "agree"
            elif -band <= hi and lo <= band:
                row["verdict"], row["why"] = "inconclusive", "within sampling noise"
            elif _explained_by_server(metric, ref, band, s):
                row["verdict"], row["why"] = "inconclusive", "the server itself changed speed between the runs"
            else:
                row["verdict"] = "disagree"
        rows.append(row)
    verdicts = {r["verdict"] for r in rows if r["checked"]}
    overall = "disagree" if "disagree" in verdicts else "inconclusive" if "inconclusive" in verdicts else "agree"
    return rows, overall


