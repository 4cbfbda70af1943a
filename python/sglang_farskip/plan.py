"""FarSkip planner: what FarSkip-Collective's overlap buys on a given cluster, before running it.

    python -m sglang_farskip.plan --model deepseek-v3 --tp 16 --decode 1,64,256 --cluster amd-good
    python -m sglang_farskip.plan --model config.json --tp 8 --prefill 2048 --batch 32 --cluster my_allreduce.txt
    python -m sglang_farskip.plan --paper
    python -m sglang_farskip.plan --list
    python -m sglang_farskip.plan --fit --model config.json
    python -m sglang_farskip.plan --pd                       (prefill/decode disaggregation: plan_pd.py)

It predicts the step time of three runs of the same model on the same layout: `stock` (the
DeepSeek-V3 wiring, every all-reduce blocking), `sync` (the FarSkip wiring with blocking
collectives) and `overlap` (the FarSkip wiring with the asynchronous schedule of
python/sglang_farskip/schedule.py, which the served model runs), by replaying each run's sequence of kernels and
collectives on a compute stream and one FIFO communication stream.

Notation
    N        ranks of the TP/EP group (attention TP = MoE EP = N without DP attention)
    dp       DP-attention ranks; attention then runs on T/dp local tokens at TP N/dp
             (docs/dp-attention.md: FarSkip keeps the residual for all T rows on every rank)
    T        tokens of one forward of the whole group: prefill batch x prompt, decode batch
    ctx      attention context of a sequence: the prompt in prefill, the KV length in decode
    A, S, R  attention (to the o_proj partial), shared experts (a dense layer: its whole MLP),
             routed experts with their router;  M  one residual add + RMSNorm
    X(b)     time of an all-reduce of b bytes (the cluster); b = T x hidden x 2 (bf16 sums)
    A lane   AR(a+s) of layer k: launched after S_k, waited before attention k+1
    R lane   AR(r) of layer k: launched after R_k, waited before the MLP of layer k+1
             (under DP attention both are ARs of T x hidden over the group; stock DP instead
             all-gathers the MoE input and reduce-scatters its output, both blocking)
    window   compute the schedule puts between a collective's launch and its wait
    gamma    contention: the fraction of compute throughput lost while a collective is in
             flight (--contention); 0 = perfect overlap
    f        exposed-communication share of the stock step;  bound = 1/(1-f);
             link bound = 1/max(f, 1-f)  (no step is shorter than its compute or its comms)
    ceiling  the overlap step at gamma = 0 (what the schedule allows) and the share of
             communication time that has a window at all (115 of 119 ARs for DeepSeek-V3)

Per-op times come from the bare GPU check's JSON (--ops) or from a roofline (--gpu, --dtype),
marked "roofline" wherever printed. Every report ends with the memory figure of memory.py: the
weights in --dtype (default the checkpoint's format) on the --tp GPUs of --gpu, and the KV cache
left; --fit asks the same of a few common layouts. docs/planner.md says what is assumed and why.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

from sglang_farskip import memory
from sglang_farskip.config import FarSkipConfig, is_moe_layer
from sglang_farskip.errors import ArgumentParser, UserError, run_main
from sglang_farskip.formats import fp8

BF16 = 2  # bytes per element of every partial sum the collectives carry


# ================================================================== models
@dataclasses.dataclass(frozen=True)
class Shape:
    """The config.json keys the cost model reads (DeepSeek-V3 family)."""

    name: str
    hidden: int
    layers: int
    first_dense: int
    experts: int
    top_k: int
    moe_inter: int
    dense_inter: int
    shared: int
    q_lora: Optional[int]
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    heads: int
    vocab: int
    gated_attention: bool
    moe_layer_freq: int
    farskip: FarSkipConfig
    farskip_assumed: bool  # the config is not FarSkip: planned as if every layer were converted
    mtp_layers: int  # num_nextn_predict_layers: weights only (memory.py), never in the step
    tied_embeddings: bool
    weight_format: str  # "bf16" | "fp8": the checkpoint's (fp8.weight_format), --dtype's default

    def is_moe(self, k: int) -> bool:
        return is_moe_layer({"n_routed_experts": self.experts, "first_k_dense_replace": self.first_dense,
                             "moe_layer_freq": self.moe_layer_freq}, k)


_REQUIRED = ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "qk_rope_head_dim",
             "qk_nope_head_dim", "v_head_dim", "num_attention_heads")


def shape_from_config(cfg: dict, name: str) -> Shape:
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise UserError(f"{name}: config.json lacks {', '.join(missing)} (a DeepSeek-V3-family config is needed)")
    try:
        farskip = FarSkipConfig.from_hf_config(cfg)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None
    try:
        weight_format = fp8.weight_format(cfg)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None
    assumed = not farskip.enabled
    if assumed:  # planning a conversion: the default range converts every layer
        farskip = dataclasses.replace(farskip, enabled=True)
    return Shape(
        name=name, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
        first_dense=cfg.get("first_k_dense_replace") or 0, experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"], moe_inter=cfg["moe_intermediate_size"],
        dense_inter=cfg["intermediate_size"], shared=cfg.get("n_shared_experts") or 0,
        q_lora=cfg.get("q_lora_rank"), kv_lora=cfg["kv_lora_rank"], rope=cfg["qk_rope_head_dim"],
        nope=cfg["qk_nope_head_dim"], v_head=cfg["v_head_dim"], heads=cfg["num_attention_heads"],
        vocab=cfg.get("vocab_size") or 129280, gated_attention=bool(cfg.get("gated_attention")),
        moe_layer_freq=cfg.get("moe_layer_freq") or 1, farskip=farskip, farskip_assumed=assumed,
        mtp_layers=cfg.get("num_nextn_predict_layers") or 0, tied_embeddings=bool(cfg.get("tie_word_embeddings")),
        weight_format=weight_format,
    )


# The two built-in checkpoints' shapes (DeepSeek-V3's config.json; Instella-MoE-16B-A3B's, as
# read in shared/notes/instella-moe.md), both with FarSkip on every layer and without a
# quantization_config (their weight format is bf16 unless --dtype says otherwise).
# DeepSeek-V3 ships one MTP layer (num_nextn_predict_layers 1): memory.py counts its weights.
BUILTIN_MODELS = {
    "deepseek-v3": dict(
        hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432, n_shared_experts=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        num_attention_heads=128, vocab_size=129280, num_nextn_predict_layers=1, farskip=True),
    "instella-moe": dict(
        hidden_size=2048, num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=1408, intermediate_size=10944, n_shared_experts=2,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=96, v_head_dim=128,
        num_attention_heads=16, vocab_size=128896, gated_attention=True, farskip=True),
}


def load_shape(spec: str) -> Shape:
    if spec in BUILTIN_MODELS:
        return shape_from_config(BUILTIN_MODELS[spec], spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {spec}: not a built-in name ({', '.join(BUILTIN_MODELS)}) "
                        f"and not a readable config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--model {spec}: config.json is not a JSON object")
    return shape_from_config(cfg, path.parent.name or str(path))


# ================================================================== collectives
@dataclasses.dataclass(frozen=True)
class CommTable:
    """Collective time against message size, from measured points: log-log between points, the
    smallest point's time below them (latency floor), the largest point's bandwidth above them."""

    name: str
    source: str
    ranks: Optional[int]
    points: tuple[tuple[int, float], ...]  # (bytes, us), sorted, unique sizes

    def us(self, size: float) -> float:
        sizes = [s for s, _ in self.points]
        if size <= sizes[0]:
            return self.points[0][1]
        if size >= sizes[-1]:
            s, t = self.points[-1]
            return t * size / s
        i = bisect.bisect_left(sizes, size)
        (s0, t0), (s1, t1) = self.points[i - 1], self.points[i]
        w = math.log(size / s0) / math.log(s1 / s0)
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))

    def scaled(self, factor: float, label: str) -> "CommTable":
        return dataclasses.replace(self, name=f"{self.name} {label}",
                                   points=tuple((s, t * factor) for s, t in self.points))


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link of `mbit` Mbit/s each way with a fixed `latency_us` per collective: a ring
    all-reduce moves 2(n-1)/n of the message through each rank's link."""

    name: str
    source: str
    ranks: int
    mbit: float
    latency_us: float

    def us(self, size: float) -> float:
        return self.latency_us + 2 * (self.ranks - 1) / self.ranks * size * 8 / self.mbit

    def scaled(self, factor: float, label: str):
        return dataclasses.replace(self, name=f"{self.name} {label}", latency_us=self.latency_us * factor,
                                   mbit=self.mbit / factor)


_TOKEN = 7168 * BF16  # sizes of perf-model.md section 3's columns: one DeepSeek-V3 token is 14,336 B
_SIZES = [1 * _TOKEN, 16 * _TOKEN, 64 * _TOKEN, 256 * _TOKEN, 1024 * _TOKEN, 2048 * _TOKEN,
          4096 * _TOKEN, 8192 * _TOKEN, 65536 * _TOKEN]


def _published(name, ranks, us, source):
    return CommTable(name, source, ranks, tuple(zip(_SIZES, us)))


# perf-model.md section 3 (all_reduce, bf16 message sizes, us), each with the note's source.
BUILTIN_CLUSTERS = {c.name: c for c in [
    _published("amd-good", 16, [56, 67, 79, 114, 240, 362, 563, 941, 4873],
               "2x8 MI355X, Pollara 400 + ANP, RCCL 2.26.6: hisohara/ai-scripts training/01_rccl-smoketest/README.md"),
    _published("amd-poor", 16, [239, 248, 391, 334, 477, 571, 771, 1299, 5217],
               "2x8 MI300X, ConnectX 400G RoCE, RCCL 2.22.3: hisohara/ai-scripts training/01_rccl-smoketest/README.md"),
    _published("nv-ib", 16, [47, 86, 120, 128, 191, 277, 429, 938, 5600],
               "2x8 H20, 8 CX7 NDR IB per node, NCCL 2.21.5: nvidia/nccl issue #1244"),
    _published("h100-tcpxo", 16, [139, 166, 197, 340, 882, 1044, 1220, 1569, 6055],
               "2x8 H100 GCP A3-Mega (TCPXO, not IB): lessizzmore/create-a3mega-ztan-fork ztan-NCCL-test-result"),
    _published("mi300x-xgmi", 8, [16, 17, 28, 49, 134, 224, 388, 711, 5253],
               "1x8 MI300X xGMI, RCCL, one node: hisohara/ai-scripts training/01_rccl-smoketest/README.md"),
]}

_MPI_TAG = re.compile(r"^\[\d+,\d+\]<\w+>:\s?")  # mpirun --tag-output prefixes every line
_COLUMNS_WITH_ROOT = ("size", "count", "type", "redop", "root")


def _number(tok: str) -> Optional[float]:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_nccl_tests(text: str, name: str, column: str = "in") -> CommTable:
    """An nccl-tests / rccl-tests *_perf output: rows of size, count, type, redop, [root,]
    then time/algbw/busbw/#wrong out-of-place and the same in-place. `column` picks in-place,
    out-of-place, or the smaller of the two per row."""
    ranks, points, with_root = 0, {}, None
    for raw in text.splitlines():
        line = _MPI_TAG.sub("", raw).strip()
        if re.match(r"#\s*Rank\s+\d+", line):
            ranks += 1
            continue
        if line.startswith("#"):
            words = line.lstrip("#").split()
            if words[:2] == ["size", "count"]:
                with_root = tuple(words[:5]) == _COLUMNS_WITH_ROOT
            continue
        tok = line.split()
        if len(tok) < 8 or _number(tok[0]) is None or _number(tok[1]) is None:
            continue
        root = with_root if with_root is not None else len(tok) in (9, 13)
        first = 5 if root else 4  # index of the out-of-place time
        out_t = _number(tok[first])
        in_t = _number(tok[first + 4]) if len(tok) > first + 4 else None
        picked = {"in": in_t if in_t is not None else out_t, "out": out_t,
                  "min": min(t for t in (in_t, out_t) if t is not None) if out_t is not None else None}[column]
        size = int(float(tok[0]))
        if picked is None or picked <= 0 or size <= 0:
            raise UserError(f"{name}: row {line!r} has no positive time")
        points[size] = min(points.get(size, picked), picked)
    if len(points) < 2:
        raise UserError(f"{name}: no nccl-tests table found (need at least two rows of size, count, "
                        f"type, redop, root, time, algbw, busbw, ...)")
    return CommTable(Path(name).name, f"measured: {name} ({column}-place column)", ranks or None,
                     tuple(sorted(points.items())))


def load_cluster(spec: str, column: str) -> CommTable:
    if spec in BUILTIN_CLUSTERS:
        return BUILTIN_CLUSTERS[spec]
    try:
        text = Path(spec).read_text(errors="replace")
    except OSError as e:
        raise UserError(f"--cluster {spec}: not a built-in table ({', '.join(BUILTIN_CLUSTERS)}) "
                        f"and not a readable file ({e.strerror})") from None
    return parse_nccl_tests(text, spec, column)


# ================================================================== per-op times
@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peaks (TFLOP/s dense, TB/s) and the efficiencies perf-model.md section 4.2 chose; memory."""

    name: str
    tflops_bf16: float
    tflops_fp8: float
    tbs: float
    vendor: str  # "nv" or "amd": picks the efficiency row
    source: str
    hbm_gb: int  # the datasheet's figure
    hbm_bytes: int  # what the driver reports (SGLang sizes its memory from it), where known
    hbm_source: str


# The datasheets' "80 GB", "141 GB", "192 GB" are closer to GiB: the drivers report 6-7% more
# bytes than the figure x 1e9, so memory uses the reported totals where one was found.
_MIB = 1 << 20
BUILTIN_GPUS = {g.name: g for g in [
    Gpu("H100", 989, 1979, 3.35, "nv", "NVIDIA H100 SXM datasheet", 80, 81559 * _MIB,
        "nvidia-smi 81559 MiB (modal-labs/modal-client PR 2797)"),
    Gpu("H200", 989, 1979, 4.8, "nv", "datacrunch.io H200 blog (perf-model.md 4.2)", 141, 143771 * _MIB,
        "nvidia-smi 143771 MiB"),
    Gpu("MI300X", 1307, 2615, 5.3, "amd", "docs.vultr.com inference-cookbook (perf-model.md 4.2)", 192,
        206141652992, "rocm-smi VRAM Total Memory (ROCm issue 4750)"),
    Gpu("MI325X", 1307, 2615, 6.0, "amd", "docs.vultr.com inference-cookbook (perf-model.md 4.2)", 256,
        256 * 10**9, "datasheet 256 GB as 1e9 bytes: no driver report found, likely ~7% low"),
]}

# (HBM, GEMM, MoE, attention core as fractions; which peak the FLOP fractions apply to; kernel us).
# perf-model.md 4.2, except the NV BF16 row, which is this planner's own choice.
EFFICIENCY = {
    ("nv", "fp8"): (0.70, 0.45, 0.35, 0.50, "fp8", "bf16", 4.0),
    ("nv", "bf16"): (0.70, 0.60, 0.50, 0.50, "bf16", "bf16", 4.0),
    ("amd", "fp8"): (0.65, 0.30, 0.25, 0.35, "fp8", "bf16", 6.0),
    ("amd", "bf16"): (0.65, 0.45, 0.38, 0.35, "bf16", "bf16", 6.0),
}
KERNELS = {"attention": 12, "shared_experts": 3, "dense_mlp": 3, "routed_experts": 6, "norm_add": 2, "head": 1}


class Roofline:
    """time = max(FLOPs / effective FLOP/s, bytes / effective HBM) + kernels x launch, per op."""

    measured = False

    def __init__(self, shape: Shape, gpu: Gpu, dtype: str):
        self.shape, self.gpu, self.dtype = shape, gpu, dtype
        bw, gemm, moe, core, mm_peak, core_peak, self.t_k = EFFICIENCY[(gpu.vendor, dtype)]
        peak = {"bf16": gpu.tflops_bf16, "fp8": gpu.tflops_fp8}
        self.bw = bw * gpu.tbs * 1e12
        self.f_gemm, self.f_moe = gemm * peak[mm_peak] * 1e12, moe * peak[mm_peak] * 1e12
        self.f_core = core * peak[core_peak] * 1e12
        self.bpp = 1 if dtype == "fp8" else 2
        self.label = f"roofline {gpu.name} {dtype} ({gpu.source}; efficiencies of perf-model.md 4.2)"

    def _time(self, op: str, flop_s: float, nbytes: float) -> float:
        return max(flop_s, nbytes / self.bw) * 1e6 + KERNELS[op] * self.t_k

    def _attn_params(self, tp: int) -> float:
        m = self.shape
        qk, H, nh = m.nope + m.rope, m.hidden, m.heads
        rep = H * (m.kv_lora + m.rope) + (H * m.q_lora if m.q_lora else 0)
        sharded = ((m.q_lora or H) * nh * qk + m.kv_lora * nh * (m.nope + m.v_head) + nh * m.v_head * H
                   + (H * nh * m.v_head if m.gated_attention else 0))
        return rep + sharded / tp

    def __call__(self, op: str, tokens: float, context: float, tp: int) -> float:
        m, T = self.shape, tokens
        if op in ("attention_prefill", "attention_decode"):
            params, heads = self._attn_params(tp), m.heads / tp
            if op == "attention_prefill":  # MHA over the expanded latent, causal: ctx/2 keys per query
                core = 2 * T * heads * (m.nope + m.rope + m.v_head) * context / 2
                kv_bytes = 0.0
            else:  # absorbed MLA: every query reads the whole latent cache of its sequence
                core = 2 * T * heads * (2 * m.kv_lora + m.rope) * context
                kv_bytes = T * context * (m.kv_lora + m.rope) * BF16
            flop_s = 2 * T * params / self.f_gemm + core / self.f_core
            return self._time("attention", flop_s, params * self.bpp + kv_bytes)
        if op in ("shared_experts", "dense_mlp"):
            width = m.moe_inter * m.shared if op == "shared_experts" else m.dense_inter
            params = 3 * m.hidden * width / tp
            return self._time(op, 2 * T * params / self.f_gemm, params * self.bpp + 2 * T * m.hidden * BF16)
        if op == "routed_experts":
            pairs, per_expert = m.top_k * T / tp, 3 * m.hidden * m.moe_inter
            active = min(m.experts / tp, math.ceil(pairs))  # balanced routing, as the paper forces
            flops = 2 * pairs * per_expert + 2 * T * m.hidden * m.experts
            return self._time(op, flops / self.f_moe, active * per_expert * self.bpp + pairs * 2 * m.hidden * BF16)
        if op == "norm_add":
            return self._time(op, 0.0, 3 * T * m.hidden * BF16)
        if op == "head":
            params = m.vocab * m.hidden / tp
            return self._time(op, 2 * T * params / self.f_gemm, params * self.bpp)
        raise KeyError(op)


OPS = ("attention_prefill", "attention_decode", "shared_experts", "routed_experts", "dense_mlp", "norm_add")


class MeasuredOps:
    """Per-op times of the bare GPU check's JSON, log-log between measured sizes (and beyond
    them from the two nearest points, flagged as extrapolated)."""

    measured = True

    def __init__(self, path: str):
        self.path = path
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--ops {path}: not a readable JSON file ({e})") from None
        rows = doc.get("per_op_us") if isinstance(doc, dict) else None
        if not isinstance(rows, list) or not rows:
            raise UserError(f"--ops {path}: no per_op_us list (schema: docs/planner.md)")
        self.table: dict[tuple[str, int], dict[int, dict[float, float]]] = {}
        for i, row in enumerate(rows):
            try:
                op, tokens, context, tp, us = row["op"], row["tokens"], row.get("context", 0), row["tp"], row["us"]
                ok = op in OPS and tokens > 0 and context >= 0 and tp > 0 and us > 0
            except (KeyError, TypeError):
                ok = False
            if not ok:
                raise UserError(f"--ops {path}: per_op_us[{i}] is malformed: {row!r}")
            self.table.setdefault((op, int(tp)), {}).setdefault(int(context), {})[float(tokens)] = float(us)
        self.label = f"measured: {doc.get('source', path)} ({doc.get('dtype', '?')})"
        self.extrapolated: set[str] = set()

    def __call__(self, op: str, tokens: float, context: float, tp: int) -> float:
        if op == "head":
            return 0.0  # not in the schema; the same in every mode
        key = (op, tp)
        if key not in self.table and op == "norm_add":  # replicated work: any TP's row will do
            key = next((k for k in self.table if k[0] == op), key)
        if key not in self.table:
            have = sorted(t for o, t in self.table if o == op)
            raise UserError(f"--ops {self.path}: no {op} rows at tp={tp} (has tp {have or 'none'})")
        by_ctx = self.table[key]
        if op.startswith("attention"):
            # Only the contexts the interpolation uses are evaluated, so that a far one scaled
            # in tokens is not reported as extrapolated when it does not count.
            ctxs = self._bracket(sorted(by_ctx), max(context, 1))
            return self._interp(ctxs, [self._at_context(op, by_ctx[c], tokens) for c in ctxs],
                                max(context, 1), f"{op} context")
        merged = {t: us for rows in by_ctx.values() for t, us in rows.items()}
        xs = sorted(merged)
        return self._interp(xs, [merged[x] for x in xs], tokens, f"{op} tokens")

    def _at_context(self, op: str, rows: dict, tokens: float) -> float:
        """Attention at one context: interpolated over tokens, or, from a single measurement,
        proportional to tokens (more sequences of the same context cost proportionally more)."""
        if len(rows) > 1:
            xs = sorted(rows)
            return self._interp(xs, [rows[x] for x in xs], tokens, f"{op} tokens")
        (t0, us0), = rows.items()
        if not math.isclose(t0, tokens):
            self.extrapolated.add(f"{op} tokens {tokens:g} (scaled from {t0:g})")
        return us0 * tokens / t0

    @staticmethod
    def _bracket(xs: list, x: float) -> list:
        """The one or two points of sorted xs that _interp(xs, ..., x) reads."""
        if len(xs) <= 1 or any(math.isclose(max(v, 1), x) for v in xs):
            return [v for v in xs if math.isclose(max(v, 1), x)] or xs
        i = min(max(bisect.bisect_left([max(v, 1) for v in xs], x), 1), len(xs) - 1)
        return xs[i - 1:i + 1]

    def _interp(self, xs: list, ys: list, x: float, what: str) -> float:
        xs = [max(v, 1) for v in xs]
        if len(xs) == 1:
            if not math.isclose(xs[0], x):
                raise UserError(f"--ops {self.path}: {what} measured only at {xs[0]:g}, needed at {x:g}")
            return ys[0]
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        if x < xs[0] or x > xs[-1]:
            self.extrapolated.add(f"{what} {x:g}")
        (x0, y0), (x1, y1) = (xs[i - 1], ys[i - 1]), (xs[i], ys[i])
        w = math.log(x / x0) / math.log(x1 / x0)
        return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


# ================================================================== schedules
@dataclasses.dataclass
class Ins:
    kind: str  # "compute" | "launch" | "wait"
    name: str  # compute: op name; launch: collective label
    us: float = 0.0
    layer: int = -1  # -1: before layer 0 (the DP embedding gather)
    cid: int = -1
    link_bytes: float = 0.0  # launch: bytes through each rank's link (ring algorithm)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int  # N: the TP/EP group
    dp: int  # DP-attention ranks (1: TP attention)
    nodes: int

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp


@dataclasses.dataclass(frozen=True)
class Phase:
    kind: str  # "prefill" | "decode"
    tokens: int  # T
    context: int
    batch: int

    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.batch}x{self.context} tokens"
        return f"decode batch {self.batch}, context {self.context}"


class Program:
    """One forward as the compute stream issues it; collectives get ids at launch."""

    def __init__(self):
        self.ins: list[Ins] = []

    def compute(self, name: str, us: float, layer: int) -> None:
        self.ins.append(Ins("compute", name, us, layer))

    def launch(self, label: str, us: float, layer: int, link_bytes: float = 0.0) -> int:
        cid = sum(1 for i in self.ins if i.kind == "launch")
        self.ins.append(Ins("launch", label, us, layer, cid, link_bytes))
        return cid

    def wait(self, *cids: Optional[int]) -> None:
        for c in cids:
            if c is not None:
                self.ins.append(Ins("wait", "", 0.0, -1, c))

    def blocking(self, label: str, us: float, layer: int, link_bytes: float = 0.0) -> None:
        self.wait(self.launch(label, us, layer, link_bytes))


@dataclasses.dataclass(frozen=True)
class Costs:
    """Every per-layer piece of one forward, in us (T tokens of the whole TP/EP group, T/dp of
    them on one DP-attention rank), and the link bytes of each collective."""

    attn: float  # the T/dp local tokens at attention TP N/dp (all T at TP N without DP)
    shared: float  # all T tokens at TP N: the MoE input holds every DP rank's rows
    routed: float
    dense: float  # all T tokens at TP N
    norm: float  # one add + RMSNorm of the T/dp local rows (stock; all T rows without DP)
    norm_rows: float  # the same on all T rows: FarSkip under DP keeps the residual for the group
    head: float
    ar_layer: float  # AR of a [T, hidden] partial over the whole group (every FarSkip lane, the DP embedding gather)
    ar_attn: float  # stock DP attention: AR of a [T/dp, hidden] partial over the attention TP group
    gather: float  # stock DP attention: all-gather of the MoE input, [T, hidden] in all
    scatter: float  # stock DP attention: reduce-scatter of the MoE output, [T, hidden] in all
    lb_ar: float = 0.0  # bytes through each rank's link, ring algorithm: 2(n-1)/n of the message
    lb_attn: float = 0.0
    lb_gather: float = 0.0  # (n-1)/n of the gathered [T, hidden]
    lb_scatter: float = 0.0  # (n-1)/n of the scattered [T, hidden]


def layer_costs(shape: Shape, layout: Layout, phase: Phase, ops: Callable, comm, gather=None, scatter=None,
                attn_comm=None) -> Costs:
    T, dp, N, A = phase.tokens, layout.dp, layout.tp, layout.attn_tp
    local = T / dp
    attn_op = "attention_prefill" if phase.kind == "prefill" else "attention_decode"
    nbytes = T * shape.hidden * BF16
    sequences = phase.batch  # logits only for each sequence's last token
    return Costs(
        attn=ops(attn_op, local, phase.context, A),
        shared=ops("shared_experts", T, 0, N) if shape.shared else 0.0,
        routed=ops("routed_experts", T, 0, N),
        dense=ops("dense_mlp", T, 0, N),
        norm=ops("norm_add", local, 0, A),
        norm_rows=ops("norm_add", T, 0, N) if dp > 1 else ops("norm_add", local, 0, A),
        head=ops("head", sequences / dp, 0, A),
        ar_layer=comm.us(nbytes),
        ar_attn=(attn_comm or comm).us(nbytes / dp) if dp > 1 and A > 1 else 0.0,
        gather=gather.us(nbytes) if gather else comm.us(nbytes) / 2,
        scatter=scatter.us(nbytes) if scatter else comm.us(nbytes) / 2,
        lb_ar=2 * (N - 1) / N * nbytes,
        lb_attn=2 * (A - 1) / A * nbytes / dp if dp > 1 else 0.0,
        lb_gather=(N - 1) / N * nbytes,
        lb_scatter=(N - 1) / N * nbytes,
    )


def stock_program(shape: Shape, c: Costs, dp: bool) -> Program:
    """Stock DeepSeek-V3 in SGLang: every collective blocks where it is issued. DP attention:
    the attention-TP AR of the local rows (attention TP > 1), the MoE input all-gathered, the
    MoE (or dense MLP) output reduce-scattered back to the DP ranks."""
    p = Program()
    for k in range(shape.layers):
        p.compute("norm", c.norm, k)
        p.compute("attention", c.attn, k)
        if not dp:
            p.blocking("AR(a)", c.ar_layer, k, c.lb_ar)
        elif c.ar_attn:
            p.blocking("AR_attn(a)", c.ar_attn, k, c.lb_attn)
        p.compute("norm", c.norm, k)
        if dp:
            p.blocking("AG(x)", c.gather, k, c.lb_gather)
        if shape.is_moe(k):
            p.compute("shared", c.shared, k)
            p.compute("routed", c.routed, k)
        else:
            p.compute("dense_mlp", c.dense, k)
        if dp:
            p.blocking("RS(s+r)", c.scatter, k, c.lb_scatter)
        else:
            p.blocking("AR(s+r)", c.ar_layer, k, c.lb_ar)
    p.compute("norm", c.norm, shape.layers)
    return p


def farskip_program(shape: Shape, c: Costs, blocking: bool, dp: bool = False) -> Program:
    """The FarSkip forward of schedule.py (layer_step, tests/test_schedule.py checks it): the same launches and waits in the
    same order; `blocking` waits each collective where it is launched (sync).

    `dp` (DP attention, docs/dp-attention.md, parallel.DpRows): the residual holds all T rows of
    the group on every rank, so the program is the same: every lane is one AR of [T, hidden]
    over the group (the attention partial of the local rows, placed in its rows, rides the A
    lane; no attention-TP AR of its own), norms run on all T rows, and one exposed AR gathers
    the embeddings before layer 0."""
    p, fs = Program(), shape.farskip
    X, B = c.ar_layer, c.lb_ar
    issue = (lambda label, us, k: p.blocking(label, us, k, B)) if blocking else \
        (lambda label, us, k: p.launch(label, us, k, B))
    if dp:
        p.blocking("AR(embed)", X, -1, B)  # [T/dp] -> [T] rows: waited before layer 0's norm
    attn_lane = routed_lane = None
    for k in range(shape.layers):
        if fs.attn_skips_prev_routed(k):
            p.wait(attn_lane)  # x = h[k-1] - r[k-1]
        else:
            p.wait(attn_lane, routed_lane)  # the full h[k-1]
            routed_lane = None
        p.compute("norm", c.norm_rows, k)
        p.compute("attention", c.attn, k)
        if fs.mlp_skips_attn(k):
            p.wait(routed_lane)  # MLP input h[k-1]
            label = "AR(a+s)"
        else:
            a = issue("AR(a)", X, k)
            p.wait(routed_lane, a)  # MLP input h[k-1] + a[k]
            label = "AR(s)"
        routed_lane = None
        p.compute("norm", c.norm_rows, k)
        if not shape.is_moe(k):  # the dense output rides the A lane, read by the next attention
            p.compute("dense_mlp", c.dense, k)
            attn_lane = issue(label, X, k)
            continue
        p.compute("shared", c.shared, k)
        attn_lane = issue(label, X, k)
        p.compute("routed", c.routed, k)
        routed_lane = issue("AR(r)", X, k)
    p.wait(attn_lane, routed_lane)  # the final norm reads the full h[L-1]
    p.compute("norm", c.norm_rows, shape.layers)
    return p


# ================================================================== simulation
@dataclasses.dataclass
class Collective:
    cid: int
    label: str
    layer: int
    us: float
    window_us: float = 0.0  # compute issued between launch and wait (no contention)
    window_ops: tuple = ()
    stall_us: float = 0.0  # time the compute stream waited for it
    link_bytes: float = 0.0  # bytes through each rank's link (ring algorithm)


@dataclasses.dataclass
class Run:
    step_us: float
    compute_us: float
    contention_us: float
    collectives: list

    @property
    def comm_us(self) -> float:
        return sum(c.us for c in self.collectives)

    @property
    def exposed_us(self) -> float:
        return sum(c.stall_us for c in self.collectives)

    @property
    def link_bytes(self) -> float:
        return sum(c.link_bytes for c in self.collectives)

    @property
    def hidden(self) -> float:
        return max(0.0, 1 - self.exposed_us / self.comm_us) if self.comm_us else 1.0


def _advance(t: float, work: float, busy: list, keep: float) -> float:
    """End of `work` us of compute started at t, running at `keep` of full speed while a
    collective is in flight (busy: disjoint (start, end) intervals in order)."""
    for start, end in busy:
        if end <= t:
            continue
        if start > t:
            if work <= start - t:
                return t + work
            work -= start - t
            t = start
        capacity = (end - t) * keep
        if work <= capacity:
            return t + work / keep
        work -= capacity
        t = end
    return t + work


def simulate(program: Program, contention: float, extra_us: float = 0.0) -> Run:
    keep = 1.0 - contention
    t = comm_free = compute = 0.0
    busy: list = []
    colls: dict[int, Collective] = {}
    ends: dict[int, float] = {}
    pending: dict[int, list] = {}  # launched, not yet waited: compute ops seen meanwhile
    for ins in program.ins:
        if ins.kind == "compute":
            t_end = _advance(t, ins.us, busy, keep)
            compute += ins.us
            t = t_end
            for ops in pending.values():
                ops.append(ins)
        elif ins.kind == "launch":
            start = max(t, comm_free)
            comm_free = ends[ins.cid] = start + ins.us
            if ins.us > 0:
                busy.append((start, comm_free))
            colls[ins.cid] = Collective(ins.cid, ins.name, ins.layer, ins.us, link_bytes=ins.link_bytes)
            pending[ins.cid] = []
        else:
            c, seen = colls[ins.cid], pending.pop(ins.cid)
            c.window_us = sum(i.us for i in seen)
            c.window_ops = tuple(dict.fromkeys(f"{i.name}[{i.layer}]" for i in seen if i.us > 0))
            c.stall_us = max(0.0, ends[ins.cid] - t)
            t += c.stall_us
    if pending:
        raise AssertionError(f"collectives never waited: {sorted(pending)}")  # a schedule bug
    step = t + extra_us
    stretched = step - compute - extra_us - sum(c.stall_us for c in colls.values())
    return Run(step, compute + extra_us, max(0.0, stretched), sorted(colls.values(), key=lambda c: c.cid))


# ================================================================== plan
@dataclasses.dataclass
class Prediction:
    shape: Shape
    layout: Layout
    phase: Phase
    costs: Costs
    contention: float
    runs: dict  # "stock" | "sync" | "overlap" -> Run
    ideal: Run  # overlap at contention 0
    ops_label: str
    comm_label: str

    @property
    def f(self) -> float:
        s = self.runs["stock"]
        return s.exposed_us / s.step_us

    def speedup(self, of: str = "overlap", over: str = "stock") -> float:
        return self.runs[over].step_us / self.runs[of].step_us

    @property
    def windowed_share(self) -> float:
        """The structural ceiling on the hidden fraction: communication with any window."""
        cs = self.ideal.collectives
        total = sum(c.us for c in cs)
        return sum(c.us for c in cs if c.window_us > 0) / total if total else 1.0

    @property
    def windowed_count(self) -> tuple[int, int]:
        cs = self.ideal.collectives
        return sum(1 for c in cs if c.window_us > 0), len(cs)


def make_plan(shape: Shape, layout: Layout, phase: Phase, ops, comm, contention: float, *,
              overhead_us: float = 0.0, gather=None, scatter=None, attn_comm=None) -> Prediction:
    if not 0 <= contention < 1:
        raise UserError(f"--contention {contention}: must be in [0, 1)")
    c = layer_costs(shape, layout, phase, ops, comm, gather, scatter, attn_comm)
    dp = layout.dp > 1
    extra = c.head + overhead_us
    runs = {"stock": simulate(stock_program(shape, c, dp), contention, extra),
            "sync": simulate(farskip_program(shape, c, True, dp), contention, extra),
            "overlap": simulate(farskip_program(shape, c, False, dp), contention, extra)}
    ideal = runs["overlap"] if contention == 0 else simulate(farskip_program(shape, c, False, dp), 0.0, extra)
    return Prediction(shape, layout, phase, c, contention, runs, ideal, ops.label, f"{comm.name}: {comm.source}")


def calibrate_to_sync_f(plan: Prediction, f: float, ops, comm, overhead_us: float, extra: dict) -> Prediction:
    """Scale every collective by one factor so that the sync run's exposed share is the measured
    f (a sync-mode profile gives it); compute keeps its per-op times. Ratios depend only on these
    proportions, so this predicts overlap/sync from a sync measurement alone."""
    if not 0 < f < 1:
        raise UserError(f"--sync-f {f}: must be in (0, 1)")
    sync = plan.runs["sync"]
    if not sync.comm_us:
        raise UserError("--sync-f: the layout has no collectives to scale")
    factor = f * (sync.step_us - sync.exposed_us) / ((1 - f) * sync.exposed_us)
    scaled = {k: (v.scaled(factor, "") if v else None) for k, v in extra.items()}
    out = make_plan(plan.shape, plan.layout, plan.phase, ops, comm.scaled(factor, f"x{factor:.3g} (sync f {f:g})"),
                    plan.contention, overhead_us=overhead_us, **scaled)
    return out


def check_layout(shape: Shape, layout: Layout) -> None:
    if layout.tp < 1 or layout.dp < 1 or layout.tp % layout.dp:
        raise UserError(f"--dp {layout.dp} must divide --tp {layout.tp}")
    if shape.heads % layout.attn_tp:
        raise UserError(f"{shape.name}: {shape.heads} attention heads do not split over attention TP {layout.attn_tp}")
    if shape.experts % layout.tp:
        raise UserError(f"{shape.name}: {shape.experts} routed experts do not split over EP {layout.tp}")


# ================================================================== output
def _ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us >= 10000 else f"{us / 1000:.3f}"


def _verdict(c: Collective, is_last: bool) -> str:
    if c.label == "AR(embed)":
        return "exposed: gathers every DP rank's embeddings before layer 0, once per forward"
    if c.window_us <= 0:
        return "exposed: the last routed collective, nothing left to hide behind" if is_last else "exposed: waited at once"
    if c.stall_us <= 1e-9:
        return "hidden"
    if c.window_us < c.us:
        return f"window shorter than the collective: {c.stall_us:.0f} us exposed"
    return f"{c.stall_us:.0f} us exposed (queued behind the previous collective or slowed compute)"


def shape_is_moe(plan: Prediction, layer: int) -> bool:
    return 0 <= layer < plan.shape.layers and plan.shape.is_moe(layer)


def layer_view(plan: Prediction) -> list[dict]:
    """One row per group of consecutive layers whose collectives fare alike (overlap run)."""
    run, last = plan.runs["overlap"], plan.runs["overlap"].collectives[-1].cid
    by_layer: dict[int, list] = {}
    for c in run.collectives:
        by_layer.setdefault(c.layer, []).append(c)
    rows: list[dict] = []
    for k in sorted(by_layer):
        items = tuple((c.label, round(c.us, 1), "+".join(sorted({o.split("[")[0] for o in c.window_ops})) or "-",
                       round(c.window_us, 1), round(c.stall_us, 1), _verdict(c, c.cid == last))
                      for c in by_layer[k])
        if rows and rows[-1]["items"] == items and rows[-1]["last"] == k - 1:
            rows[-1]["last"] = k
        else:
            rows.append({"first": k, "last": k, "items": items})
    return rows


def format_plan(plan: Prediction) -> str:
    s, L = plan.shape, plan.layout
    out = [f"{s.name}, {plan.phase.label()}, TP/EP {L.tp}" + (f" (DP attention {L.dp}, attention TP {L.attn_tp})" if L.dp > 1 else "")
           + f", {L.nodes} node{'s' if L.nodes > 1 else ''}, contention {plan.contention:.2f}",
           f"  per-op times: {plan.ops_label}", f"  all-reduce:   {plan.comm_label}"]
    if s.farskip_assumed:
        out.append("  note: the config is not FarSkip; planned as if every layer were converted")
    c, dp = plan.costs, L.dp > 1
    if dp:
        T = plan.phase.tokens
        out.append(f"  per layer, us: attention ({T / L.dp:g} local rows) {c.attn:.1f}  shared {c.shared:.1f}  routed "
                   f"{c.routed:.1f}  dense MLP {c.dense:.1f}  norm+add {c.norm:.1f} ({T / L.dp:g} rows), "
                   f"{c.norm_rows:.1f} ({T} rows)")
        out.append(f"  collectives, us: FarSkip AR of {T} x hidden over {L.tp} ranks {c.ar_layer:.1f};  stock "
                   + (f"AR_attn of {T / L.dp:g} x hidden over {L.attn_tp} {c.ar_attn:.1f}, " if c.ar_attn else "")
                   + f"AG(x) {c.gather:.1f}, RS {c.scatter:.1f}")
    else:
        out.append(f"  per layer, us: attention {c.attn:.1f}  shared {c.shared:.1f}  routed {c.routed:.1f}  dense MLP "
                   f"{c.dense:.1f}  norm+add {c.norm:.1f}  AR {c.ar_layer:.1f}")
    out.append(f"  {'mode':<8} {'step ms':>9} {'compute':>9} {'exposed':>9} {'contention':>10} {'collectives':>11} "
               f"{'hidden':>7} {'MB/rank':>8}")
    for mode, r in plan.runs.items():
        out.append(f"  {mode:<8} {_ms(r.step_us):>9} {_ms(r.compute_us):>9} {_ms(r.exposed_us):>9} "
                   f"{_ms(r.contention_us):>10} {len(r.collectives):>11} {r.hidden:>6.1%} {r.link_bytes / 1e6:>8.1f}")
    n_win, n_all = plan.windowed_count
    out.append(f"  speed-up overlap/stock {plan.speedup():.3f}x, overlap/sync {plan.speedup(over='sync'):.3f}x, "
               f"sync/stock {plan.speedup('sync', 'stock'):.3f}x")
    out.append(f"  stock f {plan.f:.3f}: bound 1/(1-f) {1 / (1 - plan.f):.3f}x, link bound "
               f"{1 / max(plan.f, 1 - plan.f):.3f}x; schedule ceiling (contention 0) "
               f"{plan.runs['stock'].step_us / plan.ideal.step_us:.3f}x")
    out.append(f"  windows: {n_win} of {n_all} collectives ({n_win / n_all:.1%}); ceiling on hidden "
               f"{plan.windowed_share:.1%} of communication time")
    if dp:
        fs, st = plan.runs["overlap"], plan.runs["stock"]
        out.append(f"  DP attention: FarSkip moves {fs.link_bytes / st.link_bytes:.2f}x stock's link bytes "
                   f"(collectives {fs.comm_us / 1000:.3f} ms a step, stock's {st.comm_us / 1000:.3f} ms, every one "
                   f"exposed); overlap floor max(compute, collectives) {_ms(max(fs.compute_us, fs.comm_us))} ms")
        stock_moe = [x for x in st.collectives if shape_is_moe(plan, x.layer)]
        per = {}
        for x in stock_moe:
            per.setdefault(x.label, x.us)
        out.append("  stock DP, every MoE layer (all blocking, nothing hidden): "
                   + " + ".join(f"{lab} {us:.1f}" for lab, us in per.items()) + " us")
        out.append("  FarSkip DP, per layer: A lane = AR(attention partial in own rows + shared) hides behind the "
                   "routed experts; R lane = AR(routed) behind the next layer's norm + attention (local rows)")
    out.append("  per layer (overlap): collective us | window (compute between launch and wait) us | exposed us | verdict")
    for row in layer_view(plan):
        span = "embeddings" if row["first"] < 0 else f"layer {row['first']}" if row["first"] == row["last"] else \
            f"layers {row['first']}-{row['last']} ({row['last'] - row['first'] + 1})"
        for i, (label, us, ops, win, stall, verdict) in enumerate(row["items"]):
            out.append(f"    {span if i == 0 else '':<20} {label:<13} {us:>9.1f} | {ops:<16} {win:>9.1f} | {stall:>8.1f} | {verdict}")
    return "\n".join(out)


def plan_json(plan: Prediction) -> dict:
    n_win, n_all = plan.windowed_count
    return {
        "model": plan.shape.name, "farskip": plan.shape.farskip.to_hf_keys(),
        "farskip_assumed": plan.shape.farskip_assumed,
        "layout": dataclasses.asdict(plan.layout), "phase": dataclasses.asdict(plan.phase),
        "contention": plan.contention, "per_op_source": plan.ops_label, "comm_source": plan.comm_label,
        "costs_us": dataclasses.asdict(plan.costs),
        "modes": {m: {"step_us": r.step_us, "compute_us": r.compute_us, "exposed_comm_us": r.exposed_us,
                      "contention_us": r.contention_us, "comm_us": r.comm_us, "collectives": len(r.collectives),
                      "hidden": r.hidden, "link_bytes_per_rank": r.link_bytes} for m, r in plan.runs.items()},
        "speedup_overlap_vs_stock": plan.speedup(), "speedup_overlap_vs_sync": plan.speedup(over="sync"),
        "f_stock": plan.f, "bound": 1 / (1 - plan.f), "link_bound": 1 / max(plan.f, 1 - plan.f),
        "schedule_ceiling": plan.runs["stock"].step_us / plan.ideal.step_us,
        "windowed": [n_win, n_all], "hidden_ceiling": plan.windowed_share,
        "per_collective": [dataclasses.asdict(c) for c in plan.runs["overlap"].collectives],
    }


def plot_plans(plans: list[Prediction], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{p.phase.kind[0]}{p.phase.tokens if p.phase.kind == 'prefill' else p.phase.batch}" for p in plans]
    width = 0.27
    for j, mode in enumerate(("stock", "sync", "overlap")):
        xs = [i + (j - 1) * width for i in range(len(plans))]
        comp = [p.runs[mode].compute_us / 1000 for p in plans]
        expo = [p.runs[mode].exposed_us / 1000 for p in plans]
        cont = [p.runs[mode].contention_us / 1000 for p in plans]
        left.bar(xs, comp, width, color=f"C{j}", label=f"{mode} compute")
        left.bar(xs, expo, width, bottom=comp, color=f"C{j}", alpha=0.45, hatch="//", label=f"{mode} exposed comm")
        left.bar(xs, cont, width, bottom=[a + b for a, b in zip(comp, expo)], color="grey", alpha=0.6,
                 label="contention" if j == 2 else None)
    left.set_xticks(range(len(plans)), names)
    left.set_ylabel("step time, ms")
    left.set_title(f"{plans[0].shape.name}, TP/EP {plans[0].layout.tp}")
    left.legend(fontsize=7)
    p = plans[-1]
    run = p.runs["overlap"]
    layers = sorted({c.layer for c in run.collectives})
    routed = {"AR(r)"}
    r_lane = [sum(c.stall_us for c in run.collectives if c.layer == k and c.label in routed) / 1000 for k in layers]
    others = [sum(c.stall_us for c in run.collectives if c.layer == k and c.label not in routed) / 1000 for k in layers]
    right.bar(layers, r_lane, color="C3", label="R lane exposed")
    right.bar(layers, others, bottom=r_lane, color="C0", label="other collectives exposed")
    right.set_xlabel("layer")
    right.set_ylabel("exposed communication, ms")
    right.set_title(f"overlap, {names[-1]}: {p.speedup():.2f}x vs stock, hidden {run.hidden:.0%}")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================== the paper's layouts
PAPER = [
    {"title": "DeepSeek-V3 prefill (TTFT), EP8/TP8 one node, batch 32 x 2048 tokens",
     "published": "up to 1.34x (v2, Fig. 6); 1.326x (v3 abstract, '32.6%'); 97.3% of prefill communication hidden",
     "claim": 1.34,
     "tp": 8, "nodes": 1, "phase": Phase("prefill", 32 * 2048, 2048, 32),
     "hardware": [("MI300X", "bf16"), ("MI325X", "bf16"), ("MI300X", "fp8")],
     "clusters": [("mi300x-xgmi", 1.0)]},
    {"title": "DeepSeek-V3 decode (ITL), EP16/TP16 two nodes, batch 1024, context 258",
     "published": "up to 1.25x (v2, Fig. 7)",
     "claim": 1.25,
     "tp": 16, "nodes": 2, "phase": Phase("decode", 1024, 258, 1024),
     "hardware": [("MI300X", "bf16"), ("MI300X", "fp8")],
     "clusters": [("amd-good", 1.0), ("amd-poor", 1.0), ("amd-good", 0.5)]},
]


def paper_report(contentions=(0.0, 0.15, 0.30)) -> tuple[str, list]:
    shape = load_shape("deepseek-v3")
    lines, records = [], []
    for case in PAPER:
        layout = Layout(case["tp"], 1, case["nodes"])
        lines += [case["title"], f"  published: {case['published']}",
                  f"  {'GPU dtype':<13} {'all-reduce table':<22} {'X us':>6} {'stock ms':>9} "
                  + " ".join(f"{'g=' + format(g, '.2f'):>7}" for g in contentions) + f" {'f':>6} {'hidden':>7}"]
        inside = []
        for gpu, dtype in case["hardware"]:
            ops = Roofline(shape, BUILTIN_GPUS[gpu], dtype)
            for cname, factor in case["clusters"]:
                comm = BUILTIN_CLUSTERS[cname]
                comm = comm if factor == 1.0 else comm.scaled(factor, f"x{factor:g}")
                plans = [make_plan(shape, layout, case["phase"], ops, comm, g) for g in contentions]
                x = plans[0].costs.ar_layer
                lines.append(f"  {gpu + ' ' + dtype:<13} {comm.name:<22} {x:>6.0f} {_ms(plans[0].runs['stock'].step_us):>9} "
                             + " ".join(f"{p.speedup():>6.2f}x" for p in plans)
                             + f" {plans[0].f:>6.3f} {plans[0].runs['overlap'].hidden:>6.1%}")
                records.append({"case": case["title"], "gpu": gpu, "dtype": dtype, "cluster": comm.name,
                                "ar_us": x, "stock_ms": plans[0].runs["stock"].step_us / 1000, "f": plans[0].f,
                                "hidden": plans[0].runs["overlap"].hidden,
                                "speedup": {str(g): p.speedup() for g, p in zip(contentions, plans)}})
                if min(p.speedup() for p in plans) <= case["claim"] <= max(p.speedup() for p in plans):
                    inside.append(f"{gpu} {dtype} / {comm.name}")
        lines.append(f"  {case['claim']:.2f}x lies between g=0 and g={contentions[-1]:.2f} for: "
                     + ("; ".join(inside) if inside else "none of these rows"))
        lines.append("")
    lines.append("Speed-up = stock step / FarSkip-overlap step (the paper's baseline is the stock model), per-op "
                 "times from the roofline of perf-model.md 4.1-4.2, g = contention (overlapped compute keeps 1-g "
                 "of its speed). 'hidden' is at g = 0; the ceiling is 115 of 119 ARs (96.6%).")
    return "\n".join(lines), records


# ================================================================== CLI
# A plain plan's defaults, applied in run() rather than by argparse: --pd has its own (plan_pd.py)
# and must tell a flag left out from one given.
DEFAULT_TP, DEFAULT_BATCH, DEFAULT_CONTEXT = 16, 1, 2048
GPUS_PER_NODE = 8


def default_nodes(tp: int) -> int:
    return max(1, tp // GPUS_PER_NODE)


def default_cluster(nodes: int) -> str:
    """The built-in table of the paper's hardware: xGMI inside one node, the best RCCL table across two."""
    return "mi300x-xgmi" if nodes == 1 else "amd-good"


def _sizes(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected integers separated by commas") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{flag} {text!r}: expected positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m sglang_farskip.plan", description="Predict stock, FarSkip-sync and FarSkip-overlap step times on a cluster.",
        epilog="docs/planner.md: inputs, assumptions, how to measure a cluster, validation.")
    p.add_argument("--model", default="deepseek-v3",
                   help=f"built-in ({', '.join(BUILTIN_MODELS)}) or a config.json / checkpoint folder")
    p.add_argument("--tp", type=int, help=f"TP = EP group size N (default {DEFAULT_TP}; 8 or 16 for the paper's layouts)")
    p.add_argument("--dp", type=int, default=1, help="DP-attention ranks (attention TP = tp/dp); docs/dp-attention.md")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default tp/8, at least 1): picks the default cluster")
    p.add_argument("--prefill", help="prompt length(s), comma-separated, e.g. 1024,2048,4096,8192")
    p.add_argument("--decode", help="decode batch size(s), comma-separated, e.g. 1,16,256,1024 (not with --prefill, "
                   "but under --pd)")
    p.add_argument("--batch", type=int, help=f"prefill: prompts in the forward (tokens = batch x prompt; default "
                   f"{DEFAULT_BATCH})")
    p.add_argument("--context", type=int, help=f"decode: KV length per sequence (default {DEFAULT_CONTEXT})")
    p.add_argument("--cluster", help="all_reduce_perf output file or a built-in table (--list); "
                   "default mi300x-xgmi on one node, amd-good on two")
    p.add_argument("--ar-column", choices=["in", "out", "min"], default="in",
                   help="which all_reduce_perf time to use: in-place (default), out-of-place, or the smaller")
    p.add_argument("--link-mbit", type=float, help="instead of a table: a link of this many Mbit/s (CPU testbed)")
    p.add_argument("--link-latency-us", type=float, default=0.0, help="with --link-mbit: fixed cost per collective")
    p.add_argument("--gather-cluster", help="--dp, stock: all_gather_perf output (default: half the all-reduce time)")
    p.add_argument("--scatter-cluster", help="--dp, stock: reduce_scatter_perf output (default: half the all-reduce time)")
    p.add_argument("--attn-cluster", help="--dp, stock: all_reduce_perf of the attention TP group (default: --cluster)")
    p.add_argument("--ops", help="per-op JSON of the bare GPU check (default: roofline of --gpu/--dtype)")
    p.add_argument("--gpu", choices=sorted(BUILTIN_GPUS), default="MI300X",
                   help="roofline GPU, and the GPU of the memory figure")
    p.add_argument("--dtype", choices=memory.FORMATS,
                   help="weight format: the roofline's GEMM precision and the memory figure (default: the "
                   "checkpoint's, fp8 for DeepSeek's block-FP8 quantization_config, else bf16)")
    p.add_argument("--contention", type=float, default=0.0,
                   help="fraction of compute throughput lost while a collective is in flight (0.15 = 15%%)")
    p.add_argument("--overhead-us", type=float, default=0.0,
                   help="per-step time outside the layers (scheduler, sampling), the same in every mode")
    p.add_argument("--sync-f", type=float, help="scale the collectives so that FarSkip-sync's exposed share is this "
                   "measured f (e.g. from overlap_bench.py's sync profile)")
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="step-time bars per mode and the per-layer exposed time")
    p.add_argument("--paper", action="store_true", help="the paper's two headline layouts next to its figures")
    p.add_argument("--list", action="store_true", help="built-in models, clusters and GPUs")
    p.add_argument("--fit", action="store_true",
                   help="does --model fit on 8xH200, 2x8xH100, 8xMI300X, ... in bf16 and fp8 (weights, KV cache)")
    from sglang_farskip import plan_pd  # builds on this module: imported once this one is loaded
    plan_pd.add_arguments(p)
    return p


def _listing() -> str:
    out = ["models: " + ", ".join(BUILTIN_MODELS), "clusters (all_reduce us at 14 KB ... 940 MB):"]
    out += [f"  {c.name:<12} {c.ranks} ranks  {', '.join(f'{t:g}' for _, t in c.points)}\n      {c.source}"
            for c in BUILTIN_CLUSTERS.values()]
    out += ["GPUs (roofline peaks; memory):"] + [
        f"  {g.name:<7} {g.tflops_bf16:g}/{g.tflops_fp8:g} TFLOP/s bf16/fp8, {g.tbs:g} TB/s ({g.source}); "
        f"{g.hbm_gb} GB datasheet, {memory.size(g.hbm_bytes)} counted ({g.hbm_source})" for g in BUILTIN_GPUS.values()]
    return "\n".join(out)


# The layouts of issue 35's question, and one node of H100 and of MI325X beside them.
FIT_LAYOUTS = (("H200", 8), ("H100", 16), ("MI300X", 8), ("H100", 8), ("MI325X", 8))


def fit_table(shape: Shape) -> tuple[str, list[memory.Fit]]:
    fits = [memory.fit(shape, fmt, gpu, BUILTIN_GPUS[gpu].hbm_bytes, n)
            for gpu, n in FIT_LAYOUTS for fmt in memory.FORMATS]
    w = {f.weights.fmt: f.weights for f in fits}
    out = [f"{shape.name}: {w['bf16'].params_text()}; weights bf16 {memory.size(w['bf16'].nbytes)}, fp8 (DeepSeek's "
           f"block FP8) {memory.size(w['fp8'].nbytes)}; KV cache {fits[0].kv_token:,} B per token (MLA latent, bf16)",
           f"  {'GPUs':<12} {'format':<6} {'weights/GPU':>11} {'usable/GPU':>10} {'KV/GPU':>9} {'KV tokens':>10}  verdict"]
    for f in fits:
        kv = (memory.size(f.kv_per_gpu), f"{f.tokens:,}") if f.fits else ("-", "-")
        out.append(f"  {f'{f.gpus} x {f.gpu}':<12} {f.weights.fmt:<6} {memory.size(f.per_gpu):>11} "
                   f"{memory.size(f.usable):>10} {kv[0]:>9} {kv[1]:>10}  "
                   f"{'fits' if f.fits else 'does not fit'}")
    out.append(f"Usable = {1 - memory.HEADROOM:.0%} of each GPU's memory (--list: sizes, sources); weights split "
               "evenly over the GPUs, MTP included; KV tokens under TP attention (each rank holds every token's "
               "latent). docs/planner.md, Memory.")
    return "\n".join(out), fits


def _comm_for(args, layout: Layout):
    if args.link_mbit:
        if args.cluster:
            raise UserError("--cluster and --link-mbit: pick one")
        return LinkModel(f"link {args.link_mbit:g} Mbit/s", f"ring model, {args.link_latency_us:g} us per collective",
                         layout.tp, args.link_mbit, args.link_latency_us)
    return cluster_for(args.cluster or default_cluster(layout.nodes), args.ar_column, layout)


def cluster_for(spec: str, column: str, layout: Layout) -> CommTable:
    comm = load_cluster(spec, column)
    if comm.ranks and comm.ranks != layout.tp:
        print(f"warning: cluster table {comm.name} was measured on {comm.ranks} ranks, the layout has {layout.tp}",
              file=sys.stderr)
    return comm


def dtype_source(flag: Optional[str], shape: Shape) -> str:
    """Where the weight format came from, as the memory figure says it."""
    if flag:
        return "--dtype"
    return "config.json's quantization_config" if shape.weight_format == "fp8" else "no quantization_config"


def make_ops(path: Optional[str], shape: Shape, gpu: Gpu, dtype: str):
    """Per-op times: the bare GPU check's file when given, else the roofline of the GPU."""
    return MeasuredOps(path) if path else Roofline(shape, gpu, dtype)


def run(argv: Optional[list] = None) -> int:
    from sglang_farskip import plan_pd  # builds on this module: imported once this one is loaded

    args = build_parser().parse_args(argv)
    plan_pd.check_flags(args)
    if args.pd:
        return plan_pd.run(args)
    if args.list:
        print(_listing())
        return 0
    if args.fit:
        text, fits = fit_table(load_shape(args.model))
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps([f.as_json() for f in fits], indent=1))
        return 0
    if args.paper:
        text, records = paper_report()
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1))
        return 0
    shape = load_shape(args.model)
    if args.prefill and args.decode:
        raise UserError("--prefill and --decode: pick one (both only with --pd)")
    tp = DEFAULT_TP if args.tp is None else args.tp
    layout = Layout(tp, args.dp, args.nodes or default_nodes(tp))
    check_layout(shape, layout)
    comm = _comm_for(args, layout)
    extra = {k: load_cluster(v, args.ar_column) if v else None for k, v in
             (("gather", args.gather_cluster), ("scatter", args.scatter_cluster), ("attn_comm", args.attn_cluster))}
    dtype = args.dtype or shape.weight_format
    gpu = BUILTIN_GPUS[args.gpu]
    ops = make_ops(args.ops, shape, gpu, dtype)
    context = DEFAULT_CONTEXT if args.context is None else args.context
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    if args.decode:
        phases = [Phase("decode", b, context, b) for b in _sizes(args.decode, "--decode")]
    else:
        phases = [Phase("prefill", batch * n, n, batch) for n in _sizes(args.prefill or "2048", "--prefill")]
    plans = [make_plan(shape, layout, ph, ops, comm, args.contention, overhead_us=args.overhead_us, **extra)
             for ph in phases]
    if args.sync_f is not None:
        plans = [calibrate_to_sync_f(p, args.sync_f, ops, comm, args.overhead_us, extra) for p in plans]
    print("\n\n".join(format_plan(p) for p in plans))
    fit = memory.fit(shape, dtype, gpu.name, gpu.hbm_bytes, layout.tp, layout.dp)
    print("\n" + "\n".join(fit.report(dtype_source(args.dtype, shape))))
    if getattr(ops, "extrapolated", None):
        print(f"warning: per-op times extrapolated beyond the measured sizes: {', '.join(sorted(ops.extrapolated))}",
              file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(plan_json(p), memory=fit.as_json()) for p in plans], indent=1))
    if args.plot:
        plot_plans(plans, args.plot)
    return 0


def main(argv: Optional[list] = None) -> int:
    return run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
