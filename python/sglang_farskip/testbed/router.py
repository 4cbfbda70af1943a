"""SGLang's router (`sglang-router`, a Rust binary behind `python -m sglang_router.launch_router`)
for tests and benchmarks: started from its own virtual environment, waited for until every
worker is registered and healthy, always killed with its process tree.

With `keys`, it starts as the router image starts it (deploy/router.py, reading both keys from
files as from a Docker or Kubernetes secret), so that a test asks the deployment's own router
what each key may do.

Its own environment (`.venv-router` at the repository root, made by scripts/bootstrap.sh from
requirements/router.txt), because pip gives it newer web packages (fastapi, uvicorn, unbounded in
its requirements) than SGLang 0.5.23 is pinned to. Why `/workers` and not `/health`: in PD mode the
router's `/health` answers 200 before it has registered a worker, and a request sent then gets
503 "No prefill workers available".
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_farskip.testbed import REPO
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.servers import HttpProcess

ROUTER_PYTHON = REPO / ".venv-router" / "bin" / "python"
START_TIMEOUT_S = 120  # 10-23 s seen here beside servers


def router_python() -> Path:
    if not ROUTER_PYTHON.exists():
        raise FileNotFoundError(f"{ROUTER_PYTHON} is missing: run scripts/bootstrap.sh (it makes the "
                                "router's environment)")
    return ROUTER_PYTHON


def _deploy_router():
    """deploy/router.py, the router image's entrypoint (standard library only), as a module."""
    spec = importlib.util.spec_from_file_location("farskip_deploy_router", REPO / "deploy" / "router.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Both modes: a dead worker dropped within seconds, a live one never. The flags and their
# reasons live in deploy/router.args, which the router image reads too (deploy/router.py); only
# the request timeout is the tests' own. It bounds every request, so a deployment sets it above
# its longest one (ROUTER_REQUEST_TIMEOUT, docs/pd.md); the tests' requests are at most 8 tokens
# of the demo model on CPU (a few seconds on busy cores), and their clients wait 30 s or more: a
# request sent to a hung replica, or in flight on a PD pair whose decode server died (its
# prefill server would wait 300 s for it), is re-sent after 20 s. A benchmark passes a longer
# one in `extra`, so that no request it times is cut and sent again.
TEST_REQUEST_TIMEOUT_S = 20
DEPLOY_ROUTER = _deploy_router()
ROUTER_FLAGS = [*DEPLOY_ROUTER.router_args(), "--request-timeout-secs", str(TEST_REQUEST_TIMEOUT_S)]


class Router(HttpProcess):
    """`launch_router --pd-disaggregation` when `prefill` ([(url, bootstrap port)]) and `decode`
    ([url]) are given; plain mode over `workers` ([url], replicas) otherwise; ROUTER_FLAGS in
    both. `extra` flags come last (argparse keeps the last of a repeated flag). `keys`
    ({"API_KEY": ..., "ADMIN_API_KEY": ...}): through deploy/router.py, each key in a file of
    its own (API_KEY_FILE, ADMIN_API_KEY_FILE)."""

    def __init__(self, prefill: list[tuple[str, int]] = (), decode: list[str] = (), *,
                 workers: list[str] = (), extra: list[str] = (), log_path: Path | None = None,
                 keys: dict[str, str] | None = None):
        if bool(workers) == bool(prefill or decode):
            raise ValueError("give either workers (plain mode) or prefill and decode (PD mode)")
        port = free_port()
        self.expected = len(prefill) + len(decode) + len(workers)
        self.keys = dict(keys or {})
        # Its metrics listener has a fixed default port (29000): one per router.
        metrics = ["--prometheus-port", str(free_port())]
        # Not this process's environment: PYTHONPATH and the like point into SGLang's venv.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        if keys:
            cmd, deployed = self._deployed(port, prefill, decode, workers, [*metrics, *extra])
            # Only what the test gives: a key in the caller's environment would be a second one.
            env = {k: v for k, v in env.items() if k not in DEPLOY_ROUTER.ROUTER_VARS} | deployed
            self._deployed_cmd, self._deployed_env = cmd, env
        else:
            cmd = [str(router_python()), "-m", "sglang_router.launch_router",
                   "--host", "127.0.0.1", "--port", str(port), *metrics]
            if workers:
                cmd += ["--worker-urls", *workers]
            else:
                cmd.append("--pd-disaggregation")
            for url, bootstrap_port in prefill:
                cmd += ["--prefill", url, str(bootstrap_port)]
            for url in decode:
                cmd += ["--decode", url]
            cmd += [*ROUTER_FLAGS, *extra]
        super().__init__(port, cmd, env, log_path or Path(f"/tmp/farskip-test-router-{port}.log"))

    def _deployed(self, port, prefill, decode, workers, extra) -> tuple[list[str], dict]:
        """deploy/router.py's command and environment: the flags come from the same variables
        as in the router image, and the keys from files, as from a secret."""
        bootstrap = {b for _, b in prefill}
        if len(bootstrap) > 1:
            raise ValueError("deploy/router.py gives every prefill server one BOOTSTRAP_PORT")
        self._key_dir = tempfile.TemporaryDirectory(prefix="farskip-router-keys-")
        env = {"ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port),
               "ROUTER_REQUEST_TIMEOUT": str(TEST_REQUEST_TIMEOUT_S), "ROUTER_EXTRA_ARGS": " ".join(extra),
               "WORKER_URLS": ",".join(workers), "PREFILL_URLS": ",".join(u for u, _ in prefill),
               "DECODE_URLS": ",".join(decode), "BOOTSTRAP_PORT": str(next(iter(bootstrap), ""))}
        for name, key in self.keys.items():
            path = Path(self._key_dir.name) / name.lower()
            path.write_text(key + "\n")
            env[f"{name}_FILE"] = str(path)
        return [str(router_python()), str(REPO / "deploy" / "router.py")], env

    def run_deployed(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """deploy/router.py ARGS (--healthcheck, --flush-cache) in this router's environment, as
        an operator runs it in the router's container; for a router started with keys."""
        return subprocess.run([*self._deployed_cmd, *args], env=self._deployed_env, capture_output=True,
                              text=True, timeout=timeout)

    def request(self, method: str, path: str, key: str | None = None, body: dict | None = None,
                timeout: float = 30) -> tuple[int, str]:
        """(status, body) of one request, with `Authorization: Bearer key` when a key is given;
        an HTTP error status is an answer, not an exception."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def workers(self) -> list[dict]:
        """GET /workers: a control-plane route, so with the admin key where there is one."""
        status, body = self.request("GET", "/workers", self.keys.get("ADMIN_API_KEY"), timeout=10)
        if status != 200:
            raise urllib.error.HTTPError(self.url + "/workers", status, body[:200], None, None)
        return json.loads(body)["workers"]

    def stop(self) -> None:
        super().stop()
        if hasattr(self, "_key_dir"):
            self._key_dir.cleanup()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Router":
        """Until every worker given is listed and healthy."""
        deadline = time.monotonic() + timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                seen = self.workers()
            except urllib.error.HTTPError as e:
                if e.code == 401:  # no answer will change: say so now
                    raise RuntimeError(f"router refuses GET /workers (401) with "
                                       f"{'the admin key' if self.keys.get('ADMIN_API_KEY') else 'no key'}:\n"
                                       f"{self.log_tail(10)}") from e
                seen = []
            except (OSError, ValueError, KeyError):
                seen = []
            if len(seen) == self.expected and all(w.get("is_healthy") for w in seen):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"router: {len(seen)} of {self.expected} workers healthy after {timeout} s "
                           f"({seen}):\n{self.log_tail()}")
