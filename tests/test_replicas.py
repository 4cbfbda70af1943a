"""Replicas behind SGLang's router (plain mode, testbed/router.py's ROUTER_FLAGS): three demo
servers through our launcher (FarSkip overlap, CPU), one router over all three, and
bench/soak.py's constant non-streaming load through the router while a replica fails:
- crash: one replica's whole process tree SIGKILLed mid-run: no request fails (the router
  re-sends a refused or reset one to another replica);
- hang: another replica's tree SIGSTOPped mid-run: no request fails (one sent to it is re-sent
  once the router's request timeout ends it) and the router marks it unhealthy;
- a streaming request whose replica is SIGKILLed mid-stream ends within STREAM_BOUND_S, never a
  silent hang. What the client sees (measured, sglang-router 0.3.2): the router ends the HTTP
  response cleanly (a well-formed end of the chunked body, no error event), so the only sign
  is the missing `data: [DONE]` and finish_reason; the test checks that the cut is seen that
  way, and a change in the router's behaviour (an error event, a reset) passes too.

Before the faults, a second router over the same replicas, started as the deployment starts it
(deploy/router.py, with an inference and an admin key), gets the control-plane checks of
tests/control_plane.py in plain mode.

Three replicas, not two, so that each fault leaves one serving without a restart in between
(a CPU start here is 25-45 s). The faults run in order, each on what the last one left.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import control_plane
from sglang_farskip.testbed import REPO
from sglang_farskip.testbed.router import Router
from sglang_farskip.testbed.servers import side_by_side

from parity import ONE_THREAD

SOAK_S, FAULT_AT_S, SETTLE_S = 30, 8, 8
STREAM_BOUND_S = 30  # from the kill to the client's error


@pytest.fixture(scope="module")
def replicas():
    runs = {name: dict(args=["--farskip-mode", "overlap"], env=ONE_THREAD) for name in "abc"}
    with side_by_side(runs) as servers:
        with Router(workers=[s.url for s in servers.values()]) as router:
            router.wait_ready()
            yield servers, router


@pytest.fixture(scope="module")
def keyed(replicas):
    """The deployment's router (both keys) over the same replicas, before any fault."""
    servers, _ = replicas
    with Router(workers=[s.url for s in servers.values()], keys=control_plane.KEYS) as router:
        yield router.wait_ready()


def test_router_control_plane_refuses_the_inference_key(keyed):
    control_plane.inference_key_cannot_steer(keyed)


def test_router_control_plane_answers_the_admin_key(keyed, replicas):
    servers, _ = replicas
    control_plane.admin_key_manages_the_fleet(keyed, {"url": servers["c"].url})


def soak(router, fault_cmd: str, tmp_path) -> dict:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--url", router.url,
         "--duration", str(SOAK_S), "--concurrency", "3", "--fault-at", str(FAULT_AT_S),
         "--fault-cmd", fault_cmd, "--request-timeout", "60", "--settle", str(SETTLE_S),
         "--max-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=SOAK_S + 120)
    result = json.loads(out.read_text()) if out.exists() else {}
    print(proc.stdout[-1500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + router.log_tail(30)
    assert result["fault"]["status"] == 0, result["fault"]
    return result


def healthy(router) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in router.workers()}


def test_crash_loses_no_request(replicas, tmp_path):
    servers, router = replicas
    result = soak(router, f"kill -KILL -- -{servers['a'].proc.pid}", tmp_path)
    assert result["failed"] == 0, result["errors"]
    assert servers["a"].proc.wait(timeout=10) is not None


def test_hang_loses_no_request(replicas, tmp_path):
    servers, router = replicas
    result = soak(router, f"kill -STOP -- -{servers['b'].proc.pid}", tmp_path)
    assert result["failed"] == 0, result["errors"]
    assert healthy(router)[servers["b"].url] is False


def test_stream_cut_ends_with_an_error(replicas):
    servers, router = replicas
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=STREAM_BOUND_S)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "default", "prompt": "The capital of France is", "max_tokens": 4000,
        "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: "), first
    killed = time.monotonic()
    os.killpg(servers["c"].proc.pid, signal.SIGKILL)
    tail, seen = b"", None
    try:
        while line := response.readline():
            tail = (tail + line)[-2000:]
    except (OSError, http.client.HTTPException) as e:
        seen = f"{type(e).__name__}: {e}"
    took = time.monotonic() - killed
    print(f"stream: ended {took:.1f} s after the kill; {seen or 'no exception'}; tail {tail[-300:]!r}")
    assert took < STREAM_BOUND_S
    # Never a stream that looks complete: no [DONE], and no chunk with a finish_reason.
    assert b"[DONE]" not in tail and b'"finish_reason":"' not in tail.replace(b" ", b""), tail
