"""Bad input to `python -m sglang_farskip.launch_server`: one clear `error:` line, exit code 2,
within a bounded time, and no server left behind."""

from __future__ import annotations

import json

import pytest

from sglang_farskip.demo_model import ensure_demo_checkpoint

from serverutil import assert_fails, launch


def write_config(path, **overrides) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4,
              "farskip": True, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_missing_model_path(tmp_path):
    assert_fails(launch(["--model-path", str(tmp_path / "nope")]), "does not exist", "--model-path")


def test_model_path_is_a_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    assert_fails(launch(["--model-path", str(f)]), "is not a directory")


def test_missing_config_json(tmp_path):
    assert_fails(launch(["--model-path", str(tmp_path)]), "has no config.json")


def test_unparseable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert_fails(launch(["--model-path", str(tmp_path)]), "not valid JSON")


def test_unreadable_config_json(tmp_path):
    # Tests run as root, so chmod cannot make a file unreadable; a directory named
    # config.json fails the read the same way (EISDIR).
    (tmp_path / "config.json").mkdir()
    assert_fails(launch(["--model-path", str(tmp_path)]), "cannot read")


@pytest.mark.parametrize("overrides, fragments", [
    ({"farskip_start_idx": 3, "farskip_end_idx": 1}, ["empty FarSkip layer range", "farskip_end_idx"]),
    ({"farskip_start_idx": 9}, ["no layer would be converted", "farskip_start_idx"]),
    ({"attn_only_farskip": True, "mlp_only_farskip": True}, ["both true", "at most one"]),
    ({"farskip": "yes"}, ["must be true or false"]),
    ({"architectures": ["LlamaForCausalLM"]}, ["LlamaForCausalLM", "DeepseekV3ForCausalLM and InstellaMoEForCausalLM only"]),
])
def test_bad_farskip_config(tmp_path, overrides, fragments):
    proc = launch(["--model-path", write_config(tmp_path, **overrides)])
    assert_fails(proc, *fragments)
    # Refused before SGLang starts anything: it logs its settings when it launches.
    assert "server_args=" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flags, fragment", [
    (["--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"], "--moe-a2a-backend none"),
    (["--pp-size", "2"], "--pp-size 1"),
    (["--enforce-shared-experts-fusion"], "drop --enforce-shared-experts-fusion"),
])
def test_unsupported_flag_combination(flags, fragment):
    proc = launch(["--model-path", str(ensure_demo_checkpoint()), *flags])
    assert_fails(proc, "FarSkip cannot run", fragment)


def test_unknown_farskip_mode():
    proc = launch(["--farskip-mode", "fast"])
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_plugin_not_loaded_is_an_error():
    """SGLANG_PLUGINS limits SGLang to the CPU-fix plugin, as a broken install would: the
    registry then holds upstream's class, and the launcher must refuse to serve."""
    proc = launch(["--model-path", str(ensure_demo_checkpoint())], env={"SGLANG_PLUGINS": "farskip_cpu"})
    assert_fails(proc, "plugin did not register")
