"""The server's own view: SGLang's Prometheus histograms (GET /metrics, --enable-metrics).

A report shows them beside the client-side numbers, measured by a second, independent clock:
the server times TTFT from when its tokenizer manager receives the request, so it excludes
HTTP and client overhead, and its quantiles are only as fine as the histogram buckets.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = {
    "ttft": "sglang:time_to_first_token_seconds",
    "itl": "sglang:inter_token_latency_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
}


def scrape(base_url: str, timeout: float = 10.0) -> dict | None:
    """{metric: {"count", "sum", "buckets": {upper bound: cumulative count}}}, summed over
    every label set (streaming or not, any model name); None when the server exports no
    metrics (started without --enable-metrics)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
    return parse(text)


def parse(text: str) -> dict | None:
    """The histograms of scrape() from Prometheus exposition text."""
    wanted = {name: key for key, name in HISTOGRAMS.items()}
    out = {key: {"count": 0.0, "sum": 0.0, "buckets": {}} for key in HISTOGRAMS}
    seen = False
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None:
            continue
        seen = True
        hist = out[key]
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])  # "+Inf" parses to inf
                hist["buckets"][le] = hist["buckets"].get(le, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                hist["count"] += sample.value
            elif sample.name.endswith("_sum"):
                hist["sum"] += sample.value
    return out if seen else None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """What happened between two scrapes: the histograms are cumulative since server start."""
    if before is None or after is None:
        return None
    out = {}
    for key, a in after.items():
        b = before.get(key, {"count": 0.0, "sum": 0.0, "buckets": {}})
        out[key] = {
            "count": a["count"] - b["count"],
            "sum": a["sum"] - b["sum"],
            "buckets": {le: n - b["buckets"].get(le, 0.0) for le, n in a["buckets"].items()},
        }
    return out


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: find the bucket holding rank q*count and interpolate
    linearly inside it (the first bucket starts at 0). A rank in the +Inf bucket returns the
    largest finite bound, as Prometheus does."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def summarize(hists: dict | None) -> dict | None:
    """Per metric: observation count, exact mean (sum/count), bucket-interpolated p50/p90/p99."""
    if hists is None:
        return None
    out = {}
    for key, h in hists.items():
        n = h["count"]
        row = {"count": int(round(n)), "mean_ms": 1000.0 * h["sum"] / n if n > 0 else None}
        for q in (50, 90, 99):
            v = bucket_quantile(q / 100.0, h["buckets"]) if n > 0 else None
            row[f"p{q}_ms"] = None if v is None else 1000.0 * v
        out[key] = row
    return out
