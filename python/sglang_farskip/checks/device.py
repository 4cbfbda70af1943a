"""One-GPU check of FarSkip's GPU overlap path: what one GPU can settle, in one short run.

    python -m sglang_farskip.checks.device [--items side-stream,breakable,...] [--keep DIR]

Needs SGLang (a GPU node where it is installed; python/sglang_farskip/checks/gpu.py is the check for a bare
machine). Estimated 12 minutes on one H200: the server item builds a ~10 GB checkpoint (about
2 minutes), starts seven servers (about a minute each) and runs the float32 reference; the
other items take seconds (an estimate: no GPU with SGLang has been lent yet, so it has never run).
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
server       SGLang end to end at TP=1 on a 3-layer model of DeepSeek-V3's widths (hidden 7168,
             128 MLA heads and ranks, expert width 2048, 1 dense layer; 16 routed experts top-8
             and a 4096-token vocabulary so that the float32 checkpoint is ~10 GB, not hundreds),
             seeded unit-scale bf16-served weights (demo_model's builder, N(0, 1/hidden)
             matrices, spread norms, router and lm_head): sync-eager (SGLang's plain path, the
             baseline); sync; overlap with the side stream forced at one rank (test-only flag,
             probe on); `blocking` (the same side stream, each all-reduce joined at its launch);
             overlap with --disable-cuda-graph; overlap with breakable prefill graphs; and
             overlap-broken, the broken-lane control (--farskip-test-drop-partial: layer 1's
             attention + shared sum adds zeros). Prompts of 1, 100 and 4096 tokens (4096 is two
             2048-token chunks), a 4096-token cached prefix longer than the chunk, decode at
             batch 1, 3 (padded to a graph of 4) and 64. Every server's logprobs are scored
             against reference.py in float32 on the same weights, teacher-forced on the server's
             own tokens; the tolerance is measured, not chosen: REF_TOL_FACTOR x sync-eager's
             error (at least REF_TOL_FLOOR). Every variant within it; overlap-broken must be
             outside it, or the check has no power and FAILs. Overlap must equal sync, and
             blocking overlap, bitwise (same graphs, same kernels; at TP=1 sync's all-reduce is
             SGLang's own, the identity). Each server runs the workload twice (prefix cache
             flushed between) and must repeat its own bits, else a bitwise check would say
             nothing.

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

from sglang_farskip.serve.launcher import wait_healthy
from sglang_farskip.serve.watchdog import signal_group
from sglang_farskip.testbed import REPO as ROOT
from sglang_farskip.testbed.ports import free_port
from sglang_farskip.testbed.servers import ADMIN_KEY, admin_post

HIDDEN = 7168
CHUNK = 2048  # --chunked-prefill-size of the servers: the 4096-token prompt is two chunks
# The server item's tolerance against the float32 reference, measured: sync-eager (SGLang's
# plain bf16 path) sets the scale of honest bf16 error on these weights, and the other variants
# differ from it only in graphs, streams and summation points, which round differently but no
# worse. x2 leaves room for that; the floor keeps a lucky small baseline from failing graphs on
# rounding alone. A lane that adds zeros (overlap-broken) moves logprobs by nats.
REF_TOL_FACTOR = 2.0
REF_TOL_FLOOR = 0.05
BROKEN_LANE = "attn+shared:1"  # what overlap-broken drops: a middle layer's attention + shared sum
ITEMS = ("side-stream", "breakable", "memory", "priority", "server")


# ------------------------------------------------------------------ checkpoint and workload
# DeepSeek-V3's widths (its config.json) with fewer experts, layers and vocabulary entries, for
# the server item: a float32 checkpoint a node writes in about two minutes.
SERVER_MODEL = dict(
    hidden_size=HIDDEN, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=16, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    num_nextn_predict_layers=0, vocab_size=4096,
    # unit scale: N(0, 1/hidden) matrices keep activations O(1) through the 7168-wide projections
    initializer_range=HIDDEN ** -0.5,
    # DeepSeek-V3's YaRN (factor 40 over 4096), so the 4160-token prompt is in range
    max_position_embeddings=163840,
    rope_parameters={"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)
SEED = 0


def server_model_config() -> dict:
    """The config.json keys the server item's checkpoint gets (before transformers' defaults)."""
    from sglang_farskip.config import FarSkipConfig
    from sglang_farskip.tools.demo_model import demo_config

    return demo_config(SERVER_MODEL, FarSkipConfig(enabled=True))


def write_checkpoint(path: Path) -> Path:
    """The server item's FarSkip checkpoint (every layer converted), float32 on disk, served bf16;
    reused when `path` already holds a whole build (--keep)."""
    from sglang_farskip.tools.demo_model import BUILD_INFO, build_checkpoint

    if (path / BUILD_INFO).exists():
        return path
    return build_checkpoint(path, seed=SEED, overrides=SERVER_MODEL)


def workload(seed: int = 0, vocab: int = SERVER_MODEL["vocab_size"]) -> list[tuple[str, list[list[int]], int]]:
    """(case, prompts sent as one batch, new tokens), in the order sent; "prefix>chunk" reuses
    the 4096-token prompt just cached, so its cached prefix is longer than a chunk."""
    rng = random.Random(seed)
    # Every prompt starts with a token of its own: in a small vocabulary two random prompts
    # would often share a first token, a cached 1-token prefix that turns a prefill into an extend.
    firsts = rng.sample(range(2, vocab), 80)

    def ids(n):
        return [firsts.pop()] + [rng.randrange(2, vocab) for _ in range(n - 1)]

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


# One sequence's output: {"ids": [...], "logprobs": [...]}
def compare(a: dict, b: dict) -> list[str]:
    """Where two runs' outputs {case: [sequence, ...]} are not bit-identical (token ids and
    logprobs); empty if they are."""
    return [f"{case}[{i}]: not bit-identical"
            for case in a for i, (x, y) in enumerate(zip(a[case], b[case]))
            if x["ids"] != y["ids"] or x["logprobs"] != y["logprobs"]]


def reference_error(run: dict, model, cases) -> float:
    """Largest |server logprob - reference logprob| over every generated token of `run`, the
    reference scoring the server's own tokens (teacher forcing: a bf16 near-tie that flips a
    token changes what is scored next, not whether it is scored)."""
    import torch

    dev = model.lm_head.weight.device
    worst = 0.0
    for case, prompts, _new in cases:
        for prompt, seq in zip(prompts, run[case]):
            ids = torch.tensor(prompt + seq["ids"][:-1], device=dev)
            logp = model(ids)[len(prompt) - 1:].float().log_softmax(-1)  # [new, vocab]
            ref = logp.gather(1, torch.tensor(seq["ids"], device=dev)[:, None])[:, 0]
            worst = max(worst, float((ref.cpu() - torch.tensor(seq["logprobs"])).abs().max()))
    return worst


def judge(errors: dict[str, float], baseline: str, broken: str | None) -> tuple[float, list[str]]:
    """The measured tolerance, and what is wrong: a variant outside it, or a broken control
    inside it (then nothing this check says can be trusted)."""
    tol = max(REF_TOL_FACTOR * errors[baseline], REF_TOL_FLOOR)
    problems = [f"{v}: {e:.3g} from the reference > tolerance {tol:.3g}"
                for v, e in errors.items() if v != broken and e > tol]
    if broken is not None and errors[broken] <= tol:
        problems.append(f"{broken}: {errors[broken]:.3g} from the reference, within tolerance {tol:.3g}: "
                        "the broken-lane control went unseen, so the check has no power")
    return tol, problems


SERVER_COMMON = [
    "--skip-tokenizer-init", "--tp-size", "1",
    "--chunked-prefill-size", str(CHUNK), "--cuda-graph-bs-decode", "1", "4", "64",
    "--mem-fraction-static", "0.7",
]
FORCE_SIDE = ["--farskip-gpu-overlap", "--farskip-test-force-side-stream"]
SERVER_VARIANTS = {
    # the reference-tolerance baseline: SGLang's plain eager path
    "sync-eager": ["--farskip-mode", "sync", "--disable-cuda-graph"],
    # prefill graphs off: the launcher turns them off for GPU overlap by default.
    "sync": ["--farskip-mode", "sync", "--cuda-graph-backend-prefill", "disabled"],
    "overlap": FORCE_SIDE,
    # the same side communicator, each all-reduce joined at its launch: overlap's A/B partner
    "blocking": [*FORCE_SIDE, "--farskip-mode", "blocking"],
    "overlap-eager": [*FORCE_SIDE, "--disable-cuda-graph"],
    "overlap-breakable": [*FORCE_SIDE, "--cuda-graph-backend-prefill", "breakable",
                          "--cuda-graph-bs-prefill", "128", "512", str(CHUNK)],
    "overlap-broken": [*FORCE_SIDE, "--farskip-test-drop-partial", BROKEN_LANE],
}
BASELINE, BROKEN = "sync-eager", "overlap-broken"
# (variant, equal bit for bit to)
BITWISE = [("overlap", "sync"), ("blocking", "overlap")]


def server_argv(model_path: str, variant: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang_farskip.serve.launcher", "--model-path", model_path,
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
    proc = subprocess.run([sys.executable, "-m", "sglang_farskip.checks.device", "--breakable-across"], capture_output=True,
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


# The bare check's items, the same on this machine (one definition: checks/gpu.py).
def item_memory(dev) -> tuple[bool, str]:
    from sglang_farskip.checks import gpu

    return gpu.item_memory(dev, {})


def item_priority(dev) -> tuple[bool, str]:
    from sglang_farskip.checks import gpu

    return gpu.item_priority(dev, {})


# ------------------------------------------------------------------ end to end
def _post(url: str, payload: dict, timeout: float = 300) -> object:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _sequence(reply: dict) -> dict:
    pairs = reply["meta_info"]["output_token_logprobs"]  # [(logprob, token id, text), ...]
    return {"ids": [tok for _lp, tok, *_ in pairs], "logprobs": [lp for lp, *_ in pairs]}


def run_workload(base: str, cases=None) -> dict:
    out = {}
    for case, prompts, new in cases or workload():
        replies = _post(base + "/generate", {
            "input_ids": prompts if len(prompts) > 1 else prompts[0],
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        })
        out[case] = [_sequence(r) for r in (replies if isinstance(replies, list) else [replies])]
    return out


def serve_and_run(model_path: str, variant: str, log_dir: Path, start_timeout: float = 600) -> tuple[dict, bool]:
    """The workload's outputs on one server, and whether a second run (prefix cache flushed
    in between) gave the same bits: without that, bitwise checks between servers mean nothing."""
    port = free_port()
    log = open(log_dir / f"server-{variant}.log", "w")
    proc = subprocess.Popen(server_argv(model_path, variant, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT,
                            env={**os.environ, "FARSKIP_ADMIN_API_KEY": ADMIN_KEY})
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(base, start_timeout, alive=lambda: proc.poll() is None):
            state = f"exited {proc.returncode}" if proc.poll() is not None else f"not ready in {start_timeout:.0f} s"
            raise RuntimeError(f"server {variant} {state}; see {log.name}")
        first = run_workload(base)
        admin_post(base, "/flush_cache")
        return first, not compare(first, run_workload(base))
    finally:
        signal_group(proc, signal.SIGKILL)  # proc may have exited: not os.killpg (pid reuse)
        proc.wait()
        log.close()


def item_server(log_dir: Path) -> tuple[bool, str]:
    import torch

    from sglang_farskip.reference import load_reference

    t0 = time.monotonic()
    ckpt = write_checkpoint(log_dir / "v3-widths")
    timings, unstable, runs = [f"checkpoint {time.monotonic() - t0:.0f} s"], [], {}
    for variant in SERVER_VARIANTS:
        t0 = time.monotonic()
        runs[variant], stable = serve_and_run(str(ckpt), variant, log_dir)
        timings.append(f"{variant} {time.monotonic() - t0:.0f} s")
        if not stable and variant != BROKEN:
            unstable.append(variant)
    (log_dir / "server-outputs.json").write_text(json.dumps(runs))
    t0 = time.monotonic()
    model = load_reference(str(ckpt), dtype=torch.float32).to("cuda:0")
    with torch.no_grad():
        errors = {v: reference_error(run, model, workload()) for v, run in runs.items()}
    del model
    torch.cuda.empty_cache()
    timings.append(f"reference {time.monotonic() - t0:.0f} s")
    tol, problems = judge(errors, BASELINE, BROKEN)
    problems += [f"{v}: two runs on one server differ (nondeterministic kernels)" for v in unstable]
    for variant, ref in BITWISE:
        problems += [f"{variant} vs {ref}: {p}" for p in compare(runs[variant], runs[ref])]
    (log_dir / "server-errors.json").write_text(json.dumps({"errors": errors, "tolerance": tol}))
    figures = ", ".join(f"{v} {e:.3g}" for v, e in errors.items())
    checks = "; ".join(f"{v} == {r}" for v, r in BITWISE)
    return not problems, (f"max |logprob - reference| {figures} (tolerance {tol:.3g}); {checks}; over "
                          f"{len(workload())} cases ({', '.join(timings)})" if not problems else "; ".join(problems[:5]))


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated subset of {ITEMS}")
    parser.add_argument("--keep", default=None, help="directory for server logs and outputs (default: temporary)")
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
               "server": lambda: item_server(log_dir)}
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
