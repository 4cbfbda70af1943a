"""What the server tests share: the float32 serving flags, the prompts, the tolerance and the
comparison of a served result with reference.py. A plain module (no fixtures), imported by the
test modules; no test module imports another.

Tolerance: logprobs within LOGPROB_ATOL = 1e-4 (absolute). Both sides compute in float32 but
not in the same order: SGLang runs MLA in absorbed form (W_UK folded into q, W_UV after the
latent attention) and sums residual lanes in the FarSkip schedule's order, the reference
decompresses K/V and adds h + a + s + r; TP/EP ranks add their partial sums in yet another
order. Measured differences are below 1e-5 on the demo models; a wiring mistake (a lane read one
layer late, a missing scale, a sum counted twice) moves logprobs by 1e-2 or more. Tokens must be
equal: the demo weights keep top-2 logit gaps far above float32 noise.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from sglang_farskip.testbed.servers import ONE_THREAD, Server  # noqa: F401 (ONE_THREAD: for the tests)
from sglang_farskip.tools import convert
from sglang_farskip.tools.demo_model import build_checkpoint

LOGPROB_ATOL = 1e-4
NEW_TOKENS = 8
TOP_K = 5
FLOAT32 = ["--dtype", "float32"]



def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    long = [0] + [rng.randrange(2, 4096) for _ in range(120)]
    return [
        [0, 17],  # a 2-token prefill
        [0] + [rng.randrange(2, 4096) for _ in range(15)],
        long,
        # Shares 121 tokens with `long`: the radix cache turns this into an extend on a
        # cached prefix, the third attention situation besides plain prefill and decode.
        long + [rng.randrange(2, 4096) for _ in range(9)],
    ]


PROMPTS = _prompts()

Served = list[tuple[list[int], list[float], list[list[float]]]]


def served(server: Server, prompts: list[list[int]] = PROMPTS,
           new_tokens: int = NEW_TOKENS, dp_ranks: list[int] | None = None) -> Served:
    """(tokens, chosen logprobs, top-k logprob values per step) for every prompt, sent one at a
    time in order (so the extend prompt finds its prefix cached). `dp_ranks`: under DP
    attention, the DP rank each prompt is sent to (SGLang's `routed_dp_rank`)."""
    results = []
    for i, prompt in enumerate(prompts):
        out = server.post("/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": TOP_K,
            **({"routed_dp_rank": dp_ranks[i]} if dp_ranks else {}),
        })
        meta = out["meta_info"]
        tokens = [t[1] for t in meta["output_token_logprobs"]]
        chosen = [t[0] for t in meta["output_token_logprobs"]]
        top = [[t[0] for t in step] for step in meta["output_top_logprobs"]]
        results.append((tokens, chosen, top))
    return results


def assert_matches_reference(results: Served, reference, prompts: list[list[int]] = PROMPTS,
                             new_tokens: int = NEW_TOKENS) -> float:
    """Greedy tokens equal to the reference's, and the chosen and top-k logprobs at every step
    within LOGPROB_ATOL; returns the largest chosen-logprob difference."""
    assert len(results) == len(prompts)
    worst = 0.0
    for prompt, (tokens, chosen, top) in zip(prompts, results):
        ref_tokens, ref_chosen = reference.greedy(prompt, new_tokens)
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens: greedy tokens differ"
        diff = max(abs(a - b) for a, b in zip(chosen, ref_chosen))
        assert diff <= LOGPROB_ATOL, (len(prompt), diff)
        worst = max(worst, diff)
        # The whole top of the distribution, not only the winner, at every decode step.
        with torch.no_grad():
            logits = reference(torch.tensor(prompt + ref_tokens[:-1]))
        ref_top = torch.log_softmax(logits[len(prompt) - 1:].float(), -1).topk(len(top[0])).values
        assert torch.allclose(torch.tensor(top), ref_top, atol=LOGPROB_ATOL, rtol=0)
    return worst


def full_and_range(root: Path) -> dict[str, Path]:
    """The demo checkpoint (seed 0) and its conversion of layers 2-3 only, under `root`."""
    full = build_checkpoint(root / "full", seed=0)
    assert convert.main([str(full), str(root / "range"), "--start-layer", "2", "--end-layer", "3",
                         "--force"]) == 0
    return {"full": full, "range": root / "range"}


# ------------------------------------------------------------------ bf16 servers (FP8 checkpoints)
def teacher_forced_errors(results: Served, reference, prompts: list[list[int]] = PROMPTS) -> list[tuple[float, float]]:
    """For every served step, against the reference run on the *served* tokens (so one bf16 near
    tie cannot derail the rest of a sequence): (|served - reference| logprob of the served token,
    how far the served token's reference logprob is below the reference's best)."""
    out = []
    for prompt, (tokens, chosen, _top) in zip(prompts, results):
        with torch.no_grad():
            logits = reference(torch.tensor(prompt + tokens[:-1]))
        ref = torch.log_softmax(logits[len(prompt) - 1:].float(), -1)  # [steps, V]
        for step, (token, lp) in enumerate(zip(tokens, chosen)):
            out.append((abs(lp - float(ref[step, token])), float(ref[step].max() - ref[step, token])))
    return out


def dequantized_copy(src: Path, dst: Path, tp_size: int) -> Path:
    """`src` (block FP8) dequantized into a float32 checkpoint at `dst`, kv_b_proj as SGLang's CPU
    loader keeps it at `tp_size` (fp8.as_cpu_loader_stores_kv_b): the weights the CPU FP8 path
    computes with at that TP size. Main model only (no MTP layer)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from sglang_farskip.reference import load_reference

    dst.mkdir(parents=True)
    state = load_reference(str(src), cpu_kv_b_tp=tp_size).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    for entry in src.iterdir():
        if entry.suffix != ".safetensors" and entry.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(entry, dst / entry.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
