"""Deployments behind SGLang's router recover by themselves from a failed server process: the
short version of bench/router_soak.py (docs/pd.md, "Failures"), run as a user would run it.

Each case starts the demo model in a layout of router_soak.py, every server process under the
deployment's watchdog, and SGLang's router in front; runs soak.py's constant non-streaming load
through the router; and SIGKILLs (or SIGSTOPs) the whole process tree of one server process
FAULT_AT_S in. The cases:
- PD (prefill and decode at TP=1): the prefill server crashes;
- PD with the decode server at TP=2 as two node processes: decode node 1 crashes (which ends
  and restarts the whole decode server: the decode side's recovery, in the layout users run;
  the same crash at TP=1 ran here too until the suite's time asked for each layout once);
- two replicas, `a` at TP=2 as two node processes and `b` at TP=1: node 1 of `a` hangs.
What must hold (router_soak.py's exit status carries soak.py's checks and its own):
- no request hangs: each ends within the clients' timeout (REQUEST_TIMEOUT_S) plus 5 s. After
  a decode crash the requests in flight would otherwise wait out the prefill server's bootstrap
  timeout (300 s); the router's request timeout (testbed/router.py, 20 s) cuts them and sends
  them again, and the client's timeout bounds the rest;
- none is dropped unanswered;
- the router listed a worker unhealthy and then every worker healthy again (its health checks,
  deploy/router.args, in both modes): the fault was felt, the watchdogs started the failed
  server (and its peer node) again, and the router took it back, with no hand from outside;
- the run ends with SETTLE_S seconds in which every request succeeded.
PD: a request can fail only when in flight at the crash or sent while the server was down, and
the router's retries (spread over 15 s) did not outlast the restart (a PD deployment with one
server per role has no other to send them to); on a quiet machine none failed at TP=1. Replicas: none
fails; the router sends them to the other replica (deploy/router.args has the retry spacing
that makes it so).

The load runs DURATION_S, then on until the run ends with SETTLE_S of success (soak.py's
--until-settled), up to MAX_S: the test asks that the deployment recover by itself, not that
it do so within a fixed window, and a restart's length varies far more than the rest. It was
17-44 s after the kill for one TP=1 server on a quiet machine, 50-60 s for a two-node server
(docs/pd.md), and over 3 minutes with nine servers starting at once on two cores. After the
load, router_soak.py waits for the router to list every worker healthy again. So DURATION_S only
has to cover the fault and what it must overlap: in PD, 30 s (the kill at 5 s, the router's
first failed checks 3-6 s later, the requests then in flight held by its retries and request
timeout until the server is back; a request that fails keeps the load going); over replicas, 60 s, because nothing fails there (the other replica answers) and the
load must go on through the restart by itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_farskip.testbed import REPO

FAULT_AT_S, SETTLE_S, MAX_S = 5, 10, 600
CASES = {  # id: (router_soak.py arguments, DURATION_S, REQUEST_TIMEOUT_S)
    "pd-prefill-crash": (["--layout", "pd", "--fault", "prefill"], 30, 30),
    "pd-decode-node1-crash": (["--layout", "pd", "--nodes", "2", "--fault", "decode1"], 30, 30),
    # A request on replica a when node 1 hangs waits until the watchdog ends node 0 (about 24 s:
    # two checks that time out), then is sent again: 30 s were seen, hence 60.
    "replica-node1-hang": (["--layout", "replicas", "--nodes", "2", "--fault", "a1", "--hang"], 60, 60),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recovers_by_itself(case, tmp_path):
    args, duration, request_timeout = CASES[case]
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "router_soak.py"), *args,
         "--fault-at", str(FAULT_AT_S), "--duration", str(duration), "--settle", str(SETTLE_S),
         "--until-settled", str(MAX_S),
         "--request-timeout", str(request_timeout), "--logs", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=MAX_S + request_timeout + 600)
    print(proc.stdout[-2500:])
    logs = "".join(f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-3000:]
                   for log in sorted(tmp_path.glob("router-soak-*.log")))
    # The summary last: a truncated report (CI's) keeps a message's end.
    assert proc.returncode == 0, logs + proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads(out.read_text())
    assert result["fault"]["status"] == 0, result["fault"]  # the signal found its victim
    assert all(result["checks"].values()), result["checks"]
    # The router took the failed server out and back in (its health checks: ROUTER_FLAGS).
    assert "(healed)" in proc.stdout, proc.stdout[-1000:]
    if case.startswith("replica"):
        assert result["failed"] == 0, result["errors"]
        # The hang was felt: a request was on replica a (soak.py's 8 prompts spread the load).
        assert result["longest_request_s"] > 10, result
    print(f"{case}: {result['failed']} of {result['requests']} failed, recovery "
          f"{result['recovery_s']} s, longest request {result['longest_request_s']} s")
