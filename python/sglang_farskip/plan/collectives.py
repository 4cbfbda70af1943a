"""Collective time against message size: a measured table (nccl-tests / rccl-tests output, or a
built-in published one) or a link model, and which table a layout gets."""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from pathlib import Path
from typing import Optional

from sglang_farskip.errors import UserError
from sglang_farskip.plan.shapes import BF16


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


_TOKEN = 7168 * BF16  # the built-in tables' columns, in DeepSeek-V3 tokens of 14,336 B (bf16 sums)
_SIZES = [1 * _TOKEN, 16 * _TOKEN, 64 * _TOKEN, 256 * _TOKEN, 1024 * _TOKEN, 2048 * _TOKEN,
          4096 * _TOKEN, 8192 * _TOKEN, 65536 * _TOKEN]


def _published(name, ranks, us, source):
    return CommTable(name, source, ranks, tuple(zip(_SIZES, us)))


# Published all_reduce_perf runs (bf16 message sizes, us), each with its source; docs/planner.md,
# "Measure your cluster", lists them.
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
