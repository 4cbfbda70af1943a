"""One-GPU check of FarSkip's GPU overlap path: what one GPU can settle, in one short run.

    python bench/device_check.py [--items side-stream,breakable,...] [--keep DIR]

Run it first on any lent GPU. Estimated 5 minutes on one H200, most of it four server
start-ups (an estimate: no GPU has been lent yet, so it has never run).
It prints one PASS/FAIL line per item and a summary, and exits 1 if any item failed.

side-stream  FarSkip's own NCCL communicator (`comm.nccl_all_reduce_`, one rank) driven through
             the real `SideStreamAllReduce` and `Communicator`, wrapped in the fork/join probe
             (double, sleep, reduce, halve): at one rank the sum is the identity, so only the
             probe makes a missing fork or join give wrong numbers. Eager; full CUDA graphs
             captured at batch 1, 3 and 64 and replayed in shuffled order; eager and graph use
             interleaved on the one communicator and event ring. Bitwise against plain compute.
breakable    SGLang's breakable CUDA graph (its default prefill graph on CUDA): launch, graph
             break (as attention makes), wait. The capture is cut at every attention while the
             routed sum is still in flight, and waiting for it after the attention means
             waiting in the next segment, which CUDA refuses; so under a breakable graph the
             model joins that sum before the attention. `join` (that schedule) must replay
             bitwise equal to eager; `across` (waited in the next segment, the schedule the
             model had before) runs in a process of its own, since it may leave the CUDA
             context unusable, and is only reported.
memory       Device memory NCCL keeps for the side communicator: taken by `warm_up` (which the
             model runs before SGLang sizes the KV pool), and nothing more at the first real
             58.7 MB all-reduce (a 4096-token DeepSeek-V3 prefill) afterwards. NCCL allocates
             its buffers at a message size's first use; if that came at the first big prefill,
             after SGLang had given the free memory to the KV pool, the prefill could run out.
priority     Stream priority against DeepSeek-V3-shaped GEMMs: how long a small kernel on a
             normal- and on a high-priority side stream waits behind them, and how much the
             GEMMs slow down. The side stream has the highest priority so that its all-reduce
             kernels are scheduled ahead of queued compute blocks instead of waiting for the
             GEMMs they should overlap; this measures whether priority does that on this GPU.
             PASS if high priority is not slower.
server       SGLang end to end at TP=1 on a 3-layer DeepSeek-V3-shaped FP8-block model
             (hidden 7168, 256 experts, dummy weights): sync; overlap with the side stream forced
             at one rank (test-only config key, probe on); `blocking` (the same side stream,
             each all-reduce joined at its launch); overlap with --disable-cuda-graph;
             overlap with breakable prefill graphs. Prompts of 1, 100 and 4096 tokens (4096 is
             two 2048-token chunks), a 4096-token cached prefix longer than the chunk, decode at
             batch 1, 3 (padded to a graph of 4) and 64. Overlap must equal sync, and blocking
             overlap, bitwise (same graphs, same kernels); eager and breakable variants must match within LOGPROB_TOL.
             Each server runs the workload twice (prefix cache flushed between) and must repeat
             its own bits, else a bitwise check would say nothing. Triton FP8 kernels, not
             DeepGEMM, unless --deepgemm (its cold-cache precompilation takes minutes).

Importable without a GPU: tests/test_gpu_readiness.py checks the checkpoint config, the
workload and the comparisons on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from overlap_bench import free_port  # noqa: E402

from sglang_farskip.launch_server import wait_healthy  # noqa: E402

HIDDEN = 7168
VOCAB = 129280
CHUNK = 2048  # --chunked-prefill-size of the servers: the 4096-token prompt is two chunks
# Graph vs eager (and breakable vs eager prefill) run different kernels or padded shapes, so
# their logprobs differ by rounding. Dummy weights (uniform +-1e-3) give near-uniform logits
# around -ln(VOCAB) = -11.77, where bf16 rounding of a logit is ~0.03; 0.1 nats is a few
# roundings and far below what a wrong sum (a partial doubled, halved or missing) does.
LOGPROB_TOL = 0.1
ITEMS = ("side-stream", "breakable", "memory", "priority", "server")


# ------------------------------------------------------------------ checkpoint and workload
def v3_config(num_layers: int = 3) -> dict:
    """DeepSeek-V3's shapes (config.json of deepseek-ai/DeepSeek-V3) with `num_layers` layers,
    the first dense, as a FarSkip checkpoint: every layer converted."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": HIDDEN, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": num_layers, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "vocab_size": VOCAB, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "ep_size": 1, "initializer_range": 0.02, "use_cache": True,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
        "farskip": True,
    }


def write_checkpoint(path: Path) -> Path:
    """config.json only: the servers load `--load-format dummy` weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(v3_config(), indent=1))
    return path


def workload(seed: int = 0) -> list[tuple[str, list[list[int]], int]]:
    """(case, prompts sent as one batch, new tokens), in the order sent; "prefix>chunk" reuses
    the 4096-token prompt just cached, so its cached prefix is longer than a chunk."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    long_prompt = ids(4096)
    return [
        ("prompt-1", [ids(1)], 8),
        ("prompt-100", [ids(100)], 8),
        ("prompt-4096", [long_prompt], 8),
        ("prefix>chunk", [long_prompt + ids(64)], 8),
        ("decode-bs1", [ids(16)], 32),
        ("decode-bs3", [ids(16) for _ in range(3)], 32),
        ("decode-bs64", [ids(16) for _ in range(64)], 32),
    ]


# One sequence's output: {"ids": [...], "logprobs": [...], "top": [[(logprob, id), ...], ...]}
def compare(a: dict, b: dict, tol: float) -> list[str]:
    """Differences between two runs' outputs {case: [sequence, ...]}; empty if they agree.
    tol == 0: token ids and logprobs bit-equal. tol > 0: logprobs within tol while the tokens
    agree; a first differing token is accepted only as a near-tie (the other run's token was
    within tol of the chosen one in this run's top logprobs), and the sequences end there."""
    problems = []
    for case in a:
        for i, (x, y) in enumerate(zip(a[case], b[case])):
            where = f"{case}[{i}]"
            if tol == 0:
                if x["ids"] != y["ids"] or x["logprobs"] != y["logprobs"]:
                    problems.append(f"{where}: not bit-identical")
                continue
            for t, (ix, iy) in enumerate(zip(x["ids"], y["ids"])):
                if ix != iy:
                    alt = dict((tok, lp) for lp, tok in x["top"][t])
                    if iy not in alt or x["logprobs"][t] - alt[iy] > tol:
                        problems.append(f"{where}: token {t} differs ({ix} vs {iy}) and is no near-tie")
                    break
                if abs(x["logprobs"][t] - y["logprobs"][t]) > tol:
                    problems.append(f"{where}: token {t} logprob {x['logprobs'][t]:.4f} vs "
                                    f"{y['logprobs'][t]:.4f}")
                    break
    return problems


SERVER_COMMON = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--tp-size", "1",
    "--chunked-prefill-size", str(CHUNK), "--cuda-graph-bs-decode", "1", "4", "64",
    "--mem-fraction-static", "0.7",
]
FORCE_SIDE = ["--farskip-gpu-overlap", "--farskip-test-force-side-stream"]
SERVER_VARIANTS = {
    # prefill graphs off in both: the launcher turns them off for GPU overlap by default.
    "sync": ["--farskip-mode", "sync", "--cuda-graph-backend-prefill", "disabled"],
    "overlap": FORCE_SIDE,
    # the same side communicator, each all-reduce joined at its launch: overlap's A/B partner
    "blocking": [*FORCE_SIDE, "--farskip-mode", "blocking"],
    "overlap-eager": [*FORCE_SIDE, "--disable-cuda-graph"],
    "overlap-breakable": [*FORCE_SIDE, "--cuda-graph-backend-prefill", "breakable",
                          "--cuda-graph-bs-prefill", "128", "512", str(CHUNK)],
}
# (variant, reference, tolerance)
SERVER_CHECKS = [("overlap", "sync", 0.0), ("blocking", "overlap", 0.0),
                 ("overlap-eager", "overlap", LOGPROB_TOL),
                 ("overlap-breakable", "overlap", LOGPROB_TOL)]


def server_argv(model_path: str, variant: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang_farskip.launch_server", "--model-path", model_path,
            "--port", str(port), *SERVER_COMMON, *SERVER_VARIANTS[variant]]


def summary(results: list[tuple[str, bool, str]]) -> tuple[str, bool]:
    lines = [f"{'PASS' if ok else 'FAIL'} {name}: {detail}" for name, ok, detail in results]
    passed = sum(ok for _, ok, _ in results)
    lines.append(f"SUMMARY {passed}/{len(results)} passed"
                 + ("" if passed == len(results) else ": " + ", ".join(n for n, ok, _ in results if not ok)))
    return "\n".join(lines), passed == len(results)


# ------------------------------------------------------------------ GPU items
def _side_comm(dev, probe: bool = True):
    import torch  # noqa: F401

    from sglang_farskip.comm import (Communicator, SideStreamAllReduce, fork_join_probe,
                                     nccl_all_reduce_)

    class OneRank:
        world_size = 1

    all_reduce_ = nccl_all_reduce_(None, dev)
    side = SideStreamAllReduce(fork_join_probe(all_reduce_) if probe else all_reduce_, device=dev)
    comm = Communicator(OneRank(), asynchronous=True, side_stream=side)
    assert comm.backend == "side-stream", comm.backend
    return comm, side


def _step(comm, x, w, join_before=None):
    """What a FarSkip layer does: a partial made on the main stream (after a stall, so it is
    still being written when the launch is enqueued), its sum in flight while other compute
    runs, waited right before the add."""
    import torch

    torch.cuda._sleep(1_000_000)
    p = x @ w
    h = comm.start_all_reduce(p, lane="routed")
    if join_before is not None:
        h.join()
        join_before()
    y = torch.tanh(x @ w.t())
    return y + h.wait()


def _plain(x, w):
    import torch

    return torch.tanh(x @ w.t()) + x @ w


def item_side_stream(dev) -> tuple[bool, str]:
    import torch

    comm, side = _side_comm(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) / 64
    inputs = {bs: torch.randn(bs, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) for bs in (1, 3, 64)}
    want = {bs: _plain(x, w) for bs, x in inputs.items()}
    bad = []
    for bs, x in inputs.items():
        if not torch.equal(_step(comm, x, w), want[bs]):
            bad.append(f"eager bs{bs}")
    graphs, outs, pool = {}, {}, torch.cuda.graph_pool_handle()
    warm = torch.cuda.Stream(device=dev)
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for bs, x in inputs.items():
            _step(comm, x, w)
    torch.cuda.current_stream().wait_stream(warm)
    for bs, x in inputs.items():
        graphs[bs] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bs], pool=pool):
            outs[bs] = _step(comm, x, w)
    order = [bs for bs in inputs for _ in range(4)]
    random.Random(0).shuffle(order)
    for n, bs in enumerate(order):
        graphs[bs].replay()
        if n % 3 == 0:  # eager use of the same communicator between replays
            if not torch.equal(_step(comm, inputs[bs], w), want[bs]):
                bad.append(f"interleaved eager bs{bs}")
        torch.cuda.synchronize()
        if not torch.equal(outs[bs], want[bs]):
            bad.append(f"graph bs{bs} replay {n}")
    launches = len(inputs) * 2 + len(order) + len(order) // 3
    detail = (f"eager + graphs bs 1/3/64, {len(order)} shuffled replays, ring of {len(side.events)} "
              f"events reused over {launches}+ launches")
    return (not bad, detail if not bad else "wrong numbers: " + ", ".join(bad[:6]))


def _breakable(dev, join: bool):
    """(eager result, replayed result) of launch / graph break / wait under SGLang's breakable
    capture; `join`: joined before the break, as the model does under a breakable graph."""
    import torch
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        BreakableCUDAGraph, BreakableCUDAGraphCapture, break_graph, enable_breakable_cuda_graph)

    comm, _ = _side_comm(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) / 64
    x = torch.randn(64, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)

    def body():
        if join:
            return _step(comm, x, w, join_before=break_graph)
        torch.cuda._sleep(1_000_000)
        h = comm.start_all_reduce(x @ w, lane="routed")
        break_graph()  # attention: ends this segment, starts the next
        return torch.tanh(x @ w.t()) + h.wait()

    want = _plain(x, w)
    eager = body()
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(
            graph, pool=torch.cuda.graph_pool_handle(), stream=torch.cuda.Stream(device=dev)):
        out = body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return torch.equal(eager, want), torch.equal(out, want)


def item_breakable(dev) -> tuple[bool, str]:
    eager_ok, replay_ok = _breakable(dev, join=True)
    # The schedule before the fix may leave the CUDA context unusable: its own process.
    proc = subprocess.run([sys.executable, __file__, "--breakable-across"], capture_output=True,
                          text=True, timeout=120)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    across = next((line for line in reversed(tail) if line.startswith("ACROSS ")), None)
    across = across[len("ACROSS "):] if across else f"exit {proc.returncode}: {tail[-1] if tail else ''}"
    ok = eager_ok and replay_ok
    return ok, (f"join before the break: eager {'==' if eager_ok else '!='} plain, replay "
                f"{'==' if replay_ok else '!='} plain; waited across the break (pre-fix): {across}")


def breakable_across_main() -> int:
    import torch

    try:
        eager_ok, replay_ok = _breakable(torch.device("cuda:0"), join=False)
        print(f"ACROSS captured; eager {'==' if eager_ok else '!='} plain, replay "
              f"{'==' if replay_ok else '!='} plain", flush=True)
    except Exception as e:  # noqa: BLE001 - the outcome is what is reported
        print(f"ACROSS capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    return 0


def item_memory(dev) -> tuple[bool, str]:
    import torch

    comm, side = _side_comm(dev, probe=False)
    mib = 2**20
    kept = side.warm_up([HIDDEN, 256 * HIDDEN, 4096 * HIDDEN], torch.bfloat16)
    t = torch.ones(4096, HIDDEN, device=dev, dtype=torch.bfloat16)  # 58.7 MB
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(dev)[0]
    out = comm.start_all_reduce(t).wait()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    later = free_before - torch.cuda.mem_get_info(dev)[0]
    ok = abs(later) <= 2 * mib and bool(torch.equal(out, torch.ones_like(out)))
    return ok, f"warm-up kept {kept / mib:.1f} MiB; the first 58.7 MB all-reduce after it {later / mib:+.1f} MiB (bound 2 MiB)"


def item_priority(dev) -> tuple[bool, str]:
    import torch

    g = torch.Generator(device=dev).manual_seed(2)
    # DeepSeek-V3 prefill (4096 tokens) shapes: MLA q_b / o_proj-like and a dense MLP GEMM.
    a = torch.randn(4096, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(HIDDEN, 18432, device=dev, dtype=torch.bfloat16, generator=g)
    small = torch.randn(256, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)  # decode-sized AR
    main = torch.cuda.current_stream()

    def run(side):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        ev[0].record(main)
        for _ in range(8):
            a @ b
        ev[1].record(main)
        ready = torch.cuda.Event()
        for i in range(8):
            a @ b
            if i == 1 and side is not None:
                ready.record(main)
        if side is not None:
            side.wait_event(ready)
            with torch.cuda.stream(side):
                ev[2].record()
                small.add_(1).sub_(1)
                ev[3].record()
        ev[4].record(main)
        torch.cuda.synchronize()
        gemm_ms = ev[1].elapsed_time(ev[4]) if side is not None else ev[0].elapsed_time(ev[1])
        return gemm_ms / 8, ev[2].elapsed_time(ev[3]) if side is not None else None

    run(None)
    base, _ = run(None)
    lo, hi = torch.cuda.Stream.priority_range()
    normal = [run(torch.cuda.Stream(device=dev, priority=lo)) for _ in range(3)][-1]
    high = [run(torch.cuda.Stream(device=dev, priority=hi)) for _ in range(3)][-1]
    ok = high[1] <= normal[1] * 1.1 + 0.05
    return ok, (f"side kernel behind GEMMs: normal priority {normal[1]:.3f} ms, high {high[1]:.3f} ms; "
                f"GEMM {base:.3f} ms alone, {normal[0]:.3f} / {high[0]:.3f} ms with the side kernel")


# ------------------------------------------------------------------ end to end
def _post(url: str, payload: dict, timeout: float = 300) -> object:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _sequence(reply: dict) -> dict:
    meta = reply["meta_info"]
    return {"ids": reply["output_ids"],
            "logprobs": [lp for lp, _tok, *_ in meta["output_token_logprobs"]],
            "top": [[(lp, tok) for lp, tok, *_ in top] for top in meta["output_top_logprobs"]]}


# DeepGEMM's start-up precompilation of every FP8 shape takes minutes on a cold cache; the
# servers use SGLang's Triton FP8 kernels instead (--deepgemm to keep DeepGEMM). What is checked
# is FarSkip's streams, not the GEMM library.
NO_DEEPGEMM = {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}


def run_workload(base: str) -> dict:
    out = {}
    for case, prompts, new in workload():
        replies = _post(base + "/generate", {
            "input_ids": prompts if len(prompts) > 1 else prompts[0],
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2,
        })
        out[case] = [_sequence(r) for r in (replies if isinstance(replies, list) else [replies])]
    return out


def serve_and_run(model_path: str, variant: str, log_dir: Path, env: dict,
                  start_timeout: float = 300) -> tuple[dict, bool]:
    """The workload's outputs on one server, and whether a second run (prefix cache flushed
    in between) gave the same bits: without that, bitwise checks between servers mean nothing."""
    port = free_port()
    log = open(log_dir / f"server-{variant}.log", "w")
    proc = subprocess.Popen(server_argv(model_path, variant, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(base, start_timeout, alive=lambda: proc.poll() is None):
            state = f"exited {proc.returncode}" if proc.poll() is not None else f"not ready in {start_timeout:.0f} s"
            raise RuntimeError(f"server {variant} {state}; see {log.name}")
        first = run_workload(base)
        urllib.request.urlopen(urllib.request.Request(base + "/flush_cache", method="POST"), timeout=60).read()
        return first, not compare(first, run_workload(base), 0.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def item_server(log_dir: Path, deepgemm: bool = False) -> tuple[bool, str]:
    ckpt = write_checkpoint(log_dir / "v3-shaped")
    runs, timings, unstable = {}, [], []
    for variant in SERVER_VARIANTS:
        t0 = time.monotonic()
        runs[variant], stable = serve_and_run(str(ckpt), variant, log_dir, {} if deepgemm else NO_DEEPGEMM)
        timings.append(f"{variant} {time.monotonic() - t0:.0f} s")
        if not stable:
            unstable.append(variant)
    problems = [f"{v}: two runs on one server differ (nondeterministic kernels)" for v in unstable]
    for variant, ref, tol in SERVER_CHECKS:
        problems += [f"{variant} vs {ref}: {p}" for p in compare(runs[variant], runs[ref], tol)]
    (log_dir / "server-outputs.json").write_text(json.dumps(runs))
    checks = "; ".join(f"{v} {'==' if t == 0 else '~'} {r}" for v, r, t in SERVER_CHECKS)
    return not problems, (f"{checks} over {len(workload())} cases ({', '.join(timings)})"
                          if not problems else "; ".join(problems[:5]))


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated subset of {ITEMS}")
    parser.add_argument("--keep", default=None, help="directory for server logs and outputs (default: temporary)")
    parser.add_argument("--deepgemm", action="store_true",
                        help="servers keep DeepGEMM (its cold-cache precompilation takes minutes)")
    parser.add_argument("--breakable-across", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.breakable_across:
        return breakable_across_main()
    items = [i for i in args.items.split(",") if i]
    unknown = [i for i in items if i not in ITEMS]
    if unknown:
        print(f"error: unknown item(s) {unknown}: choose from {', '.join(ITEMS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA/HIP device visible: run this on a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # same GEMM bits on every stream
    dev = torch.device("cuda:0")
    log_dir = Path(args.keep or tempfile.mkdtemp(prefix="farskip-device-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; logs in {log_dir}", flush=True)
    runners = {"side-stream": lambda: item_side_stream(dev), "breakable": lambda: item_breakable(dev),
               "memory": lambda: item_memory(dev), "priority": lambda: item_priority(dev),
               "server": lambda: item_server(log_dir, args.deepgemm)}
    results = []
    t_all = time.monotonic()
    for name in items:
        t0 = time.monotonic()
        try:
            ok, detail = runners[name]()
        except Exception as e:  # noqa: BLE001 - one item's crash is that item's FAIL
            traceback.print_exc()
            ok, detail = False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        results.append((name, ok, f"{detail} [{time.monotonic() - t0:.0f} s]"))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {results[-1][2]}", flush=True)
    text, all_ok = summary(results)
    print(text.splitlines()[-1] + f" in {time.monotonic() - t_all:.0f} s", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
