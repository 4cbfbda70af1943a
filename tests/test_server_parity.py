"""Real SGLang servers (HTTP, worker processes) against the plain-PyTorch reference.

Every test builds float32 checkpoints with seeded random weights (written by transformers),
serves them with `--dtype float32` and compares greedy tokens and logprobs.

Tolerance: greedy tokens equal, logprobs (the chosen token's and the top 5) within
parity.LOGPROB_ATOL = 1e-4; parity.py says why.
"""

from __future__ import annotations

import pytest

from sglang_farskip.tools import convert
from sglang_farskip.tools.demo_model import build_checkpoint
from sglang_farskip.reference import load_reference

from parity import FLOAT32, NEW_TOKENS, ONE_THREAD, PROMPTS, assert_matches_reference, served
from sglang_farskip.testbed.servers import side_by_side


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


@pytest.fixture(scope="module")
def farskip_served(checkpoints):
    """The four conversions served side by side (testbed.servers.side_by_side says why), each with
    its rank report and its served results."""
    runs = {name: {"args": ["--model-path", str(checkpoints[name]), *FLOAT32], "env": ONE_THREAD}
            for name in EXPECTED_LAYERS}
    with side_by_side(runs) as servers:
        return {name: (s.get("/farskip/info"), served(s)) for name, s in servers.items()}


@pytest.mark.parametrize("variant", list(EXPECTED_LAYERS))
def test_farskip_server_matches_reference(checkpoints, farskip_served, variant):
    info, results = farskip_served[variant]
    (rank,) = info["ranks"]
    assert rank["model_class"].endswith("FarSkipDeepseekV3ForCausalLM")
    assert rank["inner_model_class"].endswith("FarSkipDeepseekV2Model")
    assert rank["converted_layers"] == EXPECTED_LAYERS[variant]
    assert rank["mode"] == "overlap"
    assert_matches_reference(results, load_reference(str(checkpoints[variant])))


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
                  "--max-total-tokens", "16384", "--sleep-on-idle", *FLOAT32]
    plain = str(checkpoints["plain"])
    # "ours" spawns its workers as SGLang does on GPUs; the others fork them (our CPU default,
    # cpu/environment.py), so equal also means that the start method changes nothing.
    runs = {  # the same thread count on every side, so that equal means bit for bit
        "stock": {"args": ["--model-path", plain, *stock_args], "stock": True, "env": ONE_THREAD},
        "ours": {"args": ["--model-path", plain, "--farskip-cpu-start-method", "spawn", *FLOAT32],
                 "env": ONE_THREAD},
        "off": {"args": ["--model-path", str(checkpoints["all"]), "--farskip-mode", "off", *FLOAT32],
                "env": ONE_THREAD},
    }
    with side_by_side(runs) as servers:
        expected = served(servers["stock"])
        (rank,) = servers["ours"].get("/farskip/info")["ranks"]
        assert rank["mode"] == "off" and rank["converted_layers"] == []
        assert rank["inner_model_class"].endswith(".DeepseekV2Model")
        assert served(servers["ours"]) == expected
        assert served(servers["off"]) == expected
        assert "outputs are NOT the model's" in servers["off"].log_tail(400)
        assert "CPU workers start by spawn (as asked)" in servers["ours"].log_tail(100_000)
        for name in ("stock", "off"):
            assert "CPU workers start by fork" in servers[name].log_tail(100_000), name
    assert_matches_reference(expected, load_reference(str(checkpoints["plain"])))

