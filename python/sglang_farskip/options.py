"""Runtime options: what the launcher decided, the same in every process SGLang starts.

A checkpoint says what the model *is* (`config.FarSkipConfig`); these options say how this
server runs it. The launcher is their only writer: it validates them once and publishes them as
JSON in one environment variable, which SGLang's scheduler, TP and detokenizer processes
inherit, spawned or forked. Every reader (the model, the CPU attention, the settings checks) calls
`current()`, which parses and validates the variable once per process.

Each option is declared once, as a field of `RuntimeOptions` with its command-line `Flag`: the
launcher's parser is built from these declarations, the options object from what that parser
read, and docs/serving.md's table of them is generated here (`python -m sglang_farskip.options`;
tests/test_docs.py checks the page against it).

A process that SGLang started without our launcher (`python -m sglang.launch_server` with the
plugin installed) finds no variable and gets the defaults: FarSkip `overlap`, CPU overlap only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Optional

from sglang_farskip.config import FarSkipMode
from sglang_farskip.errors import ArgumentParser, UserError

ENV = "SGLANG_FARSKIP_OPTIONS"
CPU_ATTENTION_CHOICES = ("absorbed", "mha")
CPU_START_METHODS = ("fork", "spawn")
LANES = ("attn", "attn+shared", "routed")  # the collectives' lane names (schedule.py)
# SGLang features that serve requests past the API keys or this package's request checks; the
# launcher refuses each unless named in --farskip-allow-unchecked (serve/launcher.py says why).
UNCHECKED = ("rust-server", "grpc", "custom-logit-processor")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of the launcher: how its parser reads it and how the docs list it.

    A flag left out parses to `default` (None unless given), so the launcher can tell a flag
    the user gave from one left out; for a runtime option the field's default then applies
    (`RuntimeOptions.from_flags`)."""

    name: str
    help: Optional[str] = None
    type: Any = None  # argparse's converter; `bool`: a switch, which takes no value
    choices: Optional[tuple[str, ...]] = None
    metavar: Optional[str] = None
    default: Any = None
    test_only: bool = False  # hidden from --help and the docs (checks/device.py passes them)
    doc: Optional[str] = None  # the docs' text for a flag without a help line

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute, as argparse names it."""
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        shown = argparse.SUPPRESS if self.test_only else self.help
        if self.type is bool:
            parser.add_argument(self.name, action="store_true", help=shown)
        else:
            parser.add_argument(self.name, type=self.type, choices=self.choices, default=self.default,
                                metavar=self.metavar, help=shown)

    def usage(self) -> str:
        """The flag with its value, as --help writes it."""
        if self.type is bool:
            return self.name
        value = self.metavar or ("{" + ",".join(self.choices) + "}" if self.choices else self.dest.upper())
        return f"{self.name} {value}"


def option(default: Any, flag: Flag) -> Any:
    """A RuntimeOptions field and the flag that sets it."""
    return dataclasses.field(default=default, metadata={"flag": flag})


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    mode: FarSkipMode = option(FarSkipMode.OVERLAP, Flag(
        "--farskip-mode", choices=tuple(m.value for m in FarSkipMode),
        doc="how the FarSkip collectives run: `overlap` (asynchronous, each waited right before the "
        "add that reads it), `sync` (blocking), `blocking` (overlap's own all-reduce, waited at its "
        "launch) or `off` (stock DeepSeek-V3 wiring, for A/B timing only)"))
    profile_dir: Optional[str] = option(None, Flag(  # absolute, made by the launcher
        "--farskip-profile-dir",
        help="record per-layer collective/wait timings into DIR (off by default)"))
    metrics: str = option("on", Flag(
        "--farskip-metrics", choices=("on", "off"),
        help="with SGLang's --enable-metrics: FarSkip's series on /metrics (per lane and phase: "
        "collective time, time waited for it, bytes; the mode of each rank); default on"))
    gpu_overlap: bool = option(False, Flag(
        "--farskip-gpu-overlap", type=bool,
        help="use the side-stream all-reduce on GPU (not yet validated on hardware)"))
    side_max_ctas: Optional[int] = option(None, Flag(  # NCCL maxCTAs of that all-reduce
        "--farskip-side-max-ctas", type=int,
        help="cap the CTAs (SMs) one side-stream all-reduce may take from "
        "overlapped compute (NCCL maxCTAs; default: NCCL's choice)"))
    cpu_attention: Optional[str] = option(None, Flag(  # None = absorbed, uncounted
        "--farskip-cpu-attention", choices=CPU_ATTENTION_CHOICES,
        help="CPU only: MLA prefill as absorbed MLA (default) or, as on GPUs, MHA over "
        "decompressed K/V (chunked on a long cached prefix); decode stays absorbed"))
    cpu_start_method: str = option("fork", Flag(
        "--farskip-cpu-start-method", choices=CPU_START_METHODS,
        help="CPU only: SGLang's worker processes are forked from the launcher, which "
        "has imported SGLang already (default), or spawned as on GPUs (each imports it again)"))
    # What one request may ask for (serve/admission.py; read in the HTTP process only).
    max_logprobs: int = option(20, Flag(  # vLLM's default
        "--farskip-max-logprobs", type=int, metavar="K",
        help="the most log-probabilities one request may ask for per token: top ones "
        "(top_logprobs_num, OpenAI logprobs/top_logprobs; vLLM's default) and given ids (token_ids_logprob)"))
    max_n: int = option(16, Flag(
        "--farskip-max-n", type=int, metavar="N",
        help="the most sequences one request may ask for per prompt: parallel samples (n, best_of) "
        "or beams (beam_width)"))
    max_request_tokens: Optional[int] = option(None, Flag(  # None: the model's context length
        "--farskip-max-request-tokens", type=int, metavar="T",
        help="the most tokens one request may cost, summed over its prompts, counted once "
        "tokenized: prompt + n (or beam_width) x tokens to generate, plus per-step extras; "
        "default: the model's context length"))
    max_batch: int = option(1024, Flag(
        "--farskip-max-batch", type=int, metavar="N",
        help="the most prompts one request may hold (a batch, Vertex instances, scored items, "
        "embedding or tokenize inputs)"))
    max_request_chars: Optional[int] = option(None, Flag(  # None: 8 per token of the budget
        "--farskip-max-request-chars", type=int, metavar="C",
        help="the most characters of text one request may hold, checked before tokenizing; "
        "default: 8 per token of --farskip-max-request-tokens"))
    max_stop_chars: int = option(256, Flag(
        "--farskip-max-stop-chars", type=int, metavar="C",
        help="the longest stop string, and the longest match of a stop regex, a request may give "
        "(both are searched in the output after every generated token)"))
    allow_unchecked: tuple[str, ...] = option((), Flag(
        "--farskip-allow-unchecked", metavar="NAMES",
        help="serve with these SGLang features, which bypass the API keys or the request checks, "
        f"instead of refusing them (comma-separated: {', '.join(UNCHECKED)}; default: none)"))
    # What clients may keep on the server (serve/shed.py; read in the HTTP process only).
    health_cache_s: float = option(5.0, Flag(
        "--farskip-health-cache-s", type=float, metavar="T",
        help="/health_generate runs one real generation at most every T seconds; callers in "
        "between get the last successful answer (0: every call generates, as SGLang does)"))
    max_sessions: int = option(64, Flag(
        "--farskip-max-sessions", type=int, metavar="N",
        help="the most sessions (/open_session) open at once; one more is refused with a 429"))
    session_lifetime_s: float = option(1800.0, Flag(
        "--farskip-session-lifetime-s", type=float, metavar="S",
        help="a session is closed S seconds after it was opened"))
    max_stored_responses: int = option(1024, Flag(
        "--farskip-max-stored-responses", type=int, metavar="N",
        help="with --enable-response-store: the most /v1/responses results kept; the oldest "
        "is dropped first"))
    stored_response_ttl_s: float = option(3600.0, Flag(
        "--farskip-stored-response-ttl-s", type=float, metavar="S",
        help="with --enable-response-store: a stored /v1/responses result is dropped S seconds "
        "after it was stored"))
    # Test only (python/sglang_farskip/checks/device.py): the side stream even at TP=1, with the fork/join probe.
    force_side_stream: bool = option(False, Flag("--farskip-test-force-side-stream", type=bool, test_only=True))
    # Test only (python/sglang_farskip/checks/device.py's broken-lane control): "LANE:LAYER", e.g. "attn+shared:1";
    # that collective sums zeros instead of this rank's partial, so a check must see it.
    drop_partial: Optional[str] = option(None, Flag(
        "--farskip-test-drop-partial", metavar="LANE:LAYER", test_only=True))

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", FarSkipMode.parse(self.mode))
        flags = option_flags()
        for name, flag in flags.items():
            if flag.type is bool and not isinstance(getattr(self, name), bool):
                raise UserError(f"runtime option {name}={getattr(self, name)!r}: must be true or false")
        ctas = self.side_max_ctas
        if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1):
            raise UserError(f"{flags['side_max_ctas'].name} {ctas}: give a positive CTA count")
        for name, least in (("max_logprobs", 0), ("max_n", 1), ("max_request_tokens", 1), ("max_batch", 1),
                            ("max_request_chars", 1), ("max_stop_chars", 1), ("max_sessions", 1),
                            ("max_stored_responses", 1)):
            value = getattr(self, name)
            if value is None and _default(name) is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserError(f"{flags[name].name} {value!r}: give an integer of at least {least}")
        for name, least in (("health_cache_s", 0.0), ("session_lifetime_s", 1.0), ("stored_response_ttl_s", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value < float("inf"):
                raise UserError(f"{flags[name].name} {value!r}: give a number of seconds of at least {least:g}")
        for name in ("cpu_attention", "cpu_start_method", "metrics"):  # the mode's were checked by its parse
            value, choices = getattr(self, name), flags[name].choices
            if value not in choices and not (value is None and _default(name) is None):
                raise UserError(f"{flags[name].name} {value!r}: choose one of {', '.join(choices)}")
        object.__setattr__(self, "allow_unchecked", self._unchecked_names(self.allow_unchecked))
        if self.drop_partial is not None:
            self.dropped_collective()  # raises on a malformed value
        if self.profile_dir is not None and not os.path.isabs(self.profile_dir):
            # Workers may run in another directory than the launcher.
            raise UserError(f"profile directory {self.profile_dir!r} must be an absolute path")

    @staticmethod
    def _unchecked_names(value) -> tuple[str, ...]:
        """--farskip-allow-unchecked as a sorted tuple of known names (a comma-separated string
        from the command line, a list from the JSON every process reads)."""
        flag = option_flags()["allow_unchecked"].name
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise UserError(f"{flag} {value!r}: give names separated by commas, from {', '.join(UNCHECKED)}")
        names = {n.strip() for n in names if n.strip()}
        unknown = sorted(names - set(UNCHECKED))
        if unknown:
            raise UserError(f"{flag} {value!r}: unknown {', '.join(unknown)}; choose from {', '.join(UNCHECKED)}")
        return tuple(sorted(names))

    @classmethod
    def from_flags(cls, given: argparse.Namespace, **resolved: Any) -> "RuntimeOptions":
        """The options from the launcher's parsed flags: a flag left out takes its field's
        default; `resolved` are the values the launcher settled itself (the profile directory,
        made absolute)."""
        values = {name: getattr(given, flag.dest) for name, flag in option_flags().items()}
        return cls(**{**{name: value for name, value in values.items() if value is not None}, **resolved})

    def dropped_collective(self) -> Optional[tuple[str, int]]:
        """(lane, layer) of --farskip-test-drop-partial, or None."""
        if self.drop_partial is None:
            return None
        lane, _, layer = str(self.drop_partial).rpartition(":")
        if lane not in LANES or not layer.isdigit():
            raise UserError(
                f"{option_flags()['drop_partial'].name} {self.drop_partial!r}: give LANE:LAYER with LANE one of "
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


def option_flags() -> dict[str, Flag]:
    """{field name: its flag}, in the order the fields are declared (the launcher's, --help's)."""
    return {f.name: f.metadata["flag"] for f in dataclasses.fields(RuntimeOptions)}


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(RuntimeOptions) if f.name == name)


def markdown_table() -> str:
    """docs/serving.md's table of the runtime options' flags (the test-only ones left out)."""
    rows = ["| Flag | Default | What it sets |", "| --- | --- | --- |"]
    for name, flag in option_flags().items():
        if flag.test_only:
            continue
        default = _default(name)
        shown = ("unset" if default is None else "off" if default is False else "none" if default == ()
                 else f"`{getattr(default, 'value', default)}`")
        rows.append(f"| `{flag.usage()}` | {shown} | {flag.doc or flag.help} |")
    return "\n".join(rows)


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


if __name__ == "__main__":
    ArgumentParser(prog="python -m sglang_farskip.options",
                   description="Print docs/serving.md's table of the runtime options' flags.").parse_args()
    print(markdown_table())
