"""The load harness against sglang.benchmark.serving (bench/crosscheck_sglang.py): the same
server, the same workload, one tool after the other, and both against the server's own
histograms. Real HTTP, real locust, real SGLang client.

A file of its own because it compares the timings of two clients, which needs a core free for
them: beside a second pytest-xdist worker it failed its client-overhead bound (43 ms against
39 ms), and beside two busy loops on 2 cores sglang.benchmark.serving fell behind the stream
every time. tests/_workers.py runs this file with nothing beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_farskip.testbed.servers import REPO, Server

KEPT_UP = 0.9  # a client's mean ITL over the server's, below which it read chunks in bursts


@pytest.fixture(scope="module")
def server():
    # --enable-metrics: the server's own TTFT and ITL histograms, the drift-free reference.
    # --sleep-on-idle: an idle scheduler otherwise spins a core the clients need.
    with Server(["--enable-metrics", "--sleep-on-idle"]) as s:
        yield s.wait_ready()


def test_agrees_with_sglang_benchmark_serving(server, tmp_path):
    # bench/crosscheck_sglang.py: the harness, then sglang.benchmark.serving, on the same
    # server and workload. Medians: a 35 % bound (the script states 10 %) and "inconclusive"
    # accepted, so that a busy CI box shifting the load between the two runs cannot fail it;
    # "disagree" (outside the bound even allowing for sampling) fails. Then the drift-free
    # view: each tool against the server's own histograms of its own run must match the other.
    # A definition or unit error (wrong start, per chunk instead of per token, ms for s) fails
    # one or the other.
    # Time: the two runs took 150-193 s beside two busy loops (the sglang client up to 155 s of
    # it), and one run went past 240 s. The script's own --timeout ends a hang and names the
    # stuck tool with its log; the subprocess bound only backs it up.
    r = subprocess.run([sys.executable, str(REPO / "bench" / "crosscheck_sglang.py"), "--url", server.url,
                        "--rounds", "1", "--concurrency", "1", "--requests", "24", "--max-tokens", "12",
                        "--input-len", "32", "--rel-tol", "0.35", "--abs-tol-ms", "5", "--timeout", "420",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=480, cwd=REPO)
    print(r.stdout)
    out = tmp_path / "crosscheck.json"
    assert out.exists(), r.stdout + r.stderr
    res = json.loads(out.read_text())
    # Each client must have kept up with the stream. Over a run its mean gap between tokens can
    # only fall below the server's if it read queued chunks in bursts, i.e. it lacked a core.
    # Beside two busy loops on 2 cores sglang.benchmark.serving did, in 4 of 4 runs (0.18-0.88
    # of the server's mean ITL; the harness 0.96-1.01): then nothing here can be compared, so
    # the suite runs this file with nothing beside it (tests/_workers.py, ALONE).
    for tool, ref in res["server_referenced"].items():
        assert ref["itl_client_over_server"] >= KEPT_UP, (
            f"the {tool} client fell behind the stream (its mean ITL {ref['itl_client_over_server']:.2f} "
            "of the server's): this test needs a free core; run it alone\n" + r.stdout)
    assert r.returncode in (0, 3), r.stdout + r.stderr
    assert res["counts"] == {"harness": {"requests": 24, "failed": 0}, "sglang": {"requests": 24, "failed": 0}}
    assert all(row["verdict"] in ("agree", "inconclusive") for row in res["medians"] if row["checked"])
    # The server's histograms saw exactly each run's requests (the warm-up came before).
    assert [run["server"]["ttft"]["count"] for run in res["runs"]] == [24, 24]
    h, s = res["server_referenced"]["harness"], res["server_referenced"]["sglang"]
    # Client-side overhead above the server's own TTFT: a few ms for either client on a quiet
    # machine. On a loaded one a client process waits for a core like the server does (seen: the
    # server's TTFT mean 77 ms in one run and 280 ms in the other, overheads +6 and +23 ms), so
    # the bound grows with the slower run's server TTFT: 10 ms, or 10 % of it. A definition
    # error (TTFT at the second chunk: one ITL, 25 ms or more here; a unit error) still fails.
    slowest_server_ttft = max(run["server"]["ttft"]["mean_ms"] for run in res["runs"])
    assert abs(h["ttft_client_minus_server_ms"] - s["ttft_client_minus_server_ms"]) <= max(
        10.0, 0.1 * slowest_server_ttft)
    assert 0 < h["ttft_client_minus_server_ms"] and 0 < s["ttft_client_minus_server_ms"]
    assert abs(h["itl_client_over_server"] - s["itl_client_over_server"]) <= 0.05
