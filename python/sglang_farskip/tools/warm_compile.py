"""Fill torch's compile cache with what a CPU server compiles at its first forwards, once.

SGLang wraps some of its CPU math in `torch.compile` (the MoE router's top-k, sampling helpers);
inductor compiles them to C++ at a server's first forwards, about 15 CPU-seconds per rank on the
demo model, each time a fresh container starts. Run once (the CPU image does, at build time),
the results land in the directory TORCHINDUCTOR_CACHE_DIR names, and every later start on the
same CPU finds them there: the compile is skipped, the results are the same (torch keys each
entry by the graph, the shapes' kinds, the compiler flags and the torch version, so a start on
another CPU or another torch version compiles again, as it would without the cache).

    python -m sglang_farskip.tools.warm_compile [launcher flags, e.g. --dtype float32]

It serves the demo model (or the launcher flags' --model-path) on a free loopback port, sends one
request that prefills and decodes, and stops the server. The dtype changes what is compiled:
run it once per dtype that will be served.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 900  # a cold CPU start compiles: about a minute on two busy cores
REQUEST = {"input_ids": list(range(1, 33)),
           "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None, timeout: float) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def warm(flags: list[str]) -> int:
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_farskip.launch_server", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            base = f"http://127.0.0.1:{port}"
            while _post(base + "/health", None, 5) != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start (exit {server.poll()})")
                time.sleep(1)
            if _post(base + "/generate", REQUEST, 300) != 200:
                raise RuntimeError("the warm-up request failed")
        except RuntimeError as e:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            print(f"error: warm_compile {' '.join(flags)}: {e} (server log above)", file=sys.stderr)
            return 1
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGINT)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
    print(f"== compile cache warmed for {' '.join(flags) or 'the defaults'} "
          f"({os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'torch default directory')})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(warm(sys.argv[1:]))
