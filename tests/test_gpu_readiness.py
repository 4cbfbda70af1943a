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
- python/sglang_farskip/checks/device.py imports without a GPU, and its CPU-checkable parts are right: the
  server item's checkpoint, workload and variants, and its scoring against reference.py run on
  two real CPU servers, one with the broken-lane control (--farskip-test-drop-partial), which
  the scoring must catch.

Launcher checks run SGLang's real argument resolution; one subprocess imports SGLang once and
tries every case, because each import costs ~20 s here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_farskip.tools.demo_model import ensure_demo_checkpoint

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# argv -> the problem lines prepare() raises (or [] when it accepts). Also the side-stream-only
# rules, applied to the same resolved args as the model would on a GPU.
_PROBE = r'''
import json, sys, types
from sglang_farskip.serve import launcher as L
from sglang_farskip.parallel import unsupported
from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        L.prepare(["--device", "cpu", *argv])
        out[name] = {"error": None}
    except L.UserError as e:
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
    from sglang_farskip.parallel import unsupported

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
    from sglang_farskip.serve.launcher import GivenArgs, gpu_overlap_graph_args

    model = ["--model-path", "/m"]
    assert gpu_overlap_graph_args(GivenArgs([*model, "--tp", "8"])) == ["--cuda-graph-backend-prefill", "disabled"]
    for chosen in (["--cuda-graph-backend-prefill", "breakable"], ["--cuda-graph-backend-prefill=full"],
                   ["--disable-cuda-graph"], ["--disable-prefill-cuda-graph"], ["--cuda-graph-backend-pre=full"]):
        assert gpu_overlap_graph_args(GivenArgs([*model, *chosen])) == [], chosen


def test_given_args_resolve_aliases_and_forms():
    from sglang_farskip.serve.launcher import GivenArgs

    given = GivenArgs(["--model", "/m", "--tp=4", "--device=cpu"])
    assert given.get("--model-path") == "/m" and given.get("--tp-size") == 4 and given.get("--device") == "cpu"
    assert "--nnodes" not in given and given.get("--nnodes", 1) == 1
    assert "--max-total-tokens" not in given and "--attention-backend" not in given


# ------------------------------------------------------------------ python/sglang_farskip/checks/device.py on a CPU
@pytest.fixture(scope="module")
def device_check():
    from sglang_farskip.checks import device

    return device


def test_device_check_checkpoint_is_a_valid_farskip_v3(device_check, tmp_path):
    from sglang_farskip.serve.launcher import check_farskip

    config = device_check.server_model_config()
    farskip = check_farskip(config, "server item")
    assert farskip.converted_layers(config["num_hidden_layers"]) == [0, 1, 2]
    # DeepSeek-V3's own widths (its config.json), which the items' timings and memory are
    # about: a shrunken model would pass every item and say nothing about the real one. Fewer
    # experts (16, still top-8 over 8 groups of which 4 are kept) and vocabulary entries only
    # make the checkpoint writable in minutes.
    v3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
          "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1}
    assert {k: config[k] for k in v3} == v3
    assert config["n_routed_experts"] == 16 and config["n_routed_experts"] // config["n_group"] >= 2
    # Unit scale: a 7168-wide N(0, 1/7168) projection keeps unit activations unit.
    assert config["initializer_range"] == pytest.approx(7168 ** -0.5)
    # The longest prompt (4096 + 64 + 8 new) is within the YaRN range.
    longest = max(len(p) + new for _, prompts, new in device_check.workload() for p in prompts)
    rope = config["rope_parameters"]
    assert longest <= rope["factor"] * rope["original_max_position_embeddings"] <= config["max_position_embeddings"]
    # The memory and priority items build their messages from HIDDEN in bfloat16; the server
    # item's model must send the same, or the memory item measures a size serving never sends.
    assert device_check.HIDDEN == config["hidden_size"] and config["dtype"] == "bfloat16"


def test_device_check_workload_covers_the_issue_cases(device_check):
    cases = {name: (prompts, new) for name, prompts, new in device_check.workload()}
    assert [len(cases[f"prompt-{n}"][0][0]) for n in (1, 100, 4096)] == [1, 100, 4096]
    long_prompt = cases["prompt-4096"][0][0]
    prefix = cases["prefix>chunk"][0][0]
    assert prefix[:4096] == long_prompt and len(long_prompt) > device_check.CHUNK
    assert [len(cases[f"decode-bs{b}"][0]) for b in (1, 3, 64)] == [1, 3, 64]
    assert max(t for prompts, _ in cases.values() for p in prompts for t in p) < device_check.SERVER_MODEL["vocab_size"]
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
    from sglang_farskip.serve.launcher import _split_own_flags

    for variant in device_check.SERVER_VARIANTS:
        argv = device_check.server_argv("/m", variant, 1234)
        own, _ = _split_own_flags(argv)
        assert own.farskip_test_force_side_stream == (not variant.startswith("sync"))
        assert own.farskip_gpu_overlap == own.farskip_test_force_side_stream
        # only the control is broken
        assert (own.farskip_test_drop_partial is not None) == (variant == device_check.BROKEN)
    assert ("overlap", "sync") in device_check.BITWISE and ("blocking", "overlap") in device_check.BITWISE
    assert _split_own_flags(device_check.server_argv("/m", "blocking", 1234))[0].farskip_mode == "blocking"
    baseline, _ = _split_own_flags(device_check.server_argv("/m", device_check.BASELINE, 1234))
    assert baseline.farskip_mode == "sync" and "--disable-cuda-graph" in device_check.SERVER_VARIANTS[device_check.BASELINE]


def test_device_check_compare_is_bitwise(device_check):
    a = {"c": [{"ids": [5, 6], "logprobs": [-1.0, -2.0]}]}
    assert device_check.compare(a, a) == []
    assert device_check.compare(a, {"c": [{"ids": [5, 6], "logprobs": [-1.0, -2.0 + 1e-6]}]})
    assert device_check.compare(a, {"c": [{"ids": [5, 7], "logprobs": [-1.0, -2.0]}]})


def test_device_check_judge(device_check):
    tol, problems = device_check.judge({"base": 0.1, "graph": 0.15, "broken": 3.0}, "base", "broken")
    assert tol == pytest.approx(0.2) and problems == []
    _, problems = device_check.judge({"base": 0.1, "graph": 0.3, "broken": 3.0}, "base", "broken")
    assert problems == ["graph: 0.3 from the reference > tolerance 0.2"]
    tol, problems = device_check.judge({"base": 0.001, "broken": 0.04}, "base", "broken")
    assert tol == device_check.REF_TOL_FLOOR and "no power" in problems[0]


def test_device_check_summary_and_cpu_refusal(device_check):
    text, ok = device_check.summary([("a", True, "x"), ("b", False, "y")])
    assert text.splitlines() == ["PASS a: x", "FAIL b: y", "SUMMARY 1/2 passed: b"] and not ok
    proc = subprocess.run([sys.executable, "-m", "sglang_farskip.checks.device", "--items", "memory"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: no CUDA/HIP device" in proc.stderr


def test_drop_partial_is_validated():
    from sglang_farskip.errors import UserError
    from sglang_farskip.options import RuntimeOptions

    assert RuntimeOptions(drop_partial="routed:3").dropped_collective() == ("routed", 3)
    assert RuntimeOptions().dropped_collective() is None
    for bad in ("attn", "shared:1", "routed:x", "routed:-1"):
        with pytest.raises(UserError, match="LANE:LAYER with LANE one of attn, attn\\+shared, routed"):
            RuntimeOptions(drop_partial=bad)


def test_device_check_scoring_sees_the_broken_lane(device_check):
    """The server item's scoring, end to end on CPU: two real float32 servers of the demo model
    (overlap, and overlap with layer 1's attention + shared sum dropped), their outputs scored
    against reference.py by device_check's own functions. The clean server is its own baseline:
    float32 on both sides puts it within parity's 1e-4, so the tolerance is the floor, and the
    dropped sum must land far outside it."""
    import random

    from sglang_farskip.reference import load_reference

    from parity import FLOAT32, ONE_THREAD
    from sglang_farskip.testbed.servers import side_by_side

    ckpt = str(ensure_demo_checkpoint())
    rng = random.Random(1)
    cases = [("prefill", [[0] + [rng.randrange(2, 4096) for _ in range(30)]], 4),
             ("decode-bs2", [[rng.randrange(2, 4096) for _ in range(6)] for _ in range(2)], 8)]
    runs = {"clean": [], "broken": ["--farskip-test-drop-partial", device_check.BROKEN_LANE]}
    with side_by_side({name: {"args": ["--model-path", ckpt, *FLOAT32, *extra], "env": ONE_THREAD}
                       for name, extra in runs.items()}) as servers:
        outputs = {name: device_check.run_workload(s.url, cases) for name, s in servers.items()}
        assert "sums zeros" in servers["broken"].log_tail(400)
    model = load_reference(ckpt)
    errors = {name: device_check.reference_error(out, model, cases) for name, out in outputs.items()}
    assert errors["clean"] < 1e-4, errors
    tol, problems = device_check.judge(errors, "clean", "broken")
    assert problems == [] and errors["broken"] > 10 * tol, errors
