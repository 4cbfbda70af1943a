"""Static checks of the two-node deployment (docker/, deploy/, docs/deploy.md), with real tools.

- compose files: parsed and validated by Docker Compose itself (`docker-compose config`);
- Dockerfiles: hadolint; shell scripts (and the Kubernetes command lines): shellcheck;
- Kubernetes: kubernetes-validate for built-in kinds, and for the LeaderWorkerSet our schema
  (deploy/schema/) plus each pod template validated as a core/v1 PodTemplateSpec;
- deploy/entrypoint.sh: its checks and the command it builds, through its --check mode, and
  that SGLang's own argument parser accepts that command;
- agreement: the variables the entrypoint reads = the ones documented = the ones in the env
  files, with the same defaults; versions in docker/versions.env = the project's pins.

The tools come from requirements/tools.txt (section `# deploy`), which scripts/bootstrap.sh
installs; a missing tool fails its test rather than skipping it. No Docker engine is needed.
Each validator is also shown a broken input, so a tool that checks nothing cannot pass.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = ROOT / "docker"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "healthcheck.sh"
SBATCH = DEPLOY / "slurm" / "farskip.sbatch"
SBATCH_PD = DEPLOY / "slurm" / "farskip-pd.sbatch"  # prefill/decode and the router
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_RDMA = DEPLOY / "compose.rdma.yaml"
NODE_ENVS = [DEPLOY / "node0.env", DEPLOY / "node1.env"]
CPU_NODE_ENVS = [DEPLOY / "cpu-node0.env", DEPLOY / "cpu-node1.env"]  # the two-node CPU deployment
ROUTER = DEPLOY / "router.py"  # the router image's entrypoint
ROUTER_ENV = DEPLOY / "router.env"  # the router across hosts
ONE_HOST_ENVS = {"pd-cpu": DEPLOY / "pd-cpu.env", "replicas-cpu": DEPLOY / "replicas-cpu.env"}
VERSIONS = DOCKER / "versions.env"
LWS_SCHEMA = DEPLOY / "schema" / "leaderworkerset-v1.schema.json"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
PLATFORMS = ["rocm", "cuda", "cpu"]
FLAVOURS = [*PLATFORMS, "router"]  # what docker/build.sh builds
GPU_SERVICES = {"rocm": "farskip-rocm", "cuda": "farskip-cuda"}
SHELL_SCRIPTS = [
    ENTRYPOINT, HEALTHCHECK, SBATCH, SBATCH_PD, DOCKER / "build.sh", DOCKER / "install-farskip.sh",
    DOCKER / "standin" / "python-base.sh", ROOT / ".ci" / "run", ROOT / "requirements" / "lock.sh",
]
# Oldest Kubernetes minor these manifests claim to support (LWS itself needs >= 1.26), and the
# newest kubernetes-validate knows.
K8S_VERSIONS = ["1.29", "1.37"]
IMAGE_ENTRYPOINT = "/opt/sglang-farskip/deploy/entrypoint.sh"


# ---------------------------------------------------------------- helpers
def tool(name: str) -> str:
    """A validator from the project's venv (or PATH); missing means the set-up was not run."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: run scripts/bootstrap.sh, which installs "
                    "requirements/tools.txt (section '# deploy') into .venv")
    return found


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("timeout", 60)
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def read_env_file(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(set, commented) KEY -> value, for `KEY=value` and `# KEY=value` lines."""
    active, commented = {}, {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            active[m[1]] = m[2]
            continue
        m = re.match(r"^#\s*([A-Z][A-Z0-9_]*)=(\S.*)$", line)
        if m:
            commented[m[1]] = m[2]
    return active, commented


def versions() -> dict[str, str]:
    return read_env_file(VERSIONS)[0]


def shell_array(path: Path, name: str) -> list[str]:
    m = re.search(rf"^{name}=\(([^)]*)\)", path.read_text(), re.M)
    assert m, f"{path} has no {name}=(...) list"
    return m[1].split()


def entrypoint_vars() -> list[str]:
    return shell_array(ENTRYPOINT, "FARSKIP_ENV_VARS")


def entrypoint_defaults() -> dict[str, str]:
    """Defaults written as `: "${NAME:=value}"` lines."""
    return dict(re.findall(r'^: "\$\{([A-Z][A-Z0-9_]*):=(.*)\}"$', ENTRYPOINT.read_text(), re.M))


DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def deploy_doc() -> tuple[Path, str]:
    """The deployment page, docs/deploy.md ("Deploy on two nodes")."""
    text = DEPLOY_DOC.read_text()
    if not re.search(r"^#+ Deploy on two nodes", text, re.M):
        pytest.fail(f"{DEPLOY_DOC}: no 'Deploy on two nodes' heading")
    return DEPLOY_DOC, text


def doc_table(heading: str) -> dict[str, str]:
    """Variable -> Default cell of the table under the heading (up to the next heading)."""
    path, text = deploy_doc()
    m = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#)", text, re.M | re.S)
    assert m, f"{path}: no section '{heading}'"
    rows = {}
    for line in m[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]):
                rows[name] = cells[1]
    assert rows, f"{path}: the section '{heading}' has no variable table"
    return rows


def compose_config(*env_files: Path, files=(COMPOSE,), profiles=(), extra_env=None) -> dict:
    cmd = [tool("docker-compose")]
    for f in files:
        cmd += ["-f", str(f)]
    for e in env_files:
        cmd += ["--env-file", str(e)]
    for p in profiles:
        cmd += ["--profile", p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    env.update(extra_env or {})
    proc = run(cmd + ["config", "--format", "json"], env=env, cwd=ROOT)
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    # Compose only warns about a variable that is neither set nor defaulted: treat it as an error.
    assert "variable is not set" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- compose
COMPOSE_CASES = {
    "node0": dict(env_files=(VERSIONS, NODE_ENVS[0])),
    "node1": dict(env_files=(VERSIONS, NODE_ENVS[1])),
    "node0-cuda-loadtest": dict(env_files=(VERSIONS, NODE_ENVS[0]),
                                extra_env={"COMPOSE_PROFILES": "cuda,loadtest"}),
    "node1-rdma": dict(env_files=(VERSIONS, NODE_ENVS[1]), files=(COMPOSE, COMPOSE_RDMA)),
    "cpu-demo-loadtest": dict(env_files=(VERSIONS,), profiles=("cpu", "loadtest")),
    "cpu-node0": dict(env_files=(VERSIONS, CPU_NODE_ENVS[0])),
    "cpu-node1": dict(env_files=(VERSIONS, CPU_NODE_ENVS[1])),
    "pd-cpu": dict(env_files=(VERSIONS, ONE_HOST_ENVS["pd-cpu"])),
    "replicas-cpu": dict(env_files=(VERSIONS, ONE_HOST_ENVS["replicas-cpu"])),
    "router": dict(env_files=(VERSIONS, ROUTER_ENV)),
}


@pytest.mark.parametrize("case", sorted(COMPOSE_CASES))
def test_compose_files_are_valid(case):
    spec = COMPOSE_CASES[case]
    config = compose_config(*spec["env_files"], files=spec.get("files", (COMPOSE,)),
                            profiles=spec.get("profiles", ()), extra_env=spec.get("extra_env"))
    assert config["services"], "no service enabled"


def test_compose_parser_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("network_mode: host", "network_mod: host", 1))
    proc = run([tool("docker-compose"), "-f", str(broken), "--env-file", str(VERSIONS), "config"])
    assert proc.returncode != 0 and "network_mod" in proc.stderr


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_compose_gpu_service(platform, rank):
    config = compose_config(VERSIONS, NODE_ENVS[rank], extra_env={"COMPOSE_PROFILES": platform})
    assert set(config["services"]) == {GPU_SERVICES[platform]}
    svc = config["services"][GPU_SERVICES[platform]]
    # Every variable the entrypoint reads is passed through, the keys as files (test below); the
    # platform is fixed per service.
    assert set(svc["environment"]) == set(entrypoint_vars()) - set(KEY_SECRETS)
    assert svc["environment"]["FARSKIP_PLATFORM"] == platform
    assert svc["environment"]["NODE_RANK"] == str(rank)
    assert svc["image"] == f"sglang-farskip:{versions()['FARSKIP_VERSION']}-{platform}"
    assert svc["network_mode"] == "host" and svc["ipc"] == "host"
    assert int(svc["shm_size"]) >= 16 * 2**30
    assert svc["ulimits"]["memlock"] == -1
    assert svc["healthcheck"]["test"] == ["CMD", "/opt/sglang-farskip/deploy/healthcheck.sh"]
    # Back after any death, parked on 2 and 71: docs/deploy.md, Self-healing.
    assert svc["restart"] == "unless-stopped" and svc["environment"]["PARK_ON_ERROR"] == "1"
    if platform == "rocm":
        assert {d["source"] for d in svc["devices"]} == {"/dev/kfd", "/dev/dri"}
        assert "video" in svc["group_add"]
    else:
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_compose_rdma_addon_adds_infiniband():
    config = compose_config(VERSIONS, NODE_ENVS[0], files=(COMPOSE, COMPOSE_RDMA))
    devices = {d["source"] for d in config["services"]["farskip-rocm"]["devices"]}
    assert devices == {"/dev/kfd", "/dev/dri", "/dev/infiniband"}


def test_compose_loadtest_targets_node0_with_the_bench_locustfile():
    config = compose_config(VERSIONS, NODE_ENVS[0],
                            extra_env={"COMPOSE_PROFILES": "rocm,loadtest"})
    lt = config["services"]["loadtest"]
    assert lt["image"] == versions()["LOCUST_IMAGE"]
    assert lt["depends_on"]["farskip-rocm"]["condition"] == "service_healthy"
    mounts = {v["target"]: Path(v["source"]) for v in lt["volumes"]}
    assert mounts["/mnt/bench"] == ROOT / "bench"
    command = lt["command"]
    locustfile = command[command.index("--locustfile") + 1]
    assert locustfile == "/mnt/bench/locustfile.py"
    assert (ROOT / "bench" / "locustfile.py").is_file(), "bench/locustfile.py is missing"
    port = entrypoint_defaults()["HTTP_PORT"]
    assert command[command.index("--host") + 1] == f"http://127.0.0.1:{port}"
    # Every flag passed is locust's own or one the locustfile defines (it may evolve).
    locust_flags = {"--locustfile", "--host", "--headless", "--users", "--spawn-rate",
                    "--run-time", "--csv", "--stop-timeout"}
    own = set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', (ROOT / "bench" / "locustfile.py").read_text()))
    passed = {a for a in command if a.startswith("--")}
    assert passed - locust_flags <= own, f"not defined by bench/locustfile.py: {passed - locust_flags - own}"


def test_compose_servers_come_back_and_park():
    """Every server and router service: restarted after any death (unless-stopped), parked
    rather than exited on 2 and 71 (PARK_ON_ERROR=1, fixed: the env file cannot turn it off),
    so that a refused setting is never started again in a loop."""
    seen = set()
    for env_files, profiles in ((NODE_ENVS[:1], ("rocm", "cuda")), (CPU_NODE_ENVS[:1], ("cpu-nodes",)),
                                ((), ("cpu",)), (ONE_HOST_ENVS.values(), ("pd-cpu", "replicas-cpu")),
                                ((ROUTER_ENV,), ("router",))):
        config = compose_config(VERSIONS, *env_files, extra_env={"COMPOSE_PROFILES": ",".join(profiles),
                                                                 "PARK_ON_ERROR": "0"})
        for name, svc in config["services"].items():
            if re.search(r"healthcheck\.sh|router\.py", " ".join(svc.get("healthcheck", {}).get("test", []))):
                seen.add(name)
                assert svc["restart"] == "unless-stopped", name
                assert svc["environment"]["PARK_ON_ERROR"] == "1", name
    assert {"farskip-rocm", "farskip-cuda", "farskip-cpu", "demo-cpu", "pd-prefill", "replica-a", "router",
            "pd-router", "replicas-router"} <= seen, seen


# The keys compose hands over as files (deploy/compose.yaml, `secrets`): variable -> file name.
KEY_SECRETS = {"API_KEY": "farskip_API_KEY", "ADMIN_API_KEY": "farskip_ADMIN_API_KEY"}


def test_compose_gives_the_keys_as_files_never_as_variables():
    """A variable given to a container stays in `docker inspect` and in docker-init's environment
    for the container's lifetime: every server and router gets API_KEY and ADMIN_API_KEY as
    files compose writes from those variables, at the path the entrypoint and router.py read.
    The loopback CPU demo alone takes them as variables (it runs with no env file)."""
    seen = set()
    for env_files, profiles in ((NODE_ENVS[:1], ("rocm", "cuda")), (CPU_NODE_ENVS[:1], ("cpu-nodes",)),
                                (ONE_HOST_ENVS.values(), ("pd-cpu", "replicas-cpu")),
                                ((ROUTER_ENV,), ("router",))):
        config = compose_config(VERSIONS, *env_files, extra_env={"COMPOSE_PROFILES": ",".join(profiles)})
        sources = {name: spec.get("environment") for name, spec in config.get("secrets", {}).items()}
        for name, svc in config["services"].items():
            if not re.search(r"healthcheck\.sh|router\.py", " ".join(svc.get("healthcheck", {}).get("test", []))):
                continue
            seen.add(name)
            assert not set(KEY_SECRETS) & set(svc["environment"]), f"{name}: a key passed as a variable"
            given = {sources[s["source"]]: s["target"] for s in svc.get("secrets", [])}
            assert given == KEY_SECRETS, f"{name}: {given}"
    assert {"farskip-rocm", "farskip-cuda", "farskip-cpu", "pd-prefill", "pd-decode0", "replica-a", "router",
            "pd-router", "replicas-router"} <= seen, seen
    # Where compose writes them is where they are read.
    assert '"/run/secrets/farskip_$1"' in ENTRYPOINT.read_text()
    assert 'Path("/run/secrets")' in (DEPLOY / "router.py").read_text()
    assert 'f"farskip_{name}"' in (DEPLOY / "router.py").read_text()


def test_parked_marker_is_one_path():
    """The entrypoint writes the parked marker where deploy/healthcheck.sh reads it."""
    written = re.search(r'^parked_file="(.+)"$', ENTRYPOINT.read_text(), re.M)
    read = re.search(r'^parked="(.+)"$', HEALTHCHECK.read_text(), re.M)
    assert written and read and written[1] == read[1], (written, read)


def test_compose_cpu_demo_uses_the_entrypoint_single_node():
    config = compose_config(VERSIONS, profiles=("cpu",))
    demo = config["services"]["demo-cpu"]
    assert demo["image"] == f"sglang-farskip:{versions()['FARSKIP_VERSION']}-cpu"
    env = demo["environment"]
    assert (env["NNODES"], env["NODE_RANK"], env["MODEL_PATH"]) == ("1", "0", "demo")
    assert set(env) <= set(entrypoint_vars())
    assert "healthcheck" in demo


# ---------------------------------------------------------------- Dockerfiles and images
def dockerfile(platform: str) -> Path:
    return DOCKER / f"Dockerfile.{platform}"


@pytest.mark.parametrize("path", [*(f"Dockerfile.{p}" for p in FLAVOURS),
                                  "standin/Dockerfile.gpu-base", "standin/Dockerfile.locust"])
def test_dockerfile_lints_clean(path):
    proc = run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(DOCKER / path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_rejects_a_bad_dockerfile():
    bad = "FROM ubuntu:latest\nRUN cd /tmp && pip install requests\n"
    proc = run([tool("hadolint"), "--no-color", "-"], input=bad)
    assert proc.returncode != 0 and "DL3007" in proc.stdout


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dockerfile_installs_like_every_other_install(platform):
    text = dockerfile(platform).read_text()
    assert re.search(rf"^RUN docker/install-farskip\.sh {platform} /opt/sglang-farskip ",
                     text, re.M)
    assert f'ENTRYPOINT ["{IMAGE_ENTRYPOINT}"]' in text
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD \[\"/opt/sglang-farskip/deploy/healthcheck\.sh\"\]",
                     text, re.M)
    assert f"ENV FARSKIP_PLATFORM={platform}" in text
    # The base image comes from a build argument, i.e. from docker/versions.env (the CPU
    # image's later stage starts from its own first stage).
    (base,) = re.findall(r"^FROM \$\{(\w+)\}(?: AS [\w-]+)?$", text, re.M)
    assert base in versions()
    # The image copies the context, which its .dockerignore allow-list filters: that list must
    # let through what the image runs and installs. (patches/ may be absent: nothing to apply.)
    copies = re.findall(r"^COPY (.+)$", text, re.M)
    assert copies[-1] == ". .", f"Dockerfile.{platform} must COPY the filtered context"
    ignore = (DOCKER / f"Dockerfile.{platform}.dockerignore").read_text().splitlines()
    assert "*" in ignore, "the .dockerignore must exclude everything, then allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    needed = {"pyproject.toml", "README.md", "python", "patches", "deploy/entrypoint.sh",
              "deploy/healthcheck.sh", "docker/install-farskip.sh", "requirements/build.lock"}
    if platform == "cpu":
        needed |= {"requirements/torch.lock", "requirements/sglang-cpu.lock", "requirements/pd-cpu.lock"}
    assert needed <= allowed, f"not let through: {needed - allowed}"
    for path in needed - {"patches"}:
        assert (ROOT / path).exists(), f"Dockerfile.{platform} needs {path}, which is missing"
    for src in (c.split()[0] for c in copies[:-1]):
        assert src in allowed and (ROOT / src).exists(), src


def test_install_script_keeps_torch_and_applies_patches_with_the_one_command():
    text = (DOCKER / "install-farskip.sh").read_text()
    # The package alone (--no-deps), built by the hash-locked setuptools with nothing fetched.
    assert ('PYTHONPATH="$build_deps" "${pip[@]}" --no-deps --no-build-isolation --no-index "$src"'
            in text)
    assert '"$python" -m sglang_farskip.tools.patches apply' in text


# ---------------------------------------------------------------- supply chain
LOCKS = ROOT / "requirements"
DIGEST = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
# What docker/versions.env holds until a releaser fills in a digest (no registry was reachable
# where it was written); docker/build.sh refuses it like a tag.
PLACEHOLDER = re.compile(r"^[^\s@:]+:[^\s@]+@sha256:UNPINNED$")


def image_tag(ref: str) -> str:
    """The TAG of NAME:TAG[@sha256:...]."""
    m = re.fullmatch(r"[^@]+:([^:@/]+)(?:@sha256:\S+)?", ref)
    assert m, f"{ref} names no tag"
    return m[1]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of the `name==version` lines of a requirements or lock file."""
    return {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)==([^\s;\\]+)",
                                                    path.read_text(), re.M)}


def commands(text: str) -> list[str]:
    """Shell commands of a script or a Dockerfile's RUN lines, continuations joined, split at
    && / ; / |, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines()
                                            if not line.lstrip().startswith("#")))
    return [c.strip() for line in joined.splitlines() for c in re.split(r"&&|;|\|\|?", line)]


def pip_installs(paths) -> list[tuple[str, str]]:
    """(file, command) for every pip install: `pip install`, or the scripts' "${pip[@]}", an
    array that starts with `pip install`."""
    found = []
    for path in paths:
        for cmd in commands(path.read_text()):
            if re.match(r"\w+=\(", cmd):  # an array's definition, run where it is used
                continue
            if re.search(r"\bpip3? install\b", cmd) or '"${pip[@]}"' in cmd:
                found.append((path.name, cmd))
    return found


def unpinned_installs(paths) -> list[tuple[str, str]]:
    """The pip installs that could fetch something no hash checks: neither --require-hashes
    (every file checked against the lock) nor a local build with --no-deps, --no-index and
    --no-build-isolation (nothing fetched at all)."""
    local = ("--no-deps", "--no-index", "--no-build-isolation")
    return [(f, c) for f, c in pip_installs(paths)
            if "--require-hashes" not in c and not all(flag in c for flag in local)]


def image_sources() -> list[Path]:
    return sorted(p for p in DOCKER.rglob("*")
                  if p.is_file() and (p.name.startswith("Dockerfile") and not p.suffix == ".dockerignore"
                                      or p.suffix == ".sh"))


def test_every_pip_install_in_the_images_is_hash_checked_or_fetches_nothing():
    installs = pip_installs(image_sources())
    # Not vacuous: the CPU image's two locks, the locust stand-in, and install-farskip.sh's
    # "${pip[@]}" array, setuptools from the lock and the package itself.
    assert len(installs) >= 5, installs
    assert unpinned_installs(image_sources()) == []
    # The `pip=(...)` array itself is the install command the script's lines extend.
    assert re.search(r'^pip=\("\$python" -m pip install ', (DOCKER / "install-farskip.sh").read_text(), re.M)


def test_the_pip_install_check_catches_an_unhashed_install(tmp_path):
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM x\nRUN pip install --no-cache-dir --no-deps sglang==0.5.23\n"
                   "RUN apt-get update \\\n    && pip install -r requirements.txt\n")
    script = tmp_path / "bad.sh"
    script.write_text('pip=(python -m pip install)\n"${pip[@]}" --no-deps "$src"\n')
    assert len(unpinned_installs([bad, script])) == 3


def test_the_locks_are_hashed_and_match_the_pins():
    v = versions()
    locks = {name: LOCKS / name for name in
             ("build.lock", "torch.lock", "sglang-cpu.lock", "locust.lock", "pd-cpu.lock", "router.lock")}
    for name, path in locks.items():
        text = path.read_text()
        assert text.startswith("# Generated by requirements/lock.sh"), name
        # Every requirement carries hashes (pip --require-hashes would refuse it in the build).
        entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 1)[1].strip())
        assert entries and all("--hash=sha256:" in e for e in entries), name
        assert len(entries) == len(pins(path)), f"{name}: an entry without an exact pin"
    setuptools = re.search(r'^requires = \["setuptools==([^"]+)"\]$',
                           (ROOT / "pyproject.toml").read_text(), re.M)
    assert setuptools, "pyproject.toml [build-system] must pin setuptools exactly"
    assert pins(locks["build.lock"]) == {"setuptools": setuptools[1]}
    torch = pins(locks["torch.lock"])
    assert torch["torch"] == v["TORCH_VERSION"] and torch["torchvision"] == v["TORCHVISION_VERSION"]
    cpu = pins(LOCKS / "cpu.txt")
    # Installed one after the other with --no-deps: the locks must agree where they overlap.
    assert {k: torch[k] for k in torch.keys() & cpu.keys()} == {k: cpu[k] for k in torch.keys() & cpu.keys()}
    assert pins(locks["sglang-cpu.lock"]) == {**cpu, "sglang": v["SGLANG_VERSION"]}
    tools = pins(LOCKS / "tools.txt")
    locust = pins(locks["locust.lock"])
    assert locust["locust"] == tools["locust"] == image_tag(v["LOCUST_IMAGE"])
    for name, version in locust.items():
        assert tools.get(name, cpu.get(name, version)) == version, name
    # Mooncake goes into the CPU image after the SGLang lock: what both hold must agree.
    pd = pins(locks["pd-cpu.lock"])
    assert pins(LOCKS / "pd-cpu.txt").items() <= pd.items()
    for name, version in pd.items():
        assert tools.get(name, cpu.get(name, version)) == version, name
    # The router's own venv, frozen in router.txt, is what its image installs.
    assert pins(locks["router.lock"]) == pins(LOCKS / "router.txt")


def test_versions_name_registry_images_by_digest_or_a_marked_placeholder():
    images = {k: v for k, v in versions().items() if k.endswith("_IMAGE")}
    assert set(images) == {"SGLANG_CUDA_IMAGE", "SGLANG_ROCM_IMAGE", "PYTHON_IMAGE", "LOCUST_IMAGE"}
    for key, ref in images.items():
        assert DIGEST.match(ref) or PLACEHOLDER.match(ref), f"{key}={ref}: not IMAGE:TAG@sha256:<digest>"


def fake_docker(tmp_path: Path, local: tuple[str, ...] = ()) -> dict[str, str]:
    """PATH with a `docker` that records its arguments and has the images `local` only: what
    build.sh decides is real, the engine is not needed to see it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    (bin_dir / "docker").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {shlex.quote(str(log))}\n'
        'if [[ "$1 $2" == "image inspect" ]]; then\n'
        f'  for have in {" ".join(shlex.quote(i) for i in local)}; do [[ "$3" == "$have" ]] && exit 0; done\n'
        "  exit 1\n"
        "fi\n")
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_LOG": str(log)}


BASE_ARG = {"cuda": "SGLANG_CUDA_IMAGE", "rocm": "SGLANG_ROCM_IMAGE", "cpu": "PYTHON_IMAGE",
            "router": "PYTHON_IMAGE"}


@pytest.mark.parametrize("platform", FLAVOURS)
def test_release_build_refuses_a_base_without_a_digest(platform, tmp_path):
    env = fake_docker(tmp_path, local=("farskip-standin/base:test",))
    name = BASE_ARG[platform]
    build = [str(DOCKER / "build.sh"), platform]

    def refused(*args: str) -> str:
        proc = run([*build, *args], env=env)
        errors = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error:"), proc.stderr
        return errors[0]

    # versions.env as shipped (a placeholder until a releaser fills it in), a tag, a bad digest.
    ref = versions()[name]
    if not DIGEST.match(ref):
        line = refused()
        assert f"{name}={ref} is not pinned by digest" in line
        assert f"docker buildx imagetools inspect {ref.split('@')[0]}" in line and "--local-base" in line
        if "YYYYMMDD" in ref:
            assert "date for YYYYMMDD" in line
    for bad in ("python:3.11-slim-bookworm", "lmsysorg/sglang:v1@sha256:abc"):
        assert f"{name}={bad} is not pinned" in refused("--build-arg", f"{name}={bad}")
        assert f"{name}={bad} is not pinned" in refused(f"--build-arg={name}={bad}")
    assert not Path(env["DOCKER_LOG"]).exists(), "docker ran for a refused build"
    # A digest passes, and reaches docker build as given.
    pinned = "example.org/base:1@sha256:" + "0" * 64
    proc = run([*build, "--build-arg", f"{name}={pinned}"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"--build-arg {name}={pinned}" in Path(env["DOCKER_LOG"]).read_text()
    # --local-base: a base this engine has passes, one it would have to pull is refused.
    proc = run([*build, "--local-base", "--build-arg", f"{name}=farskip-standin/base:test"], env=env)
    assert proc.returncode == 0, proc.stderr
    line = refused("--local-base", "--build-arg", f"{name}=python:3.11-slim-bookworm")
    assert line.startswith(f"error: --local-base: {name}=python:3.11-slim-bookworm is not an image")


def test_dockerignore_files_are_identical():
    texts = {(DOCKER / f"Dockerfile.{p}.dockerignore").read_text() for p in FLAVOURS}
    assert len(texts) == 1


@pytest.mark.parametrize("platform", FLAVOURS)
def test_build_script_passes_exactly_the_versions(platform):
    proc = run([str(DOCKER / "build.sh"), platform, "--print"])
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    passed = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")
    declared = set(re.findall(r"^ARG (\w+)", dockerfile(platform).read_text(), re.M))
    assert set(passed) == declared
    assert all(passed[k] == versions()[k] for k in passed)
    assert argv[argv.index("-t") + 1] == f"sglang-farskip:{versions()['FARSKIP_VERSION']}-{platform}"


def test_versions_file_matches_the_project_pins():
    v = versions()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"sglang=={v["SGLANG_VERSION"]}"' in pyproject
    assert f'"torch=={v["TORCH_VERSION"]}"' in pyproject
    assert re.search(rf'^version = "{re.escape(v["FARSKIP_VERSION"])}"$', pyproject, re.M)
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert f"torchvision=={v['TORCHVISION_VERSION']}" in bootstrap
    for key in ("SGLANG_CUDA_IMAGE", "SGLANG_ROCM_IMAGE"):
        assert f":v{v['SGLANG_VERSION']}-" in v[key], f"{key} is not SGLang {v['SGLANG_VERSION']}"
    assert "mi30x" in v["SGLANG_ROCM_IMAGE"], "MI300X/MI325X need the gfx942 (mi30x) build"
    # If the bench tools pin locust, the load-test image must be the same version.
    m = re.search(r"^locust==(\S+)", (ROOT / "requirements" / "tools.txt").read_text(), re.M)
    if m:
        assert image_tag(v["LOCUST_IMAGE"]) == m[1]
    # Only KEY=VALUE and whole-line comments: docker/build.sh and compose both read it.
    for line in VERSIONS.read_text().splitlines():
        assert not line or line.startswith("#") or re.fullmatch(r"[A-Z][A-Z0-9_]*=\S+", line), line


# ---------------------------------------------------------------- Kubernetes
def k8s_docs() -> list[tuple[Path, dict]]:
    """Every object of deploy/k8s/, the items of a v1 List one by one (kubectl applies them so)."""
    docs = [(f, d) for f in K8S_FILES for d in yaml.safe_load_all(f.read_text()) if d]
    return [(f, i) for f, d in docs for i in (d["items"] if d["kind"] == "List" else [d])]


def k8s_lists() -> list[tuple[Path, dict]]:
    return [(f, d) for f in K8S_FILES for d in yaml.safe_load_all(f.read_text()) if d and d["kind"] == "List"]


def k8s_object(kind: str, name: str) -> dict:
    """The one object of this kind and name in deploy/k8s/."""
    (doc,) = [d for _, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def lws_docs() -> list[tuple[Path, dict]]:
    return [(f, d) for f, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]


def validate_lws(doc: dict) -> None:
    """Raises if the LeaderWorkerSet or one of its pod templates is invalid."""
    import jsonschema
    import kubernetes_validate

    jsonschema.Draft202012Validator(json.loads(LWS_SCHEMA.read_text())).validate(doc)
    templates = doc["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        if role in templates:
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                       "template": templates[role]}
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(wrapped, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_builtin_kinds_validate(version):
    proc = run([tool("kubernetes-validate"), "--strict", "-k", version] + [str(f) for f in K8S_FILES])
    assert proc.returncode == 0 and "ERROR" not in proc.stdout, proc.stdout + proc.stderr
    kinds = {d["kind"] for _, d in k8s_docs()}
    assert {"ConfigMap", "Service", "LeaderWorkerSet", "NetworkPolicy", "DaemonSet"} <= kinds


def test_network_policy_admits_everything_from_the_group_and_only_http_from_clients():
    # The allowlist of deploy/firewall.nft (tests/test_firewall.py loads that one for real).
    policy = k8s_object("NetworkPolicy", "sglang-farskip")
    http = int(k8s_object("ConfigMap", "sglang-farskip")["data"]["HTTP_PORT"])
    (name,) = {d["metadata"]["name"] for f, d in lws_docs() if f.name.startswith("lws-")}
    group = {"leaderworkerset.sigs.k8s.io/name": name}
    assert policy["spec"]["podSelector"]["matchLabels"] == group
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers, clients = policy["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": group}}]}  # every port
    assert "from" not in clients and clients["ports"] == [{"protocol": "TCP", "port": http}]


def host_firewall() -> dict:
    (daemonset,) = [d for _, d in k8s_docs() if d["kind"] == "DaemonSet"]
    return daemonset


def test_host_firewall_sets_every_define_of_the_ruleset():
    """The DaemonSet's env replaces the `define NAME = ` lines of deploy/firewall.nft: the same
    names, so an edit of the ruleset's defines shows up here."""
    spec = host_firewall()["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    defines = re.findall(r"^define (\w+) = ", (DEPLOY / "firewall.nft").read_text(), re.M)
    assert [e["name"] for e in container["env"]] == defines
    assert all(name in container["command"][2] for name in defines)
    (configmap, http) = (k8s_object("ConfigMap", "sglang-farskip"),
                         {e["name"]: e["value"] for e in container["env"]}["HTTP_PORT"])
    assert http == configmap["data"]["HTTP_PORT"]
    assert spec["hostNetwork"] is True  # the node's own network namespace


def test_no_service_takes_the_name_of_a_leaderworkerset():
    """The LWS controller makes a headless Service named after each LeaderWorkerSet, unless a
    Service of that name exists; only a headless one gives the pods the DNS names the entrypoint
    resolves (LWS_LEADER_ADDRESS, the worker's), so ours must be named otherwise."""
    services = {d["metadata"]["name"] for _, d in k8s_docs() if d["kind"] == "Service"}
    assert services and not services & {d["metadata"]["name"] for _, d in lws_docs()}


def test_k8s_validator_rejects_a_broken_service(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {portz: []}\n")
    proc = run([tool("kubernetes-validate"), "--strict", str(bad)])
    assert proc.returncode != 0 and "portz" in proc.stdout


def lws_id(path: Path, doc: dict) -> str:
    return f"{path.name}:{doc['metadata']['name']}"


@pytest.mark.parametrize("which", [lws_id(f, d) for f, d in lws_docs()])
def test_leaderworkerset_validates(which):
    (doc,) = [d for f, d in lws_docs() if lws_id(f, d) == which]
    validate_lws(doc)


def test_k8s_lists_hold_only_leaderworkersets():
    """kubernetes-validate skips a v1 List: only LeaderWorkerSets, which validate_lws checks, may
    be in one (the built-in kinds stay plain documents, which it validates)."""
    assert k8s_lists(), "deploy/k8s/pd-cuda.yaml's LeaderWorkerSets are a List"
    for path, lst in k8s_lists():
        assert set(lst) == {"apiVersion", "kind", "items"} and lst["apiVersion"] == "v1", path
        assert {i["kind"] for i in lst["items"]} == {"LeaderWorkerSet"}, path


@pytest.mark.parametrize("breakage", ["unknown spec key", "size as string", "bad restart policy",
                                      "unknown container field", "missing workerTemplate"])
def test_leaderworkerset_validation_rejects_broken_manifests(breakage):
    import jsonschema
    import kubernetes_validate

    (doc,) = [d for f, d in lws_docs() if f.name == "lws-cuda.yaml"]
    doc = copy.deepcopy(doc)
    lwt = doc["spec"]["leaderWorkerTemplate"]
    if breakage == "unknown spec key":
        doc["spec"]["groupSize"] = 2
    elif breakage == "size as string":
        lwt["size"] = "2"
    elif breakage == "bad restart policy":
        lwt["restartPolicy"] = "Always"
    elif breakage == "unknown container field":
        lwt["workerTemplate"]["spec"]["containers"][0]["cmd"] = ["x"]
    else:
        del lwt["workerTemplate"]
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_lws(doc)


@pytest.mark.parametrize("path", [f.name for f, _ in lws_docs() if f.name.startswith("lws-")])
def test_leaderworkerset_matches_the_other_launchers(path):
    (doc,) = [d for f, d in lws_docs() if f.name == path]
    platform = re.fullmatch(r"lws-(rocm|cuda)\.yaml", path)[1]
    configmap = k8s_object("ConfigMap", "sglang-farskip")
    # The clients' Service: the one whose selector picks this LeaderWorkerSet's leader.
    (service,) = [d for _, d in k8s_docs() if d["kind"] == "Service"
                  and d["spec"]["selector"].get("leaderworkerset.sigs.k8s.io/name") == doc["metadata"]["name"]]
    settings = configmap["data"]
    assert set(settings) <= set(entrypoint_vars())
    lwt = doc["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == int(entrypoint_defaults()["NNODES"])
    assert doc["spec"]["startupPolicy"] == "LeaderCreated"
    port = int(settings.get("HTTP_PORT", entrypoint_defaults()["HTTP_PORT"]))
    assert service["spec"]["ports"][0]["targetPort"] == port
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == doc["metadata"]["name"]
    gpu_resource = {"rocm": "amd.com/gpu", "cuda": "nvidia.com/gpu"}[platform]
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = lwt[role]["spec"]["containers"]
        assert container["image"].endswith(f":{versions()['FARSKIP_VERSION']}-{platform}")
        assert container["command"][:2] == ["/bin/bash", "-c"]
        assert container["command"][2].endswith(f"exec {IMAGE_ENTRYPOINT}")
        assert container["resources"]["limits"][gpu_resource] == 8
        assert lwt[role]["spec"]["hostNetwork"] is True
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    # Self-healing: both pods' liveness asks whether the whole group generates, and starts
    # only after a startup probe (loading DeepSeek-V3 takes many minutes).
    assert leader["livenessProbe"]["httpGet"] == {"path": "/health_generate", "port": port}
    assert "startupProbe" in leader
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe"):
        assert worker[probe]["exec"]["command"][2].endswith("healthcheck.sh --deployment")
        assert worker[probe]["timeoutSeconds"] > 30  # the check itself waits up to 30 s
    assert worker["livenessProbe"]["failureThreshold"] == 3


def pod_template(doc: dict) -> dict:
    """The template of a LeaderWorkerSet's leader (its worker template when it has no leader
    template, as LWS does), or of a Deployment's pods."""
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return lwt.get("leaderTemplate", lwt["workerTemplate"])
    return doc["spec"]["template"]


def container_env(template: dict) -> dict[str, str]:
    """The environment Kubernetes gives the template's one container, from the objects of
    deploy/k8s/: envFrom's ConfigMaps in order, then env (later wins), $(NAME) expanded, a
    fieldRef to the template's annotations or labels (empty when missing, as the kubelet gives
    it). Secrets are not in these files: their keys are left out, the caller adds a key."""
    (container,) = template["spec"]["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(k8s_object("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[var["name"]] = k8s_object("ConfigMap", key["name"])["data"][key["key"]]
        elif "fieldRef" in ref:
            m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", ref["fieldRef"]["fieldPath"])
            assert m, ref
            env[var["name"]] = template.get("metadata", {}).get(m[1], {}).get(m[2], "")
        else:
            assert set(ref) == {"secretKeyRef"}, ref
    return env


def pd_lws(role: str) -> dict:
    """The LeaderWorkerSet whose pods have PD_ROLE=role."""
    found = [d for _, d in lws_docs() if container_env(pod_template(d)).get("PD_ROLE") == role]
    assert len(found) == 1, f"{len(found)} LeaderWorkerSets whose pods get PD_ROLE={role}, not 1"
    return found[0]


def pd_leader_command(doc: dict, model: Path) -> list[str]:
    """The server command the LeaderWorkerSet's leader runs: its own command line, with its
    environment (the node's own settings and the keys replaced by this machine's), run through
    the entrypoint in dry-run mode."""
    template = pod_template(doc)
    (container,) = template["spec"]["containers"]
    env = {**container_env(template), "PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "FARSKIP_PYTHON": sys.executable, "FARSKIP_PLATFORM": "cuda", "FARSKIP_DRY_RUN": "1",
           "MODEL_PATH": str(model), "NET_IFNAME": "lo", "API_KEY": TEST_API_KEY,
           "LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": str(doc["spec"]["leaderWorkerTemplate"]["size"]),
           "LWS_LEADER_ADDRESS": "127.0.0.1", "WORKER_ADDRS": "127.0.0.1"}
    script = container["command"][2].replace(IMAGE_ENTRYPOINT, str(ENTRYPOINT))
    return command_of(run(["bash", "-c", script], env=env, timeout=30))


def test_k8s_pd_servers_run_the_papers_layouts(model):
    """Prefill TP8/EP8 on one node, decode TP16/EP16 on two, each pod through the entrypoint on
    host networking with 8 GPUs and the RDMA devices, probed like the two-node deployment."""
    for role, size, tp in (("prefill", 1, "8"), ("decode", 2, "16")):
        doc = pd_lws(role)
        lwt = doc["spec"]["leaderWorkerTemplate"]
        assert lwt["size"] == size and lwt["restartPolicy"] == "None" and doc["spec"]["replicas"] == 1
        argv = pd_leader_command(doc, model)
        assert (flag(argv, "--nnodes"), flag(argv, "--tp-size"), flag(argv, "--ep-size")) == (str(size), tp, tp)
        assert flag(argv, "--disaggregation-mode") == role
        spec = lwt["workerTemplate"]["spec"]
        (container,) = spec["containers"]
        assert spec["hostNetwork"] is True and container["image"].endswith(f":{versions()['FARSKIP_VERSION']}-cuda")
        assert container["command"][2].endswith(f"exec {IMAGE_ENTRYPOINT}")
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 8 and any("rdma" in k for k in limits), limits
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"][2].endswith("healthcheck.sh --deployment")
    assert pd_lws("decode")["spec"]["startupPolicy"] == "LeaderCreated"


def test_k8s_router_finds_the_pd_servers(model):
    """The router's --prefill is the prefill leader's DNS name (from the LWS controller's
    headless Service, <name>-0.<name>), at its HTTP port, with the bootstrap port it listens
    on; its --decode the decode leader's."""
    prefill, decode = pd_lws("prefill"), pd_lws("decode")
    router_env = {**container_env(pod_template(k8s_object("Deployment", "sglang-farskip-router"))),
                  "API_KEY": TEST_API_KEY, "ADMIN_API_KEY": ADMIN_TEST_KEY}
    assert_pd_wiring(router_env, pd_leader_command(prefill, model), pd_leader_command(decode, model),
                     *(f"{d['metadata']['name']}-0.{d['metadata']['name']}" for d in (prefill, decode)))


def test_k8s_router_deployment():
    """Ready on the router's /workers (as compose's healthcheck), alive on /health; one port
    across the env, the container, the Service and the NetworkPolicy; the servers' API_KEY and
    ADMIN_API_KEY (its control plane's key) from the Secret."""
    deployment = k8s_object("Deployment", "sglang-farskip-router")
    template = pod_template(deployment)
    (container,) = template["spec"]["containers"]
    assert container["image"].endswith(f":{versions()['FARSKIP_VERSION']}-router")
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", (DOCKER / "Dockerfile.router").read_text(), re.M)[1]
    assert container["command"] == json.loads(entrypoint)
    compose = yaml.safe_load(COMPOSE.read_text())["x-router"]["healthcheck"]["test"]
    assert container["readinessProbe"].get("exec", {}).get("command") == compose[1:], container["readinessProbe"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert template["spec"].get("hostNetwork") is not True
    env = container_env(template)
    assert set(env) - {"SERVER_HTTP_PORT"} <= set(router_vars())
    port = int(env["ROUTER_PORT"])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    service = k8s_object("Service", "sglang-farskip-router")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    policy = k8s_object("NetworkPolicy", "sglang-farskip-router")
    assert policy["spec"]["podSelector"]["matchLabels"] == template["metadata"]["labels"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": port}]}]
    secrets = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"] if "secretKeyRef" in v.get("valueFrom", {})}
    assert {n: (s["name"], s["key"]) for n, s in secrets.items()} == {
        "API_KEY": ("sglang-farskip-api-key", "API_KEY"),
        # Its control plane's one key (deploy/router.py refuses API_KEY without it).
        "ADMIN_API_KEY": ("sglang-farskip-api-key", "ADMIN_API_KEY"),
        "FARSKIP_ALLOW_NO_API_KEY": ("sglang-farskip-api-key", "FARSKIP_ALLOW_NO_API_KEY")}
    assert "envFrom" not in container  # the keys by name, nothing else of the Secret


def test_k8s_pd_network_policy():
    """Where it is enforced: the PD pods reach each other on every port (bootstrap, Mooncake,
    the decode server's own), the router only their HTTP port."""
    policy = k8s_object("NetworkPolicy", "sglang-farskip-pd")
    (selector,) = policy["spec"]["podSelector"]["matchExpressions"]
    names = {pd_lws(r)["metadata"]["name"] for r in ("prefill", "decode")}
    assert (selector["key"], selector["operator"], set(selector["values"])) == (
        "leaderworkerset.sigs.k8s.io/name", "In", names)
    peers, router = policy["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": policy["spec"]["podSelector"]}]}  # every port
    labels = pod_template(k8s_object("Deployment", "sglang-farskip-router"))["metadata"]["labels"]
    http = int(container_env(pod_template(pd_lws("prefill")))["HTTP_PORT"])
    assert router == {"from": [{"podSelector": {"matchLabels": labels}}], "ports": [{"protocol": "TCP", "port": http}]}


# ---------------------------------------------------------------- shell
def k8s_command_scripts() -> list[str]:
    scripts = []
    for _, doc in lws_docs():
        for role in ("leaderTemplate", "workerTemplate"):
            for c in doc["spec"]["leaderWorkerTemplate"].get(role, {"spec": {"containers": []}})["spec"]["containers"]:
                scripts.append(c["command"][2])
                scripts += [c[probe]["exec"]["command"][2] for probe in ("startupProbe", "livenessProbe")
                            if "exec" in c.get(probe, {})]
    scripts += [c["command"][2] for c in host_firewall()["spec"]["template"]["spec"]["containers"]]
    return scripts


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    proc = run([tool("shellcheck"), "--shell=bash", "--severity=style", str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_shellcheck_kubernetes_command_lines():
    for script in k8s_command_scripts():
        proc = run([tool("shellcheck"), "--shell=bash", "-"], input=script + "\n")
        assert proc.returncode == 0, proc.stdout


def test_shellcheck_rejects_a_bad_script():
    proc = run([tool("shellcheck"), "--shell=bash", "-"], input="rm -rf $dir/build\n")
    assert proc.returncode != 0 and "SC2086" in proc.stdout


def test_slurm_job_is_two_nodes_through_the_entrypoint():
    text = SBATCH.read_text()
    assert re.search(r"^#SBATCH --nodes=2$", text, re.M)
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)
    assert "--kill-on-bad-exit=1" in text
    assert 'entrypoint="$repo/deploy/entrypoint.sh"' in text
    assert f"entrypoint={IMAGE_ENTRYPOINT}" in text


def run_sbatch_pd(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """deploy/slurm/farskip-pd.sbatch in a fake job of nodes node1..node3: scontrol names them,
    srun records its arguments and environment, then ends once every step has started. Returns
    the script's process and the steps by what they run: prefill, decode, router."""
    bin_dir, log = tmp_path / "bin", tmp_path / "steps"
    bin_dir.mkdir(parents=True)
    log.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ \"$1 $2\" == 'show hostnames' ]] && printf 'node%s\\n' 1 2 3\n")
    (bin_dir / "srun").write_text(f"""#!{sys.executable}
import json, os, sys, time, uuid
log = {str(log)!r}
path = os.path.join(log, uuid.uuid4().hex)
with open(path + ".tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
os.rename(path + ".tmp", path + ".json")
deadline = time.time() + 20
while len([n for n in os.listdir(log) if n.endswith(".json")]) < 3 and time.time() < deadline:
    time.sleep(0.05)
""")
    for tool_ in ("scontrol", "srun"):
        (bin_dir / tool_).chmod(0o755)
    job = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_JOB_NUM_NODES": "3", "SLURM_SUBMIT_DIR": str(ROOT), "FARSKIP_ROUTER_PYTHON": sys.executable,
           "JOB_RESTARTS": "0",  # one round of steps (test_slurm_supervisor has the restarts)
           "API_KEY": TEST_API_KEY, "ADMIN_API_KEY": ADMIN_TEST_KEY, "MODEL_PATH": "/models/DeepSeek-V3-FarSkip",
           "NET_IFNAME": "ens8np0", **env}
    proc = run(["bash", str(SBATCH_PD)], env=job, timeout=60)
    steps = {}
    for record in log.glob("*.json"):
        step = json.loads(record.read_text())
        role = step["env"].get("PD_ROLE") or ("router" if str(ROUTER.name) in " ".join(step["argv"]) else "?")
        assert role not in steps, f"two steps run {role}"
        steps[role] = step
    return proc, steps


def test_slurm_pd_job_runs_each_role_and_the_router(tmp_path, model):
    """Prefill on the first node (TP8, one node), decode on the other two (TP16, node 0 the
    second node), the router on the first node with both servers' addresses and the prefill
    server's bootstrap port; every step through the entrypoint or deploy/router.py, each srun
    with --kill-on-bad-exit; the first step to end ends the job, as a failure."""
    proc, steps = run_sbatch_pd(tmp_path, ADMIN_API_KEY=ADMIN_TEST_KEY)
    assert set(steps) == {"prefill", "decode", "router"}, (steps.keys(), proc.stderr)
    # The router's control plane answers the admin key alone (deploy/router.py).
    assert steps["prefill"]["env"]["ADMIN_API_KEY"] == steps["router"]["env"]["ADMIN_API_KEY"] == ADMIN_TEST_KEY
    assert proc.returncode == 1 and "stopping the others" in proc.stderr, proc.stderr
    for step in steps.values():
        assert "--kill-on-bad-exit=1" in step["argv"] and "--ntasks-per-node=1" in step["argv"]
    nodelists = {role: [a for a in s["argv"] if a.startswith("--nodelist=")] for role, s in steps.items()}
    assert nodelists == {"prefill": ["--nodelist=node1"], "decode": ["--nodelist=node2,node3"],
                         "router": ["--nodelist=node1"]}
    assert "--overlap" in steps["router"]["argv"]
    assert steps["router"]["argv"][-2:] == [sys.executable, str(ROOT / "deploy" / "router.py")]
    servers = {}
    for role in ("prefill", "decode"):
        argv = steps[role]["argv"]
        assert argv[-4:] == ["bash", "-c", 'NODE_RANK="$SLURM_PROCID" exec "$0"', str(ENTRYPOINT)]
        env = {**steps[role]["env"], "NODE_RANK": "0", "MODEL_PATH": str(model), "NET_IFNAME": "lo",
               "FARSKIP_PYTHON": sys.executable, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        if role == "decode":
            assert (env["MASTER_ADDR"], env["WORKER_ADDRS"]) == ("node2", "node3")
            env.update(MASTER_ADDR="127.0.0.1", WORKER_ADDRS="127.0.0.1")  # resolvable here
        else:
            assert "MASTER_ADDR" not in env and "WORKER_ADDRS" not in env
        servers[role] = command_of(check(env))
    assert (flag(servers["prefill"], "--nnodes"), flag(servers["prefill"], "--tp-size")) == ("1", "8")
    assert (flag(servers["decode"], "--nnodes"), flag(servers["decode"], "--tp-size")) == ("2", "16")
    assert_pd_wiring(steps["router"]["env"], servers["prefill"], servers["decode"], "node1", "node2")
    # The ports and addresses a site sets reach every step that needs them.
    proc, steps = run_sbatch_pd(tmp_path / "site", BOOTSTRAP_PORT="9100", HTTP_PORT="31000",
                                PD_ADDRS="10.0.0.1,10.0.0.2,10.0.0.3")
    router = shlex.split(router_check(**steps["router"]["env"]).stdout)
    assert router[router.index("--prefill") + 1:][:2] == ["http://10.0.0.1:31000", "9100"]
    assert steps["prefill"]["env"]["BOOTSTRAP_PORT"] == "9100" and steps["decode"]["env"]["MASTER_ADDR"] == "10.0.0.2"


# Per round of steps, the status every srun of the round ends with; JOB_RESTARTS; what the job
# must do: (exit status, rounds run).
SUPERVISOR_CASES = {
    "killed, then refused": ([137, 0, 2], "3", (2, 3)),
    "watchdog gave up": ([71], "3", (71, 1)),
    "refused at once": ([2], "3", (2, 1)),
    "killed past the bound": ([137] * 5, "2", (137, 3)),
    "never restarted": ([143], "0", (143, 1)),
}


@pytest.mark.parametrize("script", [SBATCH, SBATCH_PD], ids=lambda p: p.name)
@pytest.mark.parametrize("case", sorted(SUPERVISOR_CASES))
def test_slurm_supervisor(tmp_path, script, case):
    """The batch script is the steps' supervisor: a step that ended other than with 2 or 71 (a
    node's processes killed from outside: srun's 137) is started again, up to JOB_RESTARTS
    times; 2 (a refused setting) and 71 (a watchdog gave up) end the job with that status."""
    statuses, restarts, (want_status, want_rounds) = SUPERVISOR_CASES[case]
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    nodes = "3" if script == SBATCH_PD else "2"
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\nfor n in $(seq {nodes}); do echo node$n; done\n")
    # The step that ends a round (the two-node one: decode in PD) takes the next call number
    # (exclusive create) and ends with its round's status; the other steps wait to be stopped.
    (bin_dir / "srun").write_text(f"""#!{sys.executable}
import os, sys, time
if "--nodes=2" not in sys.argv:
    time.sleep(60)
i = 0
while True:
    try:
        os.close(os.open(os.path.join({str(calls)!r}, str(i)), os.O_CREAT | os.O_EXCL))
        break
    except FileExistsError:
        i += 1
statuses = {statuses!r}
sys.exit(statuses[min(i, len(statuses) - 1)])
""")
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    job = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
           "SLURM_JOB_NUM_NODES": nodes, "SLURM_SUBMIT_DIR": str(ROOT), "FARSKIP_ROUTER_PYTHON": sys.executable,
           "JOB_RESTARTS": restarts}
    proc = run(["bash", str(script)], env=job, timeout=60)
    rounds = len(list(calls.iterdir()))
    assert (proc.returncode, rounds) == (want_status, want_rounds), proc.stderr
    assert proc.stderr.count("again (") == want_rounds - 1, proc.stderr
    (last,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ("not starting" in last) == (want_status in (2, 71)) and f"status {want_status}" in last, last


def test_slurm_pd_job_refuses_a_wrong_node_count(tmp_path):
    proc, steps = run_sbatch_pd(tmp_path, PD_ADDRS="10.0.0.1,10.0.0.2")
    assert proc.returncode == 2 and not steps
    assert proc.stderr.startswith("error: ") and "PD_ADDRS" in proc.stderr


def test_slurm_pd_job_defaults_are_the_entrypoints():
    """The one default it repeats (the router's URLs need the number) is the entrypoint's."""
    defaults = dict(re.findall(r'^: "\$\{([A-Z][A-Z0-9_]*):=(.*)\}"$', SBATCH_PD.read_text(), re.M))
    assert defaults["HTTP_PORT"] == entrypoint_defaults()["HTTP_PORT"]
    assert re.search(r"^#SBATCH --nodes=3$", SBATCH_PD.read_text(), re.M)


# ---------------------------------------------------------------- entrypoint behaviour
@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "DeepSeek-V3-FarSkip"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


TEST_API_KEY = "farskip-static-test-key"


def good_env(model: Path, **overrides) -> dict[str, str]:
    """A valid two-node setting on this machine: both "nodes" on loopback."""
    env = {
        "PATH": os.environ["PATH"], "FARSKIP_PYTHON": sys.executable,
        "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "WORKER_ADDRS": "127.0.0.1", "NET_IFNAME": "lo",
        "MODEL_PATH": str(model), "FARSKIP_PLATFORM": "rocm", "API_KEY": TEST_API_KEY,
        # The entrypoint asks FARSKIP_PYTHON's sglang_farskip (its modes): this checkout's.
        "PYTHONPATH": os.environ.get("PYTHONPATH"),
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run(["bash", str(ENTRYPOINT), "--check", *args], env=env, timeout=30)


def full_command_of(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def watchdog_and_server(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the watchdog's own arguments, the server command it runs); ([], argv) without one."""
    if argv[1:3] != ["-m", "sglang_farskip.serve.watchdog"]:
        return [], argv
    split = argv.index("--")
    return argv[3:split], argv[split + 1:]


def command_of(proc: subprocess.CompletedProcess) -> list[str]:
    """The server command (inside the watchdog's, when there is one)."""
    return watchdog_and_server(full_command_of(proc))[1]


def settings_of(proc: subprocess.CompletedProcess) -> dict[str, str]:
    lines = proc.stdout.strip().splitlines()[:-1]
    return {k: shlex.split(v)[0] if v else "" for k, v in (line.split("=", 1) for line in lines)}


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def test_entrypoint_builds_the_two_node_command(model):
    proc = check(good_env(model))
    argv = command_of(proc)
    assert argv[:3] == [sys.executable, "-m", "sglang_farskip.launch_server"]
    expected = {
        "--farskip-mode": "overlap", "--model-path": str(model), "--tp-size": "16",
        "--ep-size": "16", "--moe-a2a-backend": "none", "--nnodes": "2", "--node-rank": "1",
        "--dist-init-addr": "127.0.0.1:50000", "--dist-timeout": "300", "--host": "0.0.0.0",
        "--port": "30000",
    }
    assert {k: flag(argv, k) for k in expected} == expected
    settings = settings_of(proc)
    assert settings["GLOO_SOCKET_IFNAME"] == settings["NCCL_SOCKET_IFNAME"] == "lo"
    assert settings["SGLANG_HOST_IP"] == "127.0.0.1"
    assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert settings["NCCL_DEBUG"] == "WARN"


@pytest.mark.parametrize("rank, overrides, url", [
    ("0", {}, "http://127.0.0.1:30000/health_generate"),
    ("0", {"HTTP_HOST": "10.1.2.3", "HTTP_PORT": "8080"}, "http://10.1.2.3:8080/health_generate"),
    ("1", {}, "http://127.0.0.1:30000/health_generate"),
    ("1", {"MASTER_ADDR": "::1"}, "http://[::1]:30000/health_generate"),
], ids=["node0", "node0-own-address", "node1", "node1-ipv6"])
def test_entrypoint_runs_the_server_under_the_watchdog(model, rank, overrides, url):
    """Every node's watchdog asks node 0's /health_generate (docs/deploy.md, Self-healing)."""
    argv = full_command_of(check(good_env(model, NODE_RANK=rank, **overrides)))
    watchdog, server = watchdog_and_server(argv)
    assert argv[0] == sys.executable
    keys = ("--url", "--up-url", "--interval", "--timeout", "--failures", "--start-timeout",
            "--restarts", "--backoff")
    assert {k: flag(watchdog, k) for k in keys} == {
        "--url": url, "--up-url": url.replace("/health_generate", "/health"), "--interval": "10",
        "--timeout": "30", "--failures": "3", "--start-timeout": "3600", "--restarts": "5",
        "--backoff": "10"}
    assert server[:3] == [sys.executable, "-m", "sglang_farskip.launch_server"]
    # WATCHDOG=0: the server command alone, unchanged.
    bare = full_command_of(check(good_env(model, NODE_RANK=rank, WATCHDOG="0", **overrides)))
    assert bare == server


def test_entrypoint_platform_defaults_and_extra_flags(model):
    env = good_env(model, FARSKIP_PLATFORM="cuda", NODE_RANK="0", DIST_TIMEOUT="60",
                   EXTRA_ARGS="--mem-fraction-static 0.85")
    argv = command_of(check(env, "--log-level", "debug"))
    assert flag(argv, "--dist-timeout") == "60"
    # EXTRA_ARGS, then the arguments, come last, so they win over the generated flags.
    assert argv[-4:] == ["--mem-fraction-static", "0.85", "--log-level", "debug"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_entrypoint_leaves_cuda_graphs_to_the_launcher(model, platform):
    """The prefill CUDA-graph policy lives in the launcher (gpu_overlap_graph_args: off only
    with the GPU side stream). A graph flag added here would read as the user's choice there
    and override it, as the entrypoint's blanket `--cuda-graph-backend-prefill disabled` did."""
    from sglang_farskip.serve.launcher import PREFILL_GRAPH_FLAGS

    argv = command_of(check(good_env(model, FARSKIP_PLATFORM=platform)))
    assert not set(PREFILL_GRAPH_FLAGS) & set(argv), argv


def test_entrypoint_accepts_exactly_the_launchers_modes(model):
    """FARSKIP_MODE takes the launcher's --farskip-mode choices, no more and no fewer."""
    from sglang_farskip.serve.launcher import own_parser

    modes = next(a.choices for a in own_parser()._actions if "--farskip-mode" in a.option_strings)
    for mode in modes:
        assert flag(command_of(check(good_env(model, FARSKIP_MODE=mode))), "--farskip-mode") == mode
    proc = check(good_env(model, FARSKIP_MODE="fast"))
    assert proc.returncode == 2, proc.stderr
    offered = re.search(r"FARSKIP_MODE=fast is not a FarSkip mode: use one of (.*)", proc.stderr)[1]
    assert offered.split(", ") == list(modes)
    assert check(good_env(model, FARSKIP_MODE="sync off")).returncode == 2  # one mode, not a list


def test_entrypoint_single_node_demo(model):
    env = good_env(model, NNODES="1", NODE_RANK="0", MASTER_ADDR=None, NET_IFNAME=None,
                   MODEL_PATH="demo", TP_SIZE="1", EP_SIZE="1", FARSKIP_PLATFORM="cpu")
    argv = command_of(check(env))
    assert "--model-path" not in argv and "--dist-init-addr" not in argv
    assert flag(argv, "--nnodes") == "1"


ADMIN_TEST_KEY = "farskip-static-admin-key"


@pytest.mark.parametrize("source", ["variables", "files"])
def test_entrypoint_api_key_never_on_a_command_line(model, tmp_path, source):
    keys = {"API_KEY": TEST_API_KEY, "ADMIN_API_KEY": ADMIN_TEST_KEY}
    if source == "files":  # a Docker or Kubernetes secret: the key in a file, a newline after it
        for name, key in list(keys.items()):
            (tmp_path / name).write_text(key + "\n")
            keys[name], keys[f"{name}_FILE"] = None, str(tmp_path / name)
    proc = check(good_env(model, NODE_RANK="0", **keys))
    assert proc.returncode == 0, proc.stderr
    assert TEST_API_KEY not in proc.stdout + proc.stderr and ADMIN_TEST_KEY not in proc.stdout + proc.stderr
    assert "--api-key" not in command_of(proc)  # the launcher takes them from FARSKIP_*API_KEY
    assert "API_KEY=<set, not shown>" in proc.stdout and "ADMIN_API_KEY=<set, not shown>" in proc.stdout


def test_entrypoint_node1_needs_no_key_and_keeps_none(model):
    """Node 1 serves no API: it starts without a key beyond loopback, and one given is dropped."""
    assert check(good_env(model, API_KEY=None)).returncode == 0
    proc = check(good_env(model))
    assert proc.returncode == 0 and "API_KEY=<set" not in proc.stdout


@pytest.mark.parametrize("overrides", [
    {"API_KEY": None, "HTTP_HOST": "127.0.0.1"},
    {"API_KEY": None, "FARSKIP_ALLOW_NO_API_KEY": "1"},
], ids=["loopback", "opt-out"])
def test_entrypoint_serves_without_a_key_on_loopback_or_by_choice(model, overrides):
    argv = command_of(check(good_env(model, **overrides)))
    assert flag(argv, "--host") == overrides.get("HTTP_HOST", "0.0.0.0")


PARK_CASES = {  # the server's exit status (None: a setting the entrypoint refuses) -> parked?
    "refused setting": (None, True),
    "watchdog gave up": (71, True),
    "launcher refused": (2, True),
    "crashed": (3, False),
}


@pytest.mark.parametrize("case", sorted(PARK_CASES))
def test_entrypoint_parks_on_2_and_71_only(tmp_path, model, case):
    """PARK_ON_ERROR=1 (compose): on 2 or 71 the entrypoint stays up, healthcheck.sh fails with
    the error: line, SIGTERM (docker stop) ends it with that status; any other status is its
    own at once (Docker restarts it). A marker left from before (the container's files survive
    a restart) is gone at the next start. The server is a stand-in that ends with the status."""
    status, parks = PARK_CASES[case]
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import os, sys
if "sglang_farskip.launch_server" not in sys.argv:  # the entrypoint's own questions
    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
print("error: the stand-in server ends with {status}", file=sys.stderr)
sys.exit({status or 0})
""")
    fake.chmod(0o755)
    marker = tmp_path / "farskip-parked"
    marker.write_text("parked: from an earlier start\n")
    env = good_env(model, NODE_RANK="0" if status else None, NNODES="1", TP_SIZE="1", EP_SIZE="1",
                   HTTP_HOST="127.0.0.1", WATCHDOG="0", PARK_ON_ERROR="1", FARSKIP_PLATFORM="cpu",
                   FARSKIP_PYTHON=str(fake), TMPDIR=str(tmp_path), MASTER_ADDR=None, WORKER_ADDRS=None)
    proc = subprocess.Popen(["bash", str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        if not parks:
            assert proc.wait(timeout=30) == status and not marker.exists()
            return
        deadline = time.monotonic() + 30
        while not (marker.exists() and "exit status" in marker.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        want = status or 2
        time.sleep(1)
        assert proc.poll() is None  # parked: up
        health = run(["bash", str(HEALTHCHECK)], env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)})
        reason = "NODE_RANK is not set" if status is None else f"the stand-in server ends with {status}"
        assert health.returncode == 1 and f"exit status {want}" in health.stderr and reason in health.stderr
        proc.terminate()
        assert proc.wait(timeout=10) == want
        assert "error: parked:" in proc.communicate()[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_entrypoint_sets_the_zmq_peer_allowlist(model):
    """SGLang's ZMQ peer allowlist: loopback, this node, node 0 and the other nodes, as IP
    addresses (SGLang parses each with `ipaddress`), and this node's connections pinned to its
    own address. tests/test_firewall.py starts servers with it."""
    proc = check(good_env(model, NODE_RANK="0", WORKER_ADDRS="localhost"))
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "ZMQ sockets admit" in x]
    admitted = line.rsplit(" ", 1)[1].split(",")
    assert admitted[:2] == ["127.0.0.1", "::1"] and len(admitted) == len(set(admitted))
    import ipaddress
    for address in admitted:
        ipaddress.ip_address(address)  # "localhost" was resolved


@pytest.mark.parametrize("role", ["none", "prefill", "decode"])
def test_entrypoint_prefill_decode_roles(model, role):
    """PD_ROLE becomes SGLang's own --disaggregation-mode (none: no flag), a prefill server's
    BOOTSTRAP_PORT its --disaggregation-bootstrap-port; SGLang's parser takes them; a Mooncake
    port range is passed on to Mooncake, and an empty one not at all."""
    proc = check(good_env(model, PD_ROLE=role, BOOTSTRAP_PORT="9100", MC_MIN_RPC_PORT="15000",
                          MC_MAX_RPC_PORT="15999"))
    argv = command_of(proc)
    if role == "none":
        assert "--disaggregation-mode" not in argv
    else:
        assert flag(argv, "--disaggregation-mode") == role
    if role == "prefill":
        assert flag(argv, "--disaggregation-bootstrap-port") == "9100"
    else:
        assert "--disaggregation-bootstrap-port" not in argv
    settings = settings_of(proc)
    assert (settings["MC_MIN_RPC_PORT"], settings["MC_MAX_RPC_PORT"]) == ("15000", "15999")
    assert "MC_MIN_RPC_PORT" not in settings_of(check(good_env(model, MC_MIN_RPC_PORT="", MC_MAX_RPC_PORT="")))
    probe = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang_farskip.serve.launcher import _split_own_flags
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(_split_own_flags(json.loads(sys.argv[1]))[1])
print(json.dumps([ns.disaggregation_mode, ns.disaggregation_bootstrap_port]))
"""
    proc = run([sys.executable, "-c", probe, json.dumps(argv[3:])], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mode, port = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mode == ("null" if role == "none" else role)
    assert port == (9100 if role == "prefill" else 8998)


def test_entrypoint_ipv6_master_is_bracketed(model):
    argv = command_of(check(good_env(model, MASTER_ADDR="::1")))
    assert flag(argv, "--dist-init-addr") == "[::1]:50000"


def test_entrypoint_dry_run_variable_prints_instead_of_starting(model):
    env = good_env(model, FARSKIP_DRY_RUN="1")
    proc = run(["bash", str(ENTRYPOINT)], env=env, timeout=30)
    assert command_of(proc)[1:3] == ["-m", "sglang_farskip.launch_server"]
    assert full_command_of(proc)[1:3] == ["-m", "sglang_farskip.serve.watchdog"]


def test_sglang_accepts_the_generated_commands(model):
    """The flags exist in the pinned SGLang and parse to the intended values."""
    commands = []
    for platform in ("rocm", "cuda"):
        for rank in ("0", "1"):
            argv = command_of(check(good_env(model, FARSKIP_PLATFORM=platform, NODE_RANK=rank)))
            commands.append(argv[3:])
    probe = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang_farskip.serve.launcher import _split_own_flags
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
out = []
for argv in json.loads(sys.argv[1]):
    own, rest = _split_own_flags(argv)
    ns = parser.parse_args(rest)
    out.append([own.farskip_mode, ns.tp_size, ns.ep_size, ns.nnodes, ns.node_rank,
                ns.dist_init_addr, ns.dist_timeout, ns.moe_a2a_backend, ns.port])
print(json.dumps(out))
"""
    proc = run([sys.executable, "-c", probe, json.dumps(commands)], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    for row, rank in zip(parsed, [0, 1, 0, 1]):
        assert row == ["overlap", 16, 16, 2, rank, "127.0.0.1:50000", 300, "none", 30000]


ERROR_CASES = {
    # name: (overrides, variable the one error line must name)
    "missing NODE_RANK": ({"NODE_RANK": None}, "NODE_RANK"),
    "NODE_RANK not a number": ({"NODE_RANK": "one"}, "NODE_RANK"),
    "NODE_RANK >= NNODES": ({"NODE_RANK": "2"}, "NODE_RANK"),
    "NNODES not a number": ({"NNODES": "two"}, "NNODES"),
    "missing MASTER_ADDR": ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    "MASTER_ADDR with a port": ({"MASTER_ADDR": "10.0.0.1:5000"}, "MASTER_ADDR"),
    "MASTER_ADDR with a bad port": ({"MASTER_ADDR": "10.0.0.1:abc"}, "MASTER_ADDR"),
    "MASTER_ADDR malformed": ({"MASTER_ADDR": "node 0!"}, "MASTER_ADDR"),
    "MASTER_ADDR does not resolve": ({"MASTER_ADDR": "node0.invalid"}, "MASTER_ADDR"),
    "MASTER_PORT out of range": ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    "missing WORKER_ADDRS": ({"WORKER_ADDRS": None}, "WORKER_ADDRS"),
    "WORKER_ADDRS too many for NNODES": ({"WORKER_ADDRS": "127.0.0.1,127.0.0.2"}, "WORKER_ADDRS"),
    "WORKER_ADDRS malformed": ({"WORKER_ADDRS": "node 1!"}, "WORKER_ADDRS"),
    "WORKER_ADDRS does not resolve": ({"WORKER_ADDRS": "node1.invalid"}, "WORKER_ADDRS"),
    # Node 0 would refuse node 1's ZMQ connections: its allowlist is WORKER_ADDRS.
    "WORKER_ADDRS is not this node 1": ({"WORKER_ADDRS": "192.0.2.7"}, "SGLANG_HOST_IP"),
    "HTTP_PORT = MASTER_PORT": ({"HTTP_PORT": "50000"}, "MASTER_PORT"),
    "TP_SIZE not a number": ({"TP_SIZE": "sixteen"}, "TP_SIZE"),
    "EP_SIZE zero": ({"EP_SIZE": "0"}, "EP_SIZE"),
    "TP_SIZE not divisible by NNODES": ({"TP_SIZE": "15", "EP_SIZE": "15"}, "TP_SIZE"),
    "EP_SIZE does not divide TP_SIZE": ({"EP_SIZE": "3"}, "EP_SIZE"),
    "DIST_TIMEOUT negative": ({"DIST_TIMEOUT": "-5"}, "DIST_TIMEOUT"),
    "missing MODEL_PATH": ({"MODEL_PATH": None}, "MODEL_PATH"),
    "MODEL_PATH missing": ({"MODEL_PATH": "/nonexistent/DeepSeek-V3"}, "MODEL_PATH"),
    "MODEL_PATH without config.json": ({"MODEL_PATH": "/"}, "MODEL_PATH"),
    "unknown FARSKIP_MODE": ({"FARSKIP_MODE": "fast"}, "FARSKIP_MODE"),
    "missing NET_IFNAME": ({"NET_IFNAME": None}, "NET_IFNAME"),
    "NET_IFNAME not on this machine": ({"NET_IFNAME": "farskip-no-such0"}, "NET_IFNAME"),
    "GLOO_SOCKET_IFNAME not on this machine": ({"GLOO_SOCKET_IFNAME": "lo,nope9"}, "GLOO_SOCKET_IFNAME"),
    "NCCL_SOCKET_IFNAME matches nothing": ({"NCCL_SOCKET_IFNAME": "=lo0"}, "NCCL_SOCKET_IFNAME"),
    "unknown FARSKIP_PLATFORM": ({"FARSKIP_PLATFORM": "tpu"}, "FARSKIP_PLATFORM"),
    "FARSKIP_PYTHON missing": ({"FARSKIP_PYTHON": "/nonexistent/python3"}, "FARSKIP_PYTHON"),
    "no API_KEY beyond loopback": ({"NODE_RANK": "0", "API_KEY": None}, "FARSKIP_ALLOW_NO_API_KEY=1"),
    "API_KEY and API_KEY_FILE": ({"NODE_RANK": "0", "API_KEY_FILE": "/etc/hostname"}, "keep one"),
    "API_KEY_FILE missing": ({"NODE_RANK": "0", "API_KEY": None, "API_KEY_FILE": "/nonexistent/key"},
                             "API_KEY_FILE=/nonexistent/key is not a readable file"),
    "ADMIN_API_KEY_FILE empty": ({"NODE_RANK": "0", "ADMIN_API_KEY_FILE": "/dev/null"}, "is not a readable file"),
    "a key flag in EXTRA_ARGS": ({"EXTRA_ARGS": "--admin-api-key x"}, "EXTRA_ARGS holds an API key flag"),
    "FARSKIP_ALLOW_NO_API_KEY not 0/1": ({"FARSKIP_ALLOW_NO_API_KEY": "yes"}, "FARSKIP_ALLOW_NO_API_KEY"),
    "WATCHDOG not 0/1": ({"WATCHDOG": "on"}, "WATCHDOG"),
    "WATCHDOG_FAILURES zero": ({"WATCHDOG_FAILURES": "0"}, "WATCHDOG_FAILURES"),
    "WATCHDOG_INTERVAL not a number": ({"WATCHDOG_INTERVAL": "10s"}, "WATCHDOG_INTERVAL"),
    "WATCHDOG_RESTARTS not a number": ({"WATCHDOG_RESTARTS": "many"}, "WATCHDOG_RESTARTS"),
    # Node 1's watchdog could never reach node 0's API (issue 34: a hang never ended).
    "HTTP_HOST loopback, node 0 elsewhere": ({"HTTP_HOST": "127.0.0.1", "MASTER_ADDR": "10.0.0.1"},
                                             "HTTP_HOST=127.0.0.1 with NNODES=2"),
    "unknown PD_ROLE": ({"PD_ROLE": "both"}, "PD_ROLE"),
    "BOOTSTRAP_PORT not a port": ({"BOOTSTRAP_PORT": "0"}, "BOOTSTRAP_PORT"),
    "BOOTSTRAP_PORT = HTTP_PORT on prefill": ({"PD_ROLE": "prefill", "BOOTSTRAP_PORT": "30000"}, "BOOTSTRAP_PORT"),
    "one Mooncake port bound": ({"MC_MIN_RPC_PORT": "15000"}, "MC_MAX_RPC_PORT"),
    "Mooncake range upside down": ({"MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "15000"}, "MC_MIN_RPC_PORT"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_entrypoint_rejects(case, model):
    overrides, variable = ERROR_CASES[case]
    proc = check(good_env(model, **overrides))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "", "printed a command despite the error"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert variable in errors[0]
    # The line says what to do, not only what is wrong.
    assert re.search(r"\b(set|use|unset|point|mount|give|fix|pass)\b", errors[0]), errors[0]


def test_entrypoint_reports_every_problem_at_once(model):
    proc = check(good_env(model, NODE_RANK=None, FARSKIP_MODE="fast", MASTER_PORT="0"))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3


def test_entrypoint_bad_dry_run_value_never_starts(model):
    env = good_env(model, FARSKIP_DRY_RUN="yes")
    proc = run(["bash", str(ENTRYPOINT)], env=env, timeout=30)
    assert proc.returncode == 2 and "FARSKIP_DRY_RUN" in proc.stderr


# ---------------------------------------------------------------- docs, env files, defaults
# TMPDIR: where the parked marker goes (the standard variable; /tmp in the images).
SHELL_BUILTIN_VARS = {"BASH_SOURCE", "BASH_REMATCH", "SECONDS", "PATH", "IFS", "TMPDIR"}


def test_entrypoint_declares_every_variable_it_reads():
    text = ENTRYPOINT.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    code = re.sub(r"<<'PY'\n.*?\nPY\n", "", code, flags=re.S)  # the embedded Python
    referenced = set(re.findall(r"\$\{!?([A-Z][A-Z0-9_]*)", code))
    referenced |= set(re.findall(r"\$([A-Z][A-Z0-9_]*)", code))
    declared = set(entrypoint_vars())
    assert referenced - SHELL_BUILTIN_VARS - {"FARSKIP_ENV_VARS"} == declared
    assert set(entrypoint_defaults()) <= declared


def test_documented_variables_are_the_variables_read():
    documented = doc_table("Variables read by deploy/entrypoint.sh")
    assert set(documented) == set(entrypoint_vars())
    for name, default in entrypoint_defaults().items():
        default = re.sub(r"\$\{(\w+):-\}", r"$\1", default)  # ${NET_IFNAME:-} reads $NET_IFNAME
        assert documented[name].startswith(f"`{default}`"), (
            f"{name}: entrypoint default {default!r}, docs say {documented[name]!r}")
    # The health check reads a subset of the same variables.
    assert set(shell_array(HEALTHCHECK, "FARSKIP_HEALTH_VARS")) <= set(entrypoint_vars())
    slurm = doc_table("Variables read by deploy/slurm/farskip.sbatch")
    assert set(shell_array(SBATCH, "FARSKIP_SLURM_VARS")) == set(slurm)
    slurm_pd = doc_table("Variables read by deploy/slurm/farskip-pd.sbatch")
    assert set(shell_array(SBATCH_PD, "FARSKIP_SLURM_PD_VARS")) == set(slurm_pd)


@pytest.mark.parametrize("env_file", NODE_ENVS, ids=lambda p: p.name)
def test_env_file_lists_every_variable_with_the_defaults(env_file):
    active, commented = read_env_file(env_file)
    defaults = entrypoint_defaults()
    for name in entrypoint_vars():
        assert name in active or name in commented, f"{env_file.name} does not mention {name}"
        shown = active.get(name, commented.get(name))
        if name in defaults and "$" not in defaults[name]:
            assert shown == defaults[name], (
                f"{env_file.name}: {name}={shown}, the entrypoint's default is {defaults[name]}")
    assert active["NODE_RANK"] == env_file.stem.removeprefix("node")
    # No inline comments: compose would read them as part of the value.
    for line in env_file.read_text().splitlines():
        assert not re.match(r"^[A-Z][A-Z0-9_]*=.*\s#", line), line


@pytest.mark.parametrize("pair", [NODE_ENVS, CPU_NODE_ENVS], ids=["gpu", "cpu"])
def test_node_env_files_differ_only_in_node_rank(pair):
    a, b = (read_env_file(p) for p in pair)
    for (one, other) in zip(a, b):
        assert {k: v for k, v in one.items() if k != "NODE_RANK"} == \
               {k: v for k, v in other.items() if k != "NODE_RANK"}


def test_compose_variables_are_documented_and_listed():
    used = set()
    for f in (COMPOSE, COMPOSE_RDMA):
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", f.read_text()))
    documented = set(doc_table("Variables read by deploy/compose.yaml"))
    documented |= set(doc_table("Variables read by deploy/entrypoint.sh"))
    documented |= set(doc_table("Variables read by deploy/router.py"))
    assert used - documented == set()
    listed = set(versions())
    for env_file in [*CPU_NODE_ENVS, *ONE_HOST_ENVS.values()]:
        # The CPU files set only variables the entrypoint, the router or compose reads.
        active, _ = read_env_file(env_file)
        assert set(active) <= set(entrypoint_vars()) | documented | {"COMPOSE_PROFILES"}, env_file
    for env_file in CPU_NODE_ENVS:
        assert read_env_file(env_file)[0]["NODE_RANK"] == env_file.stem.removeprefix("cpu-node")
    # Every variable compose reads is in an env file a user edits: the nodes', the router's, or
    # (the one-host profiles' own: ROUTER_PUBLISH) theirs.
    for env_file in [*NODE_ENVS, ROUTER_ENV, *ONE_HOST_ENVS.values()]:
        active, commented = read_env_file(env_file)
        listed |= set(active) | set(commented)
    assert used - listed == set()


# ---------------------------------------------------------------- the router and its profiles
def router_vars() -> list[str]:
    m = re.search(r"^ROUTER_VARS = \(([^)]*)\)", ROUTER.read_text(), re.M)
    assert m, f"{ROUTER} has no ROUTER_VARS"
    return re.findall(r'"([A-Z][A-Z0-9_]*)"', m[1])


def deploy_router():
    """deploy/router.py as a module (standard library only)."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("deploy_router", ROUTER)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def router_check(**env: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(ROUTER), "--check"], env={"PATH": os.environ["PATH"], **env})


ROUTER_KEYS = {"API_KEY": TEST_API_KEY, "ADMIN_API_KEY": ADMIN_TEST_KEY}


def assert_pd_wiring(router_env: dict[str, str], prefill_argv: list[str], decode_argv: list[str],
                     prefill_host: str, decode_host: str) -> None:
    """One prefill/decode deployment agrees with itself: each server has its role, and the
    router (deploy/router.py with router_env) sends prefill work to the prefill server's HTTP
    port with the bootstrap port that server listens on, decode work to the decode server's
    node 0, each by the name given. Kubernetes' and Slurm's tests share it."""
    assert flag(prefill_argv, "--disaggregation-mode") == "prefill"
    assert flag(decode_argv, "--disaggregation-mode") == "decode"
    proc = router_check(**router_env)
    assert proc.returncode == 0, proc.stderr
    flags = shlex.split(proc.stdout)
    assert "--pd-disaggregation" in flags and flags.count("--prefill") == 1
    at = flags.index("--prefill")
    assert flags[at + 1:at + 3] == [f"http://{prefill_host}:{flag(prefill_argv, '--port')}",
                                    flag(prefill_argv, "--disaggregation-bootstrap-port")]
    assert [flags[i + 1] for i, a in enumerate(flags) if a == "--decode"] == [
        f"http://{decode_host}:{flag(decode_argv, '--port')}"]


def test_router_builds_pd_and_replica_commands():
    """PD: each prefill server with BOOTSTRAP_PORT, each decode server; replicas: the workers;
    both: the flags of deploy/router.args, the file the tests' router reads too (one home), the
    request timeout, metrics on loopback, and the key nowhere on the command line."""
    from sglang_farskip.testbed.router import ROUTER_FLAGS, TEST_REQUEST_TIMEOUT_S

    shared = ROUTER_FLAGS[:ROUTER_FLAGS.index("--request-timeout-secs")]
    assert "--health-check-interval-secs" in shared and "--retry-max-retries" in shared
    assert ROUTER_FLAGS[-2:] == ["--request-timeout-secs", str(TEST_REQUEST_TIMEOUT_S)]
    proc = router_check(PREFILL_URLS="http://10.0.0.1:30000", DECODE_URLS="http://10.0.0.2:30000,http://10.0.0.3:30000",
                        BOOTSTRAP_PORT="9000", **ROUTER_KEYS)
    assert proc.returncode == 0, proc.stderr
    pd = shlex.split(proc.stdout)
    assert pd[pd.index("--prefill"):pd.index("--prefill") + 3] == ["--prefill", "http://10.0.0.1:30000", "9000"]
    assert [pd[i + 1] for i, a in enumerate(pd) if a == "--decode"] == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    assert "--pd-disaggregation" in pd and "--worker-urls" not in pd
    assert " ".join(shared) in " ".join(pd)
    assert flag(pd, "--request-timeout-secs") == "600" and flag(pd, "--prometheus-host") == "127.0.0.1"
    # The router's in-flight bound: 256 per server it sends to (here two decode servers).
    assert flag(pd, "--max-concurrent-requests") == "512" and flag(pd, "--queue-size") == "0"
    proc = router_check(WORKER_URLS="http://a:30000 http://b:30000", ROUTER_REQUEST_TIMEOUT="900", **ROUTER_KEYS)
    plain = shlex.split(proc.stdout)
    assert plain[plain.index("--worker-urls") + 1:][:2] == ["http://a:30000", "http://b:30000"]
    assert " ".join(shared) in " ".join(plain) and flag(plain, "--request-timeout-secs") == "900"
    assert flag(plain, "--max-concurrent-requests") == "512"
    given = shlex.split(router_check(WORKER_URLS="http://a:30000", ROUTER_MAX_CONCURRENT_REQUESTS="40",
                                     **ROUTER_KEYS).stdout)
    assert flag(given, "--max-concurrent-requests") == "40"
    for out in (proc.stdout + proc.stderr, " ".join(pd)):
        assert TEST_API_KEY not in out and "--api-key" not in out
        assert ADMIN_TEST_KEY not in out and "--control-plane-api-keys" not in out


def test_sglang_router_accepts_the_commands():
    """The pinned sglang-router (its own venv, .venv-router) parses what deploy/router.py builds,
    and makes an admin control-plane key of the entry deploy/router.py gives it in memory."""
    python = ROOT / ".venv-router" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run scripts/bootstrap.sh (it makes the router's environment)")
    probe = """
import json, sys
from sglang_router.launch_router import parse_router_args
for flags in json.loads(sys.argv[1]):
    args = parse_router_args(flags)
    print(json.dumps([args.pd_disaggregation, args.prefill_urls, args.decode_urls, args.worker_urls,
                      args.request_timeout_secs, args.health_check_interval_secs]))
from sglang_router.router import build_control_plane_auth_config
auth = build_control_plane_auth_config({"control_plane_api_keys": [tuple(k) for k in json.loads(sys.argv[2])]})
print(json.dumps([[k.id, k.role == k.role.Admin] for k in auth.api_keys]))
"""
    module = deploy_router()
    commands = [shlex.split(router_check(**ROUTER_KEYS, **env).stdout) for env in (
        {"PREFILL_URLS": "http://p:30000", "DECODE_URLS": "http://d:30000"},
        {"WORKER_URLS": "http://a:30000,http://b:30000"})]
    keys = module.control_plane_keys(ADMIN_TEST_KEY)
    proc = run([str(python), "-c", probe, json.dumps(commands), json.dumps(keys)], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pd, plain, control = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert control == [["farskip-admin", True]] and keys[0][2] == ADMIN_TEST_KEY
    assert pd[:3] == [True, [["http://p:30000", 8998]], ["http://d:30000"]] and pd[4] == 600
    assert plain[0] is False and plain[3] == ["http://a:30000", "http://b:30000"] and plain[5] == 2


ROUTER_ERRORS = {
    "no workers": ({}, "no workers"),
    "PD without decode": ({"PREFILL_URLS": "http://p:30000"}, "no workers"),
    "both modes": ({"WORKER_URLS": "http://a:1", "PREFILL_URLS": "http://p:1", "DECODE_URLS": "http://d:1"}, "both set"),
    "URL without port": ({"WORKER_URLS": "http://a"}, "WORKER_URLS"),
    "bad port": ({"ROUTER_PORT": "80000"}, "ROUTER_PORT"),
    "bad bootstrap port": ({"BOOTSTRAP_PORT": "x"}, "BOOTSTRAP_PORT"),
    "bad timeout": ({"ROUTER_REQUEST_TIMEOUT": "0"}, "ROUTER_REQUEST_TIMEOUT"),
    "bad in-flight bound": ({"ROUTER_MAX_CONCURRENT_REQUESTS": "0"}, "ROUTER_MAX_CONCURRENT_REQUESTS"),
    "no key beyond loopback": ({"API_KEY": ""}, "FARSKIP_ALLOW_NO_API_KEY=1"),
    "key and key file": ({"API_KEY_FILE": "/etc/hostname"}, "keep one"),
    "key file missing": ({"API_KEY": "", "API_KEY_FILE": "/nonexistent/key"}, "not a readable file"),
    "key in extra args": ({"ROUTER_EXTRA_ARGS": "--api-key x"}, "ROUTER_EXTRA_ARGS"),
    "control-plane key in extra args": ({"ROUTER_EXTRA_ARGS": "--control-plane-api-keys a:b:admin:c"},
                                        "ROUTER_EXTRA_ARGS"),
    # Without it the router's control plane answers the inference key.
    "API key without admin key": ({"ADMIN_API_KEY": ""}, "ADMIN_API_KEY is not"),
    "admin key is the API key": ({"ADMIN_API_KEY": TEST_API_KEY}, "same as API_KEY"),
    "admin key and admin key file": ({"ADMIN_API_KEY_FILE": "/etc/hostname"}, "keep one"),
    "admin key file missing": ({"ADMIN_API_KEY": "", "ADMIN_API_KEY_FILE": "/nonexistent/key"}, "not a readable file"),
    "allow not 0/1": ({"FARSKIP_ALLOW_NO_API_KEY": "yes"}, "FARSKIP_ALLOW_NO_API_KEY"),
}


@pytest.mark.parametrize("case", sorted(ROUTER_ERRORS))
def test_router_rejects(case):
    overrides, needle = ROUTER_ERRORS[case]
    env = {"WORKER_URLS": "http://a:30000", **ROUTER_KEYS}
    if "WORKER_URLS" not in overrides and ("PREFILL_URLS" in overrides or case == "no workers"):
        env.pop("WORKER_URLS")
    proc = router_check(**{**env, **overrides})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and proc.stdout == "" and len(errors) == 1, proc.stderr
    assert needle in errors[0]
    assert re.search(r"\b(set|use|unset|give|keep|mount|write)\b", errors[0]), errors[0]


def test_router_parks_a_refused_setting(tmp_path):
    """PARK_ON_ERROR=1 (compose): the refusal's error: line, then the router stays up; its
    --healthcheck fails with that line; SIGTERM (docker stop) ends it with 2."""
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "PARK_ON_ERROR": "1", "API_KEY": TEST_API_KEY}
    marker = tmp_path / "farskip-parked"
    proc = subprocess.Popen([sys.executable, str(ROUTER)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        assert proc.poll() is None
        health = run([sys.executable, str(ROUTER), "--healthcheck"], env=env)
        assert health.returncode == 1 and "parked: exit status 2" in health.stderr and "no workers" in health.stderr
        proc.terminate()
        assert proc.wait(timeout=10) == 2
        log = proc.communicate()[1]
        assert "error: no workers" in log and "error: parked: the router stopped with status 2" in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_router_serves_without_a_key_on_loopback_or_by_choice():
    for extra in ({"ROUTER_HOST": "127.0.0.1"}, {"FARSKIP_ALLOW_NO_API_KEY": "1"}):
        assert router_check(WORKER_URLS="http://a:30000", **extra).returncode == 0


def test_router_variables_are_documented_and_listed_with_the_defaults():
    module = deploy_router()
    documented = doc_table("Variables read by deploy/router.py")
    assert set(documented) == set(router_vars())
    active, commented = read_env_file(ROUTER_ENV)
    for name in router_vars():
        assert name in active or name in commented, f"router.env does not mention {name}"
        if name in module.DEFAULTS:
            assert documented[name].startswith(f"`{module.DEFAULTS[name]}`"), name
            if name in commented:
                assert commented[name] == module.DEFAULTS[name], name
    # One port for one fact: the prefill server's bootstrap default is the router's.
    assert module.DEFAULTS["BOOTSTRAP_PORT"] == entrypoint_defaults()["BOOTSTRAP_PORT"]


def test_compose_router_across_hosts():
    config = compose_config(VERSIONS, ROUTER_ENV)
    (name,) = config["services"]
    svc = config["services"][name]
    assert name == "router" and svc["network_mode"] == "host"
    assert svc["image"] == f"sglang-farskip:{versions()['FARSKIP_VERSION']}-router"
    assert set(svc["environment"]) == set(router_vars()) - set(KEY_SECRETS)
    assert "--healthcheck" in svc["healthcheck"]["test"]


@pytest.mark.parametrize("profile, servers", [
    ("pd-cpu", {"pd-prefill": "prefill", "pd-decode0": "decode", "pd-decode1": "decode"}),
    ("replicas-cpu", {"replica-a": "none", "replica-b": "none"}),
])
def test_compose_one_host_profiles(profile, servers):
    """Only the router's port is published; every server is the entrypoint's, on the profile's
    bridge network; the router's workers are the servers that serve HTTP."""
    config = compose_config(VERSIONS, ONE_HOST_ENVS[profile])
    router = f"{profile.removesuffix('-cpu')}-router"
    assert set(config["services"]) == {*servers, router}
    for name, role in servers.items():
        svc = config["services"][name]
        env = svc["environment"]
        assert "ports" not in svc and svc.get("network_mode") is None and set(svc["networks"]) == {"cpu-servers"}
        assert set(env) <= set(entrypoint_vars()) | {"OMP_NUM_THREADS"}, set(env) - set(entrypoint_vars())
        assert env.get("PD_ROLE", "none") == role and env["MODEL_PATH"] == "demo"
        assert env["HTTP_HOST"] == "0.0.0.0" and "API_KEY_FILE" in env  # the key itself as a file (KEY_SECRETS)
    svc = config["services"][router]
    (port,) = svc["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8000", 8000)
    env = svc["environment"]
    assert set(env) == set(router_vars()) - set(KEY_SECRETS)
    http = f":{entrypoint_defaults()['HTTP_PORT']}"
    if profile == "pd-cpu":
        assert (env["PREFILL_URLS"], env["DECODE_URLS"]) == (f"http://pd-prefill{http}", f"http://pd-decode0{http}")
        decode1 = config["services"]["pd-decode1"]["environment"]
        assert (decode1["NODE_RANK"], decode1["NNODES"], decode1["MASTER_ADDR"]) == ("1", "2", "pd-decode0")
        # The prefill server listens where the router tells decode servers to fetch KV.
        assert config["services"]["pd-prefill"]["environment"]["BOOTSTRAP_PORT"] == env["BOOTSTRAP_PORT"] == "8998"
    else:
        assert env["WORKER_URLS"] == f"http://replica-a{http},http://replica-b{http}"
