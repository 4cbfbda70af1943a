"""Statistics over the per-request JSONL records that bench/locustfile.py writes.

Pure standard library on purpose: the runner, the tests and anyone with a JSONL file can use it
without locust, numpy or SGLang. Every number is computed from raw samples, never from locust's
bucketed (rounded) percentiles. Times in the records are seconds; summaries are milliseconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PERCENTILES = (50, 90, 95, 99)
# The per-request metrics a report shows, in display order. ITL also reports its max, as
# sglang.benchmark.serving does: one stalled token is what a streaming user notices.
METRICS = ("ttft", "itl", "tpot", "e2e")


class RecordError(ValueError):
    """A JSONL file that is not a harness record file; the message names the file and line."""


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks.

    The same definition as numpy.percentile's default ('linear'), which is what
    sglang.benchmark.serving uses, so the two tools' p90/p99 are comparable.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_s: list[float], *, with_max: bool = False) -> dict:
    """Count, mean and percentiles in milliseconds; None values where there are no samples
    (a level where every request failed or returned no token must still produce a report)."""
    out: dict = {"count": len(samples_s)}
    if not samples_s:
        out["mean_ms"] = None
        out.update({f"p{q}_ms": None for q in PERCENTILES})
        if with_max:
            out["max_ms"] = None
        return out
    out["mean_ms"] = 1000.0 * math.fsum(samples_s) / len(samples_s)
    for q in PERCENTILES:
        out[f"p{q}_ms"] = 1000.0 * percentile(samples_s, q)
    if with_max:
        out["max_ms"] = 1000.0 * max(samples_s)
    return out


def read_records(path: Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{lineno}: not JSON ({e}); was the file cut short?") from None
            if not isinstance(rec, dict) or "ok" not in rec:
                raise RecordError(f"{path}:{lineno}: not a request record (no 'ok' field)")
            records.append(rec)
    return records


def samples(records: list[dict]) -> dict[str, list[float]]:
    """Raw samples (seconds) per metric over the successful requests, pooled the way
    sglang.benchmark.serving pools them: one TTFT/E2E per request, every ITL gap of every
    request, one TPOT per request with at least two output tokens."""
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for rec in records:
        if not rec["ok"]:
            continue
        out["e2e"].append(rec["e2e"])
        # A request that produced no token has no first-token time; it still counts as done.
        if rec.get("ttft") is not None:
            out["ttft"].append(rec["ttft"])
        out["itl"].extend(rec.get("itl") or [])
        if rec.get("tpot") is not None:
            out["tpot"].append(rec["tpot"])
    return out


def level_summary(records: list[dict]) -> dict:
    """Everything a report shows for one run at one concurrency level."""
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    raw = samples(records)
    summary: dict = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "input_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "output_tokens": sum(r.get("output_tokens") or 0 for r in ok),
    }
    # Throughput over the level's wall span: first request sent to last request finished.
    if records:
        start = min(r["start_unix"] for r in records)
        end = max(r["start_unix"] + (r.get("e2e") or 0.0) for r in records)
        span = max(end - start, 1e-9)
    else:
        span = 0.0
    summary["duration_s"] = span
    summary["request_throughput"] = len(ok) / span if span else 0.0
    summary["output_throughput"] = summary["output_tokens"] / span if span else 0.0
    for metric in METRICS:
        summary[metric] = summarize(raw[metric], with_max=(metric == "itl"))
    errors: dict[str, int] = {}
    for r in failed:
        kind = (r.get("error") or "unknown error").split(":", 1)[0]
        errors[kind] = errors.get(kind, 0) + 1
    summary["errors"] = errors
    summary["first_error"] = failed[0].get("error") if failed else None
    summary["spec_accept_length"] = accept_length(ok)
    return summary


def accept_length(records: list[dict]) -> float | None:
    """Speculative decoding's mean accept length over these requests: output tokens per verify
    step, pooled (SGLang's own per-request definition, completion tokens / verify steps, so the
    token the prefill makes counts too); None where no request reported verify steps."""
    spec = [r for r in records if r.get("spec_verify_ct")]
    if not spec:
        return None
    return sum(r["output_tokens"] for r in spec) / sum(r["spec_verify_ct"] for r in spec)
