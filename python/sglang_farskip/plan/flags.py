"""What both command lines (a plain plan and --pd) make of their flags: a comma list of sizes,
the nodes and the cluster table a layout gets, the per-op times, where the weight format came
from."""

from __future__ import annotations

import sys
from typing import Optional

from sglang_farskip.errors import UserError
from sglang_farskip.plan.collectives import CommTable, load_cluster
from sglang_farskip.plan.hardware import Gpu, MeasuredOps, Roofline
from sglang_farskip.plan.shapes import Shape
from sglang_farskip.plan.simulation import Layout

GPUS_PER_NODE = 8


def default_nodes(tp: int) -> int:
    return max(1, tp // GPUS_PER_NODE)


def default_cluster(nodes: int) -> str:
    """The built-in table of the paper's hardware: xGMI inside one node, the best RCCL table across two."""
    return "mi300x-xgmi" if nodes == 1 else "amd-good"


def sizes(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected integers separated by commas") from None
    if not vals or min(vals) < 1:
        raise UserError(f"{flag} {text!r}: expected positive integers")
    return vals


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
