"""The load harness (bench/run_load.py) aimed at SGLang's router in PD mode: real prefill and
decode servers (TP=1 each, the demo model, `--enable-metrics`), the real router, real locust.

What each test proves is in its name. The servers and the routers start once (module fixture);
a third router over the same pair is the deployment's own (deploy/router.py, with an inference
and an admin key), for the control-plane checks of tests/control_plane.py in PD mode;
the figures are kept tiny (a few requests of 8 tokens) so that the file takes well under two
minutes on 2 cores, nearly all of it the servers' start.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import control_plane
from proxies import SSEProxy
from sglang_farskip.loadtest import loadstats
from sglang_farskip.testbed import pd
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.router import Router
from sglang_farskip.testbed.servers import run_load, side_by_side

from parity import ONE_THREAD

REQUESTS, MAX_TOKENS = 4, 8
PD_QUEUE = 3  # each server's --max-queued-requests
BURST = 16


@pytest.fixture(scope="module")
def deployment():
    """The PD pair, its router, a second router whose decode worker is reached through a
    proxy (closed by the test that needs a worker nobody can reach), and a third started as the
    deployment starts it, with both keys."""
    # Small queues (tests below): the load runs here keep at most 2 requests in flight.
    runs, bootstrap = pd.pd_runs("pd", ["--enable-metrics", "--max-queued-requests", str(PD_QUEUE)],
                                 decode=["--max-running-requests", "2"], env=ONE_THREAD)
    with side_by_side(runs, serving=pd.serving(runs)) as servers:
        prefill, decode = servers["pd/prefill"], servers["pd/decode0"]
        with SSEProxy(decode.port) as proxy, \
                pd.router(servers, "pd", bootstrap) as router, \
                Router([(prefill.url, bootstrap)], [proxy.url]) as proxied, \
                pd.router(servers, "pd", bootstrap, keys=control_plane.KEYS) as keyed:
            router.wait_ready()
            proxied.wait_ready()
            keyed.wait_ready()
            yield {"prefill": prefill, "decode": decode, "router": router, "proxy": proxy, "proxied": proxied,
                   "keyed": keyed, "bootstrap": bootstrap}


@pytest.fixture(scope="module")
def pd_run(deployment, tmp_path_factory):
    out = tmp_path_factory.mktemp("pd")
    # SGLang's native /generate: the router's own /v1/completions takes no token-id prompts.
    r = run_load("--target", f"pd={deployment['router'].url}", "--endpoint", "generate", "--concurrency", "2",
                 "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--input-len", "16",
                 "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr + deployment["router"].log_tail(20)
    return out, json.loads((out / "results.json").read_text())


def test_router_target_lists_each_worker_with_its_role(deployment, pd_run):
    _, res = pd_run
    facts = res["targets"]["pd"]
    assert facts["router"] == "pd"
    roles = {w["url"]: w["role"] for w in facts["workers"]}
    assert roles == {deployment["prefill"].url: "prefill", deployment["decode"].url: "decode"}
    # The roles are the servers' own (/farskip/info), each a FarSkip server in its layout.
    assert all(w["farskip_mode"] == "overlap" and w["tp_size"] == 1 for w in facts["workers"])
    assert facts["tokenizer_path"] and facts["model_path"]


def test_each_figure_names_the_server_of_its_phase(deployment, pd_run):
    out, res = pd_run
    phases = res["targets"]["pd"]["phases"]
    assert phases == {"ttft": [deployment["prefill"].url], "itl": [deployment["decode"].url]}
    note = (out / "report.md").read_text().split("\n\n", 2)[1]
    ttft = note[note.index("TTFT = prefill phase"):note.index("ITL = decode phase")]
    itl = note[note.index("ITL = decode phase"):]
    assert f"prefill server {deployment['prefill'].url} (FarSkip mode `overlap`, TP=1, 1 node)" in ttft
    assert f"decode server {deployment['decode'].url} (FarSkip mode `overlap`, TP=1, 1 node)" in itl
    assert deployment["decode"].url not in ttft and deployment["prefill"].url not in itl


def test_each_phase_server_reports_its_own_histograms(deployment, pd_run):
    out, res = pd_run
    (lv,) = res["levels"]
    assert lv["server"] is None  # the router's URL has none of its servers' metrics
    by_role = {ps["role"]: ps for ps in lv["phase_servers"]}
    assert {r: ps["url"] for r, ps in by_role.items()} == {"prefill": deployment["prefill"].url,
                                                            "decode": deployment["decode"].url}
    recs = loadstats.read_records(out / lv["records"])
    assert len(recs) == REQUESTS and all(r["ok"] for r in recs)
    prefill, decode = by_role["prefill"]["metrics"], by_role["decode"]["metrics"]
    # The prefill server times each request's stay (E2E) and, in PD mode, no first token: the
    # decode server sends it to the client.
    assert (prefill["e2e"]["count"], prefill["ttft"]["count"], prefill["itl"]["count"]) == (REQUESTS, 0, 0)
    # The decode server sends every token: one first token per request, and a gap for each token
    # of every later output. The client times a gap for each token after its first chunk, so the
    # two counts are the same unless a first chunk carried the server's first two outputs (a
    # slow reader: SGLang merges outputs not yet sent; seen under load, 28 gaps against 27).
    # Both are then bounded by the tokens after each first one.
    assert (decode["e2e"]["count"], decode["ttft"]["count"]) == (REQUESTS, REQUESTS)
    client_gaps = sum(len(r["itl"]) for r in recs)
    assert 0 < client_gaps <= decode["itl"]["count"] <= sum(r["output_tokens"] - 1 for r in recs)
    if all(r["first_chunk_tokens"] == 1 for r in recs):
        assert decode["itl"]["count"] == client_gaps
    md = (out / "report.md").read_text()
    assert f"| pd | 2 | prefill | {deployment['prefill'].url} | - | - | {REQUESTS} / " in md
    assert f"| pd | 2 | decode | {deployment['decode'].url} | {REQUESTS} / " in md


def _wait_listening(router: Router, timeout: float = 60) -> None:
    """Until the router answers at all (its /health says 200 with no worker registered)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(router.url + "/health", timeout=5).read()
            return
        except OSError:
            assert time.monotonic() < deadline and router.proc.poll() is None, router.log_tail(20)
            time.sleep(0.3)


def _error_line(r) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    return line


def test_completions_through_the_router_name_the_endpoint_that_works(deployment, tmp_path):
    r = run_load("--url", deployment["router"].url, "--requests", "1", "--out", str(tmp_path), timeout=60)
    assert "pass --endpoint generate" in _error_line(r)


def test_router_with_no_workers_is_one_clear_error(tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"
    with Router(workers=[nowhere]) as router:  # the router never registers a worker it cannot reach
        _wait_listening(router)
        r = run_load("--url", router.url, "--requests", "1", "--out", str(tmp_path), timeout=60)
    assert f"the router at {router.url} lists no workers" in _error_line(r)


def test_worker_nobody_can_reach_is_one_clear_error(deployment, tmp_path):
    proxied, proxy = deployment["proxied"], deployment["proxy"]
    proxy.close()  # the router still lists it (unhealthy once its checks notice: seen 15 s on)
    r = run_load("--url", proxied.url, "--endpoint", "generate", "--requests", "1", "--out", str(tmp_path),
                 timeout=60)
    line = _error_line(r)
    assert f"decode worker: cannot reach the server at {proxy.url}" in line
    assert f"the router at {proxied.url} lists it" in line
    assert not (Path(tmp_path) / "results.json").exists()


def test_pd_router_control_plane_refuses_the_inference_key(deployment):
    control_plane.inference_key_cannot_steer(deployment["keyed"])


def test_pd_router_control_plane_answers_the_admin_key(deployment):
    control_plane.admin_key_manages_the_fleet(
        deployment["keyed"], {"url": deployment["prefill"].url, "worker_type": "prefill",
                              "bootstrap_port": deployment["bootstrap"]})


def post_generate(url: str, body: dict) -> tuple[int, float, str]:
    """(status, seconds, body) of one /generate; an HTTP error status is an answer."""
    start = time.monotonic()
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, time.monotonic() - start, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - start, e.read().decode()


def burst(url: str, n: int = BURST) -> list[tuple[int, float]]:
    """n /generate requests at once: (status, seconds) of each."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    with ThreadPoolExecutor(n) as pool:
        return [answer[:2] for answer in pool.map(lambda _: post_generate(url, body), range(n))]


@pytest.mark.parametrize("server", ["prefill", "decode"])
def test_pd_servers_bound_their_queues(deployment, server):
    """SGLang applies --max-queued-requests only without disaggregation (serve/shed.py,
    pd_queue_bounded): past it a PD server answers 429 at once instead of queueing. Asked
    directly, each prompt with SGLang's fake bootstrap (its own health check's: no peer, no
    transfer), so that the server's answer is what the client sees. One batch of token-id
    prompts reaches the scheduler as one message (SGLang's batch dispatch), so its prompts
    queue together: PD_QUEUE of them fit, one more is refused, whatever the machine's load
    (a burst of separate clients was not: under load they arrived one by one and each was
    served before the next came). Through the router a server's 429 is not what the client
    sees (sglang-router holds the pair's other half until its request timeout): the router's
    own bound turns a burst away first (next test)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    target = deployment[server]
    pids = target.scheduler_pids()

    def batch(n: int, first_room: int) -> dict:
        return {"input_ids": [[11, 12, 13, 14, 15 + k] for k in range(n)],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "bootstrap_host": [FAKE_BOOTSTRAP_HOST] * n, "bootstrap_room": list(range(first_room, first_room + n))}

    status, _, answer = post_generate(target.url, batch(PD_QUEUE, 1000))
    assert status == 200 and len(json.loads(answer)) == PD_QUEUE, answer[:500]
    status, took, answer = post_generate(target.url, batch(PD_QUEUE + 1, 2000))
    assert status == 429 and "request queue is full" in answer and took < 10, (status, took, answer[:500])
    assert target.scheduler_pids() == pids
    assert generate_ok(deployment["router"].url)


def test_router_turns_a_burst_away_before_the_servers(deployment):
    """Past --max-concurrent-requests in flight the router answers 429 at once (router.args:
    --queue-size 0; deploy/router.py sets the bound): the servers never see the burst, so
    the router's circuit breaker never takes them out, and the next request is served."""
    with Router([(deployment["prefill"].url, deployment["bootstrap"])], [deployment["decode"].url],
                extra=["--max-concurrent-requests", "2"]) as limited:
        limited.wait_ready()
        answers = burst(limited.url)
        shed = [s for status, s in answers if status == 429]
        assert len(shed) >= BURST - 2 - PD_QUEUE and max(shed) < 1.0, answers
        assert sum(status == 200 for status, _ in answers) >= 2, answers
        assert "status=429" not in limited.log_path.read_text(), limited.log_tail(20)  # no server shed
        assert generate_ok(limited.url)


def generate_ok(url: str) -> bool:
    status, _, answer = post_generate(url, {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    return status == 200 and bool(json.loads(answer)["text"])
