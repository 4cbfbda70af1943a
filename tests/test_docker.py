"""The images built and run for real, through docker/build.sh and the shipped compose file.

Needs a Docker engine (and, to make the stand-in base, root and debootstrap): without one every
test here skips with the reason. `.ci/run` provisions one on CI's machine; a user's machine is
never provisioned behind their back.

Stand-ins, because no container registry is reachable where these tests run (CI): the base
images are made from Debian's and PyPI's packages instead of pulled, and say so in their names
(farskip-standin/...):
- python:3.11-slim-bookworm -> docker/standin/python-base.sh (debootstrap, Debian's Python 3.11);
- the upstream SGLang CUDA / ROCm images -> docker/standin/Dockerfile.gpu-base on the CPU image's
  torch-sglang stage (a Python with torch and SGLang 0.5.23, what the upstream images hold;
  no GPU), and one with SGLang 0.5.22 that the images must refuse;
- locustio/locust -> docker/standin/Dockerfile.locust (the pinned locust from PyPI).
Every build here passes docker/build.sh --local-base (the stand-ins have no digest); the
packages come from PyPI through the hashed locks in requirements/, as in a release build.

What runs (docker compose -f deploy/compose.yaml with the shipped env files):
- the CPU demo profile: healthy, a streamed /v1/completions equal to the bootstrap venv's
  (float32, same flags), /farskip/info reports FarSkip; HTTP beyond loopback without API_KEY is
  refused at start;
- the loadtest profile against the demo: records.jsonl, every request ok, TTFT/ITL present;
- two nodes as two containers (deploy/cpu-node0.env, cpu-node1.env; tests/compose.one-host.yaml
  gives each its own network namespace and address): greedy ids equal a single-node TP=1 run,
  401 without the API key and 200 with it; self-healing (the restart policy and the watchdog,
  docs/deploy.md): bench/soak.py under load while node 1's server is killed from the host, then
  node 0's server killed, node 1's schedulers stopped (SIGSTOP), node 1's container restarted,
  and each container in turn killed whole from the host (SIGKILL to its init process: Docker's
  `restart: unless-stopped` starts it again), each followed by both nodes restarting and
  serving the reference's tokens again within HEAL_BOUND_S; `down` leaves nothing;
- a refused setting (HTTP beyond loopback without a key, exit 2) stays down under that policy:
  the container parks, never restarted, its health check saying why;
- docker/Dockerfile.cuda and .rocm built on the GPU stand-ins; a stand-in with SGLang 0.5.22,
  and one without Mooncake's transfer engine, each fail the build with the reason.

Caching: the stand-in Python base is tagged by a hash of its inputs (python-base.sh); every
docker build reuses Docker's layer cache, which keys each layer by its instruction, its parent
and the checksums of the files it copies, so a second run rebuilds only what changed.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from containers import DEPLOY, NEW_TOKENS, PREFIX, PROMPT, PROMPT_IDS, ROOT, SKIP, Project, http, report, state
from containers import images  # noqa: F401 (a fixture)
from docker_images import BUILD_TIMEOUT_S, build, sh
from sglang_farskip.testbed.servers import Server, free_port

DOCKER = ROOT / "docker"
ONE_HOST = Path(__file__).resolve().parent / "compose.one-host.yaml"
LOCUST_IMAGE = "farskip-standin/locust:test"

HEALTHY_TIMEOUT_S = 300  # a CPU start is ~1 min; health is polled every 15 s (compose.yaml)
# Self-healing: after each fault both nodes are serving again within this. A two-node CPU
# start is ~1 min here; a hang is detected after WATCHDOG_FAILURES checks of up to 20 s (SGLang's
# health-check timeout) each, a crash of node 1 ends node 0 within ~6 s.
HEAL_BOUND_S = 300
HEAL_REPEATS = int(os.environ.get("FARSKIP_HEAL_REPEATS", "1"))  # 3 for docs/deploy.md's figures
WATCHDOG = {"WATCHDOG_INTERVAL": "5", "WATCHDOG_TIMEOUT": "25", "WATCHDOG_FAILURES": "2"}
# The soak: the fault at SOAK_FAULT_AT_S, the load at least SOAK_S (its failures begin within
# a few seconds of the fault), then on until the run ends with SOAK_SETTLE_S of successes
# (soak.py --until-settled), up to the heal bound: recovery took 32 s quiet, 56-69 s beside
# another suite (as under scripts/test.sh's second worker). A fixed 160 s run waited out the
# rest of its window after every recovery.
SOAK_S, SOAK_FAULT_AT_S, SOAK_SETTLE_S = 45, 15, 30
SOAK_MAX_S = SOAK_FAULT_AT_S + HEAL_BOUND_S + SOAK_SETTLE_S
DIST_TIMEOUT = "60"  # the nodes' collective timeout here; the deployed default is 300 s
API_KEY = "farskip-test-key"
FLOAT32 = "--dtype float32"
# The flags deploy/entrypoint.sh gives a one-node demo (tests/test_deploy_static.py checks them).
DEMO_FLAGS = ["--farskip-mode", "overlap", "--tp-size", "1", "--ep-size", "1",
              "--moe-a2a-backend", "none", "--nnodes", "1", "--node-rank", "0", "--dtype", "float32"]


pytestmark = [SKIP, pytest.mark.timeout(3600)]


# ------------------------------------------------------------------ helpers
def docker_build(dockerfile: Path, image: str, *build_args: str,
                 context: Path | None = None) -> subprocess.CompletedProcess:
    """A stand-in: a Dockerfile that copies nothing goes on stdin with no context; one that
    copies names its (small) context directory."""
    cmd = ["docker", "build", "-t", image]
    for arg in build_args:
        cmd += ["--build-arg", arg]
    cmd += ["-f", str(dockerfile), str(context)] if context else ["-"]
    return subprocess.run(cmd, input=None if context else dockerfile.read_text(),
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env={**os.environ, "DOCKER_BUILDKIT": "0"})


def wait_healthy(project: Project, service: str, timeout: float = HEALTHY_TIMEOUT_S) -> float:
    cid = project.container(service)
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        st = state(cid)
        if st["Status"] == "exited":
            raise AssertionError(f"{service} exited {st['ExitCode']}:\n{project.logs()}")
        if st.get("Health", {}).get("Status") == "healthy":
            return time.monotonic() - start
        time.sleep(2)
    raise AssertionError(f"{service} not healthy after {timeout} s:\n{project.logs()}")


def streamed_completion(base: str, key: str | None = None) -> str:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    status, raw = http(base + "/v1/completions", body, key)
    assert status == 200, raw[:500]
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices") or []:
                text += choice.get("text") or ""
    assert raw.decode().rstrip().endswith("data: [DONE]"), "stream did not end with [DONE]"
    return text


def greedy_ids(base: str, key: str | None = None, timeout: float = 120) -> list[int]:
    body = {"input_ids": PROMPT_IDS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    status, raw = http(base + "/generate", body, key, timeout=timeout)
    assert status == 200, raw[:500]
    return [p[1] for p in json.loads(raw)["meta_info"]["output_token_logprobs"]]


# ------------------------------------------------------------------ CPU demo + load test
@pytest.fixture(scope="module")
def demo(images):
    """The CPU demo profile, and beside it (started together: each start is minutes on 2
    cores) the bootstrap venv's single-node TP=1 server with the entrypoint's demo flags."""
    port = free_port()
    project = Project("demo", {"FARSKIP_IMAGE": images["cpu"], "HTTP_PORT": str(port),
                               "EXTRA_ARGS": FLOAT32, "API_KEY": "", "HTTP_HOST": ""},
                      profiles=("cpu", "loadtest"))
    project.down()
    try:
        with Server(DEMO_FLAGS, eager=False) as venv:  # compiled, as in the container
            project.run("up", "-d", "demo-cpu", timeout=300)
            project.healthy_s = wait_healthy(project, "demo-cpu")
            venv.wait_ready()
            project.reference = {"text": streamed_completion(venv.url), "ids": greedy_ids(venv.url)}
        project.url = f"http://127.0.0.1:{port}"
        yield project
    finally:
        project.down()
        assert project.leftovers() == ""


@pytest.fixture(scope="module")
def reference(demo) -> dict:
    """Greedy text and ids of the bootstrap venv's single-node TP=1 server (float32)."""
    return demo.reference


def test_cpu_demo_serves_like_the_bootstrap_venv(request, demo, reference):
    report(request, f"CPU demo healthy {demo.healthy_s:.0f} s after up")
    status, raw = http(demo.url + "/farskip/info")
    assert status == 200, raw
    (rank,) = json.loads(raw)["ranks"]
    assert rank["model_class"].endswith("FarSkipDeepseekV3ForCausalLM")
    assert rank["mode"] == "overlap" and rank["converted_layers"]
    # float32 on both sides, same checkpoint (built from seed 0 in the image and in the venv),
    # same flags, same torch and SGLang: the greedy text must be identical, no tolerance.
    assert streamed_completion(demo.url) == reference["text"]
    assert greedy_ids(demo.url) == reference["ids"]


def test_cpu_demo_log_is_free_of_known_cpu_noise(demo):
    log = demo.run("logs", "--no-color", "demo-cpu").stdout
    for noise in ("Ignore import error when loading sglang.srt.models.",
                  "support AWQ currently", "support GGUF quantization currently"):
        assert noise not in log
    assert "CPU fixes applied" in log  # the log itself is there


def test_loadtest_profile_against_the_demo(request, demo, images, tmp_path):
    proc = docker_build(DOCKER / "standin" / "Dockerfile.locust", LOCUST_IMAGE,
                        f"PYTHON_IMAGE={images['base']}", context=ROOT / "requirements")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "loadtest"
    out.mkdir()
    env = {**demo.env, "LOCUST_IMAGE": LOCUST_IMAGE, "LOADTEST_DIR": str(out),
           "LOCUST_USERS": "2", "LOCUST_SPAWN_RATE": "2", "LOCUST_RUN_TIME": "20s",
           "LOCUST_INPUT_LEN": "16", "LOCUST_VOCAB_SIZE": "4096", "LOCUST_MAX_TOKENS": "8"}
    project = Project("demo", env, profiles=("cpu", "loadtest"))
    start = time.monotonic()
    project.run("up", "-d", "loadtest", timeout=300)
    cid = project.container("loadtest")
    code = int(sh(["docker", "wait", cid], timeout=240).stdout.strip())
    assert code == 0, project.run("logs", "--no-color", "loadtest").stdout[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    report(request, f"loadtest: {len(records)} requests in {time.monotonic() - start:.0f} s")
    assert records
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]][:3]
    # ITL counts the gaps between streamed chunks; a chunk may carry two tokens.
    assert all(r["output_tokens"] == NEW_TOKENS and r["ttft"] is not None
               and 1 <= len(r["itl"]) <= NEW_TOKENS - 1 for r in records)


PARKED_WATCH_S = 40  # the health check runs every 15 s (compose.yaml): two of its runs


def test_api_beyond_loopback_needs_a_key_and_the_refusal_stays_down(images):
    """HTTP beyond loopback without a key: refused (exit 2 inside), and under the shipped
    `restart: unless-stopped` it is not started again: the container parks, up, never restarted,
    its health check's output the error: line; `docker stop` ends it with the status 2."""
    project = Project("nokey", {"FARSKIP_IMAGE": images["cpu"], "HTTP_HOST": "0.0.0.0",
                                "API_KEY": "", "HTTP_PORT": str(free_port())}, profiles=("cpu",))
    try:
        project.run("up", "-d", timeout=120)
        cid = project.container("demo-cpu")
        deadline = time.monotonic() + PARKED_WATCH_S
        while time.monotonic() < deadline:
            st = state(cid)
            assert st["Status"] == "running" and st["Restarting"] is False, st
            time.sleep(2)
        st = state(cid)
        inspect = json.loads(sh(["docker", "inspect", "--format", "{{json .}}", cid]).stdout)
        assert inspect["RestartCount"] == 0 and inspect["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
        checks = st["Health"]["Log"]
        assert checks and all(c["ExitCode"] == 1 for c in checks), checks
        assert "parked: exit status 2" in checks[-1]["Output"] and "FARSKIP_ALLOW_NO_API_KEY=1" in checks[-1]["Output"]
        log = sh(["docker", "logs", cid]).stderr
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 2, log  # the refusal, once (never started again), and the parking
        assert "API_KEY" in errors[0] and "FARSKIP_ALLOW_NO_API_KEY=1" in errors[0]
        assert errors[1].startswith("error: parked: the server stopped with status 2")
        sh(["docker", "stop", "--time", "10", cid], timeout=60)
        assert state(cid)["ExitCode"] == 2
        time.sleep(3)
        assert state(cid)["Status"] == "exited"  # a stopped container stays stopped
    finally:
        project.down()


# ------------------------------------------------------------------ two nodes, two containers
@pytest.fixture(scope="module")
def one_host_network():
    """A bridge network with a subnet of our choosing (static addresses need one)."""
    name = f"{PREFIX}-one-host"
    sh(["docker", "network", "rm", name], check=False)
    for third in range(77, 97):
        subnet = f"172.30.{third}.0/24"
        if sh(["docker", "network", "create", "--subnet", subnet, name], check=False).returncode == 0:
            break
    else:
        pytest.fail("no free 172.30.x.0/24 subnet for the two-node network")
    yield name, subnet.rsplit(".", 1)[0]
    sh(["docker", "network", "rm", name], check=False)


@pytest.fixture(scope="module")
def two_nodes(request, images, demo, one_host_network):
    """deploy/cpu-node0.env and cpu-node1.env up as two containers, each on its own address
    and core, with the shipped restart policy and watchdog (its checks tightened: WATCHDOG)."""
    demo.down()  # its cores are the two nodes' now
    network, prefix = one_host_network
    addrs = [f"{prefix}.10", f"{prefix}.11"]
    cores = os.cpu_count() or 1
    nodes = []
    for rank in (0, 1):
        env = {"FARSKIP_IMAGE": images["cpu"], "ONE_HOST_NETWORK": network,
               "NODE_ADDR": addrs[rank], "NODE_CPUS": str(rank % cores),
               "NODE_MEMLOCK": str(resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]),
               "NODE_NOFILE": str(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
               # The entrypoint's variables only (deploy/cpu-node<rank>.env holds the rest).
               "MASTER_ADDR": addrs[0], "WORKER_ADDRS": addrs[1], "API_KEY": API_KEY, "DIST_TIMEOUT": DIST_TIMEOUT,
               "EXTRA_ARGS": FLOAT32, **WATCHDOG}
        nodes.append(Project(f"node{rank}", env, env_files=(DEPLOY / f"cpu-node{rank}.env",),
                             files=(ONE_HOST,)))
    try:
        for node in nodes:
            node.down()
            node.run("up", "-d", timeout=300)
        healthy = wait_healthy(nodes[0], "farskip-cpu")
        report(request, f"two nodes: node 0 healthy {healthy:.0f} s after up")
        yield nodes, f"http://{addrs[0]}:30000"
    finally:
        for node in nodes:
            node.down()
    for node in nodes:
        assert node.leftovers() == "", f"{node.name}: containers left after down"


def test_two_nodes_in_two_containers(two_nodes, reference):
    nodes, url = two_nodes
    # API key: SGLang's check, switched on by the entrypoint from API_KEY.
    status, _ = http(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert status == 401
    status, _ = http(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, key="wrong")
    assert status == 401
    # TP=2/EP=2 across the two containers vs the single-node TP=1 reference, float32: the
    # greedy ids must be the same (tests/test_parallel.py bounds the logprobs on loopback).
    assert greedy_ids(url, key=API_KEY) == reference["ids"]
    assert streamed_completion(url, key=API_KEY) == reference["text"]
    # The key came as a file (deploy/compose.yaml, `secrets`): neither in the container's
    # configuration (`docker inspect`) nor in the environment of its first process, docker-init,
    # which lives as long as the container.
    cid = nodes[0].container("farskip-cpu")
    assert API_KEY not in sh(["docker", "inspect", "--format", "{{json .Config.Env}}", cid]).stdout
    assert API_KEY not in sh(["docker", "exec", cid, "cat", "/proc/1/environ"]).stdout


# ------------------------------------------------------------------ self-healing
def server_processes(cid: str, marker: str) -> list[int]:
    """Host PIDs of the container's processes whose command line has `marker` (the watchdog,
    whose own command line names the server's, excluded)."""
    rows = sh(["docker", "top", cid, "-eo", "pid,args"]).stdout.splitlines()[1:]
    return [int(row.split(None, 1)[0]) for row in rows
            if marker in row and "sglang_farskip.serve.watchdog" not in row]


def launcher_pid(cid: str) -> int:
    (pid,) = server_processes(cid, "sglang_farskip.launch_server")
    return pid


def crash(cid: str) -> None:
    """The server process dies on its own (not `docker kill`, a deliberate stop to Docker)."""
    os.kill(launcher_pid(cid), signal.SIGKILL)


def hang(cid: str) -> None:
    """Every scheduler of the node stopped, as ranks stuck in GPU calls; the container, its
    entrypoint and watchdog stay alive."""
    pids = server_processes(cid, "sglang::scheduler")
    assert pids, sh(["docker", "top", cid]).stdout
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def restart(cid: str) -> None:
    sh(["docker", "restart", "--time", "5", cid], timeout=120)


def kill(cid: str) -> None:
    """The container's whole process tree killed from the host, as the OOM killer or an operator
    would (not `docker kill`, which Docker counts as a deliberate stop and never restarts):
    SIGKILL to its init, which ends every process of its PID namespace. Docker's restart policy
    (unless-stopped) must start it again."""
    before = state(cid)
    os.kill(before["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while state(cid).get("StartedAt") == before["StartedAt"]:
        assert time.monotonic() < deadline, f"{cid} not started again 60 s after its init was killed"
        time.sleep(0.5)


def launcher_pids(nodes) -> list[int | None]:
    """Each container's running launcher (None between two starts)."""
    pids = []
    for node in nodes:
        found = server_processes(node.container("farskip-cpu"), "sglang_farskip.launch_server")
        pids.append(found[0] if len(found) == 1 else None)
    return pids


def wait_serving_again(nodes, url: str, before: list[int | None], reference: dict,
                       since: float) -> float:
    """Seconds from `since` until both nodes run a new server (the watchdog restarts it inside
    the container; Docker the container that died) and node 0 gives the reference's greedy ids
    (a node that never restarted cannot be serving correctly: each fault here breaks the group)."""
    while time.monotonic() - since < HEAL_BOUND_S:
        now = launcher_pids(nodes)
        if all(pid is not None and pid != old for pid, old in zip(now, before)):
            try:
                if greedy_ids(url, key=API_KEY, timeout=10) == reference["ids"]:
                    return time.monotonic() - since
            except (AssertionError, OSError):
                pass
        time.sleep(1)
    raise AssertionError(f"not serving {HEAL_BOUND_S} s after the fault:\n"
                         + "\n".join(node.logs() for node in nodes))


def test_soak_with_node1_crashed_mid_run(request, two_nodes, tmp_path):
    """bench/soak.py against node 0, node 1's server killed from the host mid-run: the
    deployment comes back by itself, every request ends within its bound, none is lost, and
    every request succeeds once it is back."""
    nodes, url = two_nodes
    node1 = nodes[1].container("farskip-cpu")
    pid = launcher_pid(node1)
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--url", url,
         "--duration", str(SOAK_S), "--concurrency", "2", "--fault-at", str(SOAK_FAULT_AT_S),
         "--fault-cmd", f"kill -9 {pid}", "--request-timeout", "30", "--settle", str(SOAK_SETTLE_S),
         "--until-settled", str(SOAK_MAX_S), "--out", str(out)],
        capture_output=True, text=True, timeout=SOAK_MAX_S + 120, env={**os.environ, "API_KEY": API_KEY})
    result = json.loads(out.read_text()) if out.exists() else {}
    report(request, f"soak: {result.get('requests')} requests, {result.get('failed')} failed, "
                    f"outage {result.get('outage_window_s')} s, recovery {result.get('recovery_s')} s "
                    f"after node 1's crash, longest request {result.get('longest_request_s')} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + nodes[0].logs()
    assert result["fault"]["status"] == 0 and result["failed"] > 0  # the fault did bite
    assert result["recovery_s"] <= HEAL_BOUND_S


# Node 1's crash is the soak's fault; repeated runs (FARSKIP_HEAL_REPEATS) time it here too.
FAULTS = [("crash", 0), ("hang", 1), ("restart", 1), ("kill", 1), ("kill", 0)] + (
    [("crash", 1)] if HEAL_REPEATS > 1 else [])


@pytest.mark.parametrize("fault, node", FAULTS)
def test_two_nodes_heal_themselves(request, two_nodes, reference, fault, node):
    nodes, url = two_nodes
    assert greedy_ids(url, key=API_KEY) == reference["ids"]  # serving before the fault
    for _ in range(HEAL_REPEATS):
        # No wait for the watchdogs to arm: they arm at node 0's /health, which answered
        # before greedy_ids could (a hang right after a recovery is the case issue 34 fixed).
        cids = {n.container("farskip-cpu"): n for n in nodes}
        before = launcher_pids(nodes)
        since = time.monotonic()
        {"crash": crash, "hang": hang, "restart": restart, "kill": kill}[fault](list(cids)[node])
        took = wait_serving_again(nodes, url, before, reference, since)
        if fault == "hang":  # ended by the watchdog (the container's log spans its restarts)
            proc = sh(["docker", "logs", list(cids)[node]])
            log = proc.stdout + proc.stderr
            assert "the deployment stopped answering; killing the server" in log, log[-3000:]
        report(request, f"self-healing: node {node} {fault}: serving again after {took:.0f} s "
                        f"(bound {HEAL_BOUND_S} s)")


# ------------------------------------------------------------------ GPU Dockerfiles on stand-ins
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_gpu_image_builds_on_a_stand_in_base(request, images, platform):
    standin = f"farskip-standin/sglang-{platform}:test"
    proc = gpu_standin(images, standin, f"PLATFORM={platform}", f"SGLANG_VERSION={images['sglang']}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    image = f"sglang-farskip-test:{platform}"
    seconds = build(platform, image, "--build-arg", f"SGLANG_{platform.upper()}_IMAGE={standin}")
    report(request, f"docker/build.sh {platform} on its stand-in: {seconds:.0f} s")
    # The image's own entrypoint validates a two-node setting and prints the command.
    proc = sh(["docker", "run", "--rm", "-e", "NODE_RANK=0", "-e", "MASTER_ADDR=127.0.0.1", "-e", "WORKER_ADDRS=127.0.0.1",
               "-e", "NET_IFNAME=lo", "-e", "MODEL_PATH=demo", "-e", f"API_KEY={API_KEY}",
               image, "--check"])
    assert "-m sglang_farskip.launch_server" in proc.stdout
    assert f"FARSKIP_PLATFORM={platform}" in proc.stdout
    assert API_KEY not in proc.stdout + proc.stderr, "--check printed the API key"


def gpu_standin(images, tag: str, *build_args: str) -> subprocess.CompletedProcess:
    return docker_build(DOCKER / "standin" / "Dockerfile.gpu-base", tag,
                        f"TORCH_SGLANG_IMAGE={images['torch-sglang']}",
                        f"MOONCAKE_IMAGE={images['cpu']}", *build_args)


@pytest.mark.parametrize("wrong", ["sglang", "mooncake"])
def test_gpu_image_refuses_a_wrong_base(images, wrong):
    """A base with another SGLang, or without Mooncake's transfer engine, fails the build with
    the reason and the fix."""
    standin = f"farskip-standin/sglang-cuda:wrong-{wrong}"
    sglang = "0.5.22" if wrong == "sglang" else images["sglang"]
    proc = gpu_standin(images, standin, "PLATFORM=cuda", f"SGLANG_VERSION={sglang}",
                       f"WITH_MOONCAKE={int(wrong != 'mooncake')}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = subprocess.run([str(DOCKER / "build.sh"), "cuda", "--local-base", "--force-rm",
                           "--build-arg", f"SGLANG_CUDA_IMAGE={standin}"],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env={**os.environ, "FARSKIP_IMAGE": "sglang-farskip-test:cuda-wrong"})
    assert proc.returncode != 0
    want = {"sglang": f"error: the base image has sglang 0.5.22, sglang-farskip needs {images['sglang']}: "
                      "fix the image tag in docker/versions.env",
            "mooncake": "error: the base image has no Mooncake transfer engine (no mooncake/engine*.so), "
                        "which prefill/decode disaggregation needs"}[wrong]
    assert want in proc.stdout + proc.stderr
