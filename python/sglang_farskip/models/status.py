"""What is really running, reported by each model rank and read by the launcher.

SGLang builds the model in spawned scheduler processes and its registry swallows import
errors, so the launcher cannot trust what it asked for. Each rank's model writes one JSON file
into the directory named by SGLANG_FARSKIP_STATUS_DIR (set by the launcher, inherited by every
child); the launcher serves them at GET /farskip/info and refuses to run without them.
It sits beside the models, which write it (cpu/attention.py adds its counters), so that no
model imports from serve/; SGLang's registry imports it with the model classes, and it
registers nothing (no EntryClass).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ENV = "SGLANG_FARSKIP_STATUS_DIR"


def write_rank_status(report: dict) -> Path | None:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = Path(directory) / f"rank{report['tp_rank']}.json"
    # Write-then-rename: the launcher never reads half a file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def update_rank_status(tp_rank: int, **fields) -> Path | None:
    """Merge `fields` into this rank's report (written at model build), e.g. live counters."""
    directory = os.environ.get(ENV)
    path = Path(directory) / f"rank{tp_rank}.json" if directory else None
    if path is None or not path.exists():
        return None
    return write_rank_status({**json.loads(path.read_text()), **fields})


def read_rank_statuses(directory: str | Path) -> list[dict]:
    reports = []
    for path in sorted(Path(directory).glob("rank*.json")):
        reports.append(json.loads(path.read_text()))
    return sorted(reports, key=lambda r: r["tp_rank"])


def pd_role(disaggregation_mode: str | None) -> str:
    """SGLang's --disaggregation-mode as the report names it: "prefill", "decode", or "none"
    (SGLang's "null": one server runs both phases)."""
    return disaggregation_mode if disaggregation_mode in ("prefill", "decode") else "none"


def model_report(model, farskip, num_layers: int, requested, mode, comm_backend: str, extra: dict) -> dict:
    """What one rank's model really built: the class, the wiring, the mode that runs."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    from sglang_farskip import SGLANG_VERSION
    from sglang_farskip.formats import fp8

    active = mode.value != "off"
    # Which linear method SGLang built (torch-native FP8 on a CPU without AMX, cpu/fp8.py).
    method = type(model.model.layers[0].self_attn.o_proj.quant_method)
    parallel = get_parallel()
    return {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "inner_model_class": f"{type(model.model).__module__}.{type(model.model).__qualname__}",
        "farskip": farskip.to_hf_keys(),
        "requested_mode": requested.value,
        "mode": mode.value,
        "converted_layers": farskip.converted_layers(num_layers) if active else [],
        "num_layers": num_layers,
        "description": farskip.describe(num_layers) if active else "stock DeepSeek-V3 wiring",
        "comm_backend": comm_backend,
        "weight_format": fp8.weight_format(model.config),
        "linear_method": f"{method.__module__}.{method.__qualname__}",
        "tp_rank": parallel.tp_rank,
        "tp_size": parallel.tp_size,
        "moe_ep_size": parallel.moe_ep_size,
        "attn_dp_rank": parallel.attn_dp_rank,  # DP attention: which DP rank's tokens attend here
        "attn_dp_size": parallel.attn_dp_size,
        "attn_tp_size": parallel.attn_tp_size,
        "pd_role": pd_role(get_disagg().disaggregation_mode),
        "pid": os.getpid(),
        "sglang_version": SGLANG_VERSION,
        **extra,
    }
