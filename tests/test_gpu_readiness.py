"""GPU overlap readiness, checked on a CPU (no GPU is lent to this project yet):

- the launcher refuses, with one `error:` line naming the flag and the fix, the settings that
  give wrong results with FarSkip (a replicated dense MLP would be summed TP times over) or
  cannot live with its in-flight all-reduces in overlap mode (torch.compile cannot trace them;
  decode context parallelism runs collectives of its own inside attention meanwhile), and
  accepts them where they are fine (sync mode, or off the GPU side stream);
- with the GPU side stream, prefill CUDA graphs are turned off unless the user chose a backend
  (SGLang's default breakable prefill graph ends a segment at every attention, while the routed
  sum is still in flight, and CUDA refuses a wait in the next segment); on a GPU the profiler
  is refused while graphs could replay (its timings are CUDA events recorded by Python, which a
  replay does not run);
- bench/device_check.py imports without a GPU, and its CPU-checkable parts are right.

Launcher checks run SGLang's real argument resolution; one subprocess imports SGLang once and
tries every case, because each import costs ~20 s here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_farskip.demo_model import ensure_demo_checkpoint

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# argv -> the problem lines prepare() raises (or [] when it accepts). Also the side-stream-only
# rules, applied to the same resolved args as the model would on a GPU.
_PROBE = r'''
import json, sys, types
from sglang_farskip import launch_server as L
from sglang_farskip.compat import unsupported
from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        L.prepare(["--device", "cpu", *argv])
        out[name] = {"error": None}
    except L.LaunchError as e:
        out[name] = {"error": str(e)}
graphs_on = types.SimpleNamespace(cuda_graph_config=default_cuda_graph_config(), tp_size=2)
graphs_off = types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
    decode=types.SimpleNamespace(backend="disabled"), prefill=types.SimpleNamespace(backend="disabled")), tp_size=2)
out["profile_graphs_on"] = unsupported(graphs_on, gpu_profiling=True)
out["profile_graphs_off"] = unsupported(graphs_off, gpu_profiling=True)
out["profile_cpu"] = unsupported(graphs_on, gpu_profiling=False)
print("PROBE " + json.dumps(out))
'''

CASES = {
    "dense_tp1": ["--tp", "2", "--moe-dense-tp-size", "1"],
    "dense_tp1_sync": ["--tp", "2", "--moe-dense-tp-size", "1", "--farskip-mode", "sync"],
    "compile": ["--enable-torch-compile"],
    "compile_sync": ["--enable-torch-compile", "--farskip-mode", "sync"],
    "dcp": ["--tp", "2", "--dcp-size", "2"],
    "bad_ctas": ["--farskip-side-max-ctas", "0"],
}


@pytest.fixture(scope="module")
def probe():
    path = str(ensure_demo_checkpoint())
    cases = {k: ["--model-path", path, *v] for k, v in CASES.items()}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("PROBE "):])


def _one_problem(result, *fragments):
    assert result["error"] is not None, result
    assert "FarSkip cannot run" in result["error"]
    (line,) = [line for line in result["error"].splitlines()[1:] if all(f in line for f in fragments)]
    return line


def test_replicated_dense_mlp_is_refused_in_both_modes(probe):
    # With --moe-dense-tp-size 1 the dense MLP output is complete on every rank; FarSkip's
    # all-reduce would multiply it by the TP size, in sync mode as much as in overlap.
    for case in ("dense_tp1", "dense_tp1_sync"):
        _one_problem(probe[case], "moe_dense_tp_size=1", "drop --moe-dense-tp-size")


def test_torch_compile_is_refused_in_overlap_only(probe):
    _one_problem(probe["compile"], "enable_torch_compile=True", "drop --enable-torch-compile",
                 "--farskip-mode sync")
    assert probe["compile_sync"]["error"] is None


def test_decode_context_parallel_is_refused_in_overlap(probe):
    _one_problem(probe["dcp"], "dcp_size=2", "use --dcp-size 1", "--farskip-mode sync")


def test_deterministic_inference_is_refused_on_the_side_stream_only():
    # SGLang itself refuses deterministic inference with the CPU attention backend, so the rule
    # is checked on its own: only FarSkip's own NCCL communicator breaks batch invariance; on
    # the CPU comm thread the sum is SGLang's gloo all-reduce, as in sync mode.
    from sglang_farskip.compat import unsupported

    args = type("Args", (), {"enable_deterministic_inference": True})()
    (line,) = unsupported(args, overlap=True, side_stream=True)
    assert "drop --enable-deterministic-inference" in line and "--farskip-mode sync" in line
    assert unsupported(args, overlap=True, side_stream=False) == []


def test_gpu_profiler_needs_graphs_off(probe):
    # GPU timings come from CUDA events recorded by Python at launch and join; graphs
    # would replay without them (decode FULL graphs are SGLang's default on a GPU).
    (line,) = probe["profile_graphs_on"]
    assert "--disable-cuda-graph" in line and "--farskip-profile-dir" in line
    assert probe["profile_graphs_off"] == [] and probe["profile_cpu"] == []


def test_side_max_ctas_must_be_positive(probe):
    assert "--farskip-side-max-ctas 0" in probe["bad_ctas"]["error"]


def test_gpu_overlap_turns_prefill_graphs_off_unless_chosen():
    """The launcher reads the user's flags with SGLang's own parser, so the `=` form, the alias
    --disable-prefill-cuda-graph and abbreviations count as a choice just like the plain flag."""
    from sglang_farskip.launch_server import GivenArgs, gpu_overlap_graph_args

    model = ["--model-path", "/m"]
    assert gpu_overlap_graph_args(GivenArgs([*model, "--tp", "8"])) == ["--cuda-graph-backend-prefill", "disabled"]
    for chosen in (["--cuda-graph-backend-prefill", "breakable"], ["--cuda-graph-backend-prefill=full"],
                   ["--disable-cuda-graph"], ["--disable-prefill-cuda-graph"], ["--cuda-graph-backend-pre=full"]):
        assert gpu_overlap_graph_args(GivenArgs([*model, *chosen])) == [], chosen


def test_given_args_resolve_aliases_and_forms():
    from sglang_farskip.launch_server import GivenArgs

    given = GivenArgs(["--model", "/m", "--tp=4", "--device=cpu"])
    assert given.get("--model-path") == "/m" and given.get("--tp-size") == 4 and given.get("--device") == "cpu"
    assert "--nnodes" not in given and given.get("--nnodes", 1) == 1
    assert "--max-total-tokens" not in given and "--attention-backend" not in given


# ------------------------------------------------------------------ bench/device_check.py on a CPU
@pytest.fixture(scope="module")
def device_check():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import device_check

    return device_check


def test_device_check_checkpoint_is_a_valid_farskip_v3(device_check, tmp_path):
    from sglang_farskip.launch_server import check_farskip, read_checkpoint_config

    path = device_check.write_checkpoint(tmp_path / "v3")
    config = read_checkpoint_config(str(path))
    farskip = check_farskip(config, str(path))
    assert farskip.converted_layers(config["num_hidden_layers"]) == [0, 1, 2]
    # DeepSeek-V3's own shapes (its config.json), which the items' timings and memory are
    # about: a shrunken model would pass every item and say nothing about the real one.
    v3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
          "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
          "first_k_dense_replace": 1, "vocab_size": 129280}
    assert {k: config[k] for k in v3} == v3
    # The memory and priority items build their messages from HIDDEN in bfloat16; the server
    # item's model must send the same, or the memory item measures a size serving never sends.
    assert device_check.HIDDEN == config["hidden_size"] and config["torch_dtype"] == "bfloat16"


def test_device_check_workload_covers_the_issue_cases(device_check):
    cases = {name: (prompts, new) for name, prompts, new in device_check.workload()}
    assert [len(cases[f"prompt-{n}"][0][0]) for n in (1, 100, 4096)] == [1, 100, 4096]
    long_prompt = cases["prompt-4096"][0][0]
    prefix = cases["prefix>chunk"][0][0]
    assert prefix[:4096] == long_prompt and len(long_prompt) > device_check.CHUNK
    assert [len(cases[f"decode-bs{b}"][0]) for b in (1, 3, 64)] == [1, 3, 64]
    # Only "prefix>chunk" may find a cached prefix: any other prompt sharing a start with an
    # earlier one would be served as an extend, not the prefill or decode its case names.
    def common_start(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    sent = []
    for name, prompts, _ in device_check.workload():
        for prompt in prompts:
            shared = max((common_start(prompt, earlier) for earlier in sent), default=0)
            assert shared == (4096 if name == "prefix>chunk" else 0), (name, shared)
            sent.append(prompt)
    # bs 3 is not a captured decode size, so it runs padded to the graph of 4.
    bs = device_check.SERVER_COMMON[device_check.SERVER_COMMON.index("--cuda-graph-bs-decode") + 1:][:3]
    assert "3" not in bs and "4" in bs


def test_device_check_servers_force_the_side_stream_except_sync(device_check):
    from sglang_farskip.launch_server import _split_own_flags

    for variant in device_check.SERVER_VARIANTS:
        argv = device_check.server_argv("/m", variant, 1234)
        forced = "--farskip-test-force-side-stream" in argv
        assert forced == (variant != "sync")
        if forced:
            assert "--farskip-gpu-overlap" in argv
            own, _ = _split_own_flags(argv)
            assert own.farskip_test_force_side_stream and own.farskip_gpu_overlap
    assert ("overlap", "sync", 0.0) in device_check.SERVER_CHECKS
    assert ("blocking", "overlap", 0.0) in device_check.SERVER_CHECKS
    own, _ = _split_own_flags(device_check.server_argv("/m", "blocking", 1234))
    assert own.farskip_mode == "blocking"


def _seq(ids, lps, tops):
    return {"ids": ids, "logprobs": lps, "top": tops}


def test_device_check_compare_is_bitwise_or_tie_aware(device_check):
    compare = device_check.compare
    a = {"c": [_seq([5, 6], [-1.0, -2.0], [[(-1.0, 5), (-1.05, 7)], [(-2.0, 6), (-3.0, 9)]])]}
    assert compare(a, a, 0.0) == []
    nudged = {"c": [_seq([5, 6], [-1.0, -2.0 + 1e-6], a["c"][0]["top"])]}
    assert compare(a, nudged, 0.0) and compare(a, nudged, 0.1) == []
    near_tie = {"c": [_seq([7, 1], [-1.05, -9.0], a["c"][0]["top"])]}  # 7 was 0.05 behind 5
    assert compare(a, near_tie, 0.1) == []
    assert compare(a, near_tie, 0.01)  # not within this tolerance
    wrong = {"c": [_seq([9, 6], [-1.0, -2.0], a["c"][0]["top"])]}  # 9 was not a contender
    assert compare(a, wrong, 0.1)


def test_device_check_summary_and_cpu_refusal(device_check):
    text, ok = device_check.summary([("a", True, "x"), ("b", False, "y")])
    assert text.splitlines() == ["PASS a: x", "FAIL b: y", "SUMMARY 1/2 passed: b"] and not ok
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "device_check.py"), "--items", "memory"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: no CUDA/HIP device" in proc.stderr
