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
any key check); everything else needs the API key when one is set.
"""

from __future__ import annotations

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
    """AROUND sglang.srt.utils.auth.decide_request_auth (called by SGLang's key middleware)."""
    from sglang.srt.utils.auth import AuthDecision, AuthLevel

    decision = original(**kwargs)
    api_key, header = kwargs.get("api_key"), kwargs.get("authorization_header") or ""
    if (not decision.allowed and kwargs.get("auth_level") == AuthLevel.ADMIN_FORCE and api_key
            and header.split(" ", 1)[-1] == api_key):
        return AuthDecision(allowed=False, error_status_code=403)
    return decision


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
