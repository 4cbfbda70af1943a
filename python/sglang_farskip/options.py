"""Runtime options: what the launcher decided, the same in every process SGLang starts.

A checkpoint says what the model *is* (`config.FarSkipConfig`); these options say how this
server runs it. The launcher is their only writer: it validates them once and publishes them as
JSON in one environment variable, which SGLang's scheduler, TP and detokenizer processes
inherit, spawned or forked. Every reader (the model, the CPU attention, the settings checks) calls
`current()`, which parses and validates the variable once per process.

A process that SGLang started without our launcher (`python -m sglang.launch_server` with the
plugin installed) finds no variable and gets the defaults: FarSkip `overlap`, CPU overlap only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from sglang_farskip.config import FarSkipMode
from sglang_farskip.errors import UserError

ENV = "SGLANG_FARSKIP_OPTIONS"
CPU_ATTENTION_CHOICES = ("absorbed", "mha")
CPU_START_METHODS = ("fork", "spawn")
LANES = ("attn", "attn+shared", "routed")  # the collectives' lane names (schedule.py)


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    mode: FarSkipMode = FarSkipMode.OVERLAP  # --farskip-mode
    gpu_overlap: bool = False  # --farskip-gpu-overlap: the side-stream all-reduce on a GPU
    side_max_ctas: Optional[int] = None  # --farskip-side-max-ctas: NCCL maxCTAs of that all-reduce
    profile_dir: Optional[str] = None  # --farskip-profile-dir: absolute, made by the launcher
    cpu_attention: Optional[str] = None  # --farskip-cpu-attention: None = absorbed, uncounted
    cpu_start_method: str = "fork"  # --farskip-cpu-start-method: how SGLang starts its CPU workers
    # What one request may ask for (serve/admission.py; read in the HTTP process only).
    max_logprobs: int = 20  # --farskip-max-logprobs: top log-probabilities per token, as vLLM's default
    max_n: int = 16  # --farskip-max-n: parallel samples (n, best_of) per prompt
    max_request_tokens: Optional[int] = None  # --farskip-max-request-tokens; None: max_n full contexts
    # Test only (python/sglang_farskip/checks/device.py): the side stream even at TP=1, with the fork/join probe.
    force_side_stream: bool = False
    # Test only (python/sglang_farskip/checks/device.py's broken-lane control): "LANE:LAYER", e.g. "attn+shared:1";
    # that collective sums zeros instead of this rank's partial, so a check must see it.
    drop_partial: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", FarSkipMode.parse(self.mode))
        for name in ("gpu_overlap", "force_side_stream"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"runtime option {name}={getattr(self, name)!r}: must be true or false")
        ctas = self.side_max_ctas
        if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1):
            raise UserError(f"--farskip-side-max-ctas {ctas}: give a positive CTA count")
        for name, least in (("max_logprobs", 0), ("max_n", 1), ("max_request_tokens", 1)):
            value = getattr(self, name)
            if value is None and name == "max_request_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                flag = "--farskip-" + name.replace("_", "-")
                raise UserError(f"{flag} {value!r}: give an integer of at least {least}")
        if self.cpu_attention not in (None, *CPU_ATTENTION_CHOICES):
            raise UserError(
                f"--farskip-cpu-attention {self.cpu_attention!r}: choose one of {', '.join(CPU_ATTENTION_CHOICES)}"
            )
        if self.cpu_start_method not in CPU_START_METHODS:
            raise UserError(
                f"--farskip-cpu-start-method {self.cpu_start_method!r}: choose one of {', '.join(CPU_START_METHODS)}"
            )
        if self.drop_partial is not None:
            self.dropped_collective()  # raises on a malformed value
        if self.profile_dir is not None and not os.path.isabs(self.profile_dir):
            # Workers may run in another directory than the launcher.
            raise UserError(f"profile directory {self.profile_dir!r} must be an absolute path")

    def dropped_collective(self) -> Optional[tuple[str, int]]:
        """(lane, layer) of --farskip-test-drop-partial, or None."""
        if self.drop_partial is None:
            return None
        lane, _, layer = str(self.drop_partial).rpartition(":")
        if lane not in LANES or not layer.isdigit():
            raise UserError(
                f"--farskip-test-drop-partial {self.drop_partial!r}: give LANE:LAYER with LANE one of "
                f"{', '.join(LANES)} and LAYER a layer index, e.g. attn+shared:1"
            )
        return lane, int(layer)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "mode": self.mode.value}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RuntimeOptions":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{ENV} is not valid JSON ({e}): start the server with sglang_farskip.serve.launcher") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            extra = sorted(set(raw) - known) if isinstance(raw, dict) else raw
            raise UserError(
                f"{ENV} holds unknown options {extra}: it was written by another sglang_farskip version; "
                "start the server with this version's launcher"
            )
        return cls(**raw)


_current: Optional[RuntimeOptions] = None


def current() -> RuntimeOptions:
    """This process's options (parsed and validated on first use)."""
    global _current
    if _current is None:
        text = os.environ.get(ENV)
        _current = RuntimeOptions.from_json(text) if text else RuntimeOptions()
    return _current


def publish(options: RuntimeOptions) -> None:
    """Launcher only: make `options` this process's and every later child's."""
    global _current
    os.environ[ENV] = options.to_json()
    _current = options
