"""The one FarSkip configuration: read from a checkpoint's config.json, validated once.

Keys (the same as AMD's FarSkip-native checkpoints, e.g. Instella-MoE):
    farskip             bool   the model is FarSkip
    farskip_start_idx   int    first converted layer (inclusive, default 0)
    farskip_end_idx     int    last converted layer (inclusive, default 10000 = every layer)
    attn_only_farskip   bool   rewire only the attention input
    mlp_only_farskip    bool   rewire only the MLP input

Wiring of a converted layer k (docs/design.md, "The connectivity"):
    attention reads h[k-1] - r[k-1]   unless mlp_only   (r = routed output of an MoE layer, else 0)
    MLP       reads h[k-1]            unless attn_only  (skips this layer's attention)
An unconverted layer is a plain DeepSeek-V3 layer on the full residual h.

The serving mode (`--farskip-mode`) is not a checkpoint property: it is a runtime option
(`options.RuntimeOptions`), decided by the launcher.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from sglang_farskip.errors import UserError

DEFAULT_START_IDX = 0
DEFAULT_END_IDX = 10000  # AMD's default: "every layer"


class FarSkipMode(str, enum.Enum):
    OVERLAP = "overlap"  # FarSkip wiring, async all-reduce, waits deferred to first use
    SYNC = "sync"  # FarSkip wiring, every all-reduce waited right after launch
    # FarSkip wiring on overlap's own communicator, each all-reduce waited at its launch: the
    # A/B against `overlap` that changes only where the waits are (on a GPU `sync` also changes
    # the all-reduce kernel: SGLang's custom all-reduce against FarSkip's NCCL call).
    BLOCKING = "blocking"
    OFF = "off"  # stock DeepSeek-V3 wiring on FarSkip weights: for A/B timing only

    @property
    def own_communicator(self) -> bool:
        """Runs on FarSkip's asynchronous communicator (comm thread, GPU side stream)."""
        return self in (FarSkipMode.OVERLAP, FarSkipMode.BLOCKING)

    @classmethod
    def parse(cls, value: "str | FarSkipMode") -> "FarSkipMode":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise UserError(
                f"unknown FarSkip mode {value!r}: choose one of {choices} (--farskip-mode)"
            ) from None


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg[key]` of a config.json dict, or the attribute of a transformers PretrainedConfig."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _as_bool(cfg: Any, key: str, default: bool) -> bool:
    value = config_value(cfg, key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(
            f"config.json key {key!r} must be true or false, got {value!r}: fix config.json"
        )
    return value


def _as_int(cfg: Any, key: str, default: int) -> int:
    value = config_value(cfg, key, default)
    if value is None:
        return default
    # AMD's remote config class (trust_remote_code) defaults farskip_end_idx to the float 1e4.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(
            f"config.json key {key!r} must be an integer layer index, got {value!r}: fix config.json"
        )
    return value


@dataclasses.dataclass(frozen=True)
class FarSkipConfig:
    enabled: bool = False
    start_idx: int = DEFAULT_START_IDX
    end_idx: int = DEFAULT_END_IDX
    attn_only: bool = False
    mlp_only: bool = False

    def __post_init__(self) -> None:
        if self.start_idx < 0:
            raise UserError(
                f"farskip_start_idx is {self.start_idx}: it must be >= 0 (layers are 0-based)"
            )
        if self.end_idx < self.start_idx:
            raise UserError(
                f"empty FarSkip layer range: farskip_start_idx={self.start_idx} > "
                f"farskip_end_idx={self.end_idx}; set farskip_end_idx >= farskip_start_idx "
                f"(the range is inclusive)"
            )
        if self.attn_only and self.mlp_only:
            raise UserError(
                "attn_only_farskip and mlp_only_farskip are both true, which converts nothing: "
                "set at most one of them (neither = rewire both inputs)"
            )

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "FarSkipConfig":
        """Build from a config.json dict or a transformers PretrainedConfig."""
        return cls(
            enabled=_as_bool(cfg, "farskip", False),
            start_idx=_as_int(cfg, "farskip_start_idx", DEFAULT_START_IDX),
            end_idx=_as_int(cfg, "farskip_end_idx", DEFAULT_END_IDX),
            attn_only=_as_bool(cfg, "attn_only_farskip", False),
            mlp_only=_as_bool(cfg, "mlp_only_farskip", False),
        )

    def to_hf_keys(self) -> dict:
        return {
            "farskip": self.enabled,
            "farskip_start_idx": self.start_idx,
            "farskip_end_idx": self.end_idx,
            "attn_only_farskip": self.attn_only,
            "mlp_only_farskip": self.mlp_only,
        }

    def check_layers(self, num_layers: int) -> None:
        """The range must hit at least one of the model's layers, or FarSkip is a silent no-op."""
        if self.enabled and self.start_idx >= num_layers:
            raise UserError(
                f"farskip_start_idx={self.start_idx} but the model has only {num_layers} layers "
                f"(0..{num_layers - 1}): no layer would be converted; lower farskip_start_idx"
            )

    def converted(self, layer_id: int) -> bool:
        return self.enabled and self.start_idx <= layer_id <= self.end_idx

    def converted_layers(self, num_layers: int) -> list[int]:
        return [k for k in range(num_layers) if self.converted(k)]

    def attn_skips_prev_routed(self, layer_id: int) -> bool:
        """Attention of this layer reads h[k-1] - r[k-1] instead of h[k-1]."""
        return self.converted(layer_id) and not self.mlp_only

    def mlp_skips_attn(self, layer_id: int) -> bool:
        """The MLP of this layer reads h[k-1] instead of h[k-1] + a[k]."""
        return self.converted(layer_id) and not self.attn_only

    def describe(self, num_layers: int) -> str:
        if not self.enabled:
            return "FarSkip off (stock DeepSeek-V3 wiring)"
        layers = self.converted_layers(num_layers)
        variant = "attention-only" if self.attn_only else "MLP-only" if self.mlp_only else "full"
        span = f"{layers[0]}..{layers[-1]}" if layers else "none"
        return f"FarSkip {variant}, converted layers {span} ({len(layers)} of {num_layers})"


def is_moe_layer(hf_config: Any, layer_id: int) -> bool:
    """DeepSeek-V3's rule: dense for the first `first_k_dense_replace` layers, then MoE every
    `moe_layer_freq` layers (and only if the config has routed experts)."""
    if not config_value(hf_config, "n_routed_experts", None):
        return False
    first_dense = config_value(hf_config, "first_k_dense_replace", 0) or 0
    freq = config_value(hf_config, "moe_layer_freq", 1) or 1
    return layer_id >= first_dense and layer_id % freq == 0
