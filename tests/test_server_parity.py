"""Real SGLang servers (HTTP, spawned workers) against the plain-PyTorch reference.

Every test builds float32 checkpoints with seeded random weights (written by transformers),
serves them with `--dtype float32` and compares greedy tokens and logprobs.

Tolerance: logprobs within LOGPROB_ATOL = 1e-4 (absolute). Both sides compute in float32 but
not in the same order: SGLang runs MLA in absorbed form (W_UK folded into q, W_UV after the
latent attention) and sums residual lanes in the FarSkip schedule's order, the reference
decompresses K/V and adds h + a + s + r. Measured differences are below 1e-5 on this model; a
wiring mistake (a lane read one layer late, a missing scale) moves logprobs by 1e-2 or more.
Tokens must be equal: the demo weights keep top-2 logit gaps far above float32 noise.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_farskip import convert
from sglang_farskip.config import FarSkipConfig
from sglang_farskip.demo_model import build_checkpoint
from sglang_farskip.reference import load_reference

from serverutil import Server

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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    farskip = build_checkpoint(root / "farskip", seed=0)
    plain = build_checkpoint(root / "plain", seed=0, farskip=None)
    variants = {"all": farskip, "plain": plain}
    for name, flags in {
        "range": ["--start-layer", "2", "--end-layer", "3"],
        "attn_only": ["--attn-only"],
        "mlp_only": ["--mlp-only"],
    }.items():
        assert convert.main([str(plain), str(root / name), *flags]) == 0
        variants[name] = root / name
    return variants


def _served(server: Server) -> list[tuple[list[int], list[float], list[list[float]]]]:
    """(tokens, chosen logprobs, top-k logprob values per step) for every prompt."""
    results = []
    for prompt in PROMPTS:
        out = server.post("/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": TOP_K,
        })
        meta = out["meta_info"]
        tokens = [t[1] for t in meta["output_token_logprobs"]]
        chosen = [t[0] for t in meta["output_token_logprobs"]]
        top = [[t[0] for t in step] for step in meta["output_top_logprobs"]]
        results.append((tokens, chosen, top))
    return results


def _assert_matches_reference(served, reference) -> None:
    for prompt, (tokens, chosen, top) in zip(PROMPTS, served):
        ref_tokens, ref_chosen = reference.greedy(prompt, NEW_TOKENS)
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(chosen, ref_chosen)) <= LOGPROB_ATOL
        # The whole top of the distribution, not only the winner, at every decode step.
        with torch.no_grad():
            logits = reference(torch.tensor(prompt + ref_tokens[:-1]))
        ref_top = torch.log_softmax(logits[len(prompt) - 1:].float(), -1).topk(TOP_K).values
        assert torch.allclose(torch.tensor(top), ref_top, atol=LOGPROB_ATOL, rtol=0)


EXPECTED_LAYERS = {"all": [0, 1, 2, 3], "range": [2, 3], "attn_only": [0, 1, 2, 3],
                   "mlp_only": [0, 1, 2, 3]}


@pytest.mark.parametrize("variant", ["all", "range", "attn_only", "mlp_only"])
def test_farskip_server_matches_reference(checkpoints, variant):
    path = checkpoints[variant]
    with Server(["--model-path", str(path), *FLOAT32]) as server:
        server.wait_ready()
        info = server.get("/farskip/info")
        served = _served(server)
    (rank,) = info["ranks"]
    assert rank["model_class"].endswith("FarSkipDeepseekV3ForCausalLM")
    assert rank["inner_model_class"].endswith("FarSkipDeepseekV2Model")
    assert rank["converted_layers"] == EXPECTED_LAYERS[variant]
    assert rank["mode"] == "overlap"
    _assert_matches_reference(served, load_reference(str(path)))


def test_farskip_changes_outputs(checkpoints):
    """Guards the comparison itself: on these weights FarSkip must change the greedy tokens,
    or the parity tests above could pass with the switch ignored."""
    farskip = load_reference(str(checkpoints["all"]))
    plain = load_reference(str(checkpoints["plain"]))
    assert any(farskip.greedy(p, NEW_TOKENS)[0] != plain.greedy(p, NEW_TOKENS)[0] for p in PROMPTS)


def test_non_farskip_checkpoint_equals_stock_sglang(checkpoints):
    """`"farskip": false` (and `--farskip-mode off` on FarSkip weights) is stock SGLang.

    Same model code, same CPU kernels, requests sent one at a time: the outputs must be
    identical, not merely close."""
    stock_args = ["--device", "cpu", "--attention-backend", "torch_native",
                  "--max-total-tokens", "16384", *FLOAT32]
    with Server(["--model-path", str(checkpoints["plain"]), *stock_args], stock=True) as stock:
        stock.wait_ready()
        expected = _served(stock)
    with Server(["--model-path", str(checkpoints["plain"]), *FLOAT32]) as ours:
        ours.wait_ready()
        (rank,) = ours.get("/farskip/info")["ranks"]
        assert rank["mode"] == "off" and rank["converted_layers"] == []
        assert rank["inner_model_class"].endswith(".DeepseekV2Model")
        assert _served(ours) == expected
    with Server(["--model-path", str(checkpoints["all"]), "--farskip-mode", "off", *FLOAT32]) as off:
        off.wait_ready()
        assert _served(off) == expected
        assert "outputs are NOT the model's" in off.log_tail(400)
    _assert_matches_reference(expected, load_reference(str(checkpoints["plain"])))

