"""`python -m sglang_farskip.formats.quantize`: the block-FP8 layout it writes, its round trip, and one
clear error (exit 2, nothing written) per input it cannot represent. Serving its output is
tests/test_fp8.py (the FP8 demo is this tool's output).

Round-trip bound: e4m3 keeps 3 mantissa bits, so each element's relative rounding error is at most
2^-4 (half a step of 2^-3) and its root mean square about 2^-4/sqrt(3) = 0.036 for uniformly placed
values; the weights here measure 0.027 per tensor. 0.03 per tensor and 2^-4 of each block's largest
magnitude per element are the bounds checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sglang_farskip import checkpoint
from sglang_farskip.formats import fp8
from sglang_farskip.tools.demo_model import build_checkpoint, kind_overrides

TENSOR_RMS_BOUND = 0.03


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """The FP8 demo's bf16 source (float32 weights, 128-aligned widths, an MTP layer)."""
    return build_checkpoint(tmp_path_factory.mktemp("quantize") / "bf16", overrides=kind_overrides("deepseek-v3-fp8"))


def quantize(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_farskip.formats.quantize", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint.shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def dst(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantized") / "fp8"
    result = quantize(src, out, "--max-shard-size", "4MB")
    assert result.returncode == 0, result.stderr
    assert "tensors in block FP8" in result.stdout and "round trip" in result.stdout
    return out


def test_layout_is_deepseeks(src, dst):
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == fp8.QUANTIZATION_CONFIG and cfg["dtype"] == "bfloat16"
    assert fp8.weight_format(cfg) == "fp8"
    index = json.loads((dst / checkpoint.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    # --max-shard-size bounds the tensor bytes (as transformers' sharding does); the file adds its
    # JSON header, a few hundred bytes a tensor.
    assert all((dst / s).stat().st_size <= 4 * 10**6 + 100_000 for s in shards)
    out = tensors(dst)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum((dst / s).stat().st_size for s in shards)
    for name, t in out.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        if fp8.is_quantized(name):
            assert t.dtype == fp8.DTYPE and out[name + fp8.SCALE_SUFFIX].dtype == torch.float32, name
        else:
            assert name + fp8.SCALE_SUFFIX not in out, name
            assert t.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16), name
    # The MTP layer (model.layers.4) as the release has it: its decoder block in FP8, per expert;
    # eh_proj, its norms and shared_head in bf16.
    assert out["model.layers.4.mlp.experts.7.down_proj.weight"].dtype == fp8.DTYPE
    assert out["model.layers.4.self_attn.kv_b_proj.weight"].dtype == fp8.DTYPE
    assert out["model.layers.4.eh_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.4.shared_head.head.weight"].dtype == torch.bfloat16
    assert not any(".experts.gate_up_proj" in n or n.endswith(".experts.down_proj") for n in out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / extra).read_bytes() == (src / extra).read_bytes()


def test_round_trip_error_is_e4m3s(src, dst):
    source = {name: t for file in checkpoint.shard_files(src)
              for name, t in _per_expert_tensors(file)}
    out = tensors(dst)
    quantized = [n for n in out if fp8.is_quantized(n)]
    assert len(quantized) == sum(fp8.is_quantized(n) for n in source) > 100
    for name in quantized:
        w = source[name].float()
        back = fp8.dequantize(out[name], out[name + fp8.SCALE_SUFFIX])
        assert float((back - w).norm() / w.norm()) <= TENSOR_RMS_BOUND, name
        block_max = fp8._per_element(out[name + fp8.SCALE_SUFFIX], w.shape) * fp8.FP8_MAX
        assert bool(((back - w).abs() <= block_max * 2**-4 + 1e-12).all()), name


def _per_expert_tensors(file):
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            yield from checkpoint.per_expert(name, f.get_tensor(name))


def test_block_scales_are_checked_against_the_weight():
    """The planted bug this module's checks rest on: scales of the wrong shape are refused, and a
    scale moved to another block changes the dequantized weight."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    w[128:] *= 4  # blocks of unlike magnitude: random blocks alike in scale hid a swap (CI: 0.027)
    q, s = fp8.quantize(w)
    with pytest.raises(ValueError, match="does not match"):
        fp8.dequantize(q, s.t())
    swapped = s.clone()
    swapped[0, 0], swapped[1, 1] = s[1, 1], s[0, 0]
    assert float((fp8.dequantize(q, swapped) - w).norm() / w.norm()) > TENSOR_RMS_BOUND


def _set_config(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["InstellaMoEForCausalLM"]}, "AMD ships in bf16 only"),
    ({"quantization_config": fp8.QUANTIZATION_CONFIG}, "already block FP8"),
    ({"quantization_config": {"quant_method": "awq"}}, "is not DeepSeek's block FP8"),
    ({"q_lora_rank": 96}, "q_lora_rank 96 is not a multiple of 128"),
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
])
def test_refuses_what_it_cannot_represent(src, tmp_path, change, words):
    bad = tmp_path / "src"
    bad.mkdir()
    for entry in src.iterdir():
        (bad / entry.name).symlink_to(entry)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text((src / "config.json").read_text())
    _set_config(bad, **change)
    result = quantize(bad, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert words in line, line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_refuses_bad_flags_and_destinations(src, dst, tmp_path):
    for args, words in [
        ((src, tmp_path / "x", "--max-shard-size", "lots"), "--max-shard-size 'lots'"),
        ((src, dst), "exists: choose another directory or pass --force"),
        ((src, src / "inside"), "is inside SRC"),
        ((tmp_path / "missing", tmp_path / "y"), "missing"),
    ]:
        result = quantize(*args)
        assert result.returncode == 2 and result.stderr.startswith("error:"), result.stderr
        assert words in result.stderr, result.stderr
    assert not (tmp_path / "x").exists()


def test_nan_weights_are_refused_before_anything_is_written(src, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "src"
    bad.mkdir()
    for entry in src.iterdir():
        if entry.suffix != ".safetensors":
            (bad / entry.name).symlink_to(entry)
    state = tensors(src)
    state["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.full((256, 256), float("nan"))
    save_file(state, str(bad / "model.safetensors"))
    result = quantize(bad, tmp_path / "out")
    assert result.returncode == 2 and "holds inf or NaN" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
