"""Per-op times: the built-in GPUs (peaks, memory), the roofline over them, and the bare GPU
check's measured times (--ops)."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path

from sglang_farskip.errors import UserError
from sglang_farskip.plan.shapes import BF16, Shape


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peaks (TFLOP/s dense, TB/s), the vendor that picks its EFFICIENCY row, and memory."""

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
    Gpu("H200", 989, 1979, 4.8, "nv", "datacrunch.io H200 blog", 141, 143771 * _MIB,
        "nvidia-smi 143771 MiB"),
    Gpu("MI300X", 1307, 2615, 5.3, "amd", "docs.vultr.com inference-cookbook", 192,
        206141652992, "rocm-smi VRAM Total Memory (ROCm issue 4750)"),
    Gpu("MI325X", 1307, 2615, 6.0, "amd", "docs.vultr.com inference-cookbook", 256,
        256 * 10**9, "datasheet 256 GB as 1e9 bytes: no driver report found, likely ~7% low"),
]}

# (HBM, GEMM, MoE, attention core as fractions; which peak the FLOP fractions apply to; kernel us).
# The table of docs/planner.md, "Roofline"; the NV BF16 row is this planner's own choice.
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
        self.label = f"roofline {gpu.name} {dtype} ({gpu.source}; efficiencies of docs/planner.md, Roofline)"

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
