"""A prefill/decode deployment recovers by itself from a crash of either server: the short
version of bench/pd_soak.py (docs/pd.md, "Failures"), run as a user would run it.

Each case starts the demo model as a prefill server and a decode server (TP=1, FarSkip
overlap), each under the deployment's watchdog, and SGLang's router in PD mode; runs soak.py's
constant non-streaming load through the router; and SIGKILLs the whole process tree of one
server FAULT_AT_S in. What must hold (soak.py's own checks, which set pd_soak.py's exit status):
- no request hangs: each ends within the clients' timeout (REQUEST_TIMEOUT_S) plus 5 s. After
  a decode crash the requests in flight would otherwise wait out the prefill server's bootstrap
  timeout (300 s); the client's timeout is what bounds them, and it must be seen to;
- none is dropped unanswered;
- the run ends with SETTLE_S seconds in which every request succeeded: the watchdog started the
  server again and the router sends to it, with no hand from outside.
Requests that fail are only those in flight at the crash or sent while the server was down:
what PD can do without a second server of the same role (replicas lose none:
tests/test_replicas.py).

DURATION_S leaves room for a slow restart: 17-44 s after the kill on a quiet machine (the
measured figures in docs/pd.md), a CPU start taking twice as long beside other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_farskip.testbed import REPO

FAULT_AT_S, DURATION_S, SETTLE_S, REQUEST_TIMEOUT_S = 5, 100, 10, 30


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_pd_recovers_from_a_crash(victim, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pd_soak.py"), "--fault", victim,
         "--fault-at", str(FAULT_AT_S), "--duration", str(DURATION_S), "--settle", str(SETTLE_S),
         "--request-timeout", str(REQUEST_TIMEOUT_S), "--logs", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=DURATION_S + REQUEST_TIMEOUT_S + 300)
    print(proc.stdout[-2500:])
    logs = "".join(f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-3000:]
                   for log in sorted(tmp_path.glob("pd-soak-*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    result = json.loads(out.read_text())
    assert result["fault"]["status"] == 0, result["fault"]  # the kill found its victim
    assert all(result["checks"].values()), result["checks"]
    # The crash was felt (a fault that missed its server would fail nothing), and the server
    # came back: requests succeeded after the last failure.
    assert result["failed"] > 0 and result["recovery_s"] is not None, result
    print(f"{victim} crash: {result['failed']} of {result['requests']} failed, recovery "
          f"{result['recovery_s']} s, longest request {result['longest_request_s']} s")
