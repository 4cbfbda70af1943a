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


class Router(HttpProcess):
    """`launch_router --pd-disaggregation`: `prefill` is [(url, bootstrap port)], `decode` [url]."""

    def __init__(self, prefill: list[tuple[str, int]], decode: list[str], *,
                 extra: list[str] = (), log_path: Path | None = None):
        port = free_port()
        self.expected = len(prefill) + len(decode)
        cmd = [str(router_python()), "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--host", "127.0.0.1", "--port", str(port),
               # Its metrics listener has a fixed default port (29000): one per router.
               "--prometheus-port", str(free_port())]
        for url, bootstrap_port in prefill:
            cmd += ["--prefill", url, str(bootstrap_port)]
        for url in decode:
            cmd += ["--decode", url]
        cmd += list(extra)
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
