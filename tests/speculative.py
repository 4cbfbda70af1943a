"""What the speculative-decoding tests share: SGLang's flags for each algorithm, the prompts,
the requests (one at a time, then all at once), and a checkpoint whose drafts are accepted.

The checkpoint: the demo with its MTP ("NextN") layer made to predict what the target will, for
EAGLE tests that need accepted drafts. The demo's own MTP layer is random (demo_model.py), so
its drafts are rarely right: that checks exactness, but not the handling of accepted drafts.

Every sub-block's output projection (`o_proj`, every `down_proj`) is scaled down, so the
target's next token depends mostly on the current token (a bigram model:
head(norm(embed(t)))), and the MTP layer computes that same bigram: `eh_proj` = [I, 0] passes
the token's normalised embedding through, its decoder layer (a copy of the target's last one)
adds little, `shared_head.norm` is the target's final norm. Names as SGLang's
DeepseekV3ForCausalLMNextN loads them (`models/deepseek_common/deepseek_weight_loader.py`).
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NEW_TOKENS = 16
SPEC_FLAGS = {
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"],
    "eagle_chain": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"],
    "eagle_tree": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                   "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"],
}


def spec_prompts() -> list[list[int]]:
    """parity.PROMPTS (plain prefill, a cached-prefix extend) and a repetitive prompt asked
    twice, in order: the second time SGLang's n-gram store holds the first answer, so n-gram
    drafts are right (and EAGLE's are as usual)."""
    from parity import PROMPTS

    repeated = [0] + [101, 102, 103, 104, 105] * 6
    return [*PROMPTS, repeated, repeated]


def ask(server, prompt: list[int]) -> dict:
    return server.post("/generate", {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    })["meta_info"]


def ask_all(server, prompts: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """(one request at a time in order, all at once): the meta_info of each answer."""
    sequential = [ask(server, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: ask(server, p), prompts))
    return sequential, concurrent


def tokens(meta: dict) -> list[int]:
    return [t[1] for t in meta["output_token_logprobs"]]


def assert_greedy_equal(sequential: list[dict], concurrent: list[dict], expected) -> float:
    """Both passes' greedy tokens equal the reference's (`expected`: (tokens, logprobs) per
    prompt), the chosen logprobs within parity.LOGPROB_ATOL; returns the largest difference."""
    from parity import LOGPROB_ATOL

    worst = 0.0
    for i, (meta_s, meta_c, (ref_tokens, ref_logprobs)) in enumerate(zip(sequential, concurrent, expected)):
        assert tokens(meta_s) == ref_tokens, f"prompt {i}, one at a time"
        assert tokens(meta_c) == ref_tokens, f"prompt {i}, all at once"
        diff = max(abs(t[0] - r) for t, r in zip(meta_s["output_token_logprobs"], ref_logprobs))
        assert diff <= LOGPROB_ATOL, (i, diff)
        worst = max(worst, diff)
    return worst


def reference_greedy(path, prompts: list[list[int]], farskip=None) -> list:
    """reference.py's non-speculative greedy (tokens, logprobs) per prompt, on one thread:
    beside busy servers on 2 cores more threads were ~50x slower."""
    from sglang_farskip.reference import load_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = load_reference(str(path), **({"farskip": farskip} if farskip is not None else {}))
        return [reference.greedy(p, NEW_TOKENS) for p in prompts]
    finally:
        torch.set_num_threads(threads)


SMALL_OUTPUT_SCALE = 0.05
_OUTPUT_PROJECTIONS = re.compile(r"\.(self_attn\.o_proj|(mlp\.)?(experts\.\d+\.|shared_experts\.)?down_proj)\.weight$")


def predictable_mtp(src: Path, dst: Path) -> Path:
    """Copy the demo checkpoint at `src` (one model.safetensors with an MTP layer, as
    demo_model.build_checkpoint writes) to `dst` with predictable drafts; returns `dst`."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    L, H = config["num_hidden_layers"], config["hidden_size"]
    assert config.get("num_nextn_predict_layers") == 1, f"{src} has no MTP layer"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name in tensors:
        if _OUTPUT_PROJECTIONS.search(name):
            tensors[name] = tensors[name] * SMALL_OUTPUT_SCALE
    last, mtp = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for name in [n for n in tensors if n.startswith(last)]:  # already scaled down like the target's
        tensors[mtp + name[len(last):]] = tensors[name].clone()
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # [H, 2H]
    tensors[mtp + "enorm.weight"] = torch.ones(H)
    tensors[mtp + "hnorm.weight"] = torch.ones(H)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst
