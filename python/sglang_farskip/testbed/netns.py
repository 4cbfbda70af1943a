"""Two "nodes" on one machine for tests: two network namespaces joined by a veth pair, each
node started through deploy/entrypoint.sh with its own /dev/shm, and a client that runs inside
node 0's namespace. Needs root (`ip netns`); everything made here is removed by `Link.remove`
and `Node.kill`, also after a failure.

    python -m sglang_farskip.testbed.netns client URL MAX_TOKENS TIMEOUT   (internal: the in-namespace client)
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_farskip.serve.watchdog import signal_group
from sglang_farskip.testbed import REPO

ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
PY = sys.executable

@dataclass(frozen=True)
class Names:
    """A pair of namespaces, their veth ends and addresses (a /24 between them)."""

    ns: tuple[str, str]
    veth: tuple[str, str]
    addr: tuple[str, str]


# The tests' pair, and the benchmarks' (bench/overlap_bench.py, bench/plan_testbed.py): apart, so
# a benchmark run beside the suite never removes the suite's namespaces.
TESTS = Names(("fstest0", "fstest1"), ("fst-veth0", "fst-veth1"), ("10.251.0.1", "10.251.0.2"))
# FARSKIP_TEST_NETNS="PREFIX SUBNET" (e.g. "fswd 10.248.0") gives one checkout's suite its own
# pair, so that two suites run side by side never remove each other's namespaces.
if os.environ.get("FARSKIP_TEST_NETNS"):
    _prefix, _subnet = os.environ["FARSKIP_TEST_NETNS"].split()
    TESTS = Names((f"{_prefix}0", f"{_prefix}1"), (f"{_prefix}-veth0", f"{_prefix}-veth1"),
                  (f"{_subnet}.1", f"{_subnet}.2"))
BENCH = Names(("fsbench0", "fsbench1"), ("fsb-veth0", "fsb-veth1"), ("10.250.0.1", "10.250.0.2"))
NS, VETH, ADDR = TESTS.ns, TESTS.veth, TESTS.addr  # what Node, in_ns and node_env use
UNUSED_ADDR = ADDR[0].rsplit(".", 1)[0] + ".9"  # in the veth's subnet, assigned to nobody


def available() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, mount)"
    for tool in ("ip", "unshare", "mount"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"needs `{tool}`"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Link:
    """Two namespaces joined by a veth pair (`names`, the tests' by default), optionally shaped:
    `create(rate, burst)` puts a token bucket on both directions."""

    def __init__(self, names: Names = TESTS):
        self.names = names

    def create(self, rate: str | None = None, burst: str | None = None) -> "Link":
        ns, veth, addr = self.names.ns, self.names.veth, self.names.addr
        self.remove()
        for name in ns:
            _ip("netns", "add", name)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in (0, 1):
            _ip("link", "set", veth[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
            _ip("-n", ns[i], "link", "set", veth[i], "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
            if rate is not None:
                # A small burst on purpose: the token bucket refills while the link is idle, and
                # a 64 KB bucket banked ~26 ms of 20 mbit per compute gap, which handed `sync`
                # one sub-block of free overlap (a real link cannot bank idle time). The burst
                # must still hold one MTU-sized packet.
                subprocess.run(["tc", "-n", ns[i], "qdisc", "add", "dev", veth[i], "root", "tbf",
                                "rate", rate, "burst", burst, "latency", "50ms"], check=True, timeout=30)
        return self

    def set_up(self, rank: int, up: bool) -> None:
        _ip("-n", self.names.ns[rank], "link", "set", self.names.veth[rank], "up" if up else "down")

    def remove(self) -> None:
        for name in self.names.ns:
            kill_namespace_pids(name)
            _ip("netns", "del", name, check=False)  # deletes the veth pair with it
        # A veth left in the root namespace by an interrupted create().
        _ip("link", "del", self.names.veth[0], check=False)


@contextlib.contextmanager
def shaped_link(rate: str, burst: str, names: Names = BENCH):
    """The benchmarks' link: made, yielded, always removed."""
    if os.geteuid() != 0:
        sys.exit("error: a shaped link creates network namespaces and needs root (run with sudo)")
    link = Link(names)
    try:
        yield link.create(rate, burst)
    finally:
        link.remove()


def kill_namespace_pids(ns: str) -> None:
    """SIGKILL whatever still runs in one of our namespaces (processes these tests started)."""
    out = _ip("netns", "pids", ns, check=False)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def listening_ports(rank: int) -> set[int]:
    """TCP ports listened on in namespace NS[rank] (IPv4 and IPv6)."""
    out = subprocess.run(in_ns(rank, ["cat", "/proc/net/tcp", "/proc/net/tcp6"]), capture_output=True,
                         text=True, timeout=30).stdout
    ports = set()
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def in_ns(rank: int, cmd: list[str], names: Names = TESTS) -> list[str]:
    return ["ip", "netns", "exec", names.ns[rank], *cmd]


@dataclass
class Node:
    """One node: deploy/entrypoint.sh in namespace NS[rank], with a private /dev/shm (SGLang
    probes shared memory to decide whether ranks share a host; with the host's /dev/shm node 1
    would wait for a peer it thinks is local)."""

    rank: int
    env: dict
    log_path: Path
    args: list[str] = field(default_factory=list)
    names: Names = TESTS  # whose namespace NS[rank] is
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None

    def start(self) -> "Node":
        inner = "mount -t tmpfs tmpfs /dev/shm && exec " + shlex.join([str(ENTRYPOINT), *self.args])
        cmd = in_ns(self.rank, ["unshare", "-m", "sh", "-c", inner], self.names)
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO)
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        """Records the exit time as it happens (the tests look later)."""
        self.proc.wait()
        if self.ended is None:
            self.ended = time.monotonic()

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def wait(self, timeout: float) -> int | None:
        """Exit status, or None if still running after `timeout` seconds."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def log(self, since: int = 0) -> str:
        """The log, from byte offset `since` (a `mark()`) on."""
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def mark(self) -> int:
        return self.log_path.stat().st_size

    def log_tail(self, n: int = 40) -> str:
        lines = [x for x in self.log().splitlines() if "Ignore import error" not in x]
        return f"--- node {self.rank} log ({self.log_path}) ---\n" + "\n".join(lines[-n:])

    def kill(self) -> None:
        """SIGKILL the node's process group: also children left behind by a node that exited."""
        if self.proc is not None:
            # Not os.killpg: _watch has reaped a node that exited, and its pid may be reused.
            with contextlib.suppress(PermissionError):
                signal_group(self.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.poll()
        if getattr(self, "_log", None):
            self._log.close()


def node_env(rank: int, *, master_addr: str | None = None, master_port: int, http_port: int,
             dist_timeout: int, model_path: str, extra: dict | None = None,
             names: Names = TESTS) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "MASTER_", "NCCL_", "GLOO_"))}
    env.update({
        "NODE_RANK": str(rank), "NNODES": "2", "MASTER_ADDR": master_addr or names.addr[0],
        "WORKER_ADDRS": names.addr[1],
        "MASTER_PORT": str(master_port), "HTTP_PORT": str(http_port),
        "MODEL_PATH": model_path, "TP_SIZE": "2", "EP_SIZE": "2",
        "NET_IFNAME": names.veth[rank],  # SGLANG_HOST_IP and GLOO_SOCKET_IFNAME derived from it
        "DIST_TIMEOUT": str(dist_timeout), "FARSKIP_PLATFORM": "cpu", "FARSKIP_PYTHON": PY,
        "EXTRA_ARGS": "--dtype float32",
        "OMP_NUM_THREADS": "1",  # one core per rank
        "FARSKIP_ALLOW_NO_API_KEY": "1",  # the API listens only inside the test's namespace
        # The tests watch each node's entrypoint exit; the watchdog's restarts in place are
        # tested where asked for (extra={"WATCHDOG_RESTARTS": ...}).
        "WATCHDOG_RESTARTS": "0",
    })
    env.update(extra or {})
    return env


# ------------------------------------------------------------------ client (in node 0's namespace)
class StreamBroken(ConnectionError):
    """The server closed the connection in the middle of a chunked response."""


def _stream_lines(resp):
    """The body's lines, decoding the chunked framing here: Python's http.client treats a
    connection closed before the terminating zero-size chunk as a normal end (urllib's reader
    just stops); curl reports it ("transfer closed with outstanding read data"), and so do we."""
    fp, buf = resp.fp, b""
    if not resp.chunked:
        yield from fp
        return
    while True:
        size_line = fp.readline()
        if not size_line:
            raise StreamBroken("connection closed in the middle of the streamed response "
                               "(no terminating chunk)")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return  # the server ended the response properly
        data = fp.read(size + 2)  # the chunk and its CRLF
        if len(data) < size + 2:
            raise StreamBroken("connection closed in the middle of a chunk")
        buf += data[:size]
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


def run_client(url: str, payload: dict, path: str, timeout: float, echo: bool = False) -> dict:
    """One request (POST; GET for an empty payload). A streamed one reports each chunk's
    arrival as it comes (a JSON line on stdout when `echo`). Returns {"done": bool,
    "error": str|None, "client_timeout": bool, "chunks": [...], "elapsed": s} (and "reply"
    for a request that is not streamed). `client_timeout`: the server said nothing for
    `timeout` s, which the tests count as silence, not as an error from the server."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    start = time.monotonic()
    chunks, done, error, client_timeout = [], False, None, False
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        if payload:
            conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        else:
            conn.request("GET", path)
        resp = conn.getresponse()
        if resp.status != 200:
            error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
        elif not payload.get("stream"):
            return {"done": True, "error": None, "client_timeout": False, "chunks": [],
                    "reply": json.loads(resp.read()), "elapsed": time.monotonic() - start}
        else:
            for raw in _stream_lines(resp):
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = f"error event: {obj['error']}"
                    break
                chunks.append(obj)
                if echo:
                    print(json.dumps({"chunk": len(chunks), "t": time.monotonic() - start}), flush=True)
            else:
                error = "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException) as e:
        error = f"{type(e).__name__}: {e}"
        client_timeout = isinstance(e, TimeoutError)
    finally:
        conn.close()
    return {"done": done, "error": error, "client_timeout": client_timeout, "chunks": chunks,
            "elapsed": time.monotonic() - start}


def client_cmd(port: int, payload: dict, path: str, timeout: float) -> list[str]:
    return in_ns(0, [PY, "-m", "sglang_farskip.testbed.netns", "client", f"http://127.0.0.1:{port}", path,
                     json.dumps(payload), str(timeout)])


def client(port: int, payload: dict, path: str = "/v1/completions", timeout: float = 120) -> dict:
    """Run one request from inside node 0's namespace and return the summary."""
    out = subprocess.run(client_cmd(port, payload, path, timeout), capture_output=True, text=True,
                         timeout=timeout + 60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class BackgroundClient:
    """A streamed request running in node 0's namespace. A thread collects its output lines:
    `wait_chunks` blocks until some tokens arrived, `result` waits (bounded) for the summary."""

    def __init__(self, port: int, payload: dict, path: str = "/v1/completions", timeout: float = 300):
        self.started = time.monotonic()
        self.ended: float | None = None
        self.proc = subprocess.Popen(client_cmd(port, payload, path, timeout), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def chunks(self) -> int:
        return sum(1 for line in list(self.lines) if line.startswith('{"chunk"'))

    def wait_chunks(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks() < n:
            assert self.proc.poll() is None, f"client ended before {n} chunks: {self.lines}"
            assert time.monotonic() < deadline, f"fewer than {n} chunks in {timeout} s"
            time.sleep(0.05)

    def result(self, timeout: float) -> dict:
        """The summary; raises TimeoutError if the client is still waiting after `timeout` s."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the client got no answer and no error for {timeout} s (silence)") from None
        self.ended = time.monotonic()
        self._reader.join(timeout=10)
        err = self.proc.stderr.read()
        assert self.proc.returncode == 0 and self.lines, f"client failed: {err[-3000:]}"
        return json.loads(self.lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "client":
        _, _, url, path, payload, timeout = sys.argv
        print(json.dumps(run_client(url, json.loads(payload), path, float(timeout), echo=True)), flush=True)
        sys.exit(0)
    sys.exit(__doc__)
