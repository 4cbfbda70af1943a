"""What a client can make the server keep is bounded: sessions and stored responses.

1. Sessions (`/open_session`): SGLang keeps each until it is closed or idle for the timeout the
   client chose (none: forever), with no limit on their number. `bounded_open_session` refuses
   one past `--farskip-max-sessions` with a 429 (its Retry-After: when the oldest closes), and
   `Sessions` closes each `--farskip-session-lifetime-s` after it opened, in use or not.

2. With `--enable-response-store`, SGLang keeps every /v1/responses result and its input in two
   dicts forever (serving_responses.py: "Storage has no TTL or size limit").
   `bounded_response_stores` replaces both with `BoundedStore`s: at most
   `--farskip-max-stored-responses` results, none older than `--farskip-stored-response-ttl-s`.

Both run in the HTTP process (the launcher's "http" rows of boundary/table.csv); the queue
bound and the 429s are shed.py's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Optional

from sglang_farskip.serve.shed import RETRY_AFTER_S, retry_in, runtime_options

logger = logging.getLogger("sglang_farskip.serve.stores")


# ---------------------------------------------------------------- 1. sessions
class TooManySessions(Exception):
    status_code = 429  # http_server's open_session answers an exception with its status_code


class Sessions:
    """The sessions open now, each with the time it is closed at (monotonic); one close task."""

    def __init__(self):
        self.deadline: dict[str, float] = {}
        self.opening = 0  # opens sent to the scheduler, not yet answered: they count
        self._closer: Optional[asyncio.Task] = None

    def admit(self) -> None:
        opts = runtime_options()
        if len(self.deadline) + self.opening >= opts.max_sessions:
            soonest = min(self.deadline.values(), default=time.monotonic() + RETRY_AFTER_S) - time.monotonic()
            retry_in(soonest)
            raise TooManySessions(
                f"{len(self.deadline) + self.opening} sessions are open, this server's maximum "
                f"(--farskip-max-sessions {opts.max_sessions}): close one with /close_session, or retry "
                f"in {max(1, math.ceil(soonest))} s, when the oldest closes (sessions close "
                f"--farskip-session-lifetime-s {opts.session_lifetime_s:g} s after they open)")

    def opened(self, session_id: str, tokenizer_manager) -> None:
        self.deadline[session_id] = time.monotonic() + runtime_options().session_lifetime_s
        if self._closer is None or self._closer.done():
            self._closer = asyncio.get_running_loop().create_task(self._close_when_due(tokenizer_manager))

    async def _close_when_due(self, tokenizer_manager) -> None:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        while self.deadline:
            await asyncio.sleep(max(0.0, min(self.deadline.values()) - time.monotonic()))
            now = time.monotonic()
            for session_id in [s for s, due in self.deadline.items() if due <= now]:
                logger.info("session %s reached --farskip-session-lifetime-s; closing it", session_id)
                try:
                    await tokenizer_manager.close_session(CloseSessionReqInput(session_id=session_id))
                except Exception:  # the next one is still due; SGLang logs its own side
                    logger.exception("closing session %s failed", session_id)
                self.deadline.pop(session_id, None)


_sessions = Sessions()


async def bounded_open_session(original, self, obj, *args, **kwargs):
    """AROUND TokenizerControlMixin.open_session."""
    _sessions.admit()
    _sessions.opening += 1
    try:
        session_id = await original(self, obj, *args, **kwargs)
    finally:
        _sessions.opening -= 1
    if session_id is not None:
        _sessions.opened(session_id, self)
    return session_id


async def forget_closed_session(original, self, obj, *args, **kwargs):
    """AROUND TokenizerControlMixin.close_session: a closed session frees its place."""
    try:
        return await original(self, obj, *args, **kwargs)
    finally:
        _sessions.deadline.pop(obj.session_id, None)


# ---------------------------------------------------------------- 2. /v1/responses' store
class BoundedStore(dict):
    """A dict that keeps at most `limit` entries, none older than `max_age_s` (from when its key
    was first stored); the oldest go first."""

    def __init__(self, limit: int, max_age_s: float):
        super().__init__()
        self.limit, self.max_age_s = limit, max_age_s
        self._born: dict[Any, float] = {}  # insertion order is age order

    def __setitem__(self, key, value) -> None:
        if key not in self._born:
            self._born[key] = time.monotonic()
        super().__setitem__(key, value)
        self._prune()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._born.pop(key, None)

    def pop(self, key, *default):
        self._born.pop(key, None)
        return super().pop(key, *default)

    def __getitem__(self, key):
        self._prune()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._prune()
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._prune()
        return super().__contains__(key)

    def _prune(self) -> None:
        oldest_kept = time.monotonic() - self.max_age_s
        while self._born:
            key, born = next(iter(self._born.items()))
            if born >= oldest_kept and len(self._born) <= self.limit:
                return
            self._born.pop(key)
            super().pop(key, None)


# A response's input is stored when its request starts and read (by a request that chains on
# it) after its response was found: inputs are kept longer, and more of them, so that one whose
# response is still stored is too.
INPUT_GRACE_S = 60


def bounded_response_stores(result, self, *args, **kwargs):
    """AFTER OpenAIServingResponses.__init__: its response and input stores, bounded."""
    opts = runtime_options()
    responses = BoundedStore(opts.max_stored_responses, opts.stored_response_ttl_s)
    inputs = BoundedStore(2 * opts.max_stored_responses, opts.stored_response_ttl_s + INPUT_GRACE_S)
    for store, old in ((responses, self.response_store), (inputs, self.msg_store)):
        for key, value in old.items():  # empty when built; kept should that change
            store[key] = value
    self.response_store, self.msg_store = responses, inputs
    return None
