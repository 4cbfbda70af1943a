"""The load tools against a server that wants an API key (as every node beyond loopback does):
bench/run_load.py takes the key from API_KEY (or --api-key), hands it to locust in the
environment, never on a command line, and every request succeeds; without it, one `error:`
line names the fix before any load runs. Real demo server, real locust."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serverutil import REPO, Server

RUN_LOAD = REPO / "bench" / "run_load.py"
KEY = "sk-farskip-load-key-3e91b0"
LOAD = ["--concurrency", "1,2", "--requests", "3", "--max-tokens", "4", "--input-len", "16",
        "--warmup", "1"]


@pytest.fixture(scope="module")
def keyed_server():
    with Server(["--api-key", KEY, "--sleep-on-idle"]) as server:
        yield server.wait_ready()


def run_load(*args: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    return subprocess.run([sys.executable, str(RUN_LOAD), *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**base, **env})


def test_key_from_the_environment_every_request_ok(keyed_server, tmp_path):
    out = tmp_path / "run"
    proc = run_load("--url", keyed_server.url, *LOAD, "--out", str(out), env={"API_KEY": KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    levels = results["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["locust"] == {"requests": 3, "failures": 0}, lv["locust"]
        records = [json.loads(line) for line in (out / lv["records"]).read_text().splitlines()]
        assert [r["status"] for r in records] == [200] * 3
    # The key reached the info endpoints too: the report knows which server it measured.
    facts = results["targets"]["run"]
    assert facts["farskip_mode"] == "overlap" and facts["tp_size"] == 1, facts
    # Not on locust's command line (its log starts with nothing of it either).
    for path in out.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_key_flag_works_too(keyed_server, tmp_path):
    proc = run_load("--url", keyed_server.url, *LOAD, "--api-key", KEY, "--out", str(tmp_path / "run"),
                    env={})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_without_the_key_one_error_line_names_the_fix(keyed_server, tmp_path):
    proc = run_load("--url", keyed_server.url, *LOAD, "--out", str(tmp_path / "run"), env={})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HTTP 401" in errors[0] and "pass --api-key or set API_KEY" in errors[0], proc.stderr
