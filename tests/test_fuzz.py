"""The fuzzer (python/sglang_farskip/testbed/fuzz.py) over every route of a keyed demo server,
with the inference key: seeded (FARSKIP_FUZZ_SEED repeats a run; the seed is printed first) and
bounded (BUDGET_S of drawing, each answer within fuzz.SLOW_S). It fails on any 5xx not listed
in KNOWN, an answer slower than the bound, no answer, or the server not serving a plain
completion afterwards with the same scheduler processes. Every route of SGLang's app is fuzzed
or in NOT_FUZZED with the reason; every admin route answers the inference key 403 and nothing
else. About 180 s: one server start (~40 s) and the budget (120 s), plus SGLang's import here for its
route list.
"""

from __future__ import annotations

import re

import pytest

from parity import ONE_THREAD
from sglang_farskip.testbed import fuzz
from sglang_farskip.testbed.fuzz import Known
from sglang_farskip.testbed.servers import side_by_side

KEY = "sk-farskip-fuzz-test-5c0e9d71"
ADMIN = "adm-farskip-fuzz-test-e41a6b20"
BUDGET_S = fuzz.BUDGET_S


def values(body, field: str) -> list:
    """Every value of `field` anywhere in a JSON body (top level, sampling_params, options, ...)."""
    if isinstance(body, dict):
        return [v for k, v in body.items() if k == field] + [x for v in body.values() for x in values(v, field)]
    if isinstance(body, list):
        return [x for v in body for x in values(v, field)]
    return []


EMBEDDING_ROUTES = {"/encode", "/classify", "/v1/classify", "/v1/embeddings", "/v1/rerank"}
# 5xx found by the fuzzer in SGLang 0.5.23 itself, each a ValueError or TypeError raised by one
# route's handler in the HTTP process on the client's input (Starlette answers 500): no
# scheduler sees the request and the server serves on (the run checks it after each). Sent
# each time, counted in the report, failing nothing. Empty this list as each is answered 4xx.
KNOWN = (
    Known("/parse_function_call without a tool_call_parser", lambda r: r.route == "/parse_function_call",
          'upstream: FunctionCallParser raises ValueError("Unsupported tool_call_parser: None"), a 500; '
          'minimal: {"text": ""}', send=True),
    Known("/separate_reasoning with an empty reasoning_parser", lambda r: r.route == "/separate_reasoning",
          'upstream: ReasoningParser raises ValueError("Model type must be specified"), a 500; '
          'minimal: {"reasoning_parser": "", "text": ""}', send=True),
    Known("/v1/loads with an unknown include section", lambda r: r.route == "/v1/loads",
          'upstream: ValueError("Invalid include sections") escapes the handler, a 500; minimal: GET /v1/loads?include=0',
          send=True),
    Known("/api/chat with no messages", lambda r: r.route == "/api/chat" and not (r.body or {}).get("messages"),
          "upstream: the tokenizer's apply_chat_template raises ValueError on an empty conversation, a 500; "
          'minimal: {"messages": [], "model": ""}', send=True),
    Known("/vertex_generate with a parameter GenerateReqInput does not have",
          lambda r: r.route == "/vertex_generate" and isinstance((r.body or {}).get("parameters"), dict)
          and not set(r.body["parameters"]) <= generate_fields(),
          "upstream: the parameters become GenerateReqInput's keyword arguments unchecked (TypeError), a 500; "
          'minimal: {"instances": [{"text": "hi"}], "parameters": {"max_new_tokens": 4}}', send=True),
    Known("/v1/audio/transcriptions on a model without audio", lambda r: r.route == "/v1/audio/transcriptions",
          "upstream: the transcription request reaches the tokenizer with a keyword this model's path does "
          "not take (TypeError: _detect_language), a 500, or with stream=true the connection cut; minimal: "
          'a form {"file": ""}', send=True, kinds=("5xx", "no answer")),
    Known("an embedding route on a generation model", lambda r: r.route in EMBEDDING_ROUTES,
          "upstream: the demo serves generation, and SGLang's embedding routes raise on some shapes before "
          'refusing that (a 500): POST /v1/classify {"input": "0", "rid": []} (unhashable list), PUT /classify '
          '{"sampling_params": [{}, {}, {}, {}], "image_data": ""}', send=True),
)

def generate_fields() -> set[str]:
    import dataclasses

    from sglang.srt.managers.io_struct import GenerateReqInput

    return {f.name for f in dataclasses.fields(GenerateReqInput)}


# Routes of SGLang's app the fuzzer does not draw requests for, and why.
NOT_FUZZED = {
    "/v1/realtime": "a websocket: no HTTP request to draw (its key check: issue 46 item 6)",
    "/openapi.json": "FastAPI's schema page, read by the fuzzer itself",
    "/docs": "FastAPI's documentation page: static",
    "/docs/oauth2-redirect": "FastAPI's documentation page: static",
    "/redoc": "FastAPI's documentation page: static",
}


def app_routes():
    """{(method, path)} of SGLang's app (included routers too) and {path: endpoint}."""
    from sglang.srt.entrypoints.http_server import app

    routes, endpoints = set(), {}

    def walk(items):
        for route in items:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                walk(inner.routes)
                continue
            path = re.sub(r":\w+}", "}", route.path)  # {model:path} -> {model}, as /openapi.json has it
            endpoints[path] = getattr(route, "endpoint", None)
            methods = (getattr(route, "methods", None) or {"WEBSOCKET"}) - {"HEAD"}
            routes.update((m, path) for m in methods)

    walk(app.routes)
    return routes, endpoints, app


@pytest.fixture(scope="module")
def server():
    env = {**ONE_THREAD, "FARSKIP_API_KEY": KEY, "FARSKIP_ADMIN_API_KEY": ADMIN}
    with side_by_side({"keyed": {"args": ["--sleep-on-idle"], "env": env, "admin_key": None}}) as started:
        yield started["keyed"]


def test_fuzz_every_route(server):
    before = server.scheduler_pids()
    assert before
    report = fuzz.run(server.url, KEY, seed=fuzz.seed_from_env(), budget_s=BUDGET_S, known=KNOWN)
    print(report.summary())
    assert not report.findings, report.summary()
    assert server.scheduler_pids() == before, "a scheduler process was replaced"

    from sglang_farskip.serve import admin

    routes, endpoints, app = app_routes()
    fuzzed = {tuple(name.split(" ", 1)) for name in report.operations}
    fuzzed_endpoints = {endpoints.get(path) for _, path in fuzzed}
    missing = {(m, p) for m, p in routes - fuzzed
               if p not in NOT_FUZZED and endpoints.get(p) not in fuzzed_endpoints}  # /tokenize is /v1/tokenize
    assert not missing, f"routes of the app the fuzzer never drew: {sorted(missing)}"

    admin_paths = set(admin.admin_routes(app))
    for name in report.operations:
        statuses = set(report.statuses[name])
        if name.split(" ", 1)[1] in admin_paths:
            assert statuses <= {403}, (name, report.statuses[name])
    unanswered = [name for name in report.operations if not report.statuses[name]]
    assert not unanswered, f"operations that got no request: {unanswered}"
