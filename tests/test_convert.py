"""`python -m sglang_farskip.tools.convert`: success, and one clear error (exit 2, nothing written) per
bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_farskip.config import FarSkipConfig
from sglang_farskip.tools.convert import main
from sglang_farskip.tools.demo_model import build_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A plain (not FarSkip) 4-layer DeepSeek-V3 checkpoint, plus a subdirectory to link."""
    path = build_checkpoint(tmp_path_factory.mktemp("convert") / "plain", farskip=None)
    (path / "extras").mkdir()
    (path / "extras" / "README").write_text("kept\n")
    return path


def convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_farskip.tools.convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_converts_with_symlinks(src, tmp_path):
    dst = tmp_path / "farskip"
    result = convert(src, dst)
    assert result.returncode == 0, result.stderr
    assert "converted layers 0..3 (4 of 4)" in result.stdout

    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((dst / "config.json").read_text())
    assert not (dst / "config.json").is_symlink()
    assert cfg == {**src_cfg, **FarSkipConfig(enabled=True).to_hf_keys()}

    entries = {p.name for p in src.iterdir()} - {"config.json"}
    assert {p.name for p in dst.iterdir()} == entries | {"config.json"}
    for name in entries:
        link = dst / name
        assert link.is_symlink(), name  # linked, not copied
        assert link.resolve() == (src / name).resolve()
    assert (dst / "extras" / "README").read_text() == "kept\n"
    assert "farskip" not in json.loads((src / "config.json").read_text())  # SRC untouched


def test_layer_range_and_variant(src, tmp_path):
    dst = tmp_path / "partial"
    result = convert(src, dst, "--start-layer", 1, "--end-layer", 2, "--attn-only")
    assert result.returncode == 0, result.stderr
    assert "FarSkip attention-only, converted layers 1..2 (2 of 4)" in result.stdout
    farskip = FarSkipConfig.from_hf_config(json.loads((dst / "config.json").read_text()))
    assert farskip == FarSkipConfig(enabled=True, start_idx=1, end_idx=2, attn_only=True)


def test_force_replaces_existing(src, tmp_path):
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "old-file").write_text("old")
    result = convert(src, dst, "--mlp-only", "--force")
    assert result.returncode == 0, result.stderr
    assert not (dst / "old-file").exists()
    assert json.loads((dst / "config.json").read_text())["mlp_only_farskip"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no temp dirs left behind


def _llama(tmp_path: Path) -> Path:
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}))
    return path


def _no_config(tmp_path: Path) -> Path:
    path = tmp_path / "noconfig"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


def _bad_json(tmp_path: Path) -> Path:
    path = tmp_path / "badjson"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    return path


# (id, SRC maker (None = the good checkpoint), extra flags, words the message must contain)
BAD_INPUTS = [
    ("missing-src", lambda tmp, good: tmp / "nope", [], ["does not exist"]),
    ("no-config", lambda tmp, good: _no_config(tmp), [], ["no config.json"]),
    ("bad-json", lambda tmp, good: _bad_json(tmp), [], ["not valid JSON"]),
    ("llama", lambda tmp, good: _llama(tmp), [], ["LlamaForCausalLM", "only defined for DeepSeek-V3"]),
    ("inverted-range", None, ["--start-layer", "3", "--end-layer", "1"], ["empty layer range", "--end-layer"]),
    ("start-beyond", None, ["--start-layer", "4"], ["beyond the model's last layer 3", "--start-layer"]),
    ("negative-start", None, ["--start-layer", "-1"], ["negative"]),
    ("both-variants", None, ["--attn-only", "--mlp-only"], ["--attn-only and --mlp-only", "at most one"]),
    ("not-an-int", None, ["--start-layer", "two"], ["--start-layer", "invalid int"]),
]


@pytest.mark.parametrize("make_src, flags, words", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(src, tmp_path, make_src, flags, words):
    source = src if make_src is None else make_src(tmp_path, src)
    dst = tmp_path / "out"
    result = convert(source, dst, *flags)
    _assert_clean_error(result, words)
    assert not dst.exists()


def test_existing_nonempty_dst_without_force(src, tmp_path):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = convert(src, dst)
    _assert_clean_error(result, ["not empty", "--force"])
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]  # untouched


def test_dst_is_src(src):
    result = convert(src, src)
    _assert_clean_error(result, ["source checkpoint itself"])
    assert not (src / "config.json").is_symlink() and "farskip" not in (src / "config.json").read_text()


def test_dst_inside_src(src):
    result = convert(src, src / "farskip")
    _assert_clean_error(result, ["inside SRC"])
    assert not (src / "farskip").exists()


def test_main_in_process(src, tmp_path, capsys):
    assert main([str(src), str(tmp_path / "ok")]) == 0
    assert main([str(src), str(tmp_path / "bad"), "--start-layer", "9"]) == 2
    assert "error: --start-layer 9" in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "bad"), "--attn-only", "--mlp-only"]) == 2
    assert not (tmp_path / "bad").exists()


def _assert_clean_error(result: subprocess.CompletedProcess, words: list[str]) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert result.stdout == ""


def test_shard_files_are_the_index_or_every_safetensors(tmp_path):
    """checkpoint.shard_files, the one listing of a checkpoint's weight files (launcher gate
    check, reference loader, FCSD): the index's shards when there is one, as SGLang loads."""
    from sglang_farskip import checkpoint

    for name in ("a.safetensors", "b.safetensors", "stray.safetensors", "notes.txt"):
        (tmp_path / name).write_text("")
    every = [tmp_path / n for n in ("a.safetensors", "b.safetensors", "stray.safetensors")]
    assert checkpoint.shard_files(tmp_path) == every
    index = {"weight_map": {"model.layers.0.self_attn.gate_proj.weight": "b.safetensors",
                            "lm_head.weight": "a.safetensors"}}
    (tmp_path / checkpoint.INDEX).write_text(json.dumps(index))
    assert checkpoint.shard_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    assert checkpoint.shard_files(tmp_path, holding=checkpoint.GATE_KEY.match) == [tmp_path / "b.safetensors"]
