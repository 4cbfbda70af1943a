"""The API keys, and every other secret a server setting holds, never leave the server: not in a
log line, a process's command line or environment, or an answer of SGLang's server-info
endpoints, whether the key came as `--api-key`, as FARSKIP_API_KEY (through a watchdog), or in
the file FARSKIP_API_KEY_FILE names (the entrypoint's way), on one node and on two. And the keys
still work, websockets included, the load tools (bench/run_load.py and its locust) can send
them, and SGLang's own call to its admin route /freeze_gc passes where no user's does.

Before python/sglang_farskip/serve/redact.py, SGLang's start-up `server_args=` line printed both keys
and `/server_info` and `/get_server_info` returned them; with redact.py's rows removed from
python/sglang_farskip/boundary/table.csv this test fails on the first of those.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from sglang_farskip.serve.redact import NOT_SECRET_FLAGS, REDACTED, SECRET_FIELDS, SECRET_FLAGS, scrub, scrub_argv

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import free_port, run_load, side_by_side

# Distinctive, so that a search of a log cannot hit anything else.
KEY = "sk-farskip-test-key-5f3c9a"
ADMIN_KEY = "adm-farskip-test-key-81d2e7"
ENV_KEY = "sk-farskip-env-key-c4b019"
NODES_KEY = "sk-farskip-nodes-key-7e6a2d"
# A secret of another setting: a KV-cache store's credentials (the flag server's command line).
STORE_SECRET = "store-secret-farskip-0a94d3"
ALL_KEYS = (KEY, ADMIN_KEY, ENV_KEY, NODES_KEY, STORE_SECRET)


# ------------------------------------------------------------------ the redaction itself
def test_argv_secrets_are_redacted_in_every_form():
    argv = ["--api-key", "k1", "--admin-api-key=k2", "--api-k", "k3", "--port", "30000",
            "--model-path", "/m", "--api-key=--dash-k4", "--ssl-keyfile", "/key.pem",
            "--ssl-keyfile-password", "p1", "--ssl-keyfile-pa=p2", "--hicache-storage-backend-extra-config",
            '{"secret": 1}', "--sidecar-args", '["--token", "t"]']
    out = scrub_argv(argv)
    assert out == ["--api-key", REDACTED, f"--admin-api-key={REDACTED}", "--api-k", REDACTED,
                   "--port", "30000", "--model-path", "/m", f"--api-key={REDACTED}",
                   "--ssl-keyfile", "/key.pem",  # a flag of its own, not an abbreviation
                   "--ssl-keyfile-password", REDACTED, f"--ssl-keyfile-pa={REDACTED}",
                   "--hicache-storage-backend-extra-config", REDACTED, "--sidecar-args", REDACTED]


def test_settings_are_redacted_at_any_depth_and_unset_ones_stay_as_they_are():
    settings = {"api_key": "k1", "admin_api_key": None, "port": 1, "ssl_keyfile_password": "p",
                "hicache_storage_backend_extra_config": '{"secret_access_key": "s"}',
                "model_loader_extra_config": {}, "unified_cache_external_linker_config": {"password": "s"},
                "nested": [{"api_key": "k2"}, ("x", {"admin_api_key": "k3"})]}
    assert scrub(settings) == {"api_key": REDACTED, "admin_api_key": None, "port": 1,
                               "ssl_keyfile_password": REDACTED, "hicache_storage_backend_extra_config": REDACTED,
                               "model_loader_extra_config": {}, "unified_cache_external_linker_config": REDACTED,
                               "nested": [{"api_key": REDACTED}, ("x", {"admin_api_key": REDACTED})]}


def test_the_secret_settings_are_sglangs_own_flags():
    """Each secret field is a ServerArgs field whose flag takes one value, and every other SGLang
    flag that its flag begins with is listed as no secret (argparse then reads it whole)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    by_dest = {a.dest: a for a in parser._actions}
    for name in SECRET_FIELDS:
        assert by_dest[name].option_strings == [f"--{name.replace('_', '-')}"] and by_dest[name].nargs is None, name
    options = {o for a in parser._actions for o in a.option_strings}
    prefixes = {o for o in options for f in SECRET_FLAGS if f.startswith(o) and o != f}
    assert prefixes - set(SECRET_FLAGS) == NOT_SECRET_FLAGS


# ------------------------------------------------------------------ real servers
def fetch(url: str, key: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def process_tree_files(server, name: str) -> dict[int, bytes]:
    """/proc/PID/NAME of every process of the server's session (start_new_session), and under
    a watchdog of the server's own session too."""
    sids = {os.getsid(server.proc.pid), os.getsid(server.server_pid())}
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) not in sids:
                continue
            with open(f"/proc/{pid}/{name}", "rb") as f:
                out[pid] = f.read()
        except (OSError, ProcessLookupError):
            continue
    return out


def process_tree_cmdlines(server) -> dict[int, str]:
    return {pid: raw.replace(b"\0", b" ").decode(errors="replace")
            for pid, raw in process_tree_files(server, "cmdline").items()}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two single-node servers and a two-node TP=2 deployment on loopback, started at once:
    - flag: both keys as flags, and a storage secret in another setting;
    - env: the key in the environment of a watchdog (serve/watchdog.py) that runs the server,
      and no admin key (the demo's case: SGLang's own /freeze_gc call was refused there);
    - node0, node1: the key in a file that FARSKIP_API_KEY_FILE names (the entrypoint's way).
    --sleep-on-idle: an idle scheduler otherwise spins a core, which the load test needs."""
    addr = f"127.0.0.1:{free_port()}"
    two_nodes = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "60"]
    key_file = tmp_path_factory.mktemp("keys") / "api-key"
    key_file.write_text(NODES_KEY + "\n")  # as a secret file often ends
    store = json.dumps({"secret_access_key": STORE_SECRET})
    runs = {
        "flag": (["--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--hicache-storage-backend-extra-config", store], {}),
        "env": ([], {"FARSKIP_API_KEY": ENV_KEY}),
        "node0": ([*two_nodes, "--node-rank", "0"], {"FARSKIP_API_KEY_FILE": str(key_file)}),
        "node1": ([*two_nodes, "--node-rank", "1"], {"FARSKIP_API_KEY_FILE": str(key_file)}),
    }
    kwargs = {name: {"args": [*args, "--sleep-on-idle"], "env": {**ONE_THREAD, **env}}
              for name, (args, env) in runs.items()}
    # Its checks (a generation each) would land in the load tests' numbers: one an hour.
    kwargs["env"].update(admin_key=None, watchdog=["--interval", "3600"])
    with side_by_side(kwargs, serving=("flag", "env", "node0")) as started:  # node 1 serves no HTTP
        yield started


@pytest.fixture(scope="module")
def keyed(servers):
    """For each server: its endpoints' answers and its processes' command lines."""
    seen = {}
    for name, server in servers.items():
        seen[name] = {"cmdlines": process_tree_cmdlines(server), "launcher": server.server_pid(),
                      "watchdog": server.proc.pid if server.watched else None,
                      "environs": process_tree_files(server, "environ")}
        if name == "node1":
            continue
        key = {"flag": KEY, "env": ENV_KEY}.get(name, NODES_KEY)
        seen[name]["answers"] = {path: fetch(server.url + path, key) for path in
                                 ("/server_info", "/get_server_info", "/farskip/info", "/v1/models")}
        seen[name]["without_key"] = fetch(server.url + "/v1/models", None)[0]
    return seen


# ------------------------------------------------------------------ the load tools with a key
# bench/run_load.py takes the key from API_KEY (or --api-key), hands it to locust in the
# environment, never on a command line, and every request succeeds; without it, one `error:`
# line names the fix before any load runs.
LOAD = ["--concurrency", "1,2", "--requests", "3", "--max-tokens", "4", "--input-len", "16",
        "--warmup", "1"]


def test_load_tools_take_the_key_from_the_environment(servers, tmp_path):
    out = tmp_path / "run"
    proc = run_load("--url", servers["env"].url, *LOAD, "--out", str(out), env={"API_KEY": ENV_KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in results["levels"]] == [1, 2]
    for lv in results["levels"]:
        assert lv["locust"] == {"requests": 3, "failures": 0}, lv["locust"]
        records = [json.loads(line) for line in (out / lv["records"]).read_text().splitlines()]
        assert [r["status"] for r in records] == [200] * 3
    # The key reached the info endpoints too: the report knows which server it measured.
    facts = results["targets"]["run"]
    assert facts["farskip_mode"] == "overlap" and facts["tp_size"] == 1, facts
    for path in out.rglob("*"):  # locust's log and the report: no key anywhere
        if path.is_file():
            assert ENV_KEY.encode() not in path.read_bytes(), path


def test_load_tools_take_the_key_flag(servers, tmp_path):
    proc = run_load("--url", servers["env"].url, *LOAD, "--api-key", ENV_KEY, "--out", str(tmp_path / "run"),
                    env={})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_load_tools_without_the_key_say_which_to_set(servers, tmp_path):
    proc = run_load("--url", servers["env"].url, *LOAD, "--out", str(tmp_path / "run"), env={})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HTTP 401" in errors[0] and "pass --api-key or set API_KEY" in errors[0], proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()  # stopped before any load ran


# ------------------------------------------------------------------ what the servers let out
def test_the_keys_still_guard_the_api(keyed):
    for name in ("flag", "env", "node0"):
        assert keyed[name]["without_key"] == 401, name
        for path, (status, body) in keyed[name]["answers"].items():
            assert status == 200, (name, path, status, body[:300])


@pytest.mark.parametrize("name", ["flag", "env"])
@pytest.mark.parametrize("path", ["/v1/models", "/flush_cache"])
def test_a_key_that_is_not_ascii_is_no_key(servers, name, path):
    """SGLang's check compares str with secrets.compare_digest, which raises on non-ASCII text:
    such a header from any client was a 500 (and a traceback in the log)."""
    assert fetch(servers[name].url + path, "cl\u00e9-\u00fc") == fetch(servers[name].url + path, None)
    assert fetch(servers[name].url + path, None)[0] in (401, 403)


@pytest.mark.parametrize("name", ["flag", "env", "node0"])
def test_no_key_in_server_info_answers(keyed, name):
    for path, (_, body) in keyed[name]["answers"].items():
        for key in ALL_KEYS:
            assert key.encode() not in body, (name, path)
    info = keyed[name]["answers"]["/server_info"][1].decode()
    assert f'"api_key":"{REDACTED}"' in info.replace(" ", ""), info[:500]


@pytest.mark.parametrize("name", ["flag", "env", "node0", "node1"])
def test_no_key_in_any_log_line(servers, name):
    log = servers[name].log_path.read_bytes()  # everything so far, the load runs' requests included
    assert b"server_args=" in log or name == "node1", "the settings line this test searches is gone"
    for key in ALL_KEYS:
        assert key.encode() not in log, (name, key)


@pytest.mark.parametrize("name", ["flag", "env", "node0", "node1"])
def test_no_key_on_a_command_line_but_the_users_own(keyed, name):
    cmdlines = keyed[name]["cmdlines"]
    # launcher, scheduler(s), detokenizer; node 1 runs no detokenizer
    assert len(cmdlines) >= (2 if name == "node1" else 3), cmdlines
    for pid, cmdline in cmdlines.items():
        if name == "flag" and pid == keyed[name]["launcher"]:
            assert KEY in cmdline and STORE_SECRET in cmdline  # the user typed them there; nothing can take them back
            continue
        for key in ALL_KEYS:
            assert key not in cmdline, (name, pid, cmdline[:300])


# ------------------------------------------------------------------ environments and locust's UI
@pytest.mark.parametrize("name", ["env", "node0", "node1"])
def test_no_key_in_any_process_environment(keyed, name):
    """Not in /proc/PID/environ of any process of the server: the watchdog takes FARSKIP_API_KEY
    out of its own environment block and hands it to each start of the launcher, which reads it
    once and clears it (redact.take_from_environment; the CPU workers are forked, so they would
    copy the launcher's start-up block); a key file is read by the launcher alone."""
    environs = keyed[name]["environs"]
    assert len(environs) >= 2, environs
    if name == "env":
        assert keyed[name]["watchdog"] in environs and keyed[name]["launcher"] in environs, environs
    for pid, environ in environs.items():
        for key in ALL_KEYS:
            assert key.encode() not in environ, (name, pid)
        assert b"FARSKIP_API_KEY=" not in environ, (name, pid)


def test_locust_has_no_key_option_and_its_ui_shows_no_key(tmp_path):
    """locust serves its options on a web UI (all interfaces by default, no login): the key is
    read from $API_KEY by the locustfile, never a locust option."""
    import subprocess
    import sys
    import time

    from sglang_farskip.testbed import REPO

    locust = [sys.executable, "-m", "locust", "-f", str(REPO / "bench" / "locustfile.py")]
    env = {**os.environ, "API_KEY": ENV_KEY}
    options = re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", (REPO / "bench" / "locustfile.py").read_text())
    assert "--max-tokens" in options and not [o for o in options if "key" in o], options
    port = free_port()
    proc = subprocess.Popen([*locust, "--web-host", "127.0.0.1", "--web-port", str(port), "-H", "http://127.0.0.1:9",
                             "--input-len", "4", "--vocab-size", "100"], env=env,
                            stdout=open(tmp_path / "locust.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline, page = time.monotonic() + 120, None
        while page is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                page = fetch(f"http://127.0.0.1:{port}/", None)[1]
            except OSError:
                time.sleep(0.5)
        assert page is not None, (tmp_path / "locust.log").read_text()[-2000:]
        assert b"http://127.0.0.1:9" in page  # the UI shows what it was given ...
        assert ENV_KEY.encode() not in page  # ... and not the key
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ SGLang's own call, users' calls
@pytest.mark.parametrize("name", ["flag", "env", "node0"])
def test_sglangs_own_gc_freeze_passes(servers, name):
    """After its warm-up SGLang freezes the GC through its admin route /freeze_gc; without an
    admin key (env) that POST was refused with 403 and every start logged a traceback. The
    freeze now runs in process (serve/admin.py, freeze_gc_in_process), with and without one."""
    log = servers[name].log_path.read_text(errors="replace")
    assert "post-warmup freeze_gc failed" not in log, log[-3000:]
    assert "froze the GC after warm-up in every process of this server" in log, log[-3000:]


@pytest.mark.parametrize("name, key", [("env", ENV_KEY), ("env", None), ("flag", KEY), ("flag", None)])
def test_freeze_gc_refuses_users(servers, name, key):
    """The route stays an admin route: the inference key is told 403 (a key without the right;
    env has no admin key, so everyone is), no key 401 or 403."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(servers[name].url + "/freeze_gc", method="POST", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == (401 if name == "flag" and key is None else 403)


def upgrade_status(url: str, key: str | None) -> int:
    """The status line's code of a websocket upgrade of /v1/realtime (101: opened)."""
    host, port = url.removeprefix("http://").split(":")
    lines = ["GET /v1/realtime HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = conn.recv(4096).decode(errors="replace")
    return int(head.split(" ", 2)[1])


@pytest.mark.parametrize("name, key", [("flag", KEY), ("env", ENV_KEY)])
def test_the_websocket_route_needs_the_key(servers, name, key):
    """SGLang's key middleware passes websockets through unchecked: /v1/realtime answered an
    upgrade without a key with 101. The same decision as for HTTP now applies to the upgrade."""
    url = servers[name].url
    assert upgrade_status(url, None) == 401
    assert upgrade_status(url, "sk-not-the-key-of-this-server") == 401
    assert upgrade_status(url, key) == 101


# ------------------------------------------------------------------ the entrypoint's hand-over
def test_the_entrypoint_hands_the_keys_over_as_files(tmp_path):
    """deploy/entrypoint.sh gives the launcher (and the watchdog before it) file paths, never a
    key: API_KEY's value goes into a file only this user reads, API_KEY_FILE is passed as it is.
    FARSKIP_PYTHON stands in for the server here and reports what it was given."""
    from sglang_farskip.testbed import REPO

    admin_file = tmp_path / "admin-key"
    admin_file.write_text(ADMIN_KEY)
    report = tmp_path / "report.json"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"""#!{sys.executable}
import json, os, stat, sys
if "sglang_farskip.serve.watchdog" in sys.argv or "sglang_farskip.launch_server" in sys.argv:
    files = {{v: os.environ[v] for v in ("FARSKIP_API_KEY_FILE", "FARSKIP_ADMIN_API_KEY_FILE")}}
    json.dump({{"environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
               "files": {{v: [open(p).read(), stat.S_IMODE(os.stat(p).st_mode)] for v, p in files.items()}}}},
              open({str(report)!r}, "w"))
    sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])  # the entrypoint's own checks
""")
    stand_in.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TMPDIR": str(tmp_path),
           "FARSKIP_PYTHON": str(stand_in), "NNODES": "1", "NODE_RANK": "0", "MODEL_PATH": "demo",
           "FARSKIP_PLATFORM": "cpu", "HTTP_HOST": "127.0.0.1", "API_KEY": ENV_KEY,
           "ADMIN_API_KEY_FILE": str(admin_file)}
    for watchdog in ("1", "0"):  # the watchdog's environment, then the launcher's
        report.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(REPO / "deploy" / "entrypoint.sh")], env={**env, "WATCHDOG": watchdog},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen = json.loads(report.read_text())
        assert ENV_KEY not in seen["environ"] and ADMIN_KEY not in seen["environ"], watchdog
        assert seen["files"]["FARSKIP_API_KEY_FILE"] == [ENV_KEY, 0o600]
        assert seen["files"]["FARSKIP_ADMIN_API_KEY_FILE"][0] == ADMIN_KEY
        assert ENV_KEY not in proc.stdout + proc.stderr


def test_the_router_keeps_no_key_variable_in_its_environment():
    """deploy/router.py given both keys as variables (a Kubernetes secretKeyRef, Slurm): the
    process that serves, PID 1 of the router's container, shows neither in /proc/PID/environ
    (the environment it was started with, kept for its lifetime), and the router still asks
    clients for the API key and its control plane for the admin key."""
    import time

    from sglang_farskip.testbed import REPO
    from sglang_farskip.testbed.router import router_python

    port = free_port()
    env = {"PATH": os.environ["PATH"], "ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port),
           "WORKER_URLS": f"http://127.0.0.1:{free_port()}", "API_KEY": ENV_KEY, "ADMIN_API_KEY": ADMIN_KEY,
           "ROUTER_EXTRA_ARGS": f"--prometheus-port {free_port()}"}
    proc = subprocess.Popen([str(router_python()), str(REPO / "deploy" / "router.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                answers = tuple(fetch(f"http://127.0.0.1:{port}/workers", key)[0] for key in (ADMIN_KEY, ENV_KEY))
                break
            except OSError:
                assert time.monotonic() < deadline, "the router did not listen within 60 s"
                time.sleep(0.3)
        environ = open(f"/proc/{proc.pid}/environ", "rb").read().decode(errors="replace")
        assert ENV_KEY not in environ and ADMIN_KEY not in environ, environ.replace("\0", " ")
        assert "API_KEY=" not in environ  # not even empty
        # The keys reached the router: the admin key lists its workers, the API key does not.
        assert answers == (200, 401), answers
        chat = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=b"{}",
                                      headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(chat, timeout=5)
        assert refused.value.code == 401
    finally:
        proc.kill()
        output = proc.communicate(timeout=30)[0]
    assert ENV_KEY not in output and ADMIN_KEY not in output
