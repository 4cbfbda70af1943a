"""A target behind SGLang's router: its workers, their roles, and which server each figure of
the report comes from.

What sglang-router 0.3.2 answers itself and what it does not pass on (probed; bench/README.md
lists it): requests (/generate, /v1/completions) go to a worker; `/get_server_info`,
`/farskip/info` and `/metrics` are not a worker's answers, so a report from the router's URL
alone would know nothing of the servers it measured. The router does list its workers at
`GET /workers` (a plain SGLang server answers 404 there), each with the URL the router reaches
it at; the harness asks each of them directly, as it asks a server it was given.

A prefill/decode (PD) deployment splits the client's figures between two servers:
- TTFT is the prefill phase: the prefill server's forward computes the prompt's KV cache and
  samples the first token, Mooncake moves the KV cache, and the decode server hands the token
  on with no forward of its own (SGLang's "prebuilt" batch, disaggregation/decode.py), between
  two of its steps;
- ITL is the decode phase: every later token is a step of the decode server.
So each figure names the layout it measures, and with `--enable-metrics` each phase server's
own histograms sit beside the client's (the prefill server's, the decode server's).
"""

from __future__ import annotations

import urllib.error

from sglang_farskip.loadtest.servers import BenchError, check_reachable, get_json, layout, server_facts, unauthorized

# Which phase each client figure measures, and which worker role runs that phase.
PHASES = {"ttft": "prefill", "itl": "decode"}
PHASE_TEXT = {
    "ttft": "prefill phase: the prefill server's forward (it samples the first token), the KV transfer, "
            "the decode server's hand-off of that token (no forward)",
    "itl": "decode phase: the decode server's steps",
}


def workers(label: str, url: str, api_key: str | None) -> list[dict] | None:
    """The router's workers as it lists them ([{"url", "worker_type", "is_healthy", ...}]), or
    None when `url` is not a router (an SGLang server answers 404 at /workers; any other server
    is measured as before, as a server)."""
    try:
        listing = get_json(url + "/workers", api_key)
    except urllib.error.HTTPError as e:
        if e.code == 401:  # a server (or router) with an API key: the key first, then the answer
            raise unauthorized(url + "/workers", api_key) from None
        return None
    except (urllib.error.URLError, OSError) as e:
        raise BenchError(f"{label}: cannot reach {url} ({getattr(e, 'reason', e)})") from None
    except ValueError:
        return None  # not JSON: not SGLang's router
    if not isinstance(listing, dict) or not isinstance(listing.get("workers"), list):
        return None
    return listing["workers"]


def _router_role(worker: dict) -> str:
    """The role the router gives a worker: "prefill", "decode" or "none" (plain mode)."""
    kind = worker.get("worker_type")
    if isinstance(kind, dict):  # a Rust enum with data, e.g. {"Prefill": {"bootstrap_port": 8998}}
        kind = next(iter(kind), "")
    kind = str(kind or "").lower()
    return kind if kind in ("prefill", "decode") else "none"


def router_facts(label: str, url: str, listed: list[dict], api_key: str | None) -> dict:
    """The report's facts for a router target: each worker's own facts and role, and for each
    client figure the servers of its phase. Raises BenchError for a router with no workers, a
    worker the harness cannot reach, or a worker whose own role is not the router's."""
    if not listed:
        raise BenchError(f"{label}: the router at {url} lists no workers (GET {url}/workers): start its "
                         "servers, or wait until the router has registered them")
    found = []
    for worker in listed:
        wurl = str(worker.get("url", "")).rstrip("/")
        role = _router_role(worker)
        try:
            check_reachable(f"{label}: {role} worker", wurl)
        except BenchError as e:
            raise BenchError(f"{e} (the router at {url} lists it; run the load test where the router's "
                             "workers can be reached too)") from None
        facts = server_facts(wurl, api_key)
        own = facts.get("pd_role")
        # The server's own word (/farskip/info's pd_role) decides; a router that sends a phase to
        # a server running the other one is a broken deployment, not a report to write.
        if own is not None and role != "none" and own != role:
            raise BenchError(f"{label}: the router at {url} lists {wurl} as a {role} worker, but the server "
                             f"says it is a {own} server (/farskip/info pd_role)")
        found.append({**facts, "role": own or role, "healthy": worker.get("is_healthy")})
    roles = {w["role"] for w in found}
    pd = roles & {"prefill", "decode"}
    if pd and pd != {"prefill", "decode"}:
        raise BenchError(f"{label}: the router at {url} has {sorted(pd)[0]} workers only; a PD router needs "
                         "prefill and decode servers")
    first = next((w for w in found if w["role"] == "prefill"), found[0])
    decode = next((w for w in found if w["role"] == "decode"), found[0])
    facts = {"url": url, "router": "pd" if pd else "plain", "workers": found,
             # What the run itself needs (tokenizer, same-weights check, speculative details):
             # the prefill server's checkpoint, and the decode server's decoding.
             **{k: first.get(k) for k in ("version", "model_path", "tokenizer_path", "device")},
             **{k: decode.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                            "speculative_eagle_topk", "speculative_num_draft_tokens")}}
    if pd:
        facts["phases"] = {metric: [w["url"] for w in found if w["role"] == role]
                           for metric, role in PHASES.items()}
    return facts


def metric_sources(facts: dict) -> list[tuple[str, str]]:
    """(role, url) of every server whose /metrics a level reads: the target itself, or each of a
    router's workers."""
    if not facts.get("router"):
        return [("server", facts["url"])]
    return [(w["role"], w["url"]) for w in facts["workers"]]


def _server_words(w: dict) -> str:
    mode = w.get("farskip_mode")
    wiring = (f"FarSkip mode `{mode}`" if mode else "not a sglang-farskip server")
    return f"{w['url']} ({wiring}, {layout(w)})"


def describe(label: str, facts: dict) -> str:
    """The report's words for a router target: where each figure comes from."""
    head = f"**{label}** = {facts['url']}: SGLang's router"
    tail = f"; SGLang {facts.get('version', '?')}, model `{facts.get('model_path', '?')}`"
    if facts["router"] == "plain":
        servers = "; ".join(_server_words(w) for w in facts["workers"])
        return f"{head} over {len(facts['workers'])} server(s), each request on one of them: {servers}{tail}"
    by_url = {w["url"]: w for w in facts["workers"]}
    phases = "; ".join(
        f"{metric.upper()} = {PHASE_TEXT[metric]}, on "
        + ", ".join(f"{PHASES[metric]} server " + _server_words(by_url[u]) for u in urls)
        for metric, urls in facts["phases"].items())
    return f"{head} in PD mode; {phases}{tail}"


def target_facts(label: str, url: str, api_key: str | None) -> dict:
    """What the report says about a target: a server's facts (servers.server_facts), or a
    router's with its workers'. Fails in seconds on anything unreachable (BenchError)."""
    check_reachable(label, url)
    listed = workers(label, url, api_key)
    if listed is None:
        return server_facts(url, api_key)
    return router_facts(label, url, listed, api_key)


def check_endpoint(label: str, facts: dict, endpoint: str) -> None:
    """sglang-router 0.3.2's own /v1/completions parses the request itself: a prompt of token
    ids is refused (HTTP 422, "data did not match any variant of untagged enum StringOrArray"),
    and a streamed answer comes without the per-chunk token counts (`usage` null) that the
    harness times tokens by. Its /generate passes SGLang's native request on as it is."""
    if facts.get("router") and endpoint == "completions":
        raise BenchError(f"{label}: SGLang's router at {facts['url']} takes no token-id prompts on "
                         "/v1/completions and streams no token counts there: pass --endpoint generate")
