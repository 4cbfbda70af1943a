"""The load harness's statistics, without a server: percentiles against numpy, summaries of
awkward runs (failures, zero-token requests), Prometheus histogram parsing and quantiles."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_farskip.loadtest import loadstats, servermetrics


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    xs = [rng.lognormvariate(0, 1) for _ in range(n)]
    for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
        assert loadstats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_percentile_rejects_nonsense():
    with pytest.raises(ValueError, match="no samples"):
        loadstats.percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        loadstats.percentile([1.0], 101)


def _ok(ttft, itl, e2e, start=0.0):
    n = len(itl) + 1
    return {"ok": True, "start_unix": start, "ttft": ttft, "itl": itl, "e2e": e2e, "output_tokens": n,
            "prompt_tokens": 8, "tpot": (e2e - ttft) / (n - 1) if n > 1 else None}


def test_level_summary_pools_like_sglang():
    recs = [_ok(0.1, [0.01, 0.02], 0.13, start=100.0), _ok(0.3, [0.03], 0.33, start=100.5),
            {"ok": False, "start_unix": 101.0, "e2e": 0.05, "error": "HTTP 400: too long", "output_tokens": 0}]
    s = loadstats.level_summary(recs)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 400": 1} and s["first_error"] == "HTTP 400: too long"
    assert s["ttft"]["count"] == 2 and s["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert s["itl"]["count"] == 3 and s["itl"]["max_ms"] == pytest.approx(30.0)
    assert s["itl"]["mean_ms"] == pytest.approx(20.0)
    assert s["output_tokens"] == 5
    # Span: first start (100.0) to last end (101.05); failed requests count in the span.
    assert s["duration_s"] == pytest.approx(1.05)
    assert s["output_throughput"] == pytest.approx(5 / 1.05)


def test_accept_length_pools_tokens_over_verify_steps():
    # Pooled, not a mean of per-request ratios: 8 + 8 tokens over 2 + 6 steps is 2.0 (the
    # mean of 4.0 and 1.33 would be 2.67). Failed requests and servers without speculative
    # decoding (no spec_verify_ct) take no part.
    a, b = _ok(0.1, [0.01] * 7, 0.2), _ok(0.1, [0.01] * 7, 0.2)
    a["spec_verify_ct"], b["spec_verify_ct"] = 2, 6
    failed = {"ok": False, "start_unix": 0.0, "e2e": 0.1, "error": "x", "output_tokens": 3, "spec_verify_ct": 1}
    assert loadstats.level_summary([a, b, failed])["spec_accept_length"] == pytest.approx(2.0)
    assert loadstats.level_summary([_ok(0.1, [0.01], 0.12)])["spec_accept_length"] is None
    assert loadstats.level_summary([])["spec_accept_length"] is None


def test_zero_token_and_all_failed_levels_summarize():
    zero = {"ok": True, "start_unix": 5.0, "ttft": None, "itl": [], "e2e": 0.02, "tpot": None,
            "output_tokens": 0, "prompt_tokens": 4}
    s = loadstats.level_summary([zero, dict(zero, start_unix=5.1)])
    assert s["completed"] == 2 and s["ttft"] == {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None,
                                                 "p95_ms": None, "p99_ms": None}
    assert s["itl"]["max_ms"] is None and s["e2e"]["count"] == 2
    failed = loadstats.level_summary([{"ok": False, "start_unix": 1.0, "e2e": None, "error": "connection error: x"}])
    assert failed["completed"] == 0 and failed["request_throughput"] == 0.0
    empty = loadstats.level_summary([])
    assert empty["requests"] == 0 and empty["duration_s"] == 0.0


def test_read_records_names_bad_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"ok": true}\n{"ok": tru\n')
    with pytest.raises(loadstats.RecordError, match=r"r.jsonl:2: not JSON"):
        loadstats.read_records(p)
    p.write_text('{"x": 1}\n')
    with pytest.raises(loadstats.RecordError, match="no 'ok' field"):
        loadstats.read_records(p)


METRICS_TEXT = """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{is_streaming="true",model_name="m"} 0.9
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="0.1",model_name="m"} 2.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="0.2",model_name="m"} 4.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="+Inf",model_name="m"} 5.0
sglang:time_to_first_token_seconds_count{is_streaming="true",model_name="m"} 5.0
sglang:time_to_first_token_seconds_sum{is_streaming="false",model_name="m"} 0.1
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="0.1",model_name="m"} 1.0
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="0.2",model_name="m"} 1.0
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="+Inf",model_name="m"} 1.0
sglang:time_to_first_token_seconds_count{is_streaming="false",model_name="m"} 1.0
# HELP sglang:num_requests_total Number of requests.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 6.0
"""


def test_parse_sums_label_sets_and_delta():
    after = servermetrics.parse(METRICS_TEXT)
    ttft = after["ttft"]
    assert ttft["count"] == 6 and ttft["sum"] == pytest.approx(1.0)
    assert ttft["buckets"] == {0.1: 3.0, 0.2: 5.0, float("inf"): 6.0}
    assert after["itl"]["count"] == 0  # absent family: an empty histogram, not an error
    before = servermetrics.parse(METRICS_TEXT.replace('le="0.2",model_name="m"} 4.0', 'le="0.2",model_name="m"} 2.0')
                                 .replace('"true",model_name="m"} 5.0', '"true",model_name="m"} 2.0'))
    d = servermetrics.delta(before, after)
    assert d["ttft"]["count"] == 3 and d["ttft"]["buckets"][0.2] == 2.0
    assert servermetrics.parse("# nothing here\n") is None
    assert servermetrics.delta(None, after) is None


def test_bucket_quantile_is_prometheus_interpolation():
    b = {0.1: 2.0, 0.2: 4.0, float("inf"): 5.0}
    assert servermetrics.bucket_quantile(0.5, b) == pytest.approx(0.125)  # rank 2.5: 1/4 into (0.1, 0.2]
    assert servermetrics.bucket_quantile(0.2, b) == pytest.approx(0.05)  # rank 1 in the first bucket from 0
    assert servermetrics.bucket_quantile(0.99, b) == pytest.approx(0.2)  # +Inf bucket: highest finite bound
    assert servermetrics.bucket_quantile(0.5, {float("inf"): 0.0}) is None
    s = servermetrics.summarize({"ttft": {"count": 5.0, "sum": 0.5, "buckets": b}})
    assert s["ttft"]["mean_ms"] == pytest.approx(100.0) and s["ttft"]["p50_ms"] == pytest.approx(125.0)


def _xc_result(h_ttft, s_ttft, h_itl, s_itl):
    def side(ttft, itl):
        return {"requests": len(ttft), "failed": 0, "ttft": ttft, "itl_by_request": itl,
                "tpot_p50_ms": [1.0], "e2e_p50_ms": [2.0, 4.0]}
    return {"harness": side(h_ttft, h_itl), "sglang": side(s_ttft, s_itl)}


def test_crosscheck_verdicts():
    from sglang_farskip.loadtest import crosscheck as xc

    rng = random.Random(0)
    tight = [[0.020 + rng.uniform(-1e-4, 1e-4) for _ in range(10)] for _ in range(20)]
    ttft = [0.100 + rng.uniform(-1e-3, 1e-3) for _ in range(20)]
    rows, verdict = xc.compare(_xc_result(ttft, ttft[::-1], tight, tight[::-1]), 0.10, 2.0)
    assert verdict == "agree" and [r["verdict"] for r in rows] == ["agree", "agree", None, None]
    assert rows[3]["harness_ms"] == 3.0  # E2E: the mean of the runs' medians
    # A 2x unit/definition error with tight samples is a clear disagreement.
    doubled = [[2 * g for g in r] for r in tight]
    _, verdict = xc.compare(_xc_result(ttft, ttft, doubled, tight), 0.10, 2.0)
    assert verdict == "disagree"
    # Bimodal TTFTs from a handful of requests: outside the band, but sampling explains it.
    noisy_h = [0.1, 0.1, 0.1, 3.0, 3.0]
    noisy_s = [0.1, 0.1, 3.0, 3.0, 3.0]
    rows, verdict = xc.compare(_xc_result(noisy_h, noisy_s, tight, tight), 0.10, 2.0)
    assert rows[0]["verdict"] == "inconclusive" and verdict == "inconclusive"


def test_crosscheck_drift_explained_by_server_is_inconclusive_not_disagree():
    from sglang_farskip.loadtest import crosscheck as xc

    rng = random.Random(1)
    base = [[0.020 + rng.uniform(-1e-4, 1e-4) for _ in range(10)] for _ in range(20)]
    slow = [[1.5 * g for g in r] for r in base]  # the machine was 1.5x slower during sglang's run
    ttft = [0.1] * 20
    res = _xc_result(ttft, ttft, base, slow)
    same = {"ttft_client_minus_server_ms": 5.0, "itl_client_over_server": 1.0}
    rows, verdict = xc.compare(res, 0.10, 2.0, {"harness": same, "sglang": dict(same)})
    assert verdict == "inconclusive" and "changed speed" in rows[1]["why"]
    # Without the server's view, or if the server did not move, the same gap is a disagreement.
    assert xc.compare(res, 0.10, 2.0)[1] == "disagree"
    off = {"harness": same, "sglang": dict(same, itl_client_over_server=1.5)}
    assert xc.compare(res, 0.10, 2.0, off)[1] == "disagree"
