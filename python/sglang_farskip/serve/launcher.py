"""`python -m sglang_farskip.launch_server [--farskip-mode overlap|sync|blocking|off] [SGLang flags...]`

Every SGLang flag passes through. What this adds to `python -m sglang.launch_server`:
- no --model-path: build (once, cached) a tiny FarSkip demo checkpoint and serve it
  (`--demo deepseek-v3`, the default, `--demo deepseek-v3-fp8` or `--demo instella`);
- no GPU, or --device cpu: the CPU environment and defaults SGLang needs, set here;
- the checkpoint and flags are checked before anything starts: clear errors, exit code 2;
- the FarSkip runtime options (mode, GPU overlap, ...) are validated once and reach every
  worker as one environment variable (`options.py`);
- after start-up, each rank's report of what it really built is checked, logged and served at
  GET /farskip/info; a server whose workers did not load the plugin is stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
import urllib.request

from sglang_farskip import checkpoint
from sglang_farskip.config import FarSkipConfig, FarSkipMode
from sglang_farskip.errors import ArgumentParser, UserError, fail
from sglang_farskip.formats import fp8
from sglang_farskip.options import Flag, RuntimeOptions, option_flags, publish

logger = logging.getLogger("sglang_farskip.launch")

ENV_STATUS = "SGLANG_FARSKIP_STATUS_DIR"


DEMO_MODEL_NAMES = {"deepseek-v3": "farskip-demo", "deepseek-v3-fp8": "farskip-demo-fp8",
                    "instella": "farskip-demo-instella"}
_UNSET = object()

# Every server, not only deployments: `/health` answers SGLang's server status (200 once the
# warm-up request has generated through every rank) instead of generating a token itself.
# Load balancers ask `/health` every few seconds (SGLang's router, Kubernetes probes); a
# generating `/health` queues behind real requests, and on a busy server it timed out and the
# router dropped a live worker (docs/pd.md, "Replicas behind the router"). `/health_generate`
# still generates, for the checks that must see a hung scheduler (serve/watchdog.py).
SERVER_ENVIRONMENT = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}


# ---------------------------------------------------------------- the command line
class GivenArgs:
    """The SGLang flags the user gave, as SGLang's own parser reads them (aliases such as
    --tp, `--flag=value`, abbreviations and --config files resolved), without its defaults:
    the launcher adds a default of its own only where the user gave nothing."""

    def __init__(self, argv: list[str]):
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(prog="sglang_farskip.serve.launcher")
        ServerArgs.add_cli_args(parser)
        if "--config" in argv:  # as prepare_server_args does
            from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        self._dest = {}
        for action in parser._actions:
            for option in action.option_strings:
                self._dest[option] = action.dest
            action.default, action.required = _UNSET, False
        try:
            namespace = parser.parse_args(argv)
        except SystemExit as e:  # argparse already printed the problem
            raise UserError(f"invalid SGLang arguments (exit {e.code}); see the message above") from None
        self._values = {k: v for k, v in vars(namespace).items() if v is not _UNSET}

    def __contains__(self, flag: str) -> bool:
        return self._dest[flag] in self._values

    def get(self, flag: str, default=None):
        return self._values.get(self._dest[flag], default)


# The launcher's flags that are not runtime options, declared as those are (options.Flag).
LAUNCHER_FLAGS = (
    Flag("--farskip-ready-timeout", type=float, default=1800.0, metavar="S",
         help="seconds to wait for the first /health answer before checking that every "
         "rank built a FarSkip model (a later start is left unchecked)"),
    Flag("--demo", choices=tuple(DEMO_MODEL_NAMES),
         help="without --model-path: which tiny built-in model to serve (default deepseek-v3)"),
)


def own_parser() -> argparse.ArgumentParser:
    """The launcher's own flags; every other flag is SGLang's (`--help` shows SGLang's)."""
    parser = ArgumentParser(prog="python -m sglang_farskip.launch_server", add_help=False, allow_abbrev=False)
    for flag in (*option_flags().values(), *LAUNCHER_FLAGS):
        flag.add_to(parser)
    return parser


def _split_own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    return own_parser().parse_known_args(argv)


# ---------------------------------------------------------------- checks before launch
def read_checkpoint_config(model_path: str) -> dict:
    return checkpoint.read_config(
        model_path,
        missing_hint="pass a local checkpoint directory (download it first), or omit --model-path "
        "to serve the built-in demo model",
    )


def check_farskip(config: dict, model_path: str) -> FarSkipConfig:
    try:  # the config's own messages name the key; this names the file
        farskip = FarSkipConfig.from_hf_config(config)
        problems = checkpoint.gate_problems(config, checkpoint.checkpoint_gate_shapes(model_path))
    except UserError as e:
        raise UserError(f"{model_path}/config.json: {e}") from None
    if problems:
        raise UserError(f"{model_path}: {problems[0]}")
    if not farskip.enabled:
        return farskip
    archs = config.get("architectures") or []
    if checkpoint.architecture(config) is None:
        raise UserError(
            f"{model_path}/config.json sets \"farskip\": true but the architecture is {archs}: "
            f"FarSkip is implemented for {' and '.join(checkpoint.FARSKIP_ARCHS)} only; remove the "
            "farskip keys or use one of those checkpoints"
        )
    try:
        farskip.check_layers(int(config.get("num_hidden_layers", 0)))
    except UserError as e:
        raise UserError(f"{model_path}/config.json: {e}") from None
    return farskip


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_engine_env_first(gpu: bool) -> None:
    """SGLang's modules decide at import whether this is a CPU run (SGLANG_USE_CPU_ENGINE), and
    reading the command line with SGLang's parser imports them: without a GPU the variable is
    set before that; a CPU run asked for with --device cpu on a GPU machine re-executes (main)."""
    from sglang_farskip.cpu.environment import cpu_base_environment

    if not gpu:
        _setdefault_env(cpu_base_environment())


def _metrics_dir_first() -> None:
    """SGLang's metrics (--enable-metrics) are prometheus_client's multiprocess files, in the
    directory PROMETHEUS_MULTIPROC_DIR names, which SGLang's engine sets when it starts; but
    prometheus_client chooses between in-memory and file-backed values once, when it is first
    imported. The plugins SGLang loads before that (load_plugins below) import SGLang's KV-transfer
    connectors (our hooks in them: cpu/pd.py on CPU, serve/kv_transfer.py everywhere), which
    import prometheus_client: every value then
    stayed in its process's memory and each server's /metrics answered an empty page (measured:
    0 bytes after requests, PD or not). Naming the directory first keeps the values in files
    there (SGLang, finding the variable set, keeps it: utils/common.py's
    set_prometheus_multiproc_dir)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sglang-farskip-metrics-")


def _setdefault_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        if key in os.environ and os.environ[key] != value:
            logger.info("keeping %s=%s from the environment", key, os.environ[key])
        os.environ.setdefault(key, value)


def _device(given: GivenArgs, gpu: bool) -> str:
    from sglang_farskip.cpu.environment import is_cpu_run

    return given.get("--device") or ("cpu" if not gpu or is_cpu_run() else "cuda")


def _check_cpu_engine(on_cpu: bool, gpu: bool, device: str | None) -> None:
    """SGLang's modules, already imported, must agree with the device this run serves on."""
    from sglang_farskip.cpu.environment import is_cpu_run

    if on_cpu == is_cpu_run():
        return
    if not gpu:
        raise UserError(f"--device {device}, but torch sees no GPU (torch.cuda.is_available() is "
                          "False): drop --device to serve on CPU, or run on a machine with a GPU")
    raise UserError(f"--device {device}, but SGLANG_USE_CPU_ENGINE=1 is set in the environment: unset it "
                      "for a GPU run, or drop --device")


def _cpu_setup(given: GivenArgs) -> list[str]:
    """The per-rank CPU environment, and the CPU defaults for flags the user did not give."""
    from sglang_farskip.cpu.environment import cpu_default_args, cpu_environment

    from sglang_farskip.cpu.pd import pd_environment

    tp, nnodes = given.get("--tp-size", 1), given.get("--nnodes", 1)
    _setdefault_env(cpu_environment(ranks_on_this_node=max(1, tp // nnodes), cores=os.cpu_count() or 1))
    # SGLang's default --host is loopback (the default here is read from its own parser).
    _setdefault_env(pd_environment(given.get("--disaggregation-mode", "null"),
                                   given.get("--host", _sglang_default("host")),
                                   given.get("--dist-init-addr")))
    extra = []
    for flag, value in cpu_default_args():
        if flag not in given:
            extra += [flag] if value is None else [flag, value]
    return extra


def _sglang_default(field: str):
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return next(f.default for f in record_fields(ServerArgs) if f.name == field)


# The flags that set prefill CUDA graphs; one given by the user (or a deployment) is kept.
PREFILL_GRAPH_FLAGS = ("--cuda-graph-backend-prefill", "--disable-cuda-graph", "--disable-prefill-cuda-graph")


def gpu_overlap_graph_args(given: GivenArgs) -> list[str]:
    """With the GPU side stream, prefill runs without CUDA graphs unless the user chose a
    prefill graph backend: SGLang's default on CUDA (breakable graphs) cuts the capture at every
    attention, where the routed sum would still be in flight, so the model then joins that sum
    before attention and it overlaps nothing (docs/gpu-overlap.md).

    Only with the side stream: without it every FarSkip all-reduce on a GPU is SGLang's own,
    waited where it is launched (`overlap` falls back to the `sync` schedule), so no sum is in
    flight across a graph break and upstream's prefill graphs are as safe as for stock
    DeepSeek-V3; turning them off there would only cost launch overhead. This is the one place
    of the policy: deploy/entrypoint.sh adds no graph flag (tests/test_deploy_static.py)."""
    if any(f in given for f in PREFILL_GRAPH_FLAGS):
        logger.info("GPU overlap: keeping the prefill CUDA-graph setting given; under a breakable "
                    "graph the routed all-reduce is joined before each attention (less overlap)")
        return []
    logger.info("GPU overlap: added --cuda-graph-backend-prefill disabled (prefill runs eagerly, so "
                "both all-reduce lanes overlap compute); pass --cuda-graph-backend-prefill to choose")
    return ["--cuda-graph-backend-prefill", "disabled"]


# The keys reach the launcher as flags, or, the deployments' way, each in a file named by a
# variable (deploy/entrypoint.sh): a file is read here, by the one process that needs the key,
# so no process holds it in its environment (the watchdog that restarts this launcher holds
# only the path). A key in the variable itself (FARSKIP_API_KEY) is read once and removed from
# every process the server starts (redact.take_from_environment).
MIN_KEY_CHARS = 16


def _key_from_environment(variable: str) -> str | None:
    """The key in `variable`, or in the file `variable`_FILE names (without its trailing
    newlines, as the entrypoint reads a key file); None if neither is set."""
    from sglang_farskip.serve.redact import take_from_environment

    value, path = take_from_environment(variable), os.environ.pop(f"{variable}_FILE", None)
    if path is None:
        return value
    if value is not None:
        raise UserError(f"{variable} and {variable}_FILE are both set: keep one (the file)")
    try:
        with open(path) as f:
            return f.read().rstrip("\n")
    except OSError as e:
        raise UserError(f"{variable}_FILE={path}: cannot read the key ({e.strerror}): "
                        "mount the secret there, or unset the variable") from None


def _keys(given: GivenArgs) -> list[str]:
    """The key flags to add from the environment; refuses empty, short or shared keys (SGLang
    checks no key at all when --api-key is empty, and with one key for both, every client is
    an admin)."""
    from sglang_farskip.serve.redact import KEY_VARIABLES

    extra, keys = [], {}
    for flag, variable in KEY_VARIABLES.items():
        from_env = _key_from_environment(variable)
        if flag in given:
            keys[flag] = given.get(flag)
        elif from_env is not None:
            keys[flag] = from_env
            extra.append(f"{flag}={from_env}")  # one word: a key starting with "-" is no flag
    for flag, key in keys.items():
        where = f"{flag} (or {KEY_VARIABLES[flag]})"
        if not key or not key.strip():
            raise UserError(f"{where} is empty, so SGLang would check no key: give a key of at least "
                            f"{MIN_KEY_CHARS} characters, or leave the flag out")
        if not (key.isascii() and key.isprintable()):
            raise UserError(f"{where} holds characters other than printable ASCII, which SGLang's key "
                            "check cannot compare: use e.g. `openssl rand -hex 32`")
        if len(key) < MIN_KEY_CHARS:
            raise UserError(f"{where} is {len(key)} characters long: use at least {MIN_KEY_CHARS} "
                            "random characters (e.g. `openssl rand -hex 32`)")
    if len(keys) == 2 and keys["--api-key"] == keys["--admin-api-key"]:
        raise UserError("--api-key and --admin-api-key are the same key, which makes every client an "
                        "admin: give the admin routes their own key")
    return extra


def _check_stand_in() -> None:
    from sglang_farskip.cpu.environment import stand_in_kernels

    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        raise UserError(
            "sgl_kernel is not importable and the CPU stand-in is not installed: "
            "run scripts/bootstrap.sh (it installs python/cpu_shim)"
        ) from None
    if stand_in_kernels():
        logger.info("CPU run: sgl_kernel is sglang_farskip's stand-in (raises if any kernel is called)")


# ---------------------------------------------------------------- after launch
def wait_healthy(base_url: str, timeout: float, alive=lambda: True) -> bool:
    """Poll GET /health until it answers 200 (True), or the timeout passes or `alive()` turns
    false (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def _wait_ready_and_verify(base_url: str, status_dir: str, ranks: int, timeout: float,
                           curl_hint: str) -> None:
    """Runs in a thread beside the server: once it answers, every local rank must have
    reported the FarSkip class; otherwise the server is stopped (the plugin did not load)."""
    from sglang_farskip.models.status import read_rank_statuses

    if not wait_healthy(base_url, timeout):
        return  # SGLang reports its own start-up failures; nothing to verify
    reports = read_rank_statuses(status_dir)
    if len(reports) < ranks:
        logger.error(
            "the server is up but %d of %d ranks reported a FarSkip model: SGLang built another "
            "class (its plugin loader logs and swallows errors; look for 'Failed to execute "
            "general plugin' above). Stopping.", len(reports), ranks,
        )
        _stop_server()
        return
    first = reports[0]
    logger.info(
        "running %s on %d rank(s): %s; mode %s (requested %s); all-reduce %s; weights %s",
        first["model_class"], len(reports), first["description"], first["mode"],
        first["requested_mode"], first["comm_backend"], first["weight_format"],
    )
    print(f"\nServer ready at {base_url}. Try:\n  {curl_hint}\n", flush=True)


def _stop_server() -> None:
    from sglang.srt.utils import kill_process_tree

    kill_process_tree(os.getpid(), include_parent=True)


def _add_info_route(status_dir: str, launch_info: dict) -> None:
    from sglang.srt.entrypoints.http_server import app

    from sglang_farskip.models.status import read_rank_statuses

    @app.get("/farskip/info")
    async def farskip_info():
        return {"launcher": launch_info, "ranks": read_rank_statuses(status_dir)}


# ---------------------------------------------------------------- main
def prepare(argv: list[str]) -> tuple[object, dict]:
    """Everything before the server starts, step by step; raises UserError on bad input.

    The order matters: the environment SGLang reads at import is set before the first SGLang
    import, the checkpoint and our own flags are checked before SGLang's plugins load, and the
    options are published only once every refusal has passed."""
    own, argv = _split_own_flags(argv)
    gpu = _gpu_present()
    given = _read_sglang_flags(argv, gpu)
    on_cpu = _on_cpu(given, gpu)
    from sglang_farskip.serve.shed import queue_args

    argv = argv + _keys(given) + queue_args(given)  # a bounded queue unless given
    model_path, argv = _model_to_serve(own, given, argv)
    config = read_checkpoint_config(model_path)
    farskip = check_farskip(config, model_path)
    weight_format = check_weight_format(config, model_path, given, on_cpu)
    opts = _runtime_options(own, farskip, model_path, on_cpu)
    argv = argv + _device_setup(given, opts, farskip, on_cpu, gpu)
    _status_and_metrics_dirs(given)
    server_args = _sglang_server_args(argv)
    _refuse_what_farskip_cannot_run(server_args, config, farskip, opts, on_cpu)
    publish(opts)  # every process SGLang starts from here on inherits them
    return server_args, _launch_info(server_args, given, own, model_path, farskip, weight_format, opts, on_cpu)


def _read_sglang_flags(argv: list[str], gpu: bool) -> GivenArgs:
    """The SGLang flags the user gave. Reading them imports SGLang, whose modules read at
    import whether this is a CPU run and the server-wide switches: those are set first."""
    _cpu_engine_env_first(gpu)
    _setdefault_env(SERVER_ENVIRONMENT)
    return GivenArgs(argv)


def _on_cpu(given: GivenArgs, gpu: bool) -> bool:
    """Whether this run serves on CPU; there, torch keeps to one thread in this process from
    now on, before anything here runs torch (the demo build does), so that forked workers
    inherit no OpenMP pool (cpu/environment.py)."""
    on_cpu = _device(given, gpu) == "cpu"
    if on_cpu:
        from sglang_farskip.cpu.environment import one_thread_until_workers_start

        one_thread_until_workers_start()
    return on_cpu


def _model_to_serve(own: argparse.Namespace, given: GivenArgs, argv: list[str]) -> tuple[str, list[str]]:
    """The checkpoint to serve, and SGLang's flags for it: without --model-path, the built-in
    demo checkpoint (built once, cached) under the model id clients of the demo send."""
    if "--model-path" in given:
        if own.demo:
            raise UserError("--demo picks a built-in model and --model-path a checkpoint: pass one of them")
        return given.get("--model-path"), argv
    from sglang_farskip.tools.demo_model import ensure_demo_checkpoint

    kind = own.demo or "deepseek-v3"
    path = ensure_demo_checkpoint(kind=kind)
    logger.info("no --model-path: serving the built-in tiny FarSkip model from %s", path)
    argv = ["--model-path", str(path)] + argv
    if "--served-model-name" not in given:  # the OpenAI model id clients send
        argv += ["--served-model-name", DEMO_MODEL_NAMES[kind]]
    return str(path), argv


def _runtime_options(own: argparse.Namespace, farskip: FarSkipConfig, model_path: str,
                     on_cpu: bool) -> RuntimeOptions:
    """The runtime options from our own flags, validated; refuses a CPU-only flag on a GPU
    (there SGLang's own settings decide what it would) and makes the profile directory here,
    where a mistyped path fails once rather than in every worker."""
    if own.farskip_mode and not farskip.enabled:
        logger.warning("--farskip-mode %s has no effect: %s is not a FarSkip checkpoint",
                       own.farskip_mode, model_path)
    if own.farskip_cpu_attention and not on_cpu:
        raise UserError("--farskip-cpu-attention applies to CPU runs only; on a GPU the attention "
                          "backend (--attention-backend) chooses the MLA prefill path: remove the flag")
    if own.farskip_cpu_start_method and not on_cpu:
        raise UserError("--farskip-cpu-start-method applies to CPU runs only; on a GPU SGLang spawns its "
                          "workers (a forked CUDA process cannot use the GPU): remove the flag")
    if own.farskip_profile_dir:
        os.makedirs(own.farskip_profile_dir, exist_ok=True)
    profile_dir = os.path.abspath(own.farskip_profile_dir) if own.farskip_profile_dir else None
    return RuntimeOptions.from_flags(own, profile_dir=profile_dir)


def _device_setup(given: GivenArgs, opts: RuntimeOptions, farskip: FarSkipConfig, on_cpu: bool,
                  gpu: bool) -> list[str]:
    """The flags this device needs that the user did not give (CPU defaults and environment,
    or prefill without CUDA graphs under the GPU side stream), once SGLang's imported modules
    are known to agree with the device."""
    extra = []
    if on_cpu:
        extra = _cpu_setup(given)
        _check_stand_in()
    elif opts.gpu_overlap and farskip.enabled and opts.mode.own_communicator:
        extra = gpu_overlap_graph_args(given)
    _check_cpu_engine(on_cpu, gpu, given.get("--device"))
    return extra


def _status_and_metrics_dirs(given: GivenArgs) -> None:
    """The directory each rank reports what it built into (read after start-up and at
    /farskip/info), and, with --enable-metrics, the metrics directory before the plugins load
    (_metrics_dir_first says why)."""
    status_dir = tempfile.mkdtemp(prefix="sglang-farskip-status-")
    os.environ[ENV_STATUS] = status_dir
    if "--enable-metrics" in given:
        _metrics_dir_first()


def _sglang_server_args(argv: list[str]):
    """SGLang's ServerArgs, resolved as its server would resolve them, after its plugins
    (ours among them) loaded: our hooks change what SGLang derives (the MLA layout, for one)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sglang_farskip.serve import plugin

    load_plugins()
    if plugin.missing():
        raise UserError(
            f"the sglang_farskip plugin did not put in place {plugin.missing()} (SGLang swallowed the "
            "error; see the log above): reinstall with scripts/bootstrap.sh or `pip install --no-deps -e .`; "
            "after an SGLang upgrade run `python -m sglang_farskip.boundary check`"
        )
    try:
        server_args = prepare_server_args(argv)
    except SystemExit as e:  # argparse already printed the problem
        raise UserError(f"invalid SGLang arguments (exit {e.code}); see the message above") from None
    try:
        server_args.resolve_once()
    except (ValueError, AssertionError) as e:
        raise UserError(f"SGLang rejected the arguments: {e}") from None
    return server_args


def _refuse_what_farskip_cannot_run(server_args, config: dict, farskip: FarSkipConfig,
                                    opts: RuntimeOptions, on_cpu: bool) -> None:
    """The settings, as SGLang resolved them, that would run wrongly or unchecked: refused
    here, before any process starts (docs/serving.md, "What the launcher refuses")."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_farskip.parallel import unsupported, uses_side_stream

    resolved = resolving_view(server_args)
    _check_mla_layout(server_args, config)
    if on_cpu:
        from sglang_farskip.cpu import pd

        pd.check(resolved)
    from sglang_farskip.serve.kv_transfer import require_transfer_engine

    require_transfer_engine(resolved)
    _refuse_unchecked(resolved, opts)
    if (getattr(resolved, "tokenizer_worker_num", 1) or 1) > 1:
        raise UserError(
            "--tokenizer-worker-num above 1 starts HTTP workers that SGLang runs without its API-key "
            "check and without this launcher's request checks: leave it at 1"
        )
    prefill_backend = getattr(resolved, "prefill_attention_backend", None) or resolved.attention_backend
    if opts.cpu_attention == "mha" and prefill_backend != "torch_native":
        raise UserError(
            f"--farskip-cpu-attention mha runs with the torch_native attention backend only, not "
            f"{prefill_backend!r}: drop --attention-backend/--prefill-attention-backend, or the flag"
        )
    if farskip.enabled and opts.mode is not FarSkipMode.OFF:
        overlap = opts.mode.own_communicator
        problems = unsupported(resolved, overlap=overlap,
                               side_stream=overlap and uses_side_stream(resolved, opts),
                               gpu_profiling=bool(opts.profile_dir) and not on_cpu)
        if problems:
            raise UserError("FarSkip cannot run with these settings:\n  " + "\n  ".join(problems))


# What each --farskip-allow-unchecked name (options.UNCHECKED) lets through, as said to the user.
UNCHECKED_CONSEQUENCES = {
    "rust-server": "serves the API from Rust, without this launcher's key rules and request checks",
    "grpc": "serves gRPC, which checks no API key and none of the requests",
    "custom-logit-processor": "runs code any key holder sends in a request",
}


def _unchecked_features(resolved) -> dict[str, str]:
    """{--farskip-allow-unchecked name: the setting that turns it on} for this launch:
    - rust-server: SGLANG_RUST_SERVER=1 makes the scheduler serve the API from Rust threads
      instead of SGLang's Python HTTP server (http_server.launch_server), where the hooks on the
      key middleware (serve/admin.py) and the request checks (serve/admission.py) live;
    - grpc: --grpc-port (or SGLANG_GRPC_PORT) opens SGLang's native gRPC server beside HTTP, and
      --smg-grpc-mode (--grpc-mode) serves gRPC instead: no API key there, no request checks;
    - custom-logit-processor: --enable-custom-logit-processor lets a request carry a pickled
      (dill) processor that the scheduler loads and calls."""
    from sglang.srt.environ import envs

    found = {}
    if envs.SGLANG_RUST_SERVER.get():
        found["rust-server"] = "SGLANG_RUST_SERVER=1"
    grpc = [f"--grpc-port {resolved.grpc_port}" if getattr(resolved, "grpc_port", None) is not None else "",
            "--smg-grpc-mode" if getattr(resolved, "smg_grpc_mode", False) else "",
            "--grpc-mode" if getattr(resolved, "grpc_mode", False) else ""]
    if any(grpc):
        found["grpc"] = " ".join(filter(None, grpc))
    if getattr(resolved, "enable_custom_logit_processor", False):
        found["custom-logit-processor"] = "--enable-custom-logit-processor"
    return found


def _refuse_unchecked(resolved, opts: RuntimeOptions) -> None:
    """Refuses each feature that bypasses the keys or the checks unless the operator named it."""
    features = _unchecked_features(resolved)
    refused = [name for name in features if name not in opts.allow_unchecked]
    if refused:
        said = "; ".join(f"{features[name]} {UNCHECKED_CONSEQUENCES[name]}" for name in refused)
        raise UserError(f"{said}: remove it, or accept that with --farskip-allow-unchecked {','.join(refused)}")
    for name, setting in features.items():
        logger.warning("%s %s (allowed by --farskip-allow-unchecked %s)", setting,
                       UNCHECKED_CONSEQUENCES[name], name)


def _launch_info(server_args, given: GivenArgs, own: argparse.Namespace, model_path: str,
                 farskip: FarSkipConfig, weight_format: str, opts: RuntimeOptions, on_cpu: bool) -> dict:
    """What this launch decided: logged checks after start-up use it, GET /farskip/info serves it."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_farskip.models.status import pd_role

    resolved = resolving_view(server_args)
    return {
        "model_path": model_path,
        "demo": "--model-path" not in given,
        "served_model_name": resolved.served_model_name,
        "device": "cpu" if on_cpu else resolved.device,
        "farskip": farskip.to_hf_keys(),
        "weight_format": weight_format,
        "requested_mode": opts.mode.value if farskip.enabled else "off",
        "options": json.loads(opts.to_json()),
        "tp_size": resolved.tp_size,
        "ep_size": resolved.ep_size,
        "attn_dp_size": resolved.attn_dp_size or 1,  # DP attention (--dp with --enable-dp-attention)
        # Prefill/decode disaggregation: "prefill", "decode", or "none" (one server does both).
        "pd_role": pd_role(resolved.disaggregation_mode),
        "nnodes": resolved.nnodes,
        "node_rank": resolved.node_rank,
        "ready_timeout_s": own.farskip_ready_timeout,
    }


def check_weight_format(config: dict, model_path: str, given: "GivenArgs", on_cpu: bool) -> str:
    """"bf16" or "fp8" (DeepSeek's block FP8, sglang_farskip.formats.fp8); refuses what would load wrongly
    or fail deep inside SGLang."""
    fmt = fp8.weight_format(config)
    dtype = given.get("--dtype") or "auto"
    if fmt == "fp8":
        problem = fp8.fused_projection_problem(config)
        if problem:
            raise UserError(f"{model_path}: {problem}; requantize a bf16 copy with a q_lora_rank "
                            f"that is a multiple of {fp8.BLOCK}, or serve it in bf16")
        cpu_ok = ("auto", "bfloat16")  # SGLang's CPU MLA path is bf16 (forward_mla.py ~563)
        if dtype in ("float32", "float") or (on_cpu and dtype not in cpu_ok):
            raise UserError(f"--dtype {dtype} with a block-FP8 checkpoint: FP8 weights compute in "
                            f"bfloat16{' on CPU' if on_cpu else ' or float16'}: pass --dtype bfloat16")
    quantization = given.get("--quantization")
    if on_cpu and quantization and not (quantization == "fp8" and fmt == "fp8"):
        raise UserError(f"--quantization {quantization} on CPU: SGLang quantizes on CPU only with AMX "
                        "kernels this install does not have; requantize the checkpoint with "
                        "`python -m sglang_farskip.formats.quantize` and serve that without --quantization")
    return fmt


def _check_mla_layout(server_args, config: dict) -> None:
    """SGLang picks the KV-cache layout from the architecture name; for Instella our plugin's
    hook must have made it MLA, or the cache would be laid out per head and the model garbage."""
    if checkpoint.architecture(config) != checkpoint.INSTELLA_ARCH:
        return
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.configs.model_config import AttentionArch

    model_config = model_config_of(server_args)
    if model_config.attention_arch != AttentionArch.MLA:
        raise UserError(
            f"SGLang derived a {model_config.attention_arch} KV-cache layout for {checkpoint.INSTELLA_ARCH}: "
            "the sglang_farskip MLA hook is not active (see the log above for 'Failed to apply hooks'); "
            "reinstall with scripts/bootstrap.sh"
        )
    logger.info("%s: MLA KV cache, latent %d + rope %d", checkpoint.INSTELLA_ARCH,
                model_config.kv_lora_rank, model_config.qk_rope_head_dim)


def _reexec_for_cpu_device(argv: list[str]) -> None:
    """`--device cpu` on a machine with a GPU: start again with SGLANG_USE_CPU_ENGINE=1 set
    before SGLang is imported (GivenArgs explains why)."""
    from sglang_farskip.cpu.environment import cpu_base_environment, is_cpu_run

    if is_cpu_run() or not _gpu_present():
        return
    own, rest = _split_own_flags(argv)
    if _device(GivenArgs(rest), gpu=True) == "cpu":
        logger.info("--device cpu on a machine with a GPU: restarting the launcher as a CPU run")
        env = {**os.environ, **cpu_base_environment()}
        os.execve(sys.executable, [sys.executable, "-m", "sglang_farskip.serve.launcher", *argv], env)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _reexec_for_cpu_device(argv)
        server_args, info = prepare(argv)
    except UserError as e:
        return fail(e)

    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    from sglang.srt.entrypoints.http_server import app

    from sglang_farskip import boundary, options
    from sglang_farskip.serve import admission, admin

    resolved = resolving_view(server_args)
    status_dir = os.environ[ENV_STATUS]
    _add_info_route(status_dir, info)
    # The HTTP process's rows of the boundary table: request admission and the admin key. Before
    # SGLang starts serving: it decides then whether to install its key middleware.
    admission.configure(options.current())
    boundary.install("http")
    boundary.apply()
    if boundary.missing("http"):
        return fail(UserError(
            f"could not hook SGLang's HTTP server at {boundary.missing('http')} (see 'Failed to apply "
            "hooks' above): this sglang_farskip supports sglang 0.5.23 only; after an SGLang upgrade run "
            "`python -m sglang_farskip.boundary check`"))
    admin_routes = admin.admin_routes(app)
    logger.info("%d admin routes need the admin key (%s): %s", len(admin_routes),
                "set" if resolved.admin_api_key else "none set, so they answer 403",
                " ".join(admin_routes))
    if info["node_rank"] == 0:
        host = "127.0.0.1" if resolved.host in ("0.0.0.0", "::") else resolved.host
        base_url = f"http://{host}:{resolved.port}"
        payload = json.dumps({"prompt": "The capital of France is", "max_tokens": 16,
                              "temperature": 0, "stream": True})
        curl = f"curl -N {base_url}/v1/completions -H 'Content-Type: application/json' -d '{payload}'"
        ranks_here = max(1, info["tp_size"] // max(1, info["nnodes"]))
        threading.Thread(
            target=_wait_ready_and_verify,
            args=(base_url, status_dir, ranks_here, info["ready_timeout_s"], curl),
            daemon=True,
        ).start()
    try:
        launch_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
