"""Load is shed, not queued (python/sglang_farskip/serve/shed.py, stores.py), on one keyed demo
server with a small queue (one running request, two queued):
- past the queue bound a request is answered 429 with a Retry-After at once, streaming or not,
  on /generate and the OpenAI routes, while the requests within the bound are served; the
  scheduler is the same process afterwards and still serves;
- the launcher bounds the queue when the user gives no bound, and keeps a bound given;
- /health_generate needs no key and generates at most once per --farskip-health-cache-s;
- sessions past --farskip-max-sessions are refused (429, Retry-After), a closed one frees its
  place, and each is closed --farskip-session-lifetime-s after it opened;
- with --enable-response-store, /v1/responses keeps at most --farskip-max-stored-responses
  results, none older than --farskip-stored-response-ttl-s.

Cost: one server start (~40 s), then ~40 s of checks: SGLang's argument parser imported once
(~20 s), ~17 s waiting for a lifetime to pass.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import side_by_side

KEY = "sk-farskip-shed-test-5d20e9a7"
ADMIN = "adm-farskip-shed-test-81c4f2b6"
MODEL = "farskip-demo"
LIFETIME_S = 15  # sessions and stored responses alike
MAX_SESSIONS = 2
MAX_STORED = 2
QUEUED = 2
ARGS = ["--sleep-on-idle", "--max-running-requests", "1", "--max-queued-requests", str(QUEUED),
        "--enable-response-store", "--farskip-health-cache-s", "600",
        "--farskip-max-sessions", str(MAX_SESSIONS), "--farskip-session-lifetime-s", str(LIFETIME_S),
        "--farskip-max-stored-responses", str(MAX_STORED), "--farskip-stored-response-ttl-s", str(LIFETIME_S)]
# A shed request is answered within a scheduler step or a few (0.02 s here when idle); one that
# is queued instead waits behind a generation of minutes, so this bound tells them apart with a
# wide margin, also on a machine many times overloaded.
SHED_BOUND_S = 30

@pytest.fixture(scope="module")
def server():
    env = {**ONE_THREAD, "FARSKIP_API_KEY": KEY, "FARSKIP_ADMIN_API_KEY": ADMIN}
    with side_by_side({"shed": {"args": ARGS, "env": env, "admin_key": None}}) as servers:
        yield servers["shed"]


def call(url: str, body=None, *, key: str | None = KEY, method: str = "POST",
         timeout: float = 120) -> tuple[int, "http.client.HTTPMessage", str, float]:
    """(status, headers, body, seconds) of one request."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read().decode(errors="replace"), time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode(errors="replace"), time.monotonic() - start


def scheduler_pids(server) -> set[int]:
    return {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "sglang::scheduler" in " ".join(p.cmdline())}


def served(server) -> bool:
    status, _, body, _ = call(server.url + "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
    return status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def wait_for_load(server, running: int, waiting: int, timeout: float = 120) -> None:
    """Until the scheduler reports this many running and waiting requests (SGLang's /v1/loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, body, _ = call(server.url + "/v1/loads?include=core", method="GET")
        load = json.loads(body)["loads"][0] if status == 200 else {}
        if (load.get("num_running_reqs"), load.get("num_waiting_reqs")) == (running, waiting):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the scheduler never had {running} running and {waiting} waiting: {body[:300]}")


def in_background(url: str, body: dict) -> tuple[threading.Thread, list]:
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call(url, body, timeout=600)), daemon=True)
    thread.start()
    return thread, answer


CHAT = [{"role": "user", "content": "hi"}]
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
# Each way a client asks for a generation: past the queue bound, each must be a 429 at once.
PAST_THE_BOUND = {
    "/generate": ("/generate", GEN),
    "/generate stream": ("/generate", {**GEN, "stream": True}),
    "/v1/completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    "/v1/completions stream": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
    "/v1/chat/completions": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "/v1/chat/completions stream": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                             "stream": True}),
    "/v1/responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False}),
}


def test_past_the_queue_bound_a_client_gets_429_at_once(server):
    before = scheduler_pids(server)
    assert before and served(server)
    # One long generation runs (--max-running-requests 1), two short ones wait behind it.
    long_body = {"input_ids": [1, 2, 3], "rid": "shed-test-long",
                 "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    running = [in_background(server.url + "/generate", long_body)]
    queued = []
    try:
        wait_for_load(server, running=1, waiting=0)
        queued = [in_background(server.url + "/generate", GEN) for _ in range(QUEUED)]
        wait_for_load(server, running=1, waiting=QUEUED)
        answers = {}
        for name, (route, body) in PAST_THE_BOUND.items():
            status, headers, text, seconds = call(server.url + route, body, timeout=SHED_BOUND_S)
            answers[name] = (status, headers.get("Retry-After"), round(seconds, 2), text[:160])
            assert status == 429, (name, status, text[:400])
            assert headers.get("Retry-After") == "1", (name, dict(headers))
            assert "queue is full" in text and "data:" not in text, (name, text[:400])
        print(json.dumps(answers, indent=1))
        wait_for_load(server, running=1, waiting=QUEUED)  # the queue was full throughout
    finally:  # the server is shared: stop the long one whatever happened
        status, _, text, _ = call(server.url + "/abort_request", {"rid": "shed-test-long"}, key=ADMIN)
        for thread, _ in running + queued:
            thread.join(timeout=300)
    assert status == 200, text

    # The requests within the bound were served: the short ones once the long one was stopped.
    for _, answer in running + queued:
        assert answer and answer[0][0] == 200, answer
    for _, answer in queued:
        assert json.loads(answer[0][2])["meta_info"]["completion_tokens"] == 2, answer
    assert served(server) and scheduler_pids(server) == before


def test_the_launcher_bounds_the_queue_unless_told(server):
    """The flags as the launcher reads them (SGLang's own parser: both spellings), and the bound
    a server was given is the one it runs with."""
    from sglang_farskip.serve.launcher import GivenArgs
    from sglang_farskip.serve.shed import QUEUE_BOUND, queue_args

    assert QUEUE_BOUND == 256 and queue_args(GivenArgs([])) == ["--max-queued-requests", "256"]
    assert queue_args(GivenArgs(["--max-queued-requests", "7"])) == []
    assert queue_args(GivenArgs(["--max-queued-requests=7"])) == []
    status, _, body, _ = call(server.url + "/server_info", method="GET")
    assert status == 200 and json.loads(body)["max_queued_requests"] == QUEUED


def generations(server) -> int:
    """The batches the scheduler has prefilled so far (SGLang logs each one)."""
    return server.log_path.read_text(errors="replace").count("Prefill batch")


def test_health_generate_is_no_free_generation(server):
    """Ten checks in a row, without a key: at most one real generation (SGLang's own probe
    generates on each)."""
    before = generations(server)
    for _ in range(10):
        status, _, _, _ = call(server.url + "/health_generate", key=None, method="GET")
        assert status == 200
    assert generations(server) - before <= 1


def open_session(server) -> tuple[int, dict, str]:
    status, headers, body, _ = call(server.url + "/open_session", {"capacity_of_str_len": 1000})
    return status, headers, body


def test_sessions_are_bounded_in_number(server):
    ids = []
    try:
        for _ in range(MAX_SESSIONS):
            status, _, body = open_session(server)
            assert status == 200, body
            ids.append(json.loads(body))
        status, headers, body = open_session(server)
        assert status == 429 and "--farskip-max-sessions" in body, (status, body)
        assert 1 <= int(headers.get("Retry-After", 0)) <= LIFETIME_S, dict(headers)
        status, _, body, _ = call(server.url + "/close_session", {"session_id": ids.pop(0)})
        assert status == 200, body
        status, _, body = open_session(server)  # the closed one's place
        assert status == 200, body
        ids.append(json.loads(body))
    finally:  # the server is shared
        for session_id in ids:
            assert call(server.url + "/close_session", {"session_id": session_id})[0] == 200


def stored_response(server) -> str:
    status, _, body, _ = call(server.url + "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert status == 200, body
    return json.loads(body)["id"]


def retrieved(server, response_id: str) -> int:
    return call(server.url + f"/v1/responses/{response_id}", method="GET")[0]


def test_stored_responses_are_bounded_in_number(server):
    first, second, third = (stored_response(server) for _ in range(3))
    assert [retrieved(server, r) for r in (first, second, third)] == [404, 200, 200]


def generate_in_session(server, session_id: str) -> tuple[int, str]:
    status, _, body, _ = call(server.url + "/generate", {**GEN, "session_params": {"id": session_id}})
    return status, body


def test_sessions_and_stored_responses_expire(server):
    status, _, body = open_session(server)
    assert status == 200, body
    session_id = json.loads(body)
    response_id = stored_response(server)
    opened = time.monotonic()
    status, body = generate_in_session(server, session_id)
    assert status == 200 and json.loads(body)["meta_info"]["finish_reason"]["type"] != "abort", body
    assert retrieved(server, response_id) == 200
    time.sleep(max(0.0, opened + LIFETIME_S + 2 - time.monotonic()))
    status, body = generate_in_session(server, session_id)
    assert status == 400 and f"session id {session_id} does not exist" in body, body
    assert retrieved(server, response_id) == 404
    for _ in range(MAX_SESSIONS):  # its place is free again
        status, _, body = open_session(server)
        assert status == 200, body
        assert call(server.url + "/close_session", {"session_id": json.loads(body)})[0] == 200
