"""A property-based fuzzer over every route of a running SGLang server (ours or stock).

    python -m sglang_farskip.testbed.fuzz http://127.0.0.1:30000 --key "$API_KEY" [--seed N] [--budget 120]

It reads the server's own `/openapi.json` (SGLang's FastAPI app describes each route's query,
path and body from SGLang's request models) and, for every operation in it, draws requests with
schemathesis (Hypothesis strategies from each schema) and sends them with the key. Schemas are
narrowed before drawing so that the run looks for crashes and wedges rather than measuring how
long a big request takes (see `narrowed`): lists of at most 4 items, strings of at most 24
characters, and every field that multiplies the work (`max_new_tokens`, `n`, beam width, ...)
small or far out of range; a generating route without a token limit gets one (`bounded`).
Free-form fields that SGLang parses later (the `sampling_params` of `/generate`, `input_ids`)
get the shape of what parses them, with values of the wrong type and out-of-range edges mixed
in. For the routes that generate, half of the draws are a plain request (BASES) with one to
three drawn fields put in, so that odd values reach the scheduler instead of being refused
with the first of seventy odd fields.

A failure is: an answer with a 5xx status (or a 5xx error inside a stream), an answer slower
than `slow_s`, no answer at all, or the server not serving a plain completion afterwards. A
5xx is shrunk by Hypothesis to a minimal request (the first 5xx of an operation ends its
turn); the other kinds stop the operation (a server that is busy or gone makes shrinking
meaningless), and a server that no longer serves stops the run. 401/403 are answers like any
4xx: the admin routes refuse the inference key, and the fuzzer never holds the admin key.

Seeded (`--seed`, or FARSKIP_FUZZ_SEED; printed first) and bounded: the budget is shared out
over the operations still to run (generating ones weigh more), each gets at least one request,
and shrinking a 5xx adds at most SHRINK_S. The seed fixes the sequence of requests of each
operation; how far along it a run gets depends on how fast the server answers.

`Known` entries describe findings already known: requests matching one are either held back
(counted, reported, never sent: a crash fixed elsewhere must not hide the rest) or sent with
their 5xx counted under the entry's name instead of failing (an upstream 500 that harms
nothing). The report shows both.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import os
import random
import re
import sys
import time
import urllib.parse
import zlib
from typing import Any, Callable, Optional

DEFAULT_SEED = 46
SEED_ENV = "FARSKIP_FUZZ_SEED"
BUDGET_S = 120.0
# An answer slower than this is a finding. The demo server answers a bounded request (at most
# 4 prompts x n 16 x 16 new tokens) in a few seconds on 2 cores, and in up to 20 s beside two
# busy loops and another test run; the wedges this is for lasted minutes.
SLOW_S = 60.0
SHRINK_S = 10.0
REFUSED = {401, 403, 404}
# The routes that reach the scheduler (those of BASES) get this many shares of the budget to
# the others' one: their answers take longer, and they are where a request can wedge a server.
GENERATING_WEIGHT = 12
BATCH = 8  # examples per Hypothesis run (the first run: one); an operation runs them until its share is spent

MAX_ITEMS = 4
MAX_LENGTH = 24
MAX_PROPERTIES = 4
SMALL_INT = {"type": "integer", "minimum": -2, "maximum": 16}
# Far out of range for any request field: each must be refused, never run.
HUGE_INTS = [2**31 - 1, 2**31, 2**63, 10**12, -(2**31)]
# Fields whose value multiplies the work one request asks for: small, or far out of range.
COST_FIELDS = {"max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens", "n",
               "best_of", "beam_width", "num_predict", "top_logprobs_num", "top_logprobs", "logprobs",
               "max_thinking_tokens", "top_n", "num_ctx", "stream_interval", "routed_experts_start_len"}
# What a JSON client may put where SGLang expects a number, besides numbers.
EDGES = [-1, 0, 1e39, -1e39, 1e308, 2**63, "1", "", None, True, [], {}]
ANY_SCALAR = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "integer"}, {"type": "number"},
                        {"type": "string", "maxLength": MAX_LENGTH}]}
TOKEN_ID = {"anyOf": [{"type": "integer", "minimum": -2, "maximum": 70000}, {"enum": HUGE_INTS}]}
TOKEN_IDS = {"anyOf": [{"type": "array", "items": TOKEN_ID, "maxItems": 8},
                       {"type": "array", "items": {"type": "array", "items": TOKEN_ID, "maxItems": 8},
                        "maxItems": MAX_ITEMS},
                       ANY_SCALAR]}


# ---------------------------------------------------------------------- the requests
@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    route: str  # the operation's path, with {params}
    path: str  # filled in, with the query string
    body: Any = None  # JSON value; for multipart, the form's fields
    media: Optional[str] = None

    def key(self) -> str:
        return json.dumps([self.method, self.path, self.body, self.media], sort_keys=True, default=repr)

    def describe(self) -> str:
        body = "" if self.body is None else " " + json.dumps(self.body, default=repr)[:2000]
        return f"{self.method} {self.path}{body}"


@dataclasses.dataclass
class Answer:
    status: Optional[int]  # None: no answer (timeout, connection refused or cut)
    seconds: float
    text: str = ""
    error: str = ""

    def stream_5xx(self) -> Optional[int]:
        """A 5xx error reported inside a stream that answered 200 (SSE `data:` lines)."""
        for line in self.text.splitlines():
            if line.startswith("data:") and '"error"' in line:
                codes = re.findall(r'"(?:code|status_code)"\s*:\s*(\d{3})', line)
                if any(int(code) >= 500 for code in codes):
                    return int(codes[0])
        return None


@dataclasses.dataclass
class Finding:
    kind: str  # "5xx", "slow", "no answer", "down"
    request: Request
    answer: Answer

    def describe(self) -> str:
        status = self.answer.status if self.answer.status is not None else self.answer.error
        return (f"[{self.kind}] {self.request.describe()}\n    -> {status} after {self.answer.seconds:.1f} s: "
                f"{self.answer.text[:400]!r}")


@dataclasses.dataclass(frozen=True)
class Known:
    """A finding already known. `send=False` (a wedge or crash fixed elsewhere): requests it
    `matches` are held back, never sent. `send=True` (a harmless 5xx): they are sent, and a
    5xx they get is counted under this name instead of failing; the server must still serve
    after them. Both are in the report."""

    name: str
    matches: Callable[[Request], bool]
    reason: str
    send: bool = False
    kinds: tuple = ("5xx",)  # with send=True: the kinds of failure it accounts for


@dataclasses.dataclass
class Report:
    seed: int
    budget_s: float
    operations: list = dataclasses.field(default_factory=list)
    statuses: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    findings: list = dataclasses.field(default_factory=list)
    held_back: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    known_5xx: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: dict = dataclasses.field(default_factory=dict)  # known name -> one held-back request
    sent: int = 0
    seconds: float = 0.0

    @property
    def down(self) -> Optional[Finding]:
        return next((f for f in self.findings if f.kind == "down"), None)

    def summary(self) -> str:
        lines = [f"fuzz: seed {self.seed} ({SEED_ENV}={self.seed} to repeat), {len(self.operations)} operations, "
                 f"{self.sent} requests in {self.seconds:.0f} s (budget {self.budget_s:.0f} s), "
                 f"{len(self.findings)} finding(s)"]
        for name in self.operations:
            counts = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses[name].items(), key=str))
            lines.append(f"  {name:55s} {counts or 'nothing sent'}")
        for name, n in sorted(self.held_back.items()):
            lines.append(f"  held back (known: {name}): {n}, e.g. {self.examples[name].describe()[:300]}")
        for name, n in sorted(self.known_5xx.items()):
            lines.append(f"  known failures ({name}): {n}, e.g. {self.examples[name].describe()[:300]}")
        lines += [f.describe() for f in self.findings]
        return "\n".join(lines)


# ---------------------------------------------------------------------- schemas
def _inline(schema: Any, components: dict, depth: int = 0) -> Any:
    """`schema` with every $ref replaced by its target; past a few levels a ref is any scalar
    (recursive models: a message holding messages)."""
    if isinstance(schema, list):
        return [_inline(s, components, depth) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        if depth > 5:
            return ANY_SCALAR
        target = components[schema["$ref"].rsplit("/", 1)[-1]]
        return _inline({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, components, depth + 1)
    return {k: _inline(v, components, depth) for k, v in schema.items()}


def _has_type(schema: dict, kind: str) -> bool:
    if schema.get("type") == kind:
        return True
    return any(isinstance(s, dict) and _has_type(s, kind) for s in schema.get("anyOf", []) + schema.get("oneOf", []))


def narrowed(schema: Any, enrich: dict, name: str = "") -> Any:
    """Bounded sizes everywhere; COST_FIELDS small or far out of range; `enrich[name]` where a
    property of that name is free-form in the app's schema."""
    if not isinstance(schema, dict):
        return schema
    if name in enrich:
        return enrich[name]
    if name in COST_FIELDS and _has_type(schema, "integer"):
        return {"anyOf": [SMALL_INT, {"enum": HUGE_INTS}, {"type": "null"}]}
    if not schema or schema == {"title": schema.get("title")} or set(schema) <= {"title", "description", "default"}:
        return ANY_SCALAR  # "any value": a bounded one
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {prop: narrowed(sub, enrich, prop) for prop, sub in value.items()}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            out[key] = [narrowed(sub, enrich, name) for sub in value]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = narrowed(value, enrich)
        elif key in ("default", "examples", "example", "discriminator", "contentMediaType", "format"):
            continue  # documentation, or a format the strategies would have to honour
        else:
            out[key] = value
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "array" in kinds:
        out["maxItems"] = max(out.get("minItems", 0), min(out.get("maxItems", MAX_ITEMS), MAX_ITEMS))
    if "string" in kinds:
        out["maxLength"] = max(out.get("minLength", 0), min(out.get("maxLength", MAX_LENGTH), MAX_LENGTH))
    if "object" in kinds:
        out["maxProperties"] = max(len(out.get("required", [])), len(out.get("properties", {})), MAX_PROPERTIES)
        if out.get("additionalProperties") is True:
            out["additionalProperties"] = ANY_SCALAR
    return out


def _widened(schema: dict) -> dict:
    """A field's own schema, or an edge value (wrong type, out of range)."""
    return {"anyOf": [schema, {"enum": EDGES}]}


def sampling_params_schema() -> dict:
    """The fields of SGLang's SamplingParams (a msgspec Struct: msgspec writes each field's
    schema), each also taking edge values: what `/generate`'s free-form `sampling_params`
    reaches."""
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    properties = {}
    for field in msgspec.structs.fields(SamplingParams):
        try:
            schema = msgspec.json.schema(field.type)
        except (TypeError, msgspec.ValidationError, ValueError):
            schema = {}
        schema = _inline(schema, schema.pop("$defs", {}) if isinstance(schema, dict) else {})
        properties[field.name] = _widened(narrowed(schema, {}, field.name))
    one = {"type": "object", "properties": properties, "additionalProperties": False}
    return {"anyOf": [one, {"type": "array", "items": one, "maxItems": MAX_ITEMS}, {"type": "null"}]}


def default_enrich() -> dict:
    """Free-form fields of SGLang's request models and the schema of what parses them."""
    return {"sampling_params": sampling_params_schema(), "input_ids": TOKEN_IDS}


def narrowed_spec(spec: dict, enrich: dict) -> dict:
    """The app's OpenAPI document with every schema in it `narrowed` (components by name, and
    each operation's parameters and body)."""
    spec = json.loads(json.dumps(spec))
    components = spec.get("components", {}).get("schemas", {})
    for name, schema in components.items():
        components[name] = narrowed(schema, enrich)
    for methods in spec["paths"].values():
        for op in methods.values():
            for p in op.get("parameters", []):
                p["schema"] = narrowed(p.get("schema", {}), enrich, p["name"])
            for content in (op.get("requestBody") or {}).get("content", {}).values():
                content["schema"] = narrowed(content.get("schema", {}), enrich)
    return spec


def operations(spec: dict, enrich: dict) -> list:
    """Schemathesis' operations (APIOperation) of the narrowed document, HEAD left out (GET's
    twin)."""
    import schemathesis

    schema = schemathesis.openapi.from_dict(narrowed_spec(spec, enrich))
    found = []
    for result in schema.get_all_operations():
        op = result.ok()  # raises on a route whose schema schemathesis cannot read
        if op.method.upper() != "HEAD":
            found.append(op)
    return found


def name_of(op) -> str:
    return f"{op.method.upper()} {op.path}"


# A plain request to each generating route: most drawn bodies are refused on their first odd
# field, so half of the draws are one of these with at most three drawn fields put in, to reach
# the scheduler with odd values. "{model}": the server's model name. A route that takes token
# ids as well as text has a base of each: a drawn `input_ids` put into a text request is refused
# for giving both, so without an ids base no drawn token id would ever reach the embedding.
CHAT = [{"role": "user", "content": "hi"}]
TOKEN_BASES = {
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"model": "{model}", "prompt": [1, 2, 3], "max_tokens": 4},
}
BASES = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"model": "{model}", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "{model}", "messages": CHAT, "max_tokens": 4},
    "/invocations": {"model": "{model}", "messages": CHAT, "max_tokens": 4},
    "/v1/responses": {"model": "{model}", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "{model}", "messages": CHAT, "max_tokens": 4},
    "/api/generate": {"model": "{model}", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
    "/api/chat": {"model": "{model}", "messages": CHAT, "stream": False, "options": {"num_predict": 4}},
    "/vertex_generate": {"instances": [{"text": "hi"}], "parameters": {"sampling_params": {"max_new_tokens": 4}}},
    "/v1/score": {"model": "{model}", "query": "hi", "items": ["a", "b"], "label_token_ids": [1, 2]},
    "/v1/tokenize": {"model": "{model}", "prompt": "hi"},
    "/v1/detokenize": {"model": "{model}", "tokens": [1, 2]},
}


# The fields that reach a kernel or a scheduler loop: half of the picks come from these.
FOCUS = COST_FIELDS | {"input_ids", "prompt", "text", "input", "messages", "tokens", "items", "label_token_ids",
                       "sampling_params", "logit_bias", "stop", "stop_token_ids", "stop_regex", "token_ids_logprob",
                       "return_logprob", "logprob_start_len", "top_k", "top_p", "min_p", "temperature", "regex",
                       "json_schema", "ebnf", "response_format", "parameters", "instances", "options", "stream"}


def _near(base: dict, drawn: Any, picks: list) -> Any:
    """`base` with some of the drawn body's fields put in: `picks` are (from FOCUS?, index)."""
    if not isinstance(drawn, dict) or not drawn:
        return base
    keys = sorted(drawn)
    focus = [k for k in keys if k in FOCUS]
    chosen = [(focus if focused and focus else keys)[i % len(focus if focused and focus else keys)]
              for focused, i in picks]
    return {**base, **{k: drawn[k] for k in chosen}}


def strategy(op, model: str = "default"):
    """Requests to `op`, drawn by schemathesis from its schema: ones that fit it, and for an
    operation without a body ones that do not (query and path parameters of the wrong type)."""
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.core import NOT_SET

    def request(case) -> Request:
        path = case.formatted_path
        query = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (case.query or {}).items() if v is not None}
        if query:
            path += "?" + urllib.parse.urlencode(query)
        body = None if case.body is NOT_SET else case.body
        return Request(op.method.upper(), op.path, path, body, case.media_type)

    positive = op.as_strategy(GenerationMode.POSITIVE)
    base = BASES.get(op.path) if op.method.upper() in ("POST", "PUT") else None
    if base is not None:
        bases = [json.loads(json.dumps(b).replace("{model}", model))
                 for b in (base, TOKEN_BASES.get(op.path)) if b is not None]
        picks = st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), min_size=1, max_size=3)
        near = st.tuples(positive, st.sampled_from(bases), picks).map(
            lambda drawn: dataclasses.replace(request(drawn[0]), body=_near(drawn[1], drawn[0].body, drawn[2])))
        return st.one_of(near, positive.map(request))
    if op.body:
        # Schemathesis' negative bodies for SGLang's chat request take about a minute per example
        # here; wrong types and edges come from `narrowed` and the enrichment instead.
        return positive.map(request)
    return st.one_of(positive, op.as_strategy(GenerationMode.NEGATIVE)).map(request)


# Where each generating route takes its token limit, for requests that give none: without one
# SGLang runs to the context (Ollama's routes: 2048 new tokens), minutes on a CPU server, which
# is a long request, not a wedge. A limit the request gives is kept (COST_FIELDS narrowed it).
TOKEN_LIMITS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                "/invocations": ("max_tokens", "max_completion_tokens"),
                "/v1/responses": ("max_output_tokens",),
                "/api/generate": ("options.num_predict",), "/api/chat": ("options.num_predict",)}
DEFAULT_NEW_TOKENS = 16


def bounded(request: Request) -> Request:
    """`request` with a token limit where its route has one to give and it gives none."""
    fields = TOKEN_LIMITS.get(request.route)
    if not fields or not isinstance(request.body, dict):
        return request
    body = dict(request.body)
    for field in fields:
        holder, _, leaf = field.rpartition(".")
        inner = body.get(holder) if holder else body
        if isinstance(inner, dict) and inner.get(leaf) is not None:
            return request
    holder, _, leaf = fields[0].rpartition(".")
    if holder:
        inner = body.get(holder)
        if inner is not None and not isinstance(inner, dict):
            return request  # a wrong type there: refused before anything runs
        body[holder] = {**(inner or {}), leaf: DEFAULT_NEW_TOKENS}
    else:
        body[leaf] = DEFAULT_NEW_TOKENS
    return dataclasses.replace(request, body=body)


# ---------------------------------------------------------------------- the wire
def _encoded(request: Request) -> tuple[Optional[bytes], str]:
    if request.body is None and request.media is None:
        return None, "application/json"
    if request.media == "multipart/form-data":
        boundary = "farskipfuzz" + format(zlib.crc32(request.key().encode()), "08x")
        chunks = []
        fields = request.body if isinstance(request.body, dict) else {"file": request.body}
        for name, value in fields.items():
            data = value if isinstance(value, bytes) else (value if isinstance(value, str) else json.dumps(value)).encode()
            disposition = f'form-data; name="{name}"' + ('; filename="f.bin"' if name == "file" else "")
            chunks += [f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode(), data, b"\r\n"]
        chunks.append(f"--{boundary}--\r\n".encode())
        return b"".join(chunks), f"multipart/form-data; boundary={boundary}"
    if isinstance(request.body, bytes):  # negative mode: a body that is not JSON at all
        return request.body, "application/json"
    return json.dumps(request.body, default=_latin1).encode(), "application/json"


def _latin1(value):
    if isinstance(value, bytes):
        return value.decode("latin-1")
    raise TypeError(f"{type(value).__name__} in a request body")


def send(base_url: str, key: Optional[str], request: Request, timeout: float) -> Answer:
    """One request; the answer's whole body (a stream read to its end), bounded by `timeout`
    in all."""
    url = urllib.parse.urlsplit(base_url)
    body, content_type = _encoded(request)
    headers = {"Content-Type": content_type}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.monotonic()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request(request.method, request.path, body=body, headers=headers)
        response = conn.getresponse()
        chunks = []
        while chunk := response.read1(65536):
            chunks.append(chunk)
            if time.monotonic() - start > timeout:
                return Answer(None, time.monotonic() - start, b"".join(chunks).decode(errors="replace"),
                              f"still streaming after {timeout:.0f} s")
        return Answer(response.status, time.monotonic() - start, b"".join(chunks).decode(errors="replace"))
    except (OSError, http.client.HTTPException) as e:
        return Answer(None, time.monotonic() - start, "", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def get_json(base_url: str, key: Optional[str], path: str) -> Any:
    answer = send(base_url, key, Request("GET", path, path), 60)
    if answer.status != 200:
        raise RuntimeError(f"GET {path}: {answer.status or answer.error} {answer.text[:300]}")
    return json.loads(answer.text)


def serves(base_url: str, key: Optional[str], model: str, timeout: float = SLOW_S) -> Answer:
    """A plain two-token completion; its answer (status 200 and two tokens when served)."""
    request = Request("POST", "/v1/completions", "/v1/completions",
                      {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    answer = send(base_url, key, request, timeout)
    if answer.status == 200 and json.loads(answer.text).get("usage", {}).get("completion_tokens") != 2:
        answer.status = -1  # served, but not the two tokens asked for
    return answer


# ---------------------------------------------------------------------- the run
class _Found(Exception):
    def __init__(self, finding: Finding):
        super().__init__(finding.describe())
        self.finding = finding


def _judge(answer: Answer, slow_s: float) -> Optional[str]:
    if answer.status is None:
        return "no answer"
    if answer.status >= 500 or answer.stream_5xx():
        return "5xx"
    if answer.seconds > slow_s:
        return "slow"
    return None


def fuzz_operation(op, report: Report, *, base_url: str, key: Optional[str], model: str, seed: int,
                   seconds: float, slow_s: float, known: tuple = ()) -> None:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as fixed_seed

    state = {"deadline": time.monotonic() + seconds, "stopped": False, "failing": {}}
    requests = strategy(op, model)

    def probe(request: Request) -> None:
        if request.key() in state["failing"]:
            raise state["failing"][request.key()]
        if state["stopped"] or (time.monotonic() > state["deadline"] and report.statuses[name_of(op)]):
            return  # (every operation gets one request, however late)
        request = bounded(request)
        entry = next((entry for entry in known if entry.matches(request)), None)
        if entry is not None and not entry.send:
            report.held_back[entry.name] += 1
            report.examples.setdefault(entry.name, request)
            return
        answer = send(base_url, key, request, 2 * slow_s)
        report.sent += 1
        report.statuses[name_of(op)][answer.status if answer.status is not None else "none"] += 1
        kind = _judge(answer, slow_s)
        if kind is not None and entry is not None and kind in entry.kinds:
            report.known_5xx[entry.name] += 1
            report.examples.setdefault(entry.name, request)
            if kind != "5xx" and serves(base_url, key, model).status != 200:
                kind = "down"  # known, but it took the server with it
            else:
                return
        if kind is None:
            return
        found = _Found(Finding(kind, request, answer))
        state["failing"][request.key()] = found
        if kind == "5xx":  # shrink, within SHRINK_S more
            state["deadline"] = max(state["deadline"], time.monotonic() + SHRINK_S) if len(state["failing"]) == 1 \
                else state["deadline"]
        else:
            state["stopped"] = True
        raise found

    # Batches of a few examples, each its own seeded Hypothesis run, until the operation's time
    # is up: Hypothesis has no time limit of its own, and past a deadline it would go on
    # drawing (slow for SGLang's largest models) to reach max_examples.
    batch = 0
    try:
        while not state["stopped"] and time.monotonic() < state["deadline"]:
            def attempt(request: Request) -> None:  # a new function each run: settings mark it
                probe(request)

            given(requests)(settings(
                max_examples=BATCH if batch else 1, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                verbosity=Verbosity.quiet, print_blob=False,
            )(fixed_seed(seed ^ zlib.crc32(f"{name_of(op)} {batch}".encode()))(attempt)))()
            batch += 1
            if batch == 2 and set(report.statuses[name_of(op)]) <= REFUSED:
                break  # refused whole (an admin route, a feature this server lacks): its time to the rest
    except _Found as e:
        report.findings.append(e.finding)
        check = serves(base_url, key, model)
        if check.status != 200:
            report.findings.append(Finding("down", e.finding.request, check))


def run(base_url: str, key: Optional[str], *, seed: int = DEFAULT_SEED, budget_s: float = BUDGET_S,
        slow_s: float = SLOW_S, known: tuple = (), enrich: Optional[dict] = None,
        log: Callable[[str], None] = print) -> Report:
    """Fuzz every operation of the server at `base_url`'s /openapi.json within `budget_s`."""
    start = time.monotonic()
    report = Report(seed, budget_s)
    log(f"fuzz: seed {seed} ({SEED_ENV}={seed} to repeat), budget {budget_s:.0f} s, {base_url}")
    spec = get_json(base_url, key, "/openapi.json")
    model = get_json(base_url, key, "/v1/models")["data"][0]["id"]
    ops = operations(spec, default_enrich() if enrich is None else enrich)
    random.Random(seed).shuffle(ops)  # no operation is always last
    report.operations = sorted(name_of(op) for op in ops)
    found = 0
    weights = [GENERATING_WEIGHT if op.path in BASES else 1 for op in ops]
    for i, op in enumerate(ops):
        share = (budget_s - (time.monotonic() - start)) * weights[i] / sum(weights[i:])
        began, sent = time.monotonic(), report.sent
        fuzz_operation(op, report, base_url=base_url, key=key, model=model, seed=seed, seconds=max(share, 0.2),
                       slow_s=slow_s, known=known)
        log(f"  {name_of(op)}: {report.sent - sent} sent in {time.monotonic() - began:.1f} s")
        for finding in report.findings[found:]:
            log("  " + finding.describe())
        found = len(report.findings)
        if report.down:
            break
    else:
        check = serves(base_url, key, model)
        if check.status != 200:
            report.findings.append(Finding("down", Request("POST", "(after the run)", "(after the run)"), check))
    report.seconds = time.monotonic() - start
    return report


def seed_from_env() -> int:
    return int(os.environ.get(SEED_ENV, DEFAULT_SEED))


def main(argv: Optional[list] = None) -> int:
    from sglang_farskip.errors import ArgumentParser

    parser = ArgumentParser(prog="python -m sglang_farskip.testbed.fuzz",
                            description="Fuzz every route of a running SGLang server (see the module's docstring).")
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--key", default=os.environ.get("API_KEY"), help="the inference key (default: $API_KEY)")
    parser.add_argument("--seed", type=int, default=seed_from_env(), help=f"default: ${SEED_ENV} or {DEFAULT_SEED}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all (default %(default)s)")
    parser.add_argument("--slow", type=float, default=SLOW_S, help="an answer slower than this is a finding")
    args = parser.parse_args(argv)
    report = run(args.url.rstrip("/"), args.key, seed=args.seed, budget_s=args.budget, slow_s=args.slow)
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
