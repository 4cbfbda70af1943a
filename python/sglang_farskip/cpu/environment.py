"""SGLang 0.5.23 on a CPU without AMX: environment, defaults, and two upstream gaps.

Upstream gaps (fixed at plugin load, in every SGLang process, see serve/plugin.py):
1. DeepSeek MLA prefill with --attention-backend torch_native: the backend registry has no
   torch_native entry, falls back to the triton handler, which picks the MHA prefill path whose
   k/v head sizes do not match torch_native's compressed MLA KV cache (RuntimeError in
   torch_native_backend.py). cpu/attention.py registers a torch_native handler (absorbed MLA for
   every batch by default) and a backend subclass that also runs the MHA prefill paths
   (`--farskip-cpu-attention mha`).
2. --ep-size > 1 with the native CPU MoE: topk ids of experts owned by another EP rank arrive
   as -1 and `moe_forward_native` indexes with them (index -1 out of bounds). We run upstream's
   function once per top-k slot on the tokens whose expert is local, so foreign slots
   contribute nothing and upstream's expert math (activation, biases) is reused unchanged.
3. Speculative decoding (NGRAM, EAGLE): target verify and EAGLE's draft decode on torch_native,
   and a CUDA-only synchronize in the NextN draft's set-up (cpu/spec.py); the kernel-package
   ops those paths call have twins in the sgl_kernel stand-in.
4. DeepSeek's block-FP8 checkpoints: upstream serves them on CPU only with AMX kernels;
   cpu/fp8.py installs torch-native FP8 linear and MoE methods where those are missing.
5. PD disaggregation: a CUDA-only call in the prefill server's KV send (cpu/pd.py, which also
   holds the environment a PD server needs on CPU).

And one start-up cost: SGLang starts its workers (schedulers, detokenizer, DP controller) with
multiprocessing's "spawn" (`engine._set_envs_and_config`), because a forked process cannot use
CUDA. Each spawned worker imports SGLang again, about 20 CPU-seconds here, which is most of a
CPU server's start. On CPU they are forked from the launcher, which has imported SGLang, the
plugin and its hooks already (`--farskip-cpu-start-method spawn` restores upstream's way).
Forking is safe here because nothing but the main thread computes in the launcher before SGLang
starts its workers (before the tokenizer manager and the HTTP server), and torch is kept on one
thread there (`one_thread_until_workers_start`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import warnings

import torch

logger = logging.getLogger("sglang_farskip.cpu")

# The CPU KV cache otherwise takes a large share of RAM and startup time.
DEFAULT_MAX_TOTAL_TOKENS = "16384"


def is_cpu_run() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def stand_in_kernels() -> bool:
    """True if `sgl_kernel` is this project's raising stand-in (no real CPU build here)."""
    try:
        import sgl_kernel
    except ImportError:
        return False
    return bool(getattr(sgl_kernel, "IS_FARSKIP_CPU_STAND_IN", False))


def cpu_base_environment() -> dict[str, str]:
    """What SGLang's CPU engine needs before any SGLang module is imported (they read it then)."""
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        # torch's CUDA build bundles NCCL; SGLang then builds a pynccl communicator on CPU
        # tensors and fails. A path that does not exist makes it skip pynccl.
        "SGLANG_NCCL_SO_PATH": "/nonexistent/sglang-farskip-no-nccl-on-cpu/libnccl.so",
        "PYTHONWARNINGS": _noise_pythonwarnings(),
        # SGLang refuses to start ranks whose free "device" memory differs by over 10%; on CPU
        # that is the host's free RAM, which any other process changes between two ranks'
        # readings (a two-node start failed so beside other servers here). A warning then.
        "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
    }


def cpu_environment(ranks_on_this_node: int, cores: int) -> dict[str, str]:
    """Environment SGLang's CPU engine needs; callers apply it with setdefault semantics."""
    env = cpu_base_environment()
    # One core set per rank, "0|1" style; SGLang asserts it is set when TP > 1 and pins
    # each rank's OpenMP threads to its set. Ranks beyond the cores go round the cores again
    # (TP=4 on 2 cores: "0|1|0|1"): piling them all on the last core left one core idle
    # while three ranks queued on the other.
    per_rank = max(1, cores // max(1, ranks_on_this_node))
    sets = []
    for r in range(ranks_on_this_node):
        first = (r * per_rank) % cores
        last = min(first + per_rank - 1, cores - 1)
        sets.append(str(first) if first == last else f"{first}-{last}")
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(sets)
    if ranks_on_this_node > 1:
        # Oversubscribed OpenMP threads across ranks made TP=2 about 3x slower here.
        env["OMP_NUM_THREADS"] = str(per_rank)
    if not _cxx_compiler():
        # SGLang torch.compiles some of its CPU math (the MoE router's top-k, sampling helpers)
        # and inductor builds it with a C++ compiler at the first forward: without one every
        # server died there (InvalidCxxCompiler), e.g. on a fresh Debian without g++. Run those
        # functions eagerly instead: the same math, as the test servers run it.
        logger.warning("no C++ compiler (%s) on PATH: SGLang's torch.compile'd CPU functions run "
                       "eagerly (TORCHDYNAMO_DISABLE=1); apt-get install g++ to compile them",
                       os.environ.get("CXX") or "g++")
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def _cxx_compiler() -> str | None:
    """The compiler inductor would use on CPU (torch/_inductor/config.py: $CXX, else g++)."""
    return shutil.which(os.environ.get("CXX") or "g++")


def cpu_default_args() -> list[tuple[str, str | None]]:
    """(flag, value) pairs the launcher adds on CPU unless the user gave the flag (value None:
    a switch)."""
    return [
        ("--device", "cpu"),
        ("--attention-backend", "torch_native"),
        ("--max-total-tokens", DEFAULT_MAX_TOTAL_TOKENS),
        # An idle scheduler otherwise polls its sockets without pause and holds a whole core
        # (93% here, measured with top); with it, it waits in zmq's poll and wakes on a request.
        ("--sleep-on-idle", None),
    ]


# What SGLang prints on every CPU start that says nothing about this run: its model registry
# imports every model module and logs each one whose CUDA-only dependency is missing (none is
# a model served here: the FarSkip classes are registered by this package and the launcher
# checks that), and its GPU-only quantization and kernel modules warn at import. Real warnings
# and errors, including those of the same loggers, are kept.
_NOISE_LOG_PREFIXES = {
    "sglang.srt.models.registry": "Ignore import error when loading sglang.srt.models.",
    "sglang.kernels.jit.utils.arch": "Cannot detect CUDA architecture",
}
# (message start, module): also as PYTHONWARNINGS (cpu_environment), because SGLang's worker
# processes import these modules before they load any plugin.
_NOISE_WARNINGS = (
    ("Only CUDA, HIP and XPU support AWQ", "sglang.srt.layers.quantization.awq.awq"),
    ("Only CUDA, MUSA and NPU support GGUF", "sglang.srt.layers.quantization.gguf"),
    ("Triton is not supported on current platform", "sglang.kernels.ops.attention.fla.utils"),
)


def _noise_pythonwarnings() -> str:
    # PYTHONWARNINGS separates filters with commas and fields with colons: a message is given
    # by its start up to the first comma (a prefix is what the field matches anyway).
    return ",".join(f"ignore:{message.split(',')[0]}:UserWarning:{module}"
                    for message, module in _NOISE_WARNINGS)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_quieted = False


def quiet_known_cpu_noise() -> None:
    """On a CPU run, drop the messages above. Called when the plugin module is imported, which
    SGLang does in each of its processes before the imports that print them. Idempotent."""
    global _quieted
    if _quieted or not is_cpu_run():
        return
    _quieted = True
    for name, prefix in _NOISE_LOG_PREFIXES.items():
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    for message, module in _NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning,
                                module=re.escape(module))


_applied = False


def apply_cpu_fixes() -> None:
    """Install the table's "cpu" rows (sglang_farskip/boundary/table.csv): the fixes above and
    the torch_native attention paths. Idempotent; harmless on GPU (they touch CPU-only code
    paths), but only called when SGLang runs on CPU."""
    global _applied
    if _applied:
        return
    from sglang_farskip import boundary

    if multiprocessing.parent_process() is None:  # the launching process (with SGLang's own CLI)
        one_thread_until_workers_start()
    boundary.install("cpu")
    _applied = True
    logger.info("sglang_farskip: CPU fixes applied (torch_native MLA dispatch and MHA prefill, "
                "speculative verify and draft decode, EP>1 native MoE, reduce-scatterv on gloo, "
                "torch-native block FP8, PD KV send without CUDA)")


# torch's thread count for SGLang's workers, saved when this process went down to one thread.
_worker_threads: int | None = None


def one_thread_until_workers_start() -> None:
    """Run torch on one thread in this (the launching) process, so that it never starts an
    OpenMP thread pool: a forked child inherits the pool's state but not its threads, and its
    first parallel op then waits for them forever (GNU libgomp is not fork-safe; PyTorch's
    DataLoader workers go down to one thread for the same reason). Forked workers get the count
    back that torch would have given a spawned one. Idempotent; the launcher calls it first
    thing on CPU, the plugin on load in a process that multiprocessing did not start."""
    global _worker_threads
    if _worker_threads is not None:
        return
    _worker_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    os.register_at_fork(after_in_child=lambda: torch.set_num_threads(_worker_threads))


def start_workers_as_chosen(result, server_args, *args, **kwargs):
    """AFTER upstream's "spawn" (see the module docstring): fork where that is safe."""
    from sglang_farskip import options

    method, why = options.current().cpu_start_method, "as asked"
    if method == "fork":
        if _worker_threads is None:
            method, why = "spawn", "torch may have run on several threads here (a fork could deadlock)"
        elif getattr(server_args, "numa_node", None) is not None:
            method, why = "spawn", "--numa-node binds each worker by putting numactl before its interpreter"
        else:
            why = f"from this process, which has imported SGLang; {_worker_threads} torch threads each"
    if method == "fork":
        multiprocessing.set_start_method("fork", force=True)
    logger.info("sglang_farskip: SGLang's CPU workers start by %s (%s)", method, why)
    return result


def native_moe_skipping_foreign_experts(original, layer, x, topk_output, moe_runner_config):
    """AROUND fused_moe_native.moe_forward_native (unquant.py and cpu/fp8.py look it up at call
    time): with EP > 1, the ids of other ranks' experts arrive as -1."""
    ids, weights, logits = topk_output.topk_ids, topk_output.topk_weights, topk_output.router_logits
    if not bool((ids < 0).any()):
        return original(layer, x, topk_output, moe_runner_config)
    # Upstream counts experts per token with a scatter that collapses repeated ids, so a
    # foreign slot cannot simply be pointed at a local expert. Run upstream once per top-k
    # slot instead (one id per token: no repeats), on the tokens whose slot is local.
    out = torch.zeros_like(x)  # [T, H]
    for j in range(ids.shape[1]):
        own = ids[:, j] >= 0  # [T]
        if not bool(own.any()):
            continue
        slot = topk_output._replace(
            topk_ids=ids[own, j : j + 1],  # [T_own, 1]
            topk_weights=weights[own, j : j + 1],
            router_logits=None if logits is None else logits[own],
        )
        out[own] += original(layer, x[own], slot, moe_runner_config).to(out.dtype)
    return out


def reduce_scatterv_without_pynccl(original, self, input_, output=None, sizes=None):
    """AROUND GroupCoordinator.reduce_scatterv. DP attention with EP (attention DP size = TP =
    EP) returns the MoE output with it (layers/layer_boundary/exit.py), and it insists on
    pynccl. A CPU run has none (cpu_base_environment points SGLang away from torch's bundled
    NCCL), so there it runs upstream's own rank-independent variant: all-reduce over the group,
    keep this rank's rows. Same sum, more bytes; CPU only."""
    pynccl = self.pynccl_comm
    if input_.device.type == "cpu" and (pynccl is None or not hasattr(pynccl, "device")):
        return self._deterministic_reduce_scatterv(input_, output, sizes)
    return original(self, input_, output, sizes)
