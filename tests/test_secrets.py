"""The API keys never leave the server: not in a log line, a process's command line or an answer
of SGLang's server-info endpoints, whether the key came as `--api-key` or as FARSKIP_API_KEY
(the entrypoint's way), on one node and on two. And the keys still work, and the load tools
(bench/run_load.py and its locust) can send them.

Before python/sglang_farskip/serve/redact.py, SGLang's start-up `server_args=` line printed both keys
and `/server_info` and `/get_server_info` returned them; with redact.py's rows removed from
python/sglang_farskip/boundary/table.csv this test fails on the first of those.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest

from sglang_farskip.serve.redact import REDACTED, scrub, scrub_argv

from parity import ONE_THREAD
from sglang_farskip.testbed.servers import free_port, run_load, side_by_side

# Distinctive, so that a search of a log cannot hit anything else.
KEY = "sk-farskip-test-key-5f3c9a"
ADMIN_KEY = "adm-farskip-test-key-81d2e7"
ENV_KEY = "sk-farskip-env-key-c4b019"
NODES_KEY = "sk-farskip-nodes-key-7e6a2d"
ALL_KEYS = (KEY, ADMIN_KEY, ENV_KEY, NODES_KEY)


# ------------------------------------------------------------------ the redaction itself
def test_argv_secrets_are_redacted_in_every_form():
    argv = ["--api-key", "k1", "--admin-api-key=k2", "--api-k", "k3", "--port", "30000",
            "--model-path", "/m", "--api-key=--dash-k4"]
    out = scrub_argv(argv)
    assert out == ["--api-key", REDACTED, f"--admin-api-key={REDACTED}", "--api-k", REDACTED,
                   "--port", "30000", "--model-path", "/m", f"--api-key={REDACTED}"]


def test_settings_are_redacted_at_any_depth_and_unset_keys_stay_none():
    settings = {"api_key": "k1", "admin_api_key": None, "port": 1,
                "nested": [{"api_key": "k2"}, ("x", {"admin_api_key": "k3"})]}
    assert scrub(settings) == {"api_key": REDACTED, "admin_api_key": None, "port": 1,
                               "nested": [{"api_key": REDACTED}, ("x", {"admin_api_key": REDACTED})]}


# ------------------------------------------------------------------ real servers
def fetch(url: str, key: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def process_tree_files(root_pid: int, name: str) -> dict[int, bytes]:
    """/proc/PID/NAME of the launcher and every process of its session (start_new_session)."""
    sid = os.getsid(root_pid)
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != sid:
                continue
            with open(f"/proc/{pid}/{name}", "rb") as f:
                out[pid] = f.read()
        except (OSError, ProcessLookupError):
            continue
    return out


def process_tree_cmdlines(root_pid: int) -> dict[int, str]:
    return {pid: raw.replace(b"\0", b" ").decode(errors="replace")
            for pid, raw in process_tree_files(root_pid, "cmdline").items()}


@pytest.fixture(scope="module")
def servers():
    """Two single-node servers (key as a flag with an admin key, key in the environment) and a
    two-node TP=2 deployment on loopback (key in the environment of both), started at once.
    --sleep-on-idle: an idle scheduler otherwise spins a core, which the load test needs."""
    addr = f"127.0.0.1:{free_port()}"
    two_nodes = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "60"]
    runs = {
        "flag": (["--api-key", KEY, "--admin-api-key", ADMIN_KEY], {}),
        "env": ([], {"FARSKIP_API_KEY": ENV_KEY}),
        "node0": ([*two_nodes, "--node-rank", "0"], {"FARSKIP_API_KEY": NODES_KEY}),
        "node1": ([*two_nodes, "--node-rank", "1"], {"FARSKIP_API_KEY": NODES_KEY}),
    }
    kwargs = {name: {"args": [*args, "--sleep-on-idle"], "env": {**ONE_THREAD, **env}}
              for name, (args, env) in runs.items()}
    with side_by_side(kwargs, serving=("flag", "env", "node0")) as started:  # node 1 serves no HTTP
        yield started


@pytest.fixture(scope="module")
def keyed(servers):
    """For each server: its endpoints' answers and its processes' command lines."""
    seen = {}
    for name, server in servers.items():
        seen[name] = {"cmdlines": process_tree_cmdlines(server.proc.pid), "launcher": server.proc.pid,
                      "environs": process_tree_files(server.proc.pid, "environ")}
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
            assert KEY in cmdline  # the user typed it there; nothing can take it back
            continue
        for key in ALL_KEYS:
            assert key not in cmdline, (name, pid, cmdline[:300])


# ------------------------------------------------------------------ environments and locust's UI
@pytest.mark.parametrize("name", ["env", "node0", "node1"])
def test_no_key_in_any_process_environment(keyed, name):
    """The launcher reads FARSKIP_API_KEY once and clears it (redact.take_from_environment): not
    in /proc/PID/environ of the launcher or of any process it started (the CPU workers are
    forked, so they would copy the launcher's start-up environment block)."""
    environs = keyed[name]["environs"]
    assert len(environs) >= 2, environs
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
