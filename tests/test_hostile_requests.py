"""No request from a key holder takes the server down or over (python/sglang_farskip/serve/
admission.py, admin.py): each hostile request below, sent with the inference key, is answered
4xx, streaming ones before their stream starts; the scheduler is the same process before and
after and still serves. The admin routes answer 403 to the inference key, 401 to no key, and
serve the admin key; a server with no admin key answers 403 to everyone.

Without admission.py's rows in python/sglang_farskip/boundary/table.csv, the first case ends the
server (topk out of range in the scheduler), and the test fails there; without admin.py's rows,
the inference key gets 200 from /pause_generation.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import psutil
import pytest

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import side_by_side

KEY = "sk-farskip-hostile-test-9a41c3"
ADMIN = "adm-farskip-hostile-test-27f0b8"
MODEL = "farskip-demo"
VOCAB = 4096  # the demo model's

CHAT = [{"role": "user", "content": "hi"}]
SMALL = {"max_new_tokens": 2}
# name -> (route, body, a fragment the answer must hold). Ours first (each of these crashed or
# wedged the server before admission.py), then ones SGLang refuses itself, kept refused.
HOSTILE = {
    "top_logprobs_num huge": ("/generate", {"input_ids": [1, 2], "sampling_params": SMALL,
                                            "return_logprob": True, "top_logprobs_num": 1000000},
                              "top_logprobs_num=1000000"),
    "top_logprobs_num negative": ("/generate", {"input_ids": [1, 2], "sampling_params": SMALL,
                                                "return_logprob": True, "top_logprobs_num": -5}, "top_logprobs_num=-5"),
    "top_logprobs_num per batch item": ("/generate", {"input_ids": [[1], [2]], "sampling_params": SMALL,
                                                      "return_logprob": True, "top_logprobs_num": [1, 5000]},
                                        "top_logprobs_num=5000"),
    "input id beyond the vocabulary": ("/generate", {"input_ids": [1, 2, 1000000000], "sampling_params": SMALL},
                                       "token id 1000000000 is outside the vocabulary"),
    "input id = vocabulary size": ("/generate", {"input_ids": [VOCAB], "sampling_params": SMALL},
                                   f"token id {VOCAB} is outside"),
    "negative input id": ("/generate", {"input_ids": [1, -2, 3], "sampling_params": SMALL}, "token id -2"),
    "bad id in a batch": ("/generate", {"input_ids": [[1, 2], [3, 99999]], "sampling_params": SMALL}, "token id 99999"),
    "logprob_start_len negative": ("/generate", {"input_ids": [1, 2, 3], "sampling_params": SMALL,
                                                 "return_logprob": True, "logprob_start_len": -7}, "logprob_start_len=-7"),
    "n huge": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "n": 100000}}, "n=100000"),
    "n zero": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "n": 0}}, "n=0"),
    "too many tokens in one batch": ("/generate", {"input_ids": [[1, 2]] * 600, "sampling_params": {"max_new_tokens": 128}},
                                     "--farskip-max-request-tokens"),
    "stream: top_logprobs_num huge": ("/generate", {"input_ids": [1, 2], "stream": True, "sampling_params": SMALL,
                                                    "return_logprob": True, "top_logprobs_num": 1000000},
                                      "top_logprobs_num=1000000"),
    "completions logprobs huge": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                      "logprobs": 1000000}, "logprobs=1000000"),
    "completions token prompt beyond the vocabulary": ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 1000000000],
                                                                           "max_tokens": 2}, "prompt: token id 1000000000"),
    "completions n huge": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 100000}, "n=100000"),
    "completions best_of huge": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                     "best_of": 100000}, "best_of=100000"),
    "completions stream logprobs huge": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                             "stream": True, "logprobs": 1000000}, "logprobs=1000000"),
    "chat top_logprobs huge": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                        "logprobs": True, "top_logprobs": 1000000}, "top_logprobs=1000000"),
    "chat n huge": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": 100000}, "n=100000"),
    "chat stream top_logprobs huge": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                               "stream": True, "logprobs": True, "top_logprobs": 1000000},
                                      "top_logprobs=1000000"),
    "detokenize ids beyond the vocabulary": ("/v1/detokenize", {"model": MODEL, "tokens": [1, 1000000000]},
                                             "token id 1000000000"),
    # Refused by SGLang itself.
    "temperature negative": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "temperature": -1}}, "temperature"),
    "top_p zero": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "top_p": 0}}, "top_p"),
    "top_k zero": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "top_k": 0}}, "top_k"),
    "min_p above 1": ("/generate", {"text": "hi", "sampling_params": {**SMALL, "min_p": 5}}, "min_p"),
    "logit_bias beyond the vocabulary": ("/generate", {"text": "hi", "sampling_params": {
        **SMALL, "logit_bias": {"1000000000": 1.0}}}, "logit_bias"),
    "max_new_tokens past the context": ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}},
                                        "context length"),
    "logprob_start_len past the prompt": ("/generate", {"input_ids": [1, 2, 3], "sampling_params": SMALL,
                                                        "return_logprob": True, "logprob_start_len": 100}, "logprob_start_len"),
    "token_ids_logprob beyond the vocabulary": ("/generate", {"input_ids": [1], "sampling_params": SMALL,
                                                              "return_logprob": True, "token_ids_logprob": [10**9]},
                                                "out-of-vocabulary"),
    "bad json schema": ("/generate", {"input_ids": [1], "sampling_params": {**SMALL, "json_schema": "{not json"}}, "json"),
    "input_embeds": ("/generate", {"input_embeds": [[0.0] * 7], "sampling_params": SMALL}, "input_embeds"),
    "empty input_ids": ("/generate", {"input_ids": [], "sampling_params": SMALL}, "empty"),
    "malformed body": ("/generate", "{not json", ""),
}


def call(url: str, body, key: str | None = KEY, method: str = "POST", timeout: float = 60) -> tuple[int, str]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data if method != "GET" else None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def scheduler_pids(server) -> set[int]:
    return {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "sglang::scheduler" in " ".join(p.cmdline())}


@pytest.fixture(scope="module")
def servers():
    """One server with both keys, one with only the inference key (admin routes closed)."""
    env = {**ONE_THREAD, "FARSKIP_API_KEY": KEY}
    runs = {"keyed": {"args": ["--sleep-on-idle"], "env": {**env, "FARSKIP_ADMIN_API_KEY": ADMIN}, "admin_key": None},
            "no_admin": {"args": ["--sleep-on-idle"], "env": env, "admin_key": None}}
    with side_by_side(runs) as started:
        yield started


def served(server) -> bool:
    status, body = call(server.url + "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
    return status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_hostile_requests_are_refused_and_the_server_keeps_serving(servers):
    server = servers["keyed"]
    before = scheduler_pids(server)
    assert before and served(server)
    answers = {}
    for name, (route, body, fragment) in HOSTILE.items():
        status, text = call(server.url + route, body)
        answers[name] = (status, text[:300])
        assert 400 <= status < 500 and fragment in text, (name, status, text[:500])
        assert "data:" not in text, (name, "refused inside a stream, not before it")
        assert served(server), f"the server stopped serving after: {name}"
    assert scheduler_pids(server) == before, "a scheduler process was replaced"
    print(json.dumps(answers, indent=1))


def test_limits_are_exact(servers):
    """The largest allowed values pass: the checks refuse only past the limits."""
    url = servers["keyed"].url
    ok = {"input_ids": [0, VOCAB - 1], "sampling_params": {"max_new_tokens": 1, "n": 16},
          "return_logprob": True, "top_logprobs_num": 20, "logprob_start_len": -1}
    status, text = call(url + "/generate", ok)
    assert status == 200 and len(json.loads(text)) == 16, text[:300]
    status, text = call(url + "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                       "logprobs": True, "top_logprobs": 20, "n": 2})
    assert status == 200, text[:300]
    assert call(url + "/generate", {**ok, "top_logprobs_num": 21})[0] == 400


def admin_routes() -> list[tuple[str, str]]:
    """(method, path) of every admin route of SGLang's app, as the launcher's hooks rate them."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_farskip.serve import admin

    paths = set(admin.admin_routes(app))
    routes = [(method, r.path) for r in app.routes if getattr(r, "path", None) in paths
              for method in sorted((getattr(r, "methods", None) or set()) - {"HEAD"})]
    return sorted(routes)


def test_admin_routes_need_the_admin_key(servers):
    keyed, no_admin = servers["keyed"], servers["no_admin"]
    routes = admin_routes()
    assert ("POST", "/pause_generation") in routes and ("POST", "/configure_logging") in routes
    for method, path in routes:
        path = path.replace("{method}", "x")
        for server, key, expected in ((keyed, KEY, 403), (keyed, None, 401), (no_admin, KEY, 403),
                                      (no_admin, ADMIN, 403)):
            status, text = call(server.url + path, {}, key=key, method=method)
            assert status == expected, (path, key, status, text[:200])
    # The admin key opens them (harmless ones here), and the server still serves after.
    for path in ("/flush_cache", "/pause_generation", "/continue_generation"):
        status, text = call(keyed.url + path, {}, key=ADMIN)
        assert status == 200, (path, text[:200])
    assert served(keyed) and served(no_admin)
