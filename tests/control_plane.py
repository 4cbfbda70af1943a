"""The router's control plane behind the admin key (docs/deploy.md, "Keys"): the checks that
tests/test_load_router.py (PD mode) and tests/test_replicas.py (plain mode) run against a router
started as the deployment starts it (deploy/router.py with KEYS, testbed.router.Router(keys=)),
in front of servers their module already runs.

What a client holding only the inference key, or no key, must not do: list, add or remove the
router's workers, or flush every server's cache (measured before the deployment gave the router
an admin key: DELETE /workers/{id} and POST /workers answered 202, POST /flush_cache 200).
What the admin key must do: all of that, and nothing on the data plane.
"""

from __future__ import annotations

import json
import time

from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.router import Router
from sglang_farskip.testbed.servers import ADMIN_KEY as SERVERS_ADMIN_KEY

# The admin key is the servers' too (testbed.servers.ADMIN_KEY), as in a deployment: the flush
# command sends it to each server.
KEYS = {"API_KEY": "inf-farskip-router-test-5c1e07aa", "ADMIN_API_KEY": SERVERS_ADMIN_KEY}
INFERENCE, ADMIN = KEYS["API_KEY"], KEYS["ADMIN_API_KEY"]
SETTLE_S = 60  # a worker's removal or registration is queued; seen within 2-6 s here


def generate(router: Router, key: str | None) -> tuple[int, str]:
    return router.request("POST", "/generate", key, {"text": "The capital of France is",
                                                     "sampling_params": {"max_new_tokens": 2}}, timeout=120)


def listed(router: Router) -> dict[str, dict]:
    return {w["url"]: w for w in router.workers()}


def wait_listed(router: Router, urls: set[str]) -> dict[str, dict]:
    """Until the router lists exactly `urls`, each healthy."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        seen = listed(router)
        if set(seen) == urls and all(w["is_healthy"] for w in seen.values()):
            return seen
        assert time.monotonic() < deadline, f"router lists {seen}, not {urls}:\n{router.log_tail(20)}"
        time.sleep(0.5)


def inference_key_cannot_steer(router: Router) -> None:
    before = listed(router)
    victim = next(iter(before.values()))
    own = f"http://127.0.0.1:{free_port()}"  # the caller's own "worker"
    for key in (INFERENCE, None, "not-a-key"):
        for method, path, body in (("GET", "/workers", None), ("POST", "/workers", {"url": own}),
                                   ("DELETE", f"/workers/{victim['id']}", None),
                                   ("POST", "/flush_cache", None), ("GET", "/get_loads", None)):
            status, answer = router.request(method, path, key, body)
            assert status == 401, (method, path, "with", key and key[:4], status, answer[:300])
    time.sleep(2)  # what a queued addition or removal would have needed to show
    assert set(listed(router)) == set(before), listed(router)
    # The inference key is the data plane's, and still serves.
    status, answer = generate(router, INFERENCE)
    assert status == 200 and json.loads(answer)["text"], answer[:300]


def admin_key_manages_the_fleet(router: Router, readd: dict) -> None:
    """`readd`: the body that registers the removed worker again (its url, and in PD mode its
    worker_type and bootstrap_port)."""
    before = listed(router)
    url = readd["url"]
    # Admitted by the router, which sends the flush to every server with the key it holds for
    # them, the inference key: the servers refuse it (their /flush_cache is an admin route), so
    # the router answers 206 with each server's refusal...
    status, answer = router.request("POST", "/flush_cache", ADMIN)
    assert status in (200, 206), (status, answer[:300])
    flushed = json.loads(answer)
    assert flushed["total_workers"] == len(before), flushed
    assert {f["worker"] for f in flushed["failed"]} == set(before), flushed
    # ...so deploy/router.py --flush-cache does it: each listed server, with the admin key.
    proc = router.run_deployed("--flush-cache")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {line.split(": ", 1)[0] for line in proc.stdout.splitlines()} == set(before), proc.stdout
    assert all(": 200 " in line for line in proc.stdout.splitlines()), proc.stdout
    assert ADMIN not in proc.stdout + proc.stderr
    status, answer = router.request("DELETE", f"/workers/{before[url]['id']}", ADMIN)
    assert status == 202, answer[:300]
    wait_listed(router, set(before) - {url})
    status, answer = router.request("POST", "/workers", ADMIN, readd)
    assert status == 202, answer[:300]
    wait_listed(router, set(before))
    # The admin key is not an inference key: the data plane refuses it.
    assert generate(router, ADMIN)[0] == 401
    status, answer = generate(router, INFERENCE)
    assert status == 200 and json.loads(answer)["text"], answer[:300]
