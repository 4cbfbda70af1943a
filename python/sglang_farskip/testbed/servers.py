"""Start real servers for tests: `python -m sglang_farskip.launch_server` (or stock SGLang) in
a subprocess on a free port, wait until it answers, and always kill its whole process tree;
and run the launcher on input it must refuse (`launch`, `assert_fails`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_farskip.serve.watchdog import signal_group
from sglang_farskip.testbed import REPO
from sglang_farskip.testbed.ports import NCCL_PORT_OFFSET, free_port

START_TIMEOUT_S = 240  # a CPU start is 25-45 s here; CI machines are slower when busy

# Test servers run upstream's one torch.compile'd function on this path eagerly: SGLang's CPU
# MoE router (`biased_grouped_topk_impl`, sglang/srt/layers/moe/topk.py) is compiled with
# inductor on the first forward of every rank, about 7 CPU-seconds each; over the suite's ~70
# rank starts that was ~4 minutes of CI. The eager function is the same math (and what the
# reference compares with). The servers of tests/test_docker.py and the deployments of
# tests/test_deploy_two_nodes.py run it compiled, as users do (`Server(..., eager=False)`).
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
# Each rank of a CPU test or bench run gets one core; two OpenMP threads per rank on two cores
# made TP=2 about 3x slower here.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

# Our launcher's admin routes (/flush_cache, ...) answer only an admin key (serve/admin.py):
# test servers get this one unless a test gives its own.
ADMIN_KEY = "adm-farskip-testbed-3b8e61c0"


def admin_post(base_url: str, path: str, payload: dict | None = None, key: str = ADMIN_KEY,
               timeout: float = 60) -> str:
    """The answer's body (some admin routes answer plain text, e.g. /flush_cache)."""
    req = urllib.request.Request(base_url + path, data=json.dumps(payload or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode(errors="replace")


class HttpProcess:
    """A command serving HTTP on `port`, in a session of its own (so that `stop` kills its whole
    tree) with its output in `log_path`. What Server and testbed.router.Router share."""

    def __init__(self, port: int, cmd: list[str], env: dict, log_path: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=REPO)

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-n:] if "Ignore import error" not in line)

    def post(self, path: str, payload: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout: float = 30) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(HttpProcess):
    """`watchdog`: run the server under serve/watchdog.py with these flags, as a deployment
    does (it restarts a crashed or hung server; `server_pid` is the server's own process). It
    checks `watch_url` (default: this server's own): a node rank above 0 serves no HTTP and
    watches node 0's, as deploy/entrypoint.sh has it. `port`: the HTTP port (default: a free
    one), for a node 0 whose URL its other nodes' watchdogs must know before it starts."""

    def __init__(self, args: list[str], *, stock: bool = False, env: dict | None = None,
                 log_path: Path | None = None, eager: bool = True, admin_key: str | None = ADMIN_KEY,
                 watchdog: list[str] | None = None, watch_url: str | None = None,
                 port: int | None = None):
        port = port or free_port()
        module = "sglang.launch_server" if stock else "sglang_farskip.launch_server"
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
        if "--nccl-port" not in args:  # not SGLang's random pick (why: ports.py)
            cmd += ["--nccl-port", str(port + NCCL_PORT_OFFSET)]
        self.watched = watchdog is not None
        if self.watched:
            url = watch_url or f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "sglang_farskip.serve.watchdog", "--url", url + "/health_generate",
                   "--up-url", url + "/health", *watchdog, "--", *cmd]
        full_env = {**os.environ, **(EAGER if eager else {}), **(env or {})}
        if admin_key and not stock and not any(a.startswith("--admin-api-key") for a in args):
            full_env.setdefault("FARSKIP_ADMIN_API_KEY", admin_key)
        if stock:
            # Stock SGLang on CPU: SGLang's own launcher, only our CPU-fix plugin, the same
            # environment our launcher would set.
            full_env.setdefault("SGLANG_PLUGINS", "farskip_cpu")
            full_env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            full_env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
            full_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "0")
        super().__init__(port, cmd, full_env, log_path or Path(f"/tmp/farskip-test-server-{port}.log"))

    def server_pid(self) -> int:
        """The launcher's pid: this process's, or under a watchdog its child's (the server runs
        in a process group of its own there, which `kill -- -PID` ends whole)."""
        import psutil

        if not self.watched:
            return self.proc.pid
        children = psutil.Process(self.proc.pid).children()
        if not children:
            raise RuntimeError(f"the watchdog (pid {self.proc.pid}) runs no server now:\n{self.log_tail()}")
        return children[0].pid

    def stop(self) -> None:
        # The server is in a session of its own under the watchdog: end it first (the watchdog's
        # back-off keeps it from starting another before the watchdog itself is ended).
        if self.watched and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                os.killpg(self.server_pid(), signal.SIGKILL)
        super().stop()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def wait_for_process(self, title: str, timeout: float = START_TIMEOUT_S) -> "Server":
        """Wait until a process of this server's tree has `title` (SGLang names its workers
        with setproctitle, e.g. "sglang::data_parallel_controller")."""
        import psutil

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(psutil.Error):
                if any(title in " ".join(child.cmdline())
                       for child in psutil.Process(self.proc.pid).children(recursive=True)):
                    return self
            time.sleep(0.5)
        raise TimeoutError(f"no {title} process after {timeout} s:\n{self.log_tail()}")

    def scheduler_pids(self) -> set[int]:
        """The pids of this server's scheduler processes: a crashed scheduler that a launcher
        or watchdog replaced shows as a new pid."""
        import psutil

        return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "sglang::scheduler" in " ".join(p.cmdline())}

    def admin(self, path: str, payload: dict | None = None) -> str:
        """POST to an admin route with the testbed's admin key."""
        return admin_post(self.url, path, payload)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the logprob of each chosen token, through SGLang's /generate."""
        out = self.post("/generate", {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True},
            "return_logprob": True,
        })
        pairs = out["meta_info"]["output_token_logprobs"]  # [(logprob, token_id, text), ...]
        return [p[1] for p in pairs], [p[0] for p in pairs]


@contextlib.contextmanager
def side_by_side(runs: dict[str, dict], timeout: float = START_TIMEOUT_S, serving=None):
    """Start several servers at once (each `runs` value is Server's keyword arguments) and
    yield {name: Server} once every one of `serving` (default: all) answers; all are killed on
    the way out. Leave out of `serving` what has no HTTP server (a node rank > 0).

    Why: a CPU start here is 25-45 s, mostly one Python process at a time importing SGLang, so
    one start keeps about one of the two cores busy; starts side by side overlap. Give each
    server one OpenMP thread (ONE_THREAD): more threads than cores made TP=2 about 3x
    slower here.
    """
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(Server(**kwargs)) for name, kwargs in runs.items()}
        for name in servers if serving is None else serving:
            try:
                servers[name].wait_ready(timeout)
            except (RuntimeError, TimeoutError) as failed:
                # A start that fails or hangs is often another server's doing (a peer node that
                # died): show every log.
                others = "".join(f"\n--- {other}'s log:\n{server.log_tail(30)}"
                                 for other, server in servers.items() if other != name)
                # Its own log last: a report cut in the middle (CI's) keeps the end, where a
                # child's traceback is (SGLang's launcher then ends itself: exit -9).
                raise type(failed)(f"{name} did not start; the others' logs first, its own "
                                   f"last:{others}\n--- {name}: {failed}") from None
        yield servers


# ------------------------------------------------------------------ a launch expected to fail
# Checks on the checkpoint run before SGLang is imported (seconds); flag checks need SGLang's
# own argument resolution (import ~10-20 s here). Either way far from a hang.
TIME_BOUND_S = 120


def launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m sglang_farskip.launch_server ARGS` run to its end (bounded); `.elapsed` is
    its run time."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_farskip.launch_server", "--port", str(free_port()), *args],
        capture_output=True, text=True, timeout=TIME_BOUND_S, env={**os.environ, **(env or {})},
    )
    proc.elapsed = time.monotonic() - start
    return proc


def assert_fails(proc, *fragments: str) -> None:
    """Exit 2 with an `error:` line, and every fragment in the message from there on."""
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert error_lines, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("error:"):]
    for fragment in fragments:
        assert fragment in message, message


def run_load(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """bench/run_load.py in a subprocess from the repository root. Its environment is this
    process's without API_KEY, plus `env`: a test says which key, if any, the load tools get."""
    base = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    return subprocess.run([sys.executable, str(REPO / "bench" / "run_load.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**base, **(env or {})})


def stream_times(url: str, ids: list[int], max_new: int) -> list[float]:
    """Arrival times, from the request, of each token of a streamed /generate (the tokens of a
    chunk that carries several arrive together); bench/overlap_bench.py and metrics_cost.py."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    times, seen = [], 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            n = json.loads(line[5:])["meta_info"]["completion_tokens"]
            now = time.perf_counter() - start
            times.extend([now] * (n - seen))  # a multi-token chunk: tokens arrive together
            seen = n
    return times
