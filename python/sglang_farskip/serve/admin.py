"""The admin routes answer the admin key only; without one they answer 403 to everyone.

SGLang marks its operator routes `ADMIN_OPTIONAL` (sglang/srt/utils/auth.py): with an API key but
no admin key, the API key opens them, so every client could pause generation
(`/pause_generation`: the health check then fails and a deployment restarts), have every user's
prompts written to a folder it names (`/configure_logging`), abort everyone's requests, flush the
cache, profile, load weights or adapters. The hooks below (rows of
sglang_farskip/boundary/table.csv, installed by the launcher in its HTTP process) raise each of
them to SGLang's own `ADMIN_FORCE` level as SGLang's key middleware looks the level up, whose
rule is the one we want: the admin key (`--admin-api-key`, the entrypoint's ADMIN_API_KEY) and
nothing else, 403 when the server has none. SGLang installs that middleware only when a key is
set or some route is ADMIN_FORCE; the second hook makes it always do so.

A client that sends the inference key to an admin route is told 403 (a valid key without the
right), not SGLang's 401 (no valid key).

Health, readiness and metrics stay open to probes and scrapers (SGLang lets them through before
any key check); everything else needs the API key when one is set, websockets included: SGLang's
middleware passes every connection that is not plain HTTP through unchecked, so
`/v1/realtime` opened to anyone; a second middleware (`keys_on_websockets`) applies the same
decision to a websocket's upgrade request.

SGLang calls one admin route itself: after its warm-up it POSTs `/freeze_gc` with the admin
key, or the API key when there is none, which the rule above refuses (403) on every server
without an admin key, so the GC freeze never happened and each start logged a traceback.
`freeze_gc_in_process` makes the same call without HTTP, so no request from outside, however
it is made, can pass for SGLang's own.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

logger = logging.getLogger(__name__)

# Routes SGLang leaves at its normal level that are operator business all the same.
ALSO_ADMIN = ("/get_hicache_l3_cache_layout",)


def _is_admin(level, path: str) -> bool:
    from sglang.srt.utils.auth import AuthLevel

    return level in (AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE) or path in ALSO_ADMIN


def admin_routes_need_the_admin_key(level, app, scope, *args, **kwargs):
    """AFTER sglang.srt.utils.auth._get_auth_level_from_app_and_scope (the middleware's lookup
    of the route a request matches)."""
    from sglang.srt.utils.auth import AuthLevel

    return AuthLevel.ADMIN_FORCE if _is_admin(level, scope.get("path", "")) else level


def always_check_keys(found, app, *args, **kwargs):
    """AFTER sglang.srt.utils.auth.app_has_admin_force_endpoints: there always are (above)."""
    return True


def inference_key_forbidden(original, **kwargs):
    """AROUND sglang.srt.utils.auth.decide_request_auth (called by SGLang's key middleware): the
    inference key on an admin route is told 403, and a header that is not ASCII counts as none."""
    from sglang.srt.utils.auth import AuthDecision, AuthLevel

    api_key, header = kwargs.get("api_key"), kwargs.get("authorization_header") or ""
    if not header.isascii():
        # SGLang compares with secrets.compare_digest on str, which raises TypeError on
        # non-ASCII text: any client without a key got a 500 and a traceback. No key the
        # launcher accepts is non-ASCII, so such a header is no key at all.
        return original(**{**kwargs, "authorization_header": None})
    decision = original(**kwargs)
    if (not decision.allowed and kwargs.get("auth_level") == AuthLevel.ADMIN_FORCE and api_key
            and _same_key(header.split(" ", 1)[-1], api_key)):
        return AuthDecision(allowed=False, error_status_code=403)
    return decision


def _same_key(given: str, key: str) -> bool:
    """In constant time, as SGLang's own check (secrets.compare_digest): how long a comparison
    takes tells nothing about how much of a guess was right."""
    return hmac.compare_digest(given.encode(), key.encode())


def keys_on_websockets(original, app, *, api_key=None, admin_api_key=None, **kwargs):
    """AROUND sglang.srt.utils.auth.add_api_key_middleware: SGLang's key middleware, then one
    that decides a websocket's upgrade request as SGLang's decides an HTTP request (the same
    hooked functions, so the admin rule above holds there too)."""
    result = original(app, api_key=api_key, admin_api_key=admin_api_key, **kwargs)
    app.add_middleware(_WebsocketKeys, api_key=api_key, admin_api_key=admin_api_key, fastapi_app=app)
    return result


class _WebsocketKeys:
    """ASGI middleware: a websocket whose upgrade request lacks the right key is refused before
    it is accepted (401/403, as an HTTP request would be, where the server can send a
    response; otherwise closed, which the server answers with 403)."""

    def __init__(self, app, *, api_key, admin_api_key, fastapi_app):
        self.app, self.api_key, self.admin_api_key, self.fastapi_app = app, api_key, admin_api_key, fastapi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        from sglang.srt.utils import auth  # through the module: our hooks on these apply

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        decision = auth.decide_request_auth(
            method="GET", path=scope.get("path", ""), authorization_header=headers.get("authorization"),
            api_key=self.api_key, admin_api_key=self.admin_api_key,
            auth_level=auth._get_auth_level_from_app_and_scope(self.fastapi_app, scope))
        if decision.allowed:
            await self.app(scope, receive, send)
            return
        status = decision.error_status_code
        if "websocket.http.response" in scope.get("extensions", {}):
            body = b'{"error":"%s"}' % (b"Unauthorized" if status == 401 else b"Forbidden")
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})


def freeze_gc_in_process(original, server_args):
    """AROUND sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup (run by SGLang's
    warm-up thread once the server is up): what its POST /freeze_gc would do, the tokenizer
    manager's `freeze_gc()` (the schedulers and detokenizer freeze on its message, then this
    process), on the server's event loop, where every call of that manager runs."""
    from sglang.srt.entrypoints.http_server import _global_state

    manager = _global_state.tokenizer_manager
    loop = manager.event_loop  # set by the first request it served: the warm-up's
    if loop is None:  # --skip-server-warmup: no request yet, and no other thread may use its socket
        logger.info("GC not frozen after start-up: no request served yet (--skip-server-warmup)")
        return
    try:
        asyncio.run_coroutine_threadsafe(manager.freeze_gc(), loop).result(timeout=10)
    except Exception:  # as upstream's call: a freeze that failed costs GC pauses, not the server
        logger.warning("post-warm-up GC freeze failed", exc_info=True)
        return
    logger.info("froze the GC after warm-up in every process of this server (in process: "
                "/freeze_gc stays an admin route)")


def admin_routes(app) -> list[str]:
    """The paths of `app` (SGLang's FastAPI app) that need the admin key once the hooks are in
    place, sorted."""
    from sglang.srt.utils.auth import AuthLevel

    paths = set()
    for route in app.routes:
        endpoint, path = getattr(route, "endpoint", None), getattr(route, "path", None)
        if endpoint is not None and path is not None:
            if _is_admin(getattr(endpoint, "_auth_level", AuthLevel.NORMAL), path):
                paths.add(path)
    return sorted(paths)
