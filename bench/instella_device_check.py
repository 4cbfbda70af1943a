"""Which GPU attention backends serve Instella-MoE's MLA correctly: one short run on one GPU.

    python bench/instella_device_check.py [--backends triton,fa3,flashinfer] [--keep DIR]
    python bench/instella_device_check.py --device cpu --backends torch_native   # the logic, on CPU
                                                                  # (with --farskip-cpu-attention mha)

Instella's MLA latent is kv_lora_rank 512 + qk_rope_head_dim 32 = 544 wide (DeepSeek-V3: 576)
with qk_nope 96 and v_head 128, 16 heads. Kernels written for DeepSeek-V3 may assume 576 or a
64-wide rope (SGLang 0.5.23: trtllm_mla's fused KV write checks rope 64, FlashMLA's kernels are
built for 576). This builds a 2-layer Instella checkpoint with exactly those attention shapes
(small MLPs, seeded random weights, the gate included), serves it once per backend with our
launcher (TP=1, bf16, CUDA graphs on), and compares against reference.py run in float32 on the
same weights:
  prefill  the prompt's own token logprobs (`logprob_start_len` 0): prompts of 1, 100 and 600
           tokens, then 600 + 40 on the cached 600 (an extend over a cached prefix). Prefill CUDA
           graphs are off and SGLang's chunked-prefix threshold and chunk capacity are lowered to
           256 (its own environment variables), so each backend's MHA prefill path runs (the
           cached 600 in three chunks where the backend chunks), not only absorbed MLA. Which
           method ran is counted only on CPU (see cpu/attention.py); on GPU it follows upstream's
           rules (docs/attention-paths.md);
  decode   16 greedy tokens at batch 1 and 3; the reference scores the server's own tokens
           (teacher forcing), so a bf16 near-tie that flips a token is not a failure.
Tolerance LOGPROB_TOL = 0.15 nats: bf16 weights and activations over two layers move a
logprob by a few hundredths here (the lm_head gives logits of std ~4); a wrong latent width,
a rope split read at 64 instead of 32 or a gate on the wrong path moves them by whole nats.
One PASS/FAIL line per backend and a summary; exit 1 if any failed. About 1 minute per backend
on one H200 (a server start with graph capture).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOGPROB_TOL = 0.15
NEW_TOKENS = 16
CHUNKING = {"SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD": "256", "SGLANG_MAX_KV_CHUNK_CAPACITY": "256"}
# Instella-MoE-16B-A3B's attention exactly; the rest shrunk so a start takes seconds.
ATTENTION_SHAPES = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                        kv_lora_rank=512, qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=128)
SMALL_REST = dict(num_hidden_layers=2, intermediate_size=1024, moe_intermediate_size=128,
                  n_routed_experts=8, num_experts_per_tok=3)


def build(path: Path) -> Path:
    from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides

    overrides = {**kind_overrides("instella"), **ATTENTION_SHAPES, **SMALL_REST}
    return build_checkpoint(path, seed=0, overrides=overrides)


def workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(2, vocab) for _ in range(n)]

    long = ids(600)
    # (case, prompt, first position whose logprob is asked: past a cached prefix, so that SGLang
    # reuses the cache instead of recomputing it for the logprobs)
    prefill = [("prompt-1", [0], 0), ("prompt-100", ids(100), 0), ("prompt-600", long, 0),
               ("prefix-600+40", long + ids(40), 600)]
    decode = [("decode-bs1", [ids(12)]), ("decode-bs3", [ids(12) for _ in range(3)])]
    return prefill, decode


def check_backend(backend: str, ckpt: Path, device: str, ref) -> list[str]:
    """Problems found (empty = PASS)."""
    import torch

    from sglang_farskip.testbed.servers import Server

    args = ["--model-path", str(ckpt), "--attention-backend", backend, "--device", device]
    if device == "cpu":
        args += ["--dtype", "float32", "--farskip-cpu-attention", "mha"]
    else:
        args += ["--dtype", "bfloat16", "--cuda-graph-max-bs", "8", "--cuda-graph-backend-prefill", "disabled"]
    problems = []
    prefill, decode = workload(ref.args.vocab_size)
    with Server(args, env=CHUNKING) as server:
        server.wait_ready(timeout=900)
        info = server.get("/farskip/info")["ranks"][0]
        if not (info["model_class"].endswith("InstellaMoEForCausalLM") and info["gated_attention"]):
            problems.append(f"served {info['model_class']} gated={info.get('gated_attention')}")
        for case, prompt, start in prefill:
            out = server.post("/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": start,
                                            "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            meta = out["meta_info"]
            lp, token = meta["output_token_logprobs"][0][:2]
            served = [p[0] for p in meta["input_token_logprobs"][1:]] + [lp]  # the first has none
            problems += _diff(case, served, _scores(ref, prompt + [token])[start:], torch)
        for case, prompts in decode:
            outs = server.post("/generate", {"input_ids": prompts, "return_logprob": True, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
            for prompt, out in zip(prompts, outs):
                pairs = out["meta_info"]["output_token_logprobs"]
                tokens, served = [p[1] for p in pairs], [p[0] for p in pairs]
                problems += _diff(case, served, _scores(ref, prompt + tokens)[len(prompt) - 1:], torch)
        report = server.get("/farskip/info")["ranks"][0]
        if "attention_methods" in report:
            print(f"    attention methods {report['attention_methods']}, prefix chunks {report['prefix_chunks']}")
    return problems


def _scores(ref, ids: list[int]) -> list[float]:
    """log p(ids[t+1] | ids[:t+1]) for t = 0 .. len(ids)-2, by the float32 reference (on CPU)."""
    import torch

    logp = ref(torch.tensor(ids)).float().log_softmax(-1)
    return [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


def _diff(case: str, served: list[float], expect: list[float], torch) -> list[str]:
    err = float((torch.tensor(served) - torch.tensor(expect)).abs().max()) if served else 0.0
    print(f"    {case}: {len(served)} logprobs, max |served - reference| = {err:.3g}", flush=True)
    return [f"{case}: logprobs off by {err:.3g} > {LOGPROB_TOL}"] if err > LOGPROB_TOL else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="triton,fa3,flashinfer,trtllm_mla,flashmla")
    p.add_argument("--device", default="cuda")
    p.add_argument("--keep", type=Path, default=None, help="build the checkpoint here and keep it")
    args = p.parse_args(argv)

    import torch

    from sglang_farskip.reference import load_reference

    root = args.keep or Path(tempfile.mkdtemp(prefix="instella-544-"))
    ckpt = root / "instella-544"
    if not (ckpt / "BUILD_INFO.json").exists():
        build(ckpt)
    ref = load_reference(str(ckpt), dtype=torch.float32)
    results = {}
    for backend in args.backends.split(","):
        start = time.monotonic()
        print(f"== {backend}", flush=True)
        try:
            problems = check_backend(backend, ckpt, args.device, ref)
        except Exception as e:  # noqa: BLE001 - a backend that cannot start is a FAIL, not the end
            traceback.print_exc(limit=2)
            problems = [f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"[:300]]
        results[backend] = problems
        verdict = "PASS" if not problems else "FAIL " + "; ".join(problems)[:400]
        print(f"{verdict.split()[0]} {backend} ({time.monotonic() - start:.0f} s) {verdict[4:]}".rstrip(), flush=True)
    passed = [b for b, pr in results.items() if not pr]
    print(f"SUMMARY latent 544: {len(passed)}/{len(results)} backends pass: {', '.join(passed) or 'none'}")
    print(json.dumps({b: pr for b, pr in results.items()}))
    return 0 if len(passed) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
