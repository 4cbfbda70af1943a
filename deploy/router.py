"""SGLang's router in front of sglang-farskip servers: the router image's entrypoint.

    router.py [--check]      check the environment, start the router (--check: print its flags)
    router.py --healthcheck  exit 0 once every worker given is registered and healthy
    router.py --flush-cache  flush the cache of every server the router lists (the admin key)

It reads the environment (docs/deploy.md, "Variables read by deploy/router.py"), prints one
`error:` line per problem (exit 2), and starts `sglang_router.launch_router` in this process:
- PD mode when PREFILL_URLS and DECODE_URLS are set (each prefill server's bootstrap port is
  BOOTSTRAP_PORT, the variable the prefill server's entrypoint reads);
- plain mode over replicas when WORKER_URLS is set;
each with the health-check and retry flags of router.args beside this file (the tests read the
same file).
The keys, each given to the router in memory, never on a command line (ps shows one to every
user of the host) nor left in the environment of the process that runs it (given as variables,
they reach a second start of this script through a pipe: restart_without_key_variables): the
router's --api-key is both what clients must send it (401 without) and what it sends the
workers, so it is the workers' API_KEY; ADMIN_API_KEY is the one admin entry of its
--control-plane-api-keys, so that its control plane (adding and removing workers, flushing
caches, listing workers and loads) answers the admin key and nothing else. Without
control-plane keys the router opens that control plane to the inference key: any client could
remove the deployment's servers and add its own, and every user's prompt would go there. So an
API key without an admin key is refused. --healthcheck asks GET /workers (a control-plane
route, so with the admin key), not /health: in PD mode /health answers 200 before any worker is
registered. PARK_ON_ERROR=1 (compose, whose policy restarts every exit): a refused setting parks
instead of exiting 2, as deploy/entrypoint.sh does (docs/deploy.md, "Self-healing"). Standard
library only (it runs in the router's own Python).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROUTER_VARS = ("ROUTER_HOST", "ROUTER_PORT", "WORKER_URLS", "PREFILL_URLS", "DECODE_URLS",
               "BOOTSTRAP_PORT", "ROUTER_REQUEST_TIMEOUT", "ROUTER_MAX_CONCURRENT_REQUESTS", "API_KEY", "API_KEY_FILE",
               "ADMIN_API_KEY", "ADMIN_API_KEY_FILE", "FARSKIP_ALLOW_NO_API_KEY", "ROUTER_EXTRA_ARGS",
               "PARK_ON_ERROR")
DEFAULTS = {
    "ROUTER_HOST": "0.0.0.0",
    "ROUTER_PORT": "8000",
    # SGLang's own default (--disaggregation-bootstrap-port), as the entrypoint's.
    "BOOTSTRAP_PORT": "8998",
    # Bounds every request, streaming ones included: a request to a hung worker is re-sent after
    # it, and one that legitimately takes longer is cut. Above the longest request (time to
    # first token + max_tokens x inter-token latency: 4000 tokens at 50 ms are 200 s).
    "ROUTER_REQUEST_TIMEOUT": "600",
    "FARSKIP_ALLOW_NO_API_KEY": "0",
    "PARK_ON_ERROR": "0",
}
# ROUTER_MAX_CONCURRENT_REQUESTS when unset: this many per server the router sends requests to
# (the workers in plain mode, the decode servers in PD mode), each server's own queue bound
# (--max-queued-requests, which the launcher sets to 256), so that the router, not a server, is
# what turns a burst away.
PER_SERVER_IN_FLIGHT = 256
ROUTER_ARGS = Path(__file__).resolve().with_name("router.args")
URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):\d{1,5}$")


def router_args(path: Path = ROUTER_ARGS) -> list[str]:
    """The flags of router.args, in order."""
    return [word for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#") for word in line.split()]


def setting(name: str) -> str:
    """The variable, or its default; empty counts as unset (compose passes unset ones empty)."""
    return os.environ.get(name) or DEFAULTS.get(name, "")


def urls(name: str) -> list[str]:
    return [u for u in re.split(r"[\s,]+", setting(name)) if u]


# deploy/compose.yaml hands API_KEY and ADMIN_API_KEY over as files, not variables (a variable
# would stay in docker-init's environment): a file here is the variable's value.
COMPOSE_SECRETS = Path("/run/secrets")


# Keys given as variables (API_KEY, ADMIN_API_KEY: a Kubernetes secretKeyRef, Slurm's
# environment) reach the router through a pipe, never its environment: the process that runs
# the router (PID 1 of its container) keeps the environment it was started with, readable in
# /proc/1/environ for its lifetime. So the first process reads them, starts this script again
# without them, and writes them into a pipe the second one reads (KEYS_FD).
KEY_VARIABLES, KEYS_FD = ("API_KEY", "ADMIN_API_KEY"), "FARSKIP_ROUTER_KEYS_FD"
_handed: dict[str, str] = {}


def restart_without_key_variables(keys: dict[str, str]) -> None:
    """exec this script again (no return) with `keys` in a pipe instead of the environment."""
    read_end, write_end = os.pipe()
    os.write(write_end, json.dumps(keys).encode())  # a few hundred bytes: within the pipe's buffer
    os.close(write_end)
    os.set_inheritable(read_end, True)
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES} | {KEYS_FD: str(read_end)}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve())], env)


def take_handed_keys() -> None:
    fd = os.environ.pop(KEYS_FD, None)
    if fd is not None:
        with os.fdopen(int(fd)) as pipe:
            _handed.update(json.loads(pipe.read()))


def read_key(errors: list[str], name: str = "API_KEY") -> str:
    """NAME's value (the variable, handed over through the pipe, or the file compose wrote for
    it), or the content of the file NAME_FILE names (a Docker or Kubernetes secret of the user's)."""
    key = os.environ.get(name, "") or _handed.get(name, "") or _compose_key(name)
    path = os.environ.get(f"{name}_FILE", "")
    if key and path:
        errors.append(f"{name} and {name}_FILE are both set: keep one (the file, for a Docker or Kubernetes secret)")
    elif path:
        try:
            key = Path(path).read_text().strip()
        except OSError:
            errors.append(f"{name}_FILE={path} is not a readable file: mount the secret there, or unset {name}_FILE")
            return ""
        if not key:
            errors.append(f"{name}_FILE={path} is empty: write the key into it")
    return key


def _compose_key(name: str) -> str:
    try:
        return (COMPOSE_SECRETS / f"farskip_{name}").read_text().rstrip("\n")
    except FileNotFoundError:
        return ""


# The one control-plane key the router gets: (id, name, key, role), as sglang_router's
# RouterArgs holds each --control-plane-api-keys entry once parsed.
def control_plane_keys(admin_key: str) -> list[tuple[str, str, str, str]]:
    return [("farskip-admin", "ADMIN_API_KEY", admin_key, "admin")] if admin_key else []


def check() -> tuple[list[str], str, str, list[str]]:
    """(the router's flags, the API key, the admin key, the errors)."""
    errors: list[str] = []
    for name in ("ROUTER_PORT", "BOOTSTRAP_PORT"):
        value = setting(name)
        if not value.isdigit() or not 1 <= int(value) <= 65535:
            errors.append(f"{name}={value} is not a TCP port: set {name} to a number from 1 to 65535")
    timeout = setting("ROUTER_REQUEST_TIMEOUT")
    if not timeout.isdigit() or int(timeout) < 1:
        errors.append(f"ROUTER_REQUEST_TIMEOUT={timeout} is not a positive number of seconds: set it "
                      "above your longest request (time to first token + max_tokens x inter-token latency)")
    workers, prefill, decode = urls("WORKER_URLS"), urls("PREFILL_URLS"), urls("DECODE_URLS")
    in_flight = setting("ROUTER_MAX_CONCURRENT_REQUESTS") or str(PER_SERVER_IN_FLIGHT * max(1, len(workers or decode)))
    if not in_flight.isdigit() or int(in_flight) < 1:
        errors.append(f"ROUTER_MAX_CONCURRENT_REQUESTS={in_flight} is not a positive number of requests: set it to "
                      "what your servers run and queue together, or unset it (256 per server)")
    if workers and (prefill or decode):
        errors.append("WORKER_URLS and PREFILL_URLS/DECODE_URLS are both set: set WORKER_URLS for replicas, "
                      "or PREFILL_URLS and DECODE_URLS for prefill/decode disaggregation, not both")
    elif not workers and not (prefill and decode):
        errors.append("no workers: set WORKER_URLS (replicas, plain mode) or both PREFILL_URLS and DECODE_URLS "
                      "(prefill/decode disaggregation), e.g. PREFILL_URLS=http://10.0.0.1:30000")
    for name in ("WORKER_URLS", "PREFILL_URLS", "DECODE_URLS"):
        bad = [u for u in urls(name) if not URL.match(u)]
        if bad:
            errors.append(f"{name}: {' '.join(bad)} is not http://HOST:PORT: give each server's HTTP "
                          "address as the router reaches it, comma-separated")
    if setting("PARK_ON_ERROR") not in ("0", "1"):
        errors.append(f"PARK_ON_ERROR={setting('PARK_ON_ERROR')} is not 0 or 1: set it to 1 only under a "
                      "restart policy that restarts every exit (compose's unless-stopped)")
    allow = setting("FARSKIP_ALLOW_NO_API_KEY")
    if allow not in ("0", "1"):
        errors.append(f"FARSKIP_ALLOW_NO_API_KEY={allow} is not 0 or 1: set it to 1 only to serve without API_KEY beyond loopback")
    before = len(errors)
    key, admin_key = read_key(errors), read_key(errors, "ADMIN_API_KEY")
    host = setting("ROUTER_HOST")
    loopback = host.startswith("127.") or host in ("::1", "localhost")
    # Anyone who reaches the router's port could use every server behind it: beyond loopback, a
    # key or an explicit yes (the entrypoint's rule for the servers).
    if not key and not loopback and allow != "1" and len(errors) == before:
        errors.append(f"API_KEY is not set and the router would listen on ROUTER_HOST={host}: set API_KEY or "
                      "API_KEY_FILE (the servers' key; clients send 'Authorization: Bearer <key>'), or set "
                      "FARSKIP_ALLOW_NO_API_KEY=1 to serve without a key, or ROUTER_HOST=127.0.0.1")
    if len(errors) == before and key and not admin_key:
        errors.append("API_KEY is set but ADMIN_API_KEY is not: without it the router's control plane (POST and "
                      "DELETE /workers, POST /flush_cache) answers the API key, so any client could replace the "
                      "servers with its own; set ADMIN_API_KEY or ADMIN_API_KEY_FILE (the servers' admin key)")
    elif len(errors) == before and key and admin_key == key:
        errors.append("ADMIN_API_KEY is the same as API_KEY: every client would hold the router's control plane; "
                      "give the admin key its own value (openssl rand -hex 32)")
    extra = shlex.split(setting("ROUTER_EXTRA_ARGS"))
    if any(a.startswith(("--api-key", "--control-plane-api-keys")) for a in extra):
        errors.append("ROUTER_EXTRA_ARGS holds an API key flag, which shows on the command line: set API_KEY "
                      "(or API_KEY_FILE) instead")

    flags = ["--host", host, "--port", setting("ROUTER_PORT"),
             # Its metrics listener (29000) stays on loopback: it is not the public port.
             "--prometheus-host", "127.0.0.1"]
    if workers:
        flags += ["--worker-urls", *workers]
    else:
        flags.append("--pd-disaggregation")
        for url in prefill:
            flags += ["--prefill", url, setting("BOOTSTRAP_PORT")]
        for url in decode:
            flags += ["--decode", url]
    # Past this many requests in flight the router answers 429 at once (router.args: no queue).
    # Without it a burst reached the servers, whose 429s the router retried and counted as
    # failures: its circuit breaker took the servers out, and every client got 503 for a minute.
    flags += [*router_args(), "--request-timeout-secs", timeout, "--max-concurrent-requests", in_flight, *extra]
    return flags, key, admin_key, errors


def parked_file() -> Path:
    """Where a parked router says why (the entrypoint's marker, deploy/healthcheck.sh's path)."""
    return Path(os.environ.get("TMPDIR") or "/tmp") / "farskip-parked"


def park(errors: list[str]) -> int:
    """Stay up, doing nothing, until told to stop (then exit 2): so that a restart policy that
    restarts every exit does not start a refused setting again and again."""
    parked_file().write_text("parked: exit status 2, a setting was refused:\n"
                             + "".join(f"error: {e}\n" for e in errors))
    print("error: parked: the router stopped with status 2 (a setting was refused; the error: line above "
          "says why); the container stays up and unhealthy so that Docker does not start it again; fix the "
          "cause, then docker compose up -d --force-recreate", file=sys.stderr, flush=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(2))
    while True:
        signal.pause()


def healthcheck() -> int:
    """0 when /workers lists every worker given, each healthy."""
    if parked_file().exists():
        print(parked_file().read_text(), file=sys.stderr, end="")
        return 1
    errors: list[str] = []
    # /workers is a control-plane route: the admin key when the router has one.
    key = read_key(errors, "ADMIN_API_KEY") or read_key(errors)
    expected = len(urls("WORKER_URLS")) + len(urls("PREFILL_URLS")) + len(urls("DECODE_URLS"))
    try:
        workers = listed_workers(key)
    except (OSError, ValueError, KeyError) as e:
        print(f"router /workers: {e}", file=sys.stderr)
        return 1
    healthy = sum(1 for w in workers if w.get("is_healthy"))
    if healthy < expected:
        print(f"router: {healthy} of {expected} workers registered and healthy", file=sys.stderr)
        return 1
    return 0


def _ask(url: str, key: str, method: str = "GET", timeout: float = 8) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def listed_workers(key: str) -> list[dict]:
    """The router's GET /workers (a control-plane route: the admin key when it has one)."""
    status, body = _ask(f"http://127.0.0.1:{setting('ROUTER_PORT')}/workers", key)
    if status != 200:
        raise OSError(f"answered {status}: {body[:300]}")
    return json.loads(body)["workers"]


def flush_cache() -> int:
    """POST /flush_cache to every server the router lists, with the admin key: 0 when each
    flushed. The router's own POST /flush_cache cannot do it: sglang-router 0.3.2 sends the
    servers the one key it holds for them, the inference key, and a server's /flush_cache is
    an admin route (SGLang refuses it the inference key). The admin key is the servers' too."""
    errors: list[str] = []
    key = read_key(errors, "ADMIN_API_KEY")
    if not key and not errors:
        errors.append("ADMIN_API_KEY is not set: a server flushes its cache for its admin key alone; "
                      "set ADMIN_API_KEY or ADMIN_API_KEY_FILE (the servers' admin key)")
    if errors:
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr)
        return 2
    try:
        servers = [w["url"] for w in listed_workers(key)]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: the router's /workers: {e}: is the router up on ROUTER_PORT, and ADMIN_API_KEY its "
              "admin key?", file=sys.stderr)
        return 1
    failed = 0
    for url in servers:
        try:
            status, body = _ask(f"{url}/flush_cache", key, "POST", timeout=60)
        except OSError as e:
            status, body = 0, str(e)
        failed += status != 200
        print(f"{url}: {status or 'no answer'} {' '.join(body.split())[:300]}")
    print(f"{len(servers) - failed} of {len(servers)} servers flushed their cache", file=sys.stderr)
    return 1 if failed or not servers else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--healthcheck"]:
        return healthcheck()
    if argv == ["--flush-cache"]:
        return flush_cache()
    if argv and argv != ["--check"]:
        print(f"usage: router.py [--check | --healthcheck | --flush-cache] (reads {' '.join(ROUTER_VARS)})",
              file=sys.stderr)
        return 2
    if not argv:
        take_handed_keys()
        parked_file().unlink(missing_ok=True)  # a container that Docker restarts keeps its files
    flags, key, admin_key, errors = check()
    if errors:
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr, flush=True)
        return park(errors) if not argv and setting("PARK_ON_ERROR") == "1" else 2
    variables = {name: value for name, value in os.environ.items() if name in KEY_VARIABLES and value}
    if not argv and variables:
        restart_without_key_variables(variables)
    held = [what for what, k in (("API key", key), ("admin key for the control plane", admin_key)) if k]
    print("sglang-farskip router: " + shlex.join(flags) + (f" ({' and '.join(held)} set, not shown)" if held else ""),
          file=sys.stderr, flush=True)
    if argv == ["--check"]:
        print(shlex.join(flags))
        return 0
    for name in ("API_KEY", "API_KEY_FILE", "ADMIN_API_KEY", "ADMIN_API_KEY_FILE"):  # nothing the router starts needs them
        os.environ.pop(name, None)
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(flags)
    args.api_key = key or None
    args.control_plane_api_keys = control_plane_keys(admin_key)
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
