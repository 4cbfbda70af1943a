"""PNG plots of latency percentiles against concurrency, one colour per run label (A/B overlay)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

TITLES = {"ttft": "Time to first token", "itl": "Inter-token latency", "tpot": "Time per output token",
          "e2e": "End-to-end latency"}
STYLES = (("p50_ms", "-", "o", "p50"), ("p90_ms", "--", "s", "p90"), ("p99_ms", ":", "^", "p99"))


def plot_percentiles(series: dict[str, list[tuple[int, dict]]], metric: str, path: Path,
                     subtitle: str = "") -> Path:
    """series: label -> [(concurrency, level summary)], summaries as loadstats.level_summary."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)  # small: the example is committed
    levels = sorted({c for points in series.values() for c, _ in points})
    for n, (label, points) in enumerate(series.items()):
        colour = f"C{n}"
        points = sorted(points, key=lambda p: p[0])
        for key, line, marker, name in STYLES:
            xs = [c for c, s in points if s[metric][key] is not None]
            ys = [s[metric][key] for c, s in points if s[metric][key] is not None]
            if xs:
                ax.plot(xs, ys, line, marker=marker, color=colour, label=f"{label} {name}")
    if levels and levels[-1] >= 4 * max(levels[0], 1):
        ax.set_xscale("log", base=2)  # concurrency sweeps are usually powers of two
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel("ms")
    values = [s[metric][key] for points in series.values() for _, s in points for key, *_ in STYLES
              if s[metric][key]]
    if values and max(values) > 30 * min(values):
        ax.set_yscale("log")  # a p99 tail 30x the median would flatten the medians on a linear axis
        ax.set_ylabel("ms (log scale)")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(TITLES[metric], fontsize=10)
    if subtitle:
        fig.text(0.5, 0.01, textwrap.fill(subtitle, 110), ha="center", va="bottom", fontsize=6.5)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=len(series))
    fig.tight_layout(rect=(0, 0.05 if subtitle else 0, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
