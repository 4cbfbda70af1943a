"""Locust users that stream completions from an SGLang server and time every token.

    locust -f bench/locustfile.py --host http://127.0.0.1:30000 --input-len 128 --vocab-size 4096

(the locust web UI, random token prompts; bench/run_load.py drives this file headless and
reads the model's vocabulary itself; see bench/README.md.)

Each user sends one streaming request after another (closed loop, no think time), with
temperature 0, ignore_eos and a fixed token budget, to OpenAI `/v1/completions` (default) or
SGLang's native `/generate`. Per request it measures TTFT, every inter-token gap, TPOT and E2E
exactly as sglang/benchmark/serving.py does (definitions in bench/README.md), reports them to
locust as custom events (rows TTFT / ITL / TPOT in the UI), and appends one JSON line per
request - failures included - to --records-out.

Never import sglang here: locust monkey-patches the standard library with gevent when it is
imported, and SGLang's imports then recurse forever. Plain `requests` is gevent-safe.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time

import gevent
import gevent.event
import requests
from locust import User, constant, events, task

PATHS = {"completions": "/v1/completions", "generate": "/generate"}


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    group = parser.add_argument_group("farskip bench")
    group.add_argument("--prompts-file", default="", help="JSONL of prompts (bench/run_load.py --write-prompts)")
    group.add_argument("--input-len", type=int, default=0, help="random token prompts of this many tokens")
    group.add_argument("--vocab-size", type=int, default=0, help="random ids are drawn below this")
    group.add_argument("--skip-ids", default="", help="comma-separated ids never drawn (special tokens)")
    group.add_argument("--seed", type=int, default=0, help="random prompt seed (same seed, same prompts)")
    group.add_argument("--endpoint", choices=sorted(PATHS), default="completions",
                       help="completions: OpenAI /v1/completions; generate: SGLang native /generate")
    group.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos is set)")
    group.add_argument("--records-out", default="", help="append one JSON line per request here")
    group.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    group.add_argument("--request-timeout", type=float, default=300.0, help="seconds without data before a request fails")
    group.add_argument("--model", default="default", help="the model name sent to /v1/completions")
    group.add_argument("--keep-alive", action="store_true",
                       help="reuse each user's connection (default: a new one per request, as sglang's client)")
    group.add_argument("--spec-details", action="store_true",
                       help="ask a speculative-decoding server how many verify steps each request took "
                            "(recorded as spec_verify_ct, for the accept length)")
    # No --api-key option: locust shows every option's value on its web UI (all interfaces, no
    # login), and a key on a command line shows in `ps`. The key is $API_KEY (api_key()).


def api_key() -> str:
    """The servers' key, sent as 'Authorization: Bearer KEY': $API_KEY, none when empty."""
    return os.environ.get("API_KEY", "")


class _Run:
    """State shared by every user of this locust process (one process per concurrency level)."""

    prompts: list[dict] = []  # from --prompts-file, cycled
    random_prompt = None  # or: seq -> a fresh random prompt
    out = None
    seq = itertools.count()
    issued = 0
    finished = 0
    all_done = gevent.event.Event()  # set when --max-requests requests have finished


def _fail_startup(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def random_prompts(input_len: int, vocab_size: int, skip_ids: str, seed: int):
    """seq -> prompt of random token ids. Each request number gets its own ids, derived from
    (seed, seq) alone: requests practically never share a prefix (the prefix cache cannot
    flatter TTFT), and an A/B pair sends identical prompts in identical order."""
    if input_len < 1:
        _fail_startup(f"--input-len {input_len}: random prompts need at least 1 token")
    try:
        skip = {int(x) for x in skip_ids.split(",") if x.strip()}
    except ValueError:
        _fail_startup(f"--skip-ids {skip_ids!r} is not a comma-separated list of token ids")
    allowed = [i for i in range(vocab_size) if i not in skip]
    if vocab_size < 1 or not allowed:
        _fail_startup(f"--vocab-size {vocab_size} leaves no token id to draw: pass the model's vocabulary size")

    def make(seq: int) -> dict:
        rng = random.Random(f"{seed}:{seq}")
        return {"input_ids": [rng.choice(allowed) for _ in range(input_len)], "input_len": input_len}
    return make


def load_prompts(path: str) -> list[dict]:
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                p = json.loads(line)
                if not isinstance(p, dict) or not ("input_ids" in p or "text" in p):
                    _fail_startup(f"{path}:{lineno}: a prompt needs 'input_ids' or 'text'")
                prompts.append(p)
    except OSError as e:
        _fail_startup(f"cannot read --prompts-file {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        _fail_startup(f"{path} is not JSONL ({e}); regenerate it with bench/run_load.py --write-prompts")
    if not prompts:
        _fail_startup(f"{path} holds no prompts")
    return prompts


@events.init.add_listener
def _on_init(environment, **_):
    opts = environment.parsed_options
    if opts is None:  # locust used as a library: the caller sets _Run up itself
        return
    if opts.max_tokens < 0:
        _fail_startup(f"--max-tokens {opts.max_tokens} is negative: pass a token count (0 only with --endpoint generate)")
    if opts.prompts_file and opts.input_len:
        _fail_startup("pass either --prompts-file or --input-len (random prompts), not both")
    if opts.prompts_file:
        _Run.prompts = load_prompts(opts.prompts_file)
    elif opts.input_len:
        _Run.random_prompt = random_prompts(opts.input_len, opts.vocab_size, opts.skip_ids, opts.seed)
    else:
        _fail_startup("no prompts: pass --input-len N --vocab-size V for random token prompts, or "
                      "--prompts-file (make one with bench/run_load.py --write-prompts FILE)")
    if opts.records_out:
        # Line-buffered append: a record is on disk as soon as its request ends, so the
        # runner's progress display and a crash both see every finished request.
        _Run.out = open(opts.records_out, "a", encoding="utf-8", buffering=1)


def request_body(endpoint: str, prompt: dict, max_tokens: int, model: str,
                 spec_details: bool = False) -> dict:
    if endpoint == "generate":
        key = "input_ids" if "input_ids" in prompt else "text"
        return {
            key: prompt[key],
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
    return {
        "model": model,
        "prompt": prompt["input_ids"] if "input_ids" in prompt else prompt["text"],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # Per-chunk token counts, so a chunk that carries several tokens is split evenly
        # (SGLang's native stream carries them anyway; OpenAI's needs this option).
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        # SGLang's extension: a closing chunk (no choices) with the request's verify steps.
        # Only when asked: another server may refuse a field it does not know.
        **({"return_spec_tokens_details": True} if spec_details else {}),
    }


def _spec_verify_count(endpoint: str, data: dict) -> int | None:
    """Verify steps so far of a speculative-decoding request, where the chunk says (SGLang's
    meta_info on /generate, every chunk; its sglext chunk on /v1/completions, once)."""
    if endpoint == "generate":
        return (data.get("meta_info") or {}).get("spec_verify_ct")
    details = (data.get("sglext") or {}).get("spec_tokens_details") or {}
    return details.get("spec_verify_ct") if isinstance(details, dict) else None


class _StreamFailure(Exception):
    pass


def _sse_lines(response):
    """Yield (arrival time, payload) per non-empty SSE line as soon as its bytes arrive."""
    buffer = b""
    for piece in response.iter_content(chunk_size=None):
        buffer += piece
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if line:
                yield time.perf_counter(), line[5:].strip() if line.startswith(b"data:") else line
    if buffer.strip():
        yield time.perf_counter(), buffer.strip()


def _parse_chunk(endpoint: str, data: dict) -> tuple[bool, int | None, int | None, str | None]:
    """(has text, completion tokens so far or None, prompt tokens or None, finish type)."""
    if data.get("object") == "error" or "error" in data:
        err = data.get("error")
        detail = data.get("message") or (err.get("message") if isinstance(err, dict) else err)
        raise _StreamFailure(f"server error in stream: {detail}")
    if endpoint == "generate":
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        return bool(data.get("text")), meta.get("completion_tokens"), meta.get("prompt_tokens"), finish.get("type")
    choices = data.get("choices") or []  # the closing usage chunk has no choice
    usage = data.get("usage") or {}
    text = choices[0].get("text") if choices else ""
    finish = choices[0].get("finish_reason") if choices else None
    return bool(text), usage.get("completion_tokens"), usage.get("prompt_tokens"), finish


def new_record(endpoint: str, prompt: dict, max_tokens: int) -> dict:
    """A request's record before it is sent (fields: bench/README.md). Made by the caller, so
    that a request killed mid-stream still leaves its record behind."""
    return {
        "endpoint": PATHS[endpoint], "start_unix": time.time(), "ok": False, "error": None,
        "status": None, "input_len": prompt.get("input_len"), "prompt_tokens": None,
        "output_tokens": 0, "expected_tokens": max_tokens, "ttft": None, "itl": [],
        "tpot": None, "e2e": None, "chunks": 0, "first_chunk_tokens": None, "spec_verify_ct": None,
    }


def stream_request(session, base_url: str, endpoint: str, prompt: dict, rec: dict,
                   model: str = "default", timeout: float = 300.0, api_key: str = "",
                   spec_details: bool = False) -> dict:
    """Send one streaming request, filling in and returning `rec` (from new_record)."""
    max_tokens = rec["expected_tokens"]
    body = request_body(endpoint, prompt, max_tokens, model, spec_details)
    st = time.perf_counter()  # as sglang.benchmark.serving: just before the POST
    last = st  # arrival of the last SSE line seen: E2E ends there, [DONE] included
    timed_at = st  # arrival of the last chunk that added text and tokens
    timed_tokens = 0  # tokens counted up to that chunk
    tokens = 0
    done = False
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        with session.post(base_url + PATHS[endpoint], json=body, headers=headers, stream=True,
                          timeout=(5.0, timeout)) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                raise _StreamFailure(f"HTTP {resp.status_code}: {resp.text[:300].strip()}")
            for t, payload in _sse_lines(resp):
                last = t
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    data = json.loads(payload)
                except json.JSONDecodeError:
                    raise _StreamFailure(f"bad chunk: not JSON: {payload[:120]!r}") from None
                rec["chunks"] += 1
                if spec_details and (verify := _spec_verify_count(endpoint, data)) is not None:
                    rec["spec_verify_ct"] = verify
                has_text, count, prompt_tokens, finish = _parse_chunk(endpoint, data)
                if prompt_tokens is not None:
                    rec["prompt_tokens"] = prompt_tokens
                if finish == "abort":
                    raise _StreamFailure("aborted: the server aborted the request mid-stream")
                if count is None:
                    # A server without per-chunk counts: one token per text chunk, as
                    # sglang.benchmark.serving assumes for OpenAI streams.
                    count = tokens + 1 if has_text else tokens
                tokens = max(tokens, count)
                if not has_text:
                    continue  # sglang's rule: only chunks with text are timed
                new = tokens - timed_tokens
                if rec["ttft"] is None:
                    # Tokens that arrive together with the first get no gap, as in sglang:
                    # nothing tells when they were made. len(itl) == tokens - first_chunk_tokens.
                    rec["ttft"], rec["first_chunk_tokens"] = t - st, new
                elif new > 0:
                    # Several tokens in one chunk: the gap is shared evenly among them.
                    rec["itl"].extend([(t - timed_at) / new] * new)
                else:
                    continue  # text without a new token: not a token arrival
                timed_at, timed_tokens = t, tokens
        if not done:
            raise _StreamFailure(f"truncated stream: the connection closed after {tokens} tokens without [DONE]")
        rec["output_tokens"] = tokens
        if tokens != max_tokens:
            raise _StreamFailure(f"short output: {tokens} of {max_tokens} tokens although ignore_eos was set")
        rec["e2e"] = last - st
        if tokens > 1 and rec["ttft"] is not None:
            rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (tokens - 1)
        rec["ok"] = True
    except _StreamFailure as e:
        rec["error"] = str(e)
    except requests.exceptions.ChunkedEncodingError as e:
        rec["error"] = f"truncated stream: the connection broke after {tokens} tokens ({e.__class__.__name__})"
    except requests.exceptions.Timeout:
        rec["error"] = f"timeout: no data for {timeout} s after {tokens} tokens"
    except requests.exceptions.ConnectionError as e:
        rec["error"] = f"connection error: {e}"
    except gevent.GreenletExit:
        # Locust killed this user mid-request (run over, --stop-timeout too short): the
        # request still gets a record, then the kill goes on.
        rec["error"] = "cancelled: the run ended before the request finished (raise --stop-timeout)"
        rec["output_tokens"], rec["e2e"] = tokens, time.perf_counter() - st
        raise
    finally:
        if not rec["ok"]:
            rec["output_tokens"] = tokens
            rec["e2e"] = rec["e2e"] if rec["e2e"] is not None else time.perf_counter() - st
    return rec


def _session() -> requests.Session:
    s = requests.Session()
    # No proxy or .netrc lookups from the environment on every request: a load test talks to
    # the server directly (as aiohttp, sglang.benchmark.serving's client, does by default).
    s.trust_env = False
    return s


class StreamingUser(User):
    wait_time = constant(0)  # closed loop: concurrency = number of users, as --max-concurrency

    def on_start(self):
        self.opts = self.environment.parsed_options
        self.session = _session() if self.opts.keep_alive else None

    def on_stop(self):
        if self.session is not None:
            self.session.close()

    def _report(self, rec: dict) -> None:
        fire = self.environment.events.request.fire
        name = rec["endpoint"]
        error = None if rec["ok"] else Exception(rec["error"])
        fire(request_type="POST", name=name, response_time=rec["e2e"] * 1000.0,
             response_length=rec["output_tokens"], exception=error, context={})
        if not rec["ok"]:
            return
        if rec["ttft"] is not None:
            fire(request_type="TTFT", name=name, response_time=rec["ttft"] * 1000.0,
                 response_length=0, exception=None, context={})
        for gap in rec["itl"]:
            fire(request_type="ITL", name=name, response_time=gap * 1000.0,
                 response_length=1, exception=None, context={})
        if rec["tpot"] is not None:
            fire(request_type="TPOT", name=name, response_time=rec["tpot"] * 1000.0,
                 response_length=0, exception=None, context={})

    def _write(self, rec: dict) -> None:
        if _Run.out is not None:
            _Run.out.write(json.dumps(rec) + "\n")

    @task
    def stream_one(self):
        limit = self.opts.max_requests
        if limit and _Run.issued >= limit:
            # Park until the last request ends; the runner is quitting by then. (A StopUser
            # here makes locust log a spurious error when it later stops the other users.)
            _Run.all_done.wait()
            return
        _Run.issued += 1  # gevent switches only on I/O, so this check-and-add is atomic
        seq = next(_Run.seq)
        if _Run.random_prompt is not None:
            prompt = _Run.random_prompt(seq)
        else:
            prompt = _Run.prompts[seq % len(_Run.prompts)]  # the same order on every run
        rec = new_record(self.opts.endpoint, prompt, self.opts.max_tokens)
        rec["seq"] = seq
        # By default each request opens its own connection, as sglang.benchmark.serving does
        # (a new aiohttp session per request): TTFT then includes the connect, and a reused
        # connection cannot win races for the server's next prefill against another client.
        session = self.session or _session()
        try:
            stream_request(session, self.host.rstrip("/"), self.opts.endpoint, prompt, rec,
                           self.opts.model, self.opts.request_timeout, api_key(),
                           self.opts.spec_details)
        except gevent.GreenletExit:
            self._write(rec)  # killed mid-request: accounted for as a failure, never dropped
            self._report(rec)
            raise
        finally:
            if session is not self.session:
                session.close()
        self._write(rec)
        self._report(rec)
        _Run.finished += 1
        if limit and _Run.finished >= limit:
            _Run.all_done.set()
            # Quit from a fresh greenlet: quitting kills every user, this one included.
            gevent.spawn(self.environment.runner.quit)
