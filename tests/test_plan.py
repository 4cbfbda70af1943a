"""sglang_farskip.plan (python -m sglang_farskip.plan): the schedule it replays, the cluster tables it reads, the bounds it must obey,
and the figures docs/planner.md says it reproduces; its memory figures (memory.py) against
DeepSeek's published sizes. Pure Python but for torch, which fp8.py (the FP8 tensor rule) imports."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from sglang_farskip.errors import UserError
from sglang_farskip.formats import fp8
from sglang_farskip.plan import cli, collectives, hardware, memory, report, shapes, simulation
from sglang_farskip.plan import pd as plan_pd

REPO = Path(__file__).resolve().parents[1]

DSV3 = shapes.load_shape("deepseek-v3")

# A few rows of a real two-node all_reduce_perf run's format (nccl-tests 2.13: root column,
# #wrong per half), behind mpirun --tag-output prefixes as rccl-tests logs often are.
SAMPLE = """\
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
[1,0]<stdout>:#
[1,0]<stdout>:# Using devices
[1,0]<stdout>:#  Rank  0 Group  0 Pid 101 on    node-a device  0 [0x1b] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  1 Group  0 Pid 102 on    node-a device  1 [0x2c] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  2 Group  0 Pid 201 on    node-b device  0 [0x1b] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  3 Group  0 Pid 202 on    node-b device  1 [0x2c] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#
[1,0]<stdout>:#                                                              out-of-place                       in-place
[1,0]<stdout>:#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
[1,0]<stdout>:#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:        8192          4096      bf16     sum      -1    40.10    0.20    0.31      0    39.50    0.21    0.31      0
[1,0]<stdout>:       16384          8192      bf16     sum      -1    44.00    0.37    0.56      0    42.00    0.39    0.59      0
[1,0]<stdout>:     1048576        524288      bf16     sum      -1    95.20   11.01   16.52      0    96.80   10.83   16.25      0
[1,0]<stdout>:    16777216       8388608      bf16     sum      -1   301.5    55.65   83.47      0   300.0    55.92   83.89      0
[1,0]<stdout>:# Out of bounds values : 0 OK
[1,0]<stdout>:# Avg bus bandwidth    : 25.1234
"""


def _plan(phase, comm, contention=0.0, shape=DSV3, tp=16, dp=1, gpu="H200", dtype="fp8"):
    layout = simulation.Layout(tp, dp, max(1, tp // 8))
    return simulation.make_plan(shape, layout, phase, hardware.Roofline(shape, hardware.BUILTIN_GPUS[gpu], dtype), comm, contention)


def _decode(batch, ctx=2048):
    return simulation.Phase("decode", batch, ctx, batch)


def _prefill(n, batch=1):
    return simulation.Phase("prefill", batch * n, n, batch)


def test_structural_ceiling_is_115_of_119_for_deepseek_v3():
    p = _plan(_decode(64), collectives.BUILTIN_CLUSTERS["nv-ib"])
    assert len(p.runs["stock"].collectives) == 122  # two blocking ARs per layer
    assert len(p.runs["sync"].collectives) == len(p.runs["overlap"].collectives) == 119
    assert p.windowed_count == (115, 119)
    assert round(p.windowed_share, 3) == 0.966
    exposed = [c for c in p.ideal.collectives if c.window_us == 0]
    assert [(c.layer, c.label) for c in exposed] == [(0, "AR(a+s)"), (1, "AR(a+s)"), (2, "AR(a+s)"), (60, "AR(r)")]


def test_lanes_hide_behind_the_windows_the_model_code_gives_them():
    p = _plan(_decode(64), collectives.BUILTIN_CLUSTERS["nv-ib"])
    by = {(c.layer, c.label): c for c in p.ideal.collectives}
    assert by[(10, "AR(a+s)")].window_ops == ("routed[10]",)
    assert by[(10, "AR(r)")].window_ops == ("norm[11]", "attention[11]")


def test_variants_move_the_waits():
    cfg = dict(shapes.BUILTIN_MODELS["deepseek-v3"], attn_only_farskip=True)
    p = _plan(_decode(64), collectives.BUILTIN_CLUSTERS["nv-ib"], shape=shapes.shape_from_config(cfg, "attn-only"))
    assert len(p.runs["sync"].collectives) == 3 * 3 + 58 * 3 - 3  # AR(a) apart, dense AR(a)+AR(s)
    labels = {c.label for c in p.ideal.collectives if c.window_us == 0}
    assert labels == {"AR(a)", "AR(s)", "AR(r)"}  # AR(a) is read at once by the MLP
    cfg = dict(shapes.BUILTIN_MODELS["deepseek-v3"], mlp_only_farskip=True)
    p = _plan(_decode(64), collectives.BUILTIN_CLUSTERS["nv-ib"], shape=shapes.shape_from_config(cfg, "mlp-only"))
    r_lane = [c for c in p.ideal.collectives if c.label == "AR(r)"]
    assert r_lane and all(c.window_us == 0 for c in r_lane)  # attention reads the full h


def test_reproduces_perf_model_decode_b1_h200():
    p = _plan(_decode(1), collectives.BUILTIN_CLUSTERS["nv-ib"])
    assert p.runs["stock"].step_us / 1000 == pytest.approx(13.1, abs=0.1)
    assert p.runs["overlap"].step_us / 1000 == pytest.approx(8.2, abs=0.1)
    assert p.speedup() == pytest.approx(1.61, abs=0.01)
    assert 1 / (1 - p.f) == pytest.approx(1.77, abs=0.01)


def test_reproduces_perf_model_paper_prefill():
    phase = _prefill(2048, batch=32)
    got = [_plan(phase, collectives.BUILTIN_CLUSTERS["mi300x-xgmi"], g, tp=8, gpu="MI300X", dtype="bf16").speedup()
           for g in (0.0, 0.15, 0.30)]
    assert [round(v, 2) for v in got] == [1.41, 1.33, 1.26]


@pytest.mark.parametrize("phase", [_decode(1), _decode(256), _decode(1024, 258), _prefill(2048), _prefill(8192)])
@pytest.mark.parametrize("cluster", ["amd-good", "amd-poor", "h100-tcpxo"])
@pytest.mark.parametrize("gamma", [0.0, 0.3])
def test_speedup_obeys_the_bounds(phase, cluster, gamma):
    p = _plan(phase, collectives.BUILTIN_CLUSTERS[cluster], gamma)
    assert 1.0 <= p.speedup() <= 1 / (1 - p.f) + 1e-9
    assert p.speedup() <= 1 / max(p.f, 1 - p.f) + 1e-9
    assert p.runs["overlap"].step_us >= p.ideal.step_us - 1e-6  # contention never helps
    assert p.runs["overlap"].hidden <= p.windowed_share + 1e-9


def test_free_communication_makes_all_modes_equal():
    free = collectives.LinkModel("free", "test", 16, mbit=1e30, latency_us=0.0)
    p = _plan(_prefill(4096), free, contention=0.3)
    steps = {m: r.step_us for m, r in p.runs.items()}
    assert steps["overlap"] == pytest.approx(steps["sync"], rel=1e-9)
    assert steps["sync"] == pytest.approx(steps["stock"], rel=1e-9)


def test_contention_stretches_only_overlapped_compute():
    busy = [(10.0, 20.0)]
    assert simulation._advance(0.0, 5.0, busy, 0.5) == 5.0  # done before the collective starts
    assert simulation._advance(0.0, 17.0, busy, 0.5) == 22.0  # 10 free, 5 at half speed in 10 us, 2 after
    assert simulation._advance(12.0, 2.0, busy, 0.5) == 16.0


def test_parses_all_reduce_perf_output(tmp_path):
    table = collectives.parse_nccl_tests(SAMPLE, "h100_2node.txt")
    assert table.ranks == 4
    assert table.points[0] == (8192, 39.5)  # in-place column by default
    assert collectives.parse_nccl_tests(SAMPLE, "x", column="out").points[-1] == (16777216, 301.5)
    assert table.us(4096) == 39.5  # latency floor below the table
    mid = math.sqrt(8192 * 16384)
    assert table.us(mid) == pytest.approx(math.sqrt(39.5 * 42.0))  # log-log between rows
    assert table.us(2 * 16777216) == pytest.approx(600.0)  # the last row's bandwidth beyond it
    f = tmp_path / "ar.txt"
    f.write_text(SAMPLE)
    assert cli.main(["--cluster", str(f), "--tp", "4", "--decode", "1"]) == 0


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_malformed_cluster_file_exits_2_with_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("# size count type\nthis is not a table\n")
    assert cli.main(["--cluster", str(bad), "--decode", "8"]) == 2
    assert "no nccl-tests table" in _one_error_line(capsys)
    assert cli.main(["--cluster", str(tmp_path / "absent.txt")]) == 2
    _one_error_line(capsys)


def _ops_file(tmp_path, rows):
    f = tmp_path / "ops.json"
    f.write_text(json.dumps({"source": "test", "dtype": "bf16", "per_op_us": rows}))
    return f


def _full_ops(tp=16):
    rows = []
    for t, scale in ((64, 1.0), (1024, 16.0)):
        rows += [{"op": "attention_decode", "tokens": t, "context": c, "tp": tp, "us": 50 * scale * (c / 512)}
                 for c in (512, 2048)]
        rows += [{"op": op, "tokens": t, "context": 0, "tp": tp, "us": us * scale}
                 for op, us in (("shared_experts", 10), ("routed_experts", 100), ("dense_mlp", 30), ("norm_add", 4))]
    return rows


def test_measured_ops_interpolate_log_log(tmp_path):
    ops = hardware.MeasuredOps(str(_ops_file(tmp_path, _full_ops())))
    assert ops("routed_experts", 256, 0, 16) == pytest.approx(100 * 4)  # power law 1 between 64 and 1024
    assert ops("attention_decode", 64, 1024, 16) == pytest.approx(100)  # geometric midpoint of 50 and 200
    assert cli.main(["--ops", str(_ops_file(tmp_path, _full_ops())), "--decode", "256", "--context", "1024",
                      "--cluster", "nv-ib"]) == 0


def test_missing_or_malformed_ops_exit_2(tmp_path, capsys):
    rows = [r for r in _full_ops() if r["op"] != "routed_experts"]
    assert cli.main(["--ops", str(_ops_file(tmp_path, rows)), "--decode", "64"]) == 2
    assert "routed_experts" in _one_error_line(capsys)
    assert cli.main(["--ops", str(_ops_file(tmp_path, [{"op": "attention_decode", "tokens": -1}])), "--decode", "64"]) == 2
    assert "malformed" in _one_error_line(capsys)


# DP attention (docs/dp-attention.md): FarSkip keeps the residual for all T rows on every rank,
# so every lane is one AR of T x hidden over the group; stock gathers the MoE input and
# reduce-scatters its output (plus an attention-TP AR of the local rows when N/dp > 1).
def _dp_counts(run):
    out = {}
    for c in run.collectives:
        out[c.label] = out.get(c.label, 0) + 1
    return out


def test_dp_attention_lanes_hide_behind_the_model_codes_windows():
    p = _plan(_decode(256), collectives.BUILTIN_CLUSTERS["nv-ib"], tp=16, dp=2)
    by = {(c.layer, c.label): c for c in p.ideal.collectives}
    assert by[(10, "AR(a+s)")].window_ops == ("routed[10]",)  # A lane: attention partial + shared
    assert by[(10, "AR(r)")].window_ops == ("norm[11]", "attention[11]")  # R lane: next attention
    x = p.costs.ar_layer
    assert all(c.us == x for c in p.ideal.collectives)  # every FarSkip collective: one AR of T x hidden
    exposed = [(c.layer, c.label) for c in p.ideal.collectives if c.window_us == 0]
    assert exposed == [(-1, "AR(embed)"), (0, "AR(a+s)"), (1, "AR(a+s)"), (2, "AR(a+s)"), (60, "AR(r)")]
    assert _dp_counts(p.runs["sync"]) == _dp_counts(p.runs["overlap"]) == {"AR(embed)": 1, "AR(a+s)": 61, "AR(r)": 58}
    # no attention-TP AR of its own in FarSkip; stock waits it, the gather and the reduce-scatter
    assert _dp_counts(p.runs["stock"]) == {"AR_attn(a)": 61, "AG(x)": 61, "RS(s+r)": 61}
    assert [c.stall_us for c in p.runs["stock"].collectives] == pytest.approx([c.us for c in p.runs["stock"].collectives])
    assert p.costs.ar_attn == pytest.approx(collectives.BUILTIN_CLUSTERS["nv-ib"].us(256 / 2 * DSV3.hidden * 2))
    attn_ar = {round(c.link_bytes) for c in p.runs["stock"].collectives if c.label == "AR_attn(a)"}
    assert attn_ar == {round(2 * 7 / 8 * 128 * DSV3.hidden * 2)}  # 128 local rows over attention TP 8


def test_dp_embedding_gather_is_one_exposed_all_reduce():
    comm = collectives.BUILTIN_CLUSTERS["mi300x-xgmi"]
    for run in ("sync", "overlap"):
        p = _plan(_decode(256), comm, tp=8, dp=8)
        embed = [c for c in p.runs[run].collectives if c.label == "AR(embed)"]
        assert len(embed) == 1 and embed[0].layer == -1 and embed[0].window_us == 0
        assert embed[0].stall_us == pytest.approx(p.costs.ar_layer)  # exposed in full, even in overlap
        assert embed[0].link_bytes == pytest.approx(2 * 7 / 8 * 256 * DSV3.hidden * 2)
    assert not [c for c in p.runs["stock"].collectives if c.label == "AR(embed)"]
    assert not [c for c in _plan(_decode(256), comm, tp=8).runs["sync"].collectives if c.label == "AR(embed)"]


def test_dp_sync_step_is_compute_plus_every_all_reduce():
    """FarSkip-sync waits each collective: its step is compute + (1 embedding gather + 61 A lanes
    + 58 R lanes) x AR(T x hidden). Fails if the embedding gather were dropped."""
    p = _plan(_prefill(4096), collectives.BUILTIN_CLUSTERS["mi300x-xgmi"], tp=8, dp=8)
    c, sync = p.costs, p.runs["sync"]
    assert sync.comm_us == pytest.approx(120 * c.ar_layer)
    assert sync.exposed_us == pytest.approx(120 * c.ar_layer)
    assert sync.step_us == pytest.approx(sync.compute_us + 120 * c.ar_layer)
    moe = sum(DSV3.is_moe(k) for k in range(61))
    compute = 61 * c.attn + moe * (c.shared + c.routed) + (61 - moe) * c.dense + 123 * c.norm_rows + c.head
    assert sync.compute_us == pytest.approx(compute)
    # the overlap run still waits the embedding gather, the 3 dense A lanes and the last R lane
    assert p.runs["overlap"].exposed_us >= 5 * c.ar_layer - 1e-6


def test_dp_at_d_equal_n_farskip_moves_twice_stocks_bytes_per_moe_layer():
    link = collectives.LinkModel("link", "test", 8, mbit=400_000, latency_us=0.0)  # pure bandwidth
    p = _plan(_decode(256), link, tp=8, dp=8)
    assert p.layout.attn_tp == 1 and p.costs.ar_attn == 0.0
    for k in (3, 30, 60):
        fs = sum(c.link_bytes for c in p.runs["overlap"].collectives if c.layer == k)
        st = sum(c.link_bytes for c in p.runs["stock"].collectives if c.layer == k)
        assert fs == pytest.approx(2 * st)
        assert st == pytest.approx(2 * 7 / 8 * 256 * DSV3.hidden * 2)  # AG + RS = one ring AR's bytes
        fs_us = sum(c.us for c in p.runs["overlap"].collectives if c.layer == k)
        assert fs_us == pytest.approx(2 * sum(c.us for c in p.runs["stock"].collectives if c.layer == k))
    # over the step: 120 ARs against 61 gathers + 61 reduce-scatters
    assert p.runs["sync"].link_bytes == pytest.approx(120 / 61 * p.runs["stock"].link_bytes)


def test_dp_free_communication_makes_all_modes_equal_but_for_the_row_work():
    free = collectives.LinkModel("free", "test", 16, mbit=1e30, latency_us=0.0)
    for phase in (_decode(256), _prefill(4096)):
        p = _plan(phase, free, contention=0.3, tp=16, dp=4)
        steps = {m: r.step_us for m, r in p.runs.items()}
        assert steps["overlap"] == pytest.approx(steps["sync"], rel=1e-9)
        # FarSkip's norms run on all T rows (the residual of the group), stock's on T/dp
        rows = 123 * (p.costs.norm_rows - p.costs.norm)
        assert rows > 0
        assert steps["sync"] - steps["stock"] == pytest.approx(rows, rel=1e-9)


@pytest.mark.parametrize("cluster", ["amd-good", "amd-poor", "nv-ib"])
@pytest.mark.parametrize("phase", [_decode(1), _decode(256), _prefill(4096)])
@pytest.mark.parametrize("dp", [2, 4, 16])
def test_dp_steps_obey_their_floors(cluster, phase, dp):
    p = _plan(phase, collectives.BUILTIN_CLUSTERS[cluster], 0.15, tp=16, dp=dp)
    o, s = p.runs["overlap"], p.runs["sync"]
    assert o.step_us <= s.step_us + 1e-6
    assert o.step_us >= max(o.compute_us, o.comm_us) - 1e-6  # one FIFO stream, one compute stream
    assert p.speedup() <= 1 / (1 - p.f) + 1e-9  # stock's exposed share still bounds it (more bytes, not fewer)


def test_dp_partial_conversions_plan_with_the_same_lanes():
    cfg = dict(shapes.BUILTIN_MODELS["deepseek-v3"], attn_only_farskip=True)
    p = _plan(_decode(256), collectives.BUILTIN_CLUSTERS["nv-ib"], shape=shapes.shape_from_config(cfg, "attn-only"), dp=2)
    assert len(p.runs["sync"].collectives) == 1 + 3 * 3 + 58 * 3 - 3  # the embedding gather, then as under TP


def test_dp_cli_prints_the_dp_view(capsys):
    assert cli.main(["--tp", "8", "--dp", "8", "--decode", "256"]) == 0
    out = capsys.readouterr().out
    assert "AR(embed)" in out and "embeddings" in out and "stock DP, every MoE layer" in out
    assert "FarSkip moves 1.97x stock's link bytes" in out


def test_paper_json_and_plot(tmp_path, capsys):
    out = tmp_path / "paper.json"
    assert cli.main(["--paper", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1.34x" in text and "1.25x" in text
    records = json.loads(out.read_text())
    assert {r["cluster"] for r in records} >= {"mi300x-xgmi", "amd-good", "amd-poor"}
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    assert cli.main(["--prefill", "1024,4096", "--plot", str(png), "--json", str(js)]) == 0
    assert png.stat().st_size > 10_000
    assert json.loads(js.read_text())[1]["windowed"] == [115, 119]


def test_sync_f_calibration_hits_the_measured_share():
    free_ops = collectives.LinkModel("link", "test", 2, mbit=200, latency_us=0)
    p = _plan(_prefill(2048), free_ops, tp=16)
    q = simulation.calibrate_to_sync_f(p, 0.4, p_ops := hardware.Roofline(DSV3, hardware.BUILTIN_GPUS["H200"], "fp8"), free_ops, 0.0, {})
    sync = q.runs["sync"]
    assert sync.exposed_us / sync.step_us == pytest.approx(0.4)
    assert p_ops.measured is False


def test_testbed_ops_file_feeds_the_planner(tmp_path):
    """bench/plan_testbed.py (torch and the reference model, in a subprocess) times the
    bench model's ops and writes an --ops file that the planner reads for that model: every op of
    both phases measured, nothing extrapolated at the sizes it timed."""
    import subprocess

    from sglang_farskip.tools.demo_model import V3_BENCH, demo_config, kind_overrides

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(demo_config(kind_overrides("v3-bench")), farskip=True)))
    ops = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "plan_testbed.py"), "--config", str(cfg),
                           "--out", str(ops), "--prefill", "32,64", "--decode", "4,8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(ops.read_text())
    assert {r["op"] for r in doc["per_op_us"]} == {"attention_prefill", "attention_decode", "shared_experts",
                                                  "routed_experts", "dense_mlp", "norm_add"}
    assert all(r["us"] >= 1.0 and r["tp"] == 2 for r in doc["per_op_us"])
    for phase in (["--prefill", "64"], ["--decode", "8", "--context", "24"]):
        out = subprocess.run([sys.executable, "-m", "sglang_farskip.plan", "--model", str(cfg), "--tp", "2",
                              "--ops", str(ops), "--link-mbit", "200", *phase],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        # one sum for the dense layer, two per MoE layer; the dense one and the last AR(r) have no window
        n = 2 * V3_BENCH["num_hidden_layers"] - 1
        assert f"{n - 2} of {n} collectives" in out.stdout
        assert "extrapolated" not in out.stdout + out.stderr


# ================================================================== memory
# What the counts are compared with: DeepSeek's README_WEIGHTS.md and model card (671B in the main
# model, MTP 11.5B unique parameters + the 0.9B embedding and 0.9B head it copies, 685B in the
# repository) and the size of the FP8 repository deepseek-ai/DeepSeek-V3 (~688 GB of safetensors,
# FP8 experts and attention with their float32 block scales, the rest bf16).
def test_deepseek_v3_parameters_match_deepseeks_published_counts():
    w = memory.weights(DSV3, "bf16")
    embed = 129280 * 7168
    assert w.params == pytest.approx(671e9, rel=0.01)
    assert w.mtp_params - 2 * embed == pytest.approx(11.5e9, rel=0.02)  # "11.5B unique", rounded
    assert w.params + w.mtp_params == pytest.approx(685e9, rel=0.01)
    assert w.nbytes == 2 * (w.params + w.mtp_params)  # bf16: 2 bytes an element, 1.37 TB
    assert 1.34e12 <= w.nbytes <= 1.37e12


def test_deepseek_v3_fp8_bytes_are_the_released_checkpoints():
    w = memory.weights(DSV3, "fp8")
    assert w.nbytes == pytest.approx(688e9, rel=0.01)
    assert w.nbytes == 688_574_809_152  # pinned: the next test shows a changed tensor rule moves it


def test_fp8_bytes_follow_fp8_is_quantized(monkeypatch):
    """Plant a change in the rule (the router quantized too): the total moves by exactly the
    router's saving, so the pinned figure above fails; memory.py has no rule of its own."""
    rule = fp8.is_quantized
    monkeypatch.setattr(fp8, "is_quantized", lambda name: rule(name) or name.endswith(".mlp.gate.weight"))
    moved = memory.weights(DSV3, "fp8").nbytes
    routers = 58 + 1  # the MoE layers and the MTP layer
    saving = 256 * 7168 * 2 - (256 * 7168 + 2 * 56 * memory.SCALE)  # bf16 -> e4m3 + 2 x 56 block scales
    assert moved == 688_574_809_152 - routers * saving


def test_tensor_names_are_the_checkpoints():
    names = {n for n, _ in memory.mtp_tensors(DSV3)}
    assert {"model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight",
            "model.layers.61.mlp.experts.255.down_proj.weight"} <= names
    assert not fp8.is_quantized("model.layers.61.eh_proj.weight")  # bf16 in the release
    assert memory.tensor_bytes("model.layers.61.eh_proj.weight", (7168, 14336), "fp8") == 7168 * 14336 * 2
    instella = {n for n, _ in memory.main_tensors(shapes.load_shape("instella-moe"))}
    assert "model.layers.0.self_attn.q_proj.weight" in instella  # q_lora_rank null
    assert "model.layers.0.self_attn.q_a_proj.weight" not in instella
    assert "model.layers.0.self_attn.gate_proj.weight" in instella  # the attention gate


FIT = {("H200", 8, "bf16"): False, ("H100", 16, "bf16"): False, ("MI300X", 8, "bf16"): True,
       ("H200", 8, "fp8"): True, ("H100", 16, "fp8"): True, ("MI300X", 8, "fp8"): True,
       ("H100", 8, "bf16"): False, ("H100", 8, "fp8"): False}


def test_fit_verdicts_for_issue_35s_layouts():
    _, fits = report.fit_table(DSV3)
    got = {(f.gpu, f.gpus, f.weights.fmt): f.fits for f in fits}
    assert {k: got[k] for k in FIT} == FIT
    mi300x = next(f for f in fits if (f.gpu, f.gpus, f.weights.fmt) == ("MI300X", 8, "bf16"))
    assert 10e9 < mi300x.kv_per_gpu < 20e9  # fits with little room: 14 GB a GPU for KV cache


def test_kv_cache_tokens():
    f = memory.fit(DSV3, "fp8", "H200", hardware.BUILTIN_GPUS["H200"].hbm_bytes, 8)
    assert f.kv_token == 61 * (512 + 64) * 2
    assert f.tokens == int((0.9 * f.hbm - f.weights.nbytes / 8) // f.kv_token)
    assert memory.fit(DSV3, "fp8", "H200", f.hbm, 8, dp=8).tokens == 8 * f.tokens  # each DP rank its own
    short = memory.fit(DSV3, "bf16", "H200", f.hbm, 8)
    assert short.tokens == 0
    assert short.verdict() == "does not fit: 1.369 TB of bf16 weights, 8 x H200 hold 1.206 TB (1.085 TB after 10% headroom)"


def test_cli_fit_table_and_report_say_the_verdict(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert cli.main(["--fit", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 x H200     bf16" in text and "does not fit" in text and "684.5B parameters" in text
    assert {(r["gpu"], r["gpus"], r["format"]): r["fits"] for r in json.loads(out.read_text())}.items() >= FIT.items()
    js = tmp_path / "plan.json"
    assert cli.main(["--tp", "8", "--gpu", "H200", "--decode", "1", "--json", str(js)]) == 0
    assert "memory, bf16 weights (no quantization_config), 8 x H200: does not fit: 1.369 TB" in capsys.readouterr().out
    assert json.loads(js.read_text())[0]["memory"]["fits"] is False


def _config(tmp_path, **keys):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(dict(shapes.BUILTIN_MODELS["deepseek-v3"], **keys)))
    return str(f)


def test_fp8_quantization_config_makes_fp8_the_default_and_dtype_overrides(tmp_path, capsys):
    cfg = _config(tmp_path, quantization_config=fp8.QUANTIZATION_CONFIG)
    assert cli.main(["--model", cfg, "--tp", "8", "--gpu", "H200", "--decode", "1"]) == 0
    text = capsys.readouterr().out
    assert "roofline H200 fp8" in text
    assert "memory, fp8 weights (config.json's quantization_config), 8 x H200: fits" in text
    assert cli.main(["--model", cfg, "--tp", "8", "--gpu", "H200", "--decode", "1", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "roofline H200 bf16" in text and "memory, bf16 weights (--dtype), 8 x H200: does not fit" in text


def test_unknown_quantization_config_is_one_error_line(tmp_path, capsys):
    cfg = _config(tmp_path, quantization_config={"quant_method": "awq", "bits": 4})
    assert cli.main(["--model", cfg, "--decode", "1"]) == 2
    line = _one_error_line(capsys)
    assert "quantization_config" in line and "awq" in line and "bf16 copy" in line
    assert cli.main(["--model", cfg, "--fit"]) == 2
    _one_error_line(capsys)


# ================================================================== prefill/decode disaggregation (plan/pd.py)
KV_TOKEN = 61 * (512 + 64) * 2  # DeepSeek-V3: every layer's MLA latent (kv_lora + rope), bf16


def test_kv_bytes_per_token_and_per_request_are_every_layers_latent():
    assert memory.kv_bytes_per_token(DSV3) == KV_TOKEN == 70_272
    t = plan_pd.Transfer(memory.kv_bytes_per_token(DSV3), prompt=4096, batch=3, copies=2, gbps=400)
    assert t.request_bytes == 4096 * 70_272 == 287_834_112
    assert t.link_bytes == 3 * 2 * 287_834_112  # the forward's requests share the busiest NIC


def test_transfer_time_is_the_busiest_links_bits_over_its_rate():
    assert plan_pd.transfer_us(50e9, 400) == pytest.approx(1e6)  # 50 GB = 400 Gbit: one second at 400 Gbit/s
    t = plan_pd.Transfer(KV_TOKEN, prompt=2048, batch=32, copies=2, gbps=400)
    assert t.us == pytest.approx(32 * 2048 * KV_TOKEN * 2 * 8 / 400e9 * 1e6)
    assert t.us / 1000 == pytest.approx(184.2, abs=0.05)


def test_kv_copies_follow_sglangs_mla_rank_mapping():
    """Every decode rank pulls one full latent copy from one prefill rank: a prefill rank serves
    decode/prefill of them, or one prefill rank of every prefill/decode sends."""
    assert [plan_pd.kv_copies(p, d) for p, d in ((8, 16), (8, 8), (16, 8), (8, 32))] == [2, 1, 1, 4]
    with pytest.raises(UserError, match="one must divide the other"):
        plan_pd.kv_copies(8, 12)


def _pd_json(tmp_path, *flags):
    out = tmp_path / "pd.json"
    assert cli.main(["--pd", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def _check_pd_ttft_and_itl(tmp_path):
    """PD TTFT = the prefill layout's step + the transfer; PD ITL = the decode layout's step; each
    against a plan made here with make_plan (H200 fp8, the default tables of one and two nodes)."""
    doc = _pd_json(tmp_path, "--gpu", "H200", "--dtype", "fp8", "--prefill", "4096", "--batch", "1",
                   "--decode", "64", "--context", "4096", "--kv-link-gbps", "200")
    colo8, colo16, pd = doc["rows"]
    x = doc["transfer"]["us"]
    assert x == pytest.approx(2 * 4096 * KV_TOKEN * 8 / 200e9 * 1e6)  # TP8 -> TP16: two copies per prefill NIC
    pre = _plan(_prefill(4096), collectives.BUILTIN_CLUSTERS["mi300x-xgmi"], tp=8)
    dec = _plan(_decode(64, 4096), collectives.BUILTIN_CLUSTERS["amd-good"], tp=16)
    for mode in plan_pd.MODES:
        assert pd["ttft_us"][mode] == pytest.approx(pre.runs[mode].step_us + x)
        assert pd["ttft_us"][mode] == pytest.approx(colo8["ttft_us"][mode] + x)
        assert pd["itl_us"][mode] == pytest.approx(dec.runs[mode].step_us) == colo16["itl_us"][mode]
    assert colo8["transfer_us"] == colo16["transfer_us"] == 0.0


def test_pd_ttft_is_prefill_plus_transfer_and_itl_the_decode_layouts(tmp_path):
    _check_pd_ttft_and_itl(tmp_path)


def test_pd_check_fails_on_a_planted_change(tmp_path, monkeypatch):
    """Plant a PD TTFT without the transfer (as if it hid under the prefill): the check above fails."""
    monkeypatch.setattr(plan_pd.Row, "ttft_us", lambda self, mode: self.prefill.runs[mode].step_us)
    with pytest.raises(AssertionError):
        _check_pd_ttft_and_itl(tmp_path)


def test_pd_paper_shaped_default_takes_each_layouts_speedup(tmp_path, capsys):
    """`--pd` alone: prefill EP8/TP8 on one node with the paper's prefill run, decode EP16/TP16 on
    two with its decode run, MI300X bf16: the prefill step gains what --paper's one-node row
    says, ITL what its two-node row says, and the transfer dilutes the TTFT gain."""
    doc = _pd_json(tmp_path)
    text = capsys.readouterr().out
    for name in ("colocated EP8/TP8 1 node", "colocated EP16/TP16 2 nodes", "PD EP8/TP8 1 node -> EP16/TP16 2 nodes"):
        assert name in text
    colo8, colo16, pd = doc["rows"]
    pre = _plan(_prefill(2048, batch=32), collectives.BUILTIN_CLUSTERS["mi300x-xgmi"], tp=8, gpu="MI300X", dtype="bf16")
    dec = _plan(_decode(1024, 258), collectives.BUILTIN_CLUSTERS["amd-good"], tp=16, gpu="MI300X", dtype="bf16")
    assert [round(pre.speedup(), 2), round(dec.speedup(), 2)] == [1.41, 1.58]  # --paper's MI300X bf16 rows
    assert colo8["ttft_speedup"] == pytest.approx(pre.speedup())
    assert pd["itl_speedup"] == colo16["itl_speedup"] == pytest.approx(dec.speedup())
    x = doc["transfer"]["us"]
    assert x == pytest.approx(32 * 2048 * KV_TOKEN * 2 * 8 / 400e9 * 1e6)
    assert pd["ttft_speedup"] == pytest.approx((pre.runs["stock"].step_us + x) / (pre.runs["overlap"].step_us + x))
    assert 1 < pd["ttft_speedup"] < colo8["ttft_speedup"]  # the transfer is the same in both modes
    assert f"the prefill step alone gains {pre.speedup():.2f}x" in text


def test_pd_says_whether_each_layout_holds_the_weights(tmp_path, capsys):
    doc = _pd_json(tmp_path, "--gpu", "H200")  # bf16: 8 x H200 does not hold it, 16 x H200 does
    assert {m["role"]: m["fits"] for m in doc["memory"]} == {"prefill server": False, "decode server": True}
    assert "prefill server (EP8/TP8 1 node): does not fit: 1.369 TB of bf16 weights" in capsys.readouterr().out
    doc = _pd_json(tmp_path, "--gpu", "H200", "--dtype", "fp8")
    assert all(m["fits"] for m in doc["memory"])
    assert {m["layout"] for m in doc["memory"]} == {"EP8/TP8 1 node", "EP16/TP16 2 nodes"}


@pytest.mark.parametrize("argv, says", [
    (["--pd", "--tp", "8"], "--pd with --tp"),
    (["--pd", "--dp", "2"], "--pd with --dp"),
    (["--prefill-tp", "8"], "--prefill-tp: only with --pd"),
    (["--pd", "--prefill", "1024,2048"], "one value"),
    (["--pd", "--decode-tp", "24"], "do not split"),
    (["--pd", "--kv-link-gbps", "0"], "--kv-link-gbps 0"),
    (["--pd", "--prefill-tp", "0"], "--prefill-tp 0"),
    (["--pd", "--decode-gpu", "H200", "--ops", "ops.json"], "one per-op file"),
    (["--prefill", "1024", "--decode", "8"], "pick one"),
])
def test_pd_bad_input_is_one_error_line(argv, says, capsys):
    assert cli.main(argv) == 2
    assert says in _one_error_line(capsys)


def test_pd_example_in_the_docs_is_the_output(capsys):
    """docs/planner.md shows `--pd`'s output verbatim: a change to the model must update the page."""
    text = (REPO / "docs" / "planner.md").read_text()
    shown = text.split("`python -m sglang_farskip.plan --pd`:\n\n```\n", 1)[1].split("```", 1)[0]
    assert cli.main(["--pd"]) == 0
    assert capsys.readouterr().out == shown
