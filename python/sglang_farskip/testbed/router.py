"""SGLang's router (`sglang-router`, a Rust binary behind `python -m sglang_router.launch_router`)
for tests and benchmarks: started from its own virtual environment, waited for until every
worker is registered and healthy, always killed with its process tree.

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
ROUTER_FLAGS = [*_deploy_router().router_args(), "--request-timeout-secs", str(TEST_REQUEST_TIMEOUT_S)]


class Router(HttpProcess):
    """`launch_router --pd-disaggregation` when `prefill` ([(url, bootstrap port)]) and `decode`
    ([url]) are given; plain mode over `workers` ([url], replicas) otherwise; ROUTER_FLAGS in
    both. `extra` flags come last (argparse keeps the last of a repeated flag)."""

    def __init__(self, prefill: list[tuple[str, int]] = (), decode: list[str] = (), *,
                 workers: list[str] = (), extra: list[str] = (), log_path: Path | None = None):
        if bool(workers) == bool(prefill or decode):
            raise ValueError("give either workers (plain mode) or prefill and decode (PD mode)")
        port = free_port()
        self.expected = len(prefill) + len(decode) + len(workers)
        cmd = [str(router_python()), "-m", "sglang_router.launch_router",
               "--host", "127.0.0.1", "--port", str(port),
               # Its metrics listener has a fixed default port (29000): one per router.
               "--prometheus-port", str(free_port())]
        if workers:
            cmd += ["--worker-urls", *workers]
        else:
            cmd.append("--pd-disaggregation")
        for url, bootstrap_port in prefill:
            cmd += ["--prefill", url, str(bootstrap_port)]
        for url in decode:
            cmd += ["--decode", url]
        cmd += [*ROUTER_FLAGS, *extra]
        # Not this process's environment: PYTHONPATH and the like point into SGLang's venv.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        super().__init__(port, cmd, env, log_path or Path(f"/tmp/farskip-test-router-{port}.log"))

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(self.url + "/workers", timeout=10) as r:
            return json.loads(r.read())["workers"]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Router":
        """Until every worker given is listed and healthy."""
        deadline = time.monotonic() + timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                seen = self.workers()
            except (OSError, urllib.error.HTTPError, ValueError, KeyError):
                seen = []
            if len(seen) == self.expected and all(w.get("is_healthy") for w in seen):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"router: {len(seen)} of {self.expected} workers healthy after {timeout} s "
                           f"({seen}):\n{self.log_tail()}")
