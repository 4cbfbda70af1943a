"""Checkpoint rules, free of SGLang imports: which architectures we serve, reading config.json,
and the attention gate's tensors (checked from the safetensors headers).

The launcher, `convert`, `fcsd` and the plugin use these; the model's weight loader applies the
very same gate rules while it streams the tensors, so a checkpoint refused here is refused there.

AMD's Instella-MoE (`InstellaMoEForCausalLM`, `model_type: deepseek_v3`) is DeepSeek-V3 MLA + MoE
with one addition, `"gated_attention": true`: per layer a `self_attn.gate_proj` [heads*v_head, H]
whose sigmoid scales the attention output before o_proj.

The FarSkip keys themselves (`farskip`, `farskip_start_idx`, ...) are read by `config.FarSkipConfig`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from sglang_farskip.config import config_value
from sglang_farskip.errors import UserError

DEEPSEEK_V3_ARCH = "DeepseekV3ForCausalLM"
INSTELLA_ARCH = "InstellaMoEForCausalLM"
FARSKIP_ARCHS = (DEEPSEEK_V3_ARCH, INSTELLA_ARCH)  # what sglang_farskip registers with SGLang
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"  # safetensors shards: {"weight_map": {tensor: file}}

GATE_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.gate_proj\.weight$")


def read_config(path: str | Path, missing_hint: str) -> dict:
    """config.json of the checkpoint directory `path`; `missing_hint` says what to pass instead
    when `path` does not exist."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} does not exist: {missing_hint}")
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is not a directory: pass the checkpoint directory (the one with {CONFIG})")
    file = path / CONFIG
    if not file.exists():
        raise UserError(f"{path} has no {CONFIG}: pass a Hugging Face checkpoint directory ({CONFIG} + weights)")
    try:
        cfg = json.loads(file.read_text())
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror}; fix its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file} is not valid JSON ({e}): fix or re-download it") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{file} is not a JSON object: fix or re-download it")
    return cfg


def check_architecture(cfg: dict, path: str | Path, fix: str) -> None:
    """`cfg` must name an architecture we serve; `fix` says which checkpoint to pass instead."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not set(archs) & set(FARSKIP_ARCHS):
        found = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures key"
        raise UserError(
            f"{path} is not a DeepSeek-V3 checkpoint (config.json architectures: {found}); FarSkip is only "
            f"defined for DeepSeek-V3 here: {fix} whose architectures list {' or '.join(FARSKIP_ARCHS)}"
        )


def num_layers(cfg: dict, path: str | Path) -> int:
    n = cfg.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"{path}/{CONFIG} has num_hidden_layers={n!r}: expected a positive integer; fix {CONFIG}")
    return n


def architecture(cfg: Any) -> str | None:
    """The first of config.json's architectures that we serve, else None."""
    archs = config_value(cfg, "architectures") or []
    return next((a for a in archs if a in FARSKIP_ARCHS), None)


def gated_attention(cfg: Any) -> bool:
    value = config_value(cfg, "gated_attention", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"config.json key 'gated_attention' must be true or false, got {value!r}: fix config.json")
    return value


def gate_shape(cfg: Any) -> tuple[int, int]:
    """[heads * v_head_dim, hidden_size]: one gate per head and value channel, head-major."""
    return (config_value(cfg, "num_attention_heads") * config_value(cfg, "v_head_dim"), config_value(cfg, "hidden_size"))


def gate_problems(cfg: Any, shapes: Mapping[int, tuple[int, ...]]) -> list[str]:
    """What is wrong with a checkpoint's gate tensors ({layer: shape}) for this config.json;
    each problem names the fix. Empty when the checkpoint can be served."""
    num_layers = config_value(cfg, "num_hidden_layers")
    arch = architecture(cfg)
    if not gated_attention(cfg):
        if shapes:
            return [
                f"the checkpoint has attention gate tensors (model.layers.{min(shapes)}.self_attn."
                "gate_proj.weight, ...) but config.json does not set \"gated_attention\": true; set it "
                "(they would otherwise be ignored and the outputs wrong)"
            ]
        return []
    if arch != INSTELLA_ARCH:
        return [
            f"config.json sets \"gated_attention\": true but the architecture is {arch or config_value(cfg, 'architectures')}: "
            f"the attention gate is implemented for {INSTELLA_ARCH} only; set architectures to "
            f"[\"{INSTELLA_ARCH}\"]"
        ]
    if not shapes:
        return [
            "config.json sets \"gated_attention\": true but the checkpoint has no "
            "model.layers.K.self_attn.gate_proj.weight tensors: the weights are incomplete (re-download "
            "them), or set \"gated_attention\": false if the model has no gate"
        ]
    problems = []
    missing = [k for k in range(num_layers) if k not in shapes]
    if missing:
        problems.append(
            f"the checkpoint has no attention gate for layers {_span(missing)} "
            f"(model.layers.K.self_attn.gate_proj.weight): the weights are incomplete; re-download them"
        )
    want = gate_shape(cfg)
    wrong = {k: s for k, s in shapes.items() if tuple(s) != want}
    if wrong:
        k = min(wrong)
        problems.append(
            f"model.layers.{k}.self_attn.gate_proj.weight has shape {list(wrong[k])} "
            f"(and {len(wrong) - 1} more layers wrong), expected {list(want)} = [num_attention_heads * "
            "v_head_dim, hidden_size]: the weights do not belong to this config.json"
        )
    extra = sorted(k for k in shapes if k >= num_layers)
    if extra:
        problems.append(
            f"the checkpoint has attention gates for layers {_span(extra)} beyond num_hidden_layers="
            f"{num_layers}: the weights do not belong to this config.json"
        )
    return problems


def _span(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 6 else f"{layers[0]}..{layers[-1]} ({len(layers)} layers)"


_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def per_expert(name: str, tensor):
    """Yield (name, tensor) under DeepSeek's per-expert names: transformers 5 holds (and
    `state_dict()` gives) a layer's experts fused, gate_up_proj [E, 2I, H] (gate rows first) and
    down_proj [E, H, I]; the release, SGLang's main-model loader and reference.py use
    mlp.experts.N.{gate,up,down}_proj.weight. Any other tensor passes through."""
    fused = _FUSED_EXPERTS.match(name)
    if not fused:
        yield name, tensor
        return
    for e in range(tensor.shape[0]):
        if fused.group(2) == "down_proj":
            yield f"{fused.group(1)}.{e}.down_proj.weight", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)  # [2I, H] -> 2 x [I, H]
            yield f"{fused.group(1)}.{e}.gate_proj.weight", gate
            yield f"{fused.group(1)}.{e}.up_proj.weight", up


def weight_map(path: str | Path) -> dict[str, str] | None:
    """{tensor name: shard file name} from the checkpoint's safetensors index; None without one."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None
    return json.loads(index.read_text())["weight_map"]


def shard_files(path: str | Path, holding: Callable[[str], object] | None = None) -> list[Path]:
    """The checkpoint's safetensors files, the way SGLang's loader picks them: the shards the
    index names, else every *.safetensors in the directory. The one place that knows this.

    `holding`, a test on tensor names, narrows that to the shards the index says hold a
    matching tensor (without an index there is nothing to narrow by: every shard)."""
    path = Path(path)
    names = weight_map(path)
    if names is None:
        return sorted(path.glob("*.safetensors"))
    return sorted({path / f for name, f in names.items() if holding is None or holding(name)})


def checkpoint_gate_shapes(path: str | Path) -> dict[int, tuple[int, ...]]:
    """{layer: shape} of every gate tensor in a safetensors checkpoint, read from the file
    headers only (a few KB per shard, whatever the checkpoint's size)."""
    from safetensors import safe_open

    shapes = {}
    for file in shard_files(path, holding=GATE_KEY.match):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                m = GATE_KEY.match(name)
                if m:
                    shapes[int(m.group(1))] = tuple(f.get_slice(name).get_shape())
    return shapes


def make_readable(path: Path) -> None:
    """Give a checkpoint directory built in a mkdtemp the permissions of any other directory:
    mkdtemp and safetensors create owner-only files, and a checkpoint is meant to be shared
    (e.g. mounted into a container running as another user). Flat directories only."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for child in path.iterdir():
        child.chmod(0o666 & ~umask)
