"""Load is shed, not queued: what one client can make the server hold is bounded, and past a
bound the client is told at once, with a 429 and a Retry-After, rather than made to wait.

1. The request queue. SGLang bounds each scheduler's waiting queue with its own flag,
   `--max-queued-requests`, unbounded by default; the launcher gives it `QUEUE_BOUND` unless the
   user gave one (`queue_args`). Past the bound the scheduler aborts the request as it receives
   it (`Scheduler._abort_on_queued_limit`) with a 503 "The request queue is full.", which
   reaches a client as a 503 without Retry-After, or, on a stream, as an error event inside a
   200 stream. `queue_full_is_429` (around `TokenizerManager._handle_abort_finish_reason`, where
   every abort from a scheduler reaches the HTTP process) turns that abort into a 429:
   - a non-streaming request: raised as an HTTPException, which every route answers with its
     status;
   - a stream whose first output is awaited before its headers are sent: raised there, so the
     route answers 429 before any stream starts. SGLang's OpenAI chat and completion routes
     await it themselves (`_handle_streaming_request`, "kick-start the generator");
     `peek_generate_stream` does it for /generate. `peeking` marks both;
   - any other stream (one that sends its headers first, e.g. a streamed /v1/responses): the
     stream's error event says 429, as it said 503.
   /v1/responses answers every exception with a 400; `shed_responses` answers a shed one 429.
   The queue-full abort is a request's first output, so a shed request costs one scheduler step.
   SGLang applies the bound only without disaggregation; `pd_queue_bounded` applies it to a
   prefill or decode server's own queues, with the same abort.

2. `ShedMiddleware` (an ASGI middleware added to SGLang's app) gives every 429 of any route a
   `Retry-After` (`RETRY_AFTER_S`, or what the refusal knows better), and answers
   `/health_generate` from `HealthCache`: SGLang's probe queues a real one-token generation per
   call and needs no key, so any client could make the server work, and fill the queue its
   health checks need. One real probe runs at most every `--farskip-health-cache-s` seconds,
   callers meanwhile share it or get its 200; a failed probe is not cached, so a hung scheduler
   is seen within that time plus SGLang's own probe timeout (20 s).

What clients can make the server keep (sessions, stored responses) is bounded in stores.py.

All of it runs in the HTTP process (the launcher's "http" rows of boundary/table.csv).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from typing import Any, Optional

from fastapi import HTTPException

logger = logging.getLogger("sglang_farskip.serve.shed")

QUEUE_BOUND = 256  # --max-queued-requests when the user gives none: per scheduler (DP rank)
RETRY_AFTER_S = 1  # a full queue drains within a scheduler step or a few; the client cannot know

# The messages of SGLang's queue-bound aborts (scheduler.py, _abort_on_queued_limit): the
# incoming request, or with priority scheduling a queued one of lower priority.
QUEUE_FULL = ("The request queue is full.", "The request is aborted by a higher priority request.")


def queued_in_pd(scheduler) -> int:
    """Requests a prefill or decode scheduler holds that have not started computing: SGLang's
    bound counts only the waiting queue of a server without disaggregation, and a PD server puts
    each new request in a queue of its own first (prefill: waiting for the decode server's
    handshake; decode: waiting for KV memory, then for the KV transfer)."""
    queues = (scheduler.disagg_prefill_bootstrap_queue, scheduler.disagg_decode_prealloc_queue,
              scheduler.disagg_decode_transfer_queue)
    return len(scheduler.waiting_queue) + sum(len(q.queue) for q in queues if q is not None)


def pd_queue_bounded(original, self, req, is_retracted=False, *args, **kwargs):
    """AROUND Scheduler._add_request_to_queue (every process; it runs in the schedulers): a
    prefill or decode server bounds what it queues with the same flag, `--max-queued-requests`,
    which SGLang applies only without disaggregation (its `_add_request_to_queue` checks
    `disaggregation_mode == NULL` first). Past the bound the request is ended as SGLang ends
    one (the same abort, status and message), so queue_full_is_429 answers it 429 as well. A
    request the decode server takes back from its running batch (retracted) is not new and
    always requeued."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    bound = self.max_queued_requests
    if (is_retracted or bound is None or self.disaggregation_mode == DisaggregationMode.NULL
            or queued_in_pd(self) + 1 <= bound):
        return original(self, req, is_retracted, *args, **kwargs)
    from http import HTTPStatus

    from sglang.srt.managers.scheduler import _make_abort_req

    abort = _make_abort_req(req, finished_reason={"type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE,
                                                  "message": QUEUE_FULL[0]})
    self.send_abort_output(abort, req)
    self._release_aborted_request(req)
    return None


def queue_args(given) -> list[str]:
    """SGLang's queue bound when the user gave none (`given`: the launcher's GivenArgs)."""
    return [] if "--max-queued-requests" in given else ["--max-queued-requests", str(QUEUE_BOUND)]


def runtime_options():
    from sglang_farskip import options

    return options.current()


class Shed(HTTPException):
    """A request past a bound: 429, which every SGLang route answers with its status."""

    def __init__(self, message: str):
        super().__init__(status_code=429, detail=message)

    def __str__(self) -> str:  # routes that answer str(e) show the message alone
        return str(self.detail)


# The Retry-After of the request being served: ShedMiddleware sets a fresh one per request, a
# refusal that knows when to come back writes it (a list: written where the context is a copy).
_retry_after: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("farskip_retry_after", default=None)
# True while a stream's first output is awaited before its headers are sent (see 1. above).
_peeking: contextvars.ContextVar[bool] = contextvars.ContextVar("farskip_shed_peeking", default=False)


def retry_in(seconds: float) -> None:
    hint = _retry_after.get()
    if hint is not None:
        hint[0] = max(1, math.ceil(seconds))


# ---------------------------------------------------------------- 1. the queue bound
def _is_queue_full(finish_reason: Any) -> bool:
    return (isinstance(finish_reason, dict) and finish_reason.get("type") == "abort"
            and finish_reason.get("status_code") == 503 and finish_reason.get("message") in QUEUE_FULL)


def _queue_full_message(reason: str) -> str:
    return (f"{reason} This server queues at most --max-queued-requests requests per scheduler; "
            f"retry after {RETRY_AFTER_S} s, or send fewer requests at once.")


async def queue_full_is_429(original, self, out, state, is_stream, *args, **kwargs):
    """AROUND TokenizerManager._handle_abort_finish_reason."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    reason = out["meta_info"].get("finish_reason")
    rid = getattr(state.obj, "rid", None)
    if not _is_queue_full(reason) or (isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX)):
        return await original(self, out, state, is_stream, *args, **kwargs)
    try:
        result = await original(self, out, state, is_stream, *args, **kwargs)  # releases the request
    except HTTPException:  # upstream's 503, non-streaming
        result = None
    message = _queue_full_message(reason["message"])
    if not is_stream or _peeking.get():
        raise Shed(message)
    reason.update(status_code=429, message=message)  # an error event inside a stream already started
    return result


async def peek_generate_stream(original, obj, request, *args, **kwargs):
    """AROUND http_server.serve_generate_request: a /generate stream's first output is awaited
    before its headers are sent, as SGLang's OpenAI routes do, so a shed stream is a 429."""
    from fastapi.responses import StreamingResponse

    token = _peeking.set(True)
    try:
        response = await original(obj, request, *args, **kwargs)
        if not isinstance(response, StreamingResponse):
            return response
        body = response.body_iterator
        try:
            first = await body.__anext__()
        except StopAsyncIteration:
            first = None
        except Shed as e:
            return _refusal(e)
    finally:
        _peeking.reset(token)

    async def whole():
        if first is not None:
            yield first
            async for chunk in body:
                yield chunk

    response.body_iterator = whole()
    return response


async def peeking(original, self, *args, **kwargs):
    """AROUND the OpenAI routes' _handle_streaming_request, which await a stream's first
    output before answering: a shed request raises there and is answered 429."""
    token = _peeking.set(True)
    try:
        return await original(self, *args, **kwargs)
    finally:
        _peeking.reset(token)


async def shed_responses(original, self, *args, **kwargs):
    """AROUND OpenAIServingResponses.responses_full_generator, whose caller answers any
    exception with a 400: a shed /v1/responses request is a 429 in that route's error shape."""
    try:
        return await original(self, *args, **kwargs)
    except Shed as e:
        return self.create_error_response(e.detail, err_type="Too Many Requests", status_code=429)


def _refusal(e: Shed):
    from fastapi.responses import ORJSONResponse

    # SGLang's error shape on /generate (http_server's HTTPException handler).
    return ORJSONResponse({"object": "error", "message": e.detail, "type": "TooManyRequests", "param": None,
                           "code": 429}, status_code=429)


# ---------------------------------------------------------------- 2. Retry-After, /health_generate
class HealthCache:
    """SGLang's /health_generate probe, run at most once per `--farskip-health-cache-s`."""

    def __init__(self):
        self._task: Optional[asyncio.Task] = None
        self._ok_at = -math.inf  # when the last probe answered 200 (monotonic)

    async def status(self) -> int:
        if time.monotonic() - self._ok_at < runtime_options().health_cache_s:
            return 200
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(self._task)  # a caller that goes away leaves it running

    async def _probe(self) -> int:
        from sglang.srt.entrypoints import http_server

        try:
            response = await http_server.health_generate(_probe_request())
        except Exception:  # every caller waiting on it would get a 500
            logger.exception("SGLang's /health_generate probe raised")
            return 503
        if response.status_code == 200:
            self._ok_at = time.monotonic()
        return response.status_code


def _probe_request():
    """A request of our own for the shared probe: SGLang aborts a probe whose request's client
    went away, and the first caller's going away must not fail everyone's check."""
    from starlette.requests import Request

    async def never_disconnects():
        await asyncio.Event().wait()

    scope = {"type": "http", "method": "GET", "path": "/health_generate", "raw_path": b"/health_generate",
             "root_path": "", "scheme": "http", "query_string": b"", "headers": [], "server": None,
             "client": None, "http_version": "1.1"}
    return Request(scope, receive=never_disconnects)


_health = HealthCache()


def _generates(path: str) -> bool:
    """Whether SGLang answers this health path by generating (/health too when
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is on, SGLang's default; the launcher turns it off)."""
    from sglang.srt.environ import envs

    return path == "/health_generate" or (path == "/health" and envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get())


class ShedMiddleware:
    """Every 429 gets a Retry-After; the generating health checks are answered from HealthCache."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "GET" and _generates(scope.get("path", "")) and runtime_options().health_cache_s > 0:
            from starlette.responses import Response

            await Response(status_code=await _health.status())(scope, receive, send)
            return
        hint = [RETRY_AFTER_S]
        token = _retry_after.set(hint)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] == 429:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", str(hint[0]).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_retry_after)
        finally:
            _retry_after.reset(token)
