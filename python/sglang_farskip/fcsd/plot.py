"""curves.png from metrics.jsonl: held-out KL and top-1 agreement, and the training loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_curves(metrics: Path, png: Path) -> bool:
    """Draw the curves; False (with a note on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no curves.png (metrics.jsonl has the numbers)", file=sys.stderr)
        return False
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("event") == "eval"]
    train = [r for r in records if r.get("event") == "train"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot([r["step"] for r in evals], [r["kl"] for r in evals], "o-")
    axes[0].set(title="held-out KL(teacher || student) / token", xlabel="step")
    axes[1].plot([r["step"] for r in evals], [r["top1"] for r in evals], "o-")
    axes[1].set(title="held-out top-1 agreement", xlabel="step")
    axes[2].plot([r["step"] for r in train], [r["kl"] for r in train], label="KL")
    if any(r["ce"] for r in train):
        axes[2].plot([r["step"] for r in train], [r["ce"] for r in train], label="CE")
    axes[2].set(title="training loss terms / token", xlabel="step")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True
