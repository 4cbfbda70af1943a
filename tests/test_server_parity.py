"""Real SGLang servers (HTTP, spawned workers) against the plain-PyTorch reference.

Every test builds float32 checkpoints with seeded random weights (written by transformers),
serves them with `--dtype float32` and compares greedy tokens and logprobs.

Tolerance: greedy tokens equal, logprobs (the chosen token's and the top 5) within
parity.LOGPROB_ATOL = 1e-4; parity.py says why.
"""

from __future__ import annotations

import pytest

from sglang_farskip import convert
from sglang_farskip.demo_model import build_checkpoint
from sglang_farskip.reference import load_reference

from parity import FLOAT32, NEW_TOKENS, PROMPTS, assert_matches_reference, served
from serverutil import Server


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


EXPECTED_LAYERS = {"all": [0, 1, 2, 3], "range": [2, 3], "attn_only": [0, 1, 2, 3],
                   "mlp_only": [0, 1, 2, 3]}


@pytest.mark.parametrize("variant", ["all", "range", "attn_only", "mlp_only"])
def test_farskip_server_matches_reference(checkpoints, variant):
    path = checkpoints[variant]
    with Server(["--model-path", str(path), *FLOAT32]) as server:
        server.wait_ready()
        info = server.get("/farskip/info")
        results = served(server)
    (rank,) = info["ranks"]
    assert rank["model_class"].endswith("FarSkipDeepseekV3ForCausalLM")
    assert rank["inner_model_class"].endswith("FarSkipDeepseekV2Model")
    assert rank["converted_layers"] == EXPECTED_LAYERS[variant]
    assert rank["mode"] == "overlap"
    assert_matches_reference(results, load_reference(str(path)))


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
        expected = served(stock)
    with Server(["--model-path", str(checkpoints["plain"]), *FLOAT32]) as ours:
        ours.wait_ready()
        (rank,) = ours.get("/farskip/info")["ranks"]
        assert rank["mode"] == "off" and rank["converted_layers"] == []
        assert rank["inner_model_class"].endswith(".DeepseekV2Model")
        assert served(ours) == expected
    with Server(["--model-path", str(checkpoints["all"]), "--farskip-mode", "off", *FLOAT32]) as off:
        off.wait_ready()
        assert served(off) == expected
        assert "outputs are NOT the model's" in off.log_tail(400)
    assert_matches_reference(expected, load_reference(str(checkpoints["plain"])))

