"""What the speculative-decoding tests share: SGLang's flags for each algorithm, the prompts,
the requests (one at a time, then all at once), and a checkpoint whose drafts are accepted
(demo_model.predictable_mtp: the demo's own MTP layer is random, so its drafts are rarely
right, which checks exactness but not the handling of accepted drafts).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

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

