"""Bad input to `python -m sglang_farskip.launch_server`: one clear `error:` line, exit code 2,
within a bounded time, and no server left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_farskip.tools.demo_model import ensure_demo_checkpoint

from sglang_farskip.testbed.servers import TIME_BOUND_S, assert_fails, launch


def write_config(path, **overrides) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4,
              "farskip": True, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# Every refusal below is the launcher's prepare() raising before anything starts; each takes
# SGLang's argument parser (its import is ~11 s here), so one subprocess imports it once and
# tries every case in turn, each in a fresh copy of the environment. main() turns that error
# into the `error:` line and exit code 2: test_refusal_is_one_error_line_and_exit_2 checks that
# on a real launch.
_TRY_EACH = r"""
import json, os, sys
from unittest import mock
from sglang_farskip.serve import launcher as L
out = {}
for name, case in json.load(sys.stdin).items():
    argv, env = (case["argv"], case["env"]) if isinstance(case, dict) else (case, {})
    with mock.patch.dict(os.environ, env):
        try:
            L.prepare(argv)
            out[name] = None
        except L.UserError as e:
            out[name] = str(e)
print("RESULTS " + json.dumps(out))
"""

BAD_CONFIGS = {
    "empty_range": ({"farskip_start_idx": 3, "farskip_end_idx": 1}, ["empty FarSkip layer range", "farskip_end_idx"]),
    "range_past_end": ({"farskip_start_idx": 9}, ["no layer would be converted", "farskip_start_idx"]),
    "both_only": ({"attn_only_farskip": True, "mlp_only_farskip": True}, ["both true", "at most one"]),
    "not_a_bool": ({"farskip": "yes"}, ["must be true or false"]),
    "other_arch": ({"architectures": ["LlamaForCausalLM"]}, ["LlamaForCausalLM", "DeepseekV3ForCausalLM and InstellaMoEForCausalLM only"]),
}
UNSUPPORTED = {
    "tbo_deepep": (["--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"], "--moe-a2a-backend none"),
    "pp": (["--pp-size", "2"], "--pp-size 1"),
    "shared_fusion": (["--enforce-shared-experts-fusion"], "drop --enforce-shared-experts-fusion"),
}


GOOD_KEY = "sk-farskip-launcher-test-0001"
BAD_KEYS = {  # (argv, environment, fragments of the error)
    "empty_key_flag": (["--api-key="], {}, ["--api-key (or FARSKIP_API_KEY) is empty", "would check no key"]),
    "empty_key_env": ([], {"FARSKIP_API_KEY": ""}, ["is empty"]),
    "short_key_env": ([], {"FARSKIP_API_KEY": "short"}, ["is 5 characters long", "at least 16"]),
    "short_admin_key": (["--admin-api-key", "adm-short"], {}, ["--admin-api-key", "at least 16"]),
    "same_keys": (["--api-key", GOOD_KEY], {"FARSKIP_ADMIN_API_KEY": GOOD_KEY},
                  ["are the same key", "own key"]),
    "non_ascii_key": ([], {"FARSKIP_API_KEY": "sk-farskip-cl\u00e9-0123456789"}, ["other than printable ASCII"]),
    "key_and_key_file": ([], {"FARSKIP_API_KEY": GOOD_KEY, "FARSKIP_API_KEY_FILE": "/etc/hostname"},
                         ["FARSKIP_API_KEY and FARSKIP_API_KEY_FILE are both set", "keep one"]),
    "key_file_missing": ([], {"FARSKIP_ADMIN_API_KEY_FILE": "/nonexistent/key"},
                         ["FARSKIP_ADMIN_API_KEY_FILE=/nonexistent/key: cannot read the key", "mount the secret"]),
    "tokenizer_workers": (["--tokenizer-worker-num", "2"], {"FARSKIP_API_KEY": GOOD_KEY},
                          ["--tokenizer-worker-num", "leave it at 1"]),
}
# Settings that serve requests past the keys or the checks (options.UNCHECKED): refused unless
# named in --farskip-allow-unchecked. (argv, environment, fragments of the error, or None: accepted)
UNCHECKED = {
    "rust_server": ([], {"SGLANG_RUST_SERVER": "1"},
                    ["SGLANG_RUST_SERVER=1 serves the API from Rust", "--farskip-allow-unchecked rust-server"]),
    "grpc_port": (["--grpc-port", "50051"], {}, ["--grpc-port 50051 serves gRPC, which checks no API key",
                                                  "--farskip-allow-unchecked grpc"]),
    "grpc_port_env": ([], {"SGLANG_GRPC_PORT": "50051"}, ["--grpc-port 50051", "--farskip-allow-unchecked grpc"]),
    "custom_logit_processor": (["--enable-custom-logit-processor"], {},
                               ["runs code any key holder sends", "--farskip-allow-unchecked custom-logit-processor"]),
    "two_at_once": (["--grpc-port", "50051", "--enable-custom-logit-processor",
                     "--farskip-allow-unchecked", "grpc"], {},
                    ["--farskip-allow-unchecked custom-logit-processor"]),
    "unknown_name": (["--farskip-allow-unchecked", "grpc,everything"], {},
                     ["--farskip-allow-unchecked 'grpc,everything'", "unknown everything", "rust-server, grpc"]),
    "opted_in": (["--enable-custom-logit-processor", "--farskip-allow-unchecked", "custom-logit-processor"], {}, None),
}
FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}, "q_lora_rank": 1536}
BAD_WEIGHTS = {  # (config changes, flags, fragments of the error)
    "fp8_in_float32": (FP8, ["--dtype", "float32"], ["--dtype float32 with a block-FP8 checkpoint", "--dtype bfloat16"]),
    "fp8_in_float16_on_cpu": (FP8, ["--dtype", "float16"], ["--dtype float16", "bfloat16 on CPU"]),
    "fp8_q_lora_not_aligned": ({**FP8, "q_lora_rank": 96}, [], ["q_lora_rank 96 is not a multiple of 128"]),
    "other_quantization": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, [],
                           ["is not DeepSeek's block FP8", "python -m sglang_farskip.formats.quantize"]),
    "online_quantization_on_cpu": ({}, ["--quantization", "fp8"], ["--quantization fp8 on CPU", "sglang_farskip.formats.quantize"]),
}
BAD_LIMITS = {
    "max_n_zero": (["--farskip-max-n", "0"], ["--farskip-max-n 0", "at least 1"]),
    "max_logprobs_negative": (["--farskip-max-logprobs=-1"], ["--farskip-max-logprobs -1"]),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, str | None]:
    """{case: the launcher's error message, or None if it accepted the input}."""
    root = tmp_path_factory.mktemp("refusals")
    (root / "weights.bin").write_text("x")
    for name in ("no_config", "bad_json", "unreadable"):
        (root / name).mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    # Tests run as root, so chmod cannot make a file unreadable; a directory named
    # config.json fails the read the same way (EISDIR).
    (root / "unreadable" / "config.json").mkdir()
    demo = str(ensure_demo_checkpoint())
    cases = {
        "missing_model_path": ["--model-path", str(root / "nope")],
        "model_path_is_a_file": ["--model-path", str(root / "weights.bin")],
        "missing_config_json": ["--model-path", str(root / "no_config")],
        "unparseable_config_json": ["--model-path", str(root / "bad_json")],
        "unreadable_config_json": ["--model-path", str(root / "unreadable")],
        **{name: ["--model-path", write_config(root / name, **overrides)]
           for name, (overrides, _) in BAD_CONFIGS.items()},
        **{name: ["--model-path", demo, *flags] for name, (flags, _) in UNSUPPORTED.items()},
        "spec_eagle3": ["--model-path", demo, "--speculative-algorithm", "EAGLE3",
                        "--speculative-draft-model-path", demo],
        "start_method_on_gpu": ["--model-path", demo, "--device", "cuda", "--farskip-cpu-start-method", "spawn"],
        "tc_piecewise": ["--model-path", demo, "--farskip-gpu-overlap",
                         "--cuda-graph-backend-prefill", "tc_piecewise"],
        **{name: {"argv": ["--model-path", demo, *argv], "env": env} for name, (argv, env, _) in BAD_KEYS.items()},
        **{name: ["--model-path", demo, *argv] for name, (argv, _) in BAD_LIMITS.items()},
        **{name: {"argv": ["--model-path", demo, *argv], "env": env} for name, (argv, env, _) in UNCHECKED.items()},
        **{name: ["--model-path", write_config(root / name, **changes), *flags]
           for name, (changes, flags, _) in BAD_WEIGHTS.items()},
    }
    proc = subprocess.run([sys.executable, "-c", _TRY_EACH], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=4 * TIME_BOUND_S)  # 39 cases
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULTS "))


def assert_refused(message: str | None, *fragments: str) -> None:
    assert message is not None, "the launcher accepted it"
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_bad_keys_are_refused(refused, case):
    assert_refused(refused[case], *BAD_KEYS[case][2])
    assert GOOD_KEY not in refused[case]  # the message never repeats a key


@pytest.mark.parametrize("case", list(UNCHECKED))
def test_what_bypasses_the_keys_or_checks_is_refused_unless_named(refused, case):
    fragments = UNCHECKED[case][2]
    if fragments is None:
        assert refused[case] is None, refused[case]
    else:
        assert_refused(refused[case], *fragments)
        assert "\n" not in refused[case]  # one `error:` line


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_weights_sglang_cannot_compute_here_are_refused(refused, case):
    assert_refused(refused[case], *BAD_WEIGHTS[case][2])


@pytest.mark.parametrize("case", list(BAD_LIMITS))
def test_bad_request_limits_are_refused(refused, case):
    assert_refused(refused[case], *BAD_LIMITS[case][1])


def test_missing_model_path(refused):
    assert_refused(refused["missing_model_path"], "does not exist", "--model-path")


def test_model_path_is_a_file(refused):
    assert_refused(refused["model_path_is_a_file"], "is not a directory")


def test_missing_config_json(refused):
    assert_refused(refused["missing_config_json"], "has no config.json")


def test_unparseable_config_json(refused):
    assert_refused(refused["unparseable_config_json"], "not valid JSON")


def test_unreadable_config_json(refused):
    assert_refused(refused["unreadable_config_json"], "cannot read")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_farskip_config(refused, case):
    assert_refused(refused[case], *BAD_CONFIGS[case][1])


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_flag_combination(refused, case):
    assert_refused(refused[case], "FarSkip cannot run", UNSUPPORTED[case][1])


def test_tc_piecewise_prefill_graphs_are_refused_with_overlap(refused):
    # torch.compile-based prefill graphs would trace the in-flight collectives. SGLang 0.5.23
    # already rejects the value when parsing; compat refuses it where a version still takes it.
    import types

    from sglang_farskip.parallel import unsupported

    assert_refused(refused["tc_piecewise"], "invalid SGLang arguments")
    phase = types.SimpleNamespace
    args = phase(cuda_graph_config=phase(decode=phase(backend="full"), prefill=phase(backend="tc_piecewise")))
    (line,) = unsupported(args, overlap=True, side_stream=True)
    assert "tc_piecewise" in line and "--cuda-graph-backend-prefill" in line and "--farskip-mode sync" in line
    assert unsupported(args, overlap=False) == []


def test_untested_speculative_decoding_is_refused(refused):
    assert_refused(refused["spec_eagle3"], "FarSkip cannot run", "EAGLE (DeepSeek's NextN layer", "EAGLE or NGRAM")


def test_cpu_start_method_is_refused_on_a_gpu(refused):
    assert_refused(refused["start_method_on_gpu"], "--farskip-cpu-start-method applies to CPU runs only")


def test_refusal_is_one_error_line_and_exit_2(tmp_path):
    proc = launch(["--model-path", write_config(tmp_path, farskip_start_idx=9)])
    assert_fails(proc, "no layer would be converted", "farskip_start_idx")
    # Refused before SGLang starts anything: it logs its settings when it launches.
    assert "server_args=" not in proc.stderr, proc.stderr[-2000:]


def test_unknown_farskip_mode():
    proc = launch(["--farskip-mode", "fast"])
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_plugin_not_loaded_is_an_error():
    """SGLANG_PLUGINS limits SGLang to the CPU-fix plugin, as a broken install would: the
    registry then holds upstream's class, and the launcher must refuse to serve, naming the
    boundary rows that are not in place."""
    proc = launch(["--model-path", str(ensure_demo_checkpoint())], env={"SGLANG_PLUGINS": "farskip_cpu"})
    assert_fails(proc, "plugin did not put in place", "registry sglang.srt.models.registry.ModelRegistry.models")
