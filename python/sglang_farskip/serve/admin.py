"""The admin routes answer the admin key only; without one they answer 403 to everyone.

SGLang marks its operator routes `ADMIN_OPTIONAL` (sglang/srt/utils/auth.py): with an API key but
no admin key, the API key opens them, so every client could pause generation
(`/pause_generation`: the health check then fails and a deployment restarts), have every user's
prompts written to a folder it names (`/configure_logging`), abort everyone's requests, flush the
cache, profile, load weights or adapters. `require_admin_key()` raises each of them to SGLang's
own `ADMIN_FORCE` level, whose rule is the one we want: the admin key (`--admin-api-key`, the
entrypoint's ADMIN_API_KEY) and nothing else, 403 when the server has none.

A client that sends the inference key to an admin route is told 403 (a valid key without the
right), not SGLang's 401 (no valid key).

Health, readiness and metrics stay open to probes and scrapers (SGLang lets them through before
any key check); everything else needs the API key when one is set.
"""

from __future__ import annotations

# Routes SGLang leaves at its normal level that are operator business all the same.
ALSO_ADMIN = ("/get_hicache_l3_cache_layout",)


def _inference_key_forbidden(original, **kwargs):
    """AROUND sglang.srt.utils.auth.decide_request_auth (called by SGLang's key middleware)."""
    from sglang.srt.utils.auth import AuthDecision, AuthLevel

    decision = original(**kwargs)
    api_key, header = kwargs.get("api_key"), kwargs.get("authorization_header") or ""
    if (not decision.allowed and kwargs.get("auth_level") == AuthLevel.ADMIN_FORCE and api_key
            and header.split(" ", 1)[-1] == api_key):
        return AuthDecision(allowed=False, error_status_code=403)
    return decision


def require_admin_key(app) -> list[str]:
    """Raise every admin route of `app` (SGLang's FastAPI app) to ADMIN_FORCE; returns their
    paths, sorted. Call before SGLang starts serving: it installs its key middleware when it
    finds an ADMIN_FORCE route, even without keys."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils.auth import AuthLevel

    HookRegistry.register("sglang.srt.utils.auth.decide_request_auth", _inference_key_forbidden, HookType.AROUND)
    HookRegistry.apply_hooks()

    paths = set()
    for route in app.routes:
        endpoint = getattr(route, "endpoint", None)
        path = getattr(route, "path", None)
        if endpoint is None or path is None:
            continue
        level = getattr(endpoint, "_auth_level", AuthLevel.NORMAL)
        if level in (AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE) or path in ALSO_ADMIN:
            endpoint._auth_level = AuthLevel.ADMIN_FORCE
            paths.add(path)
    return sorted(paths)
