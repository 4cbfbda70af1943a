"""The servable result: transformers' save_pretrained of the student's weights (per-expert tensor
names, what SGLang loads), the teacher's multi-token-prediction layers copied unchanged (their
dtype kept; transformers' model has none, SGLang's EAGLE draft reads them), the teacher's
config.json plus the FarSkip keys (as tools/convert.py writes them), and every other non-weight file
of the teacher (tokenizer, chat template, generation config). Built in a temporary directory
and renamed into place: OUT_DIR appears only complete."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import DeepseekV3ForCausalLM

from .. import checkpoint
from ..config import FarSkipConfig
from .student import FarSkipStudent

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
MTP_FILE = "model-mtp.safetensors"
_SKIP = {"config.json", checkpoint.INDEX, "pytorch_model.bin.index.json", "BUILD_INFO.json"}


def stored_dtype(teacher: Path) -> torch.dtype:
    """The floating dtype the teacher's weights are stored in (the output keeps it)."""
    for file in checkpoint.shard_files(teacher):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(t.get_dtype())
                if dtype is not None:
                    return dtype
    return torch.bfloat16


def mtp_tensors(teacher: Path, cfg: dict) -> dict:
    """The teacher's MTP ("NextN") layers `model.layers.{L}...` (L = num_hidden_layers, one per
    `num_nextn_predict_layers`), as stored. DeepSeek-V3's one layer is about 11 GB in bf16."""
    first = cfg["num_hidden_layers"]
    prefixes = tuple(f"model.layers.{k}." for k in range(first, first + (cfg.get("num_nextn_predict_layers") or 0)))
    found = {}
    for file in checkpoint.shard_files(teacher, holding=lambda name: name.startswith(prefixes)) if prefixes else []:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    found[name] = f.get_tensor(name)
    return found


def _add_mtp(tmp: Path, tensors: dict) -> None:
    """MTP_FILE beside save_pretrained's shards, and in its index where it wrote one (SGLang
    loads the files an index names, or every *.safetensors without one)."""
    if not tensors:
        return
    save_file(tensors, str(tmp / MTP_FILE), metadata={"format": "pt"})
    index = tmp / checkpoint.INDEX
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: MTP_FILE for name in tensors})
        index.write_text(json.dumps(data, indent=2) + "\n")


def full_state_dict(student: FarSkipStudent) -> dict:
    """Every rank must call this (FSDP2 gathers); only rank 0 gets the tensors, on CPU."""
    return get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_checkpoint(out: Path, teacher: Path, state: dict, farskip: FarSkipConfig, extras: list[Path]) -> None:
    dtype = stored_dtype(teacher)
    cfg = json.loads((teacher / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(FarSkipStudent.config_class.from_pretrained(teacher))
        state = {k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="5GB")
        _add_mtp(tmp, mtp_tensors(teacher, cfg))
        for path in teacher.iterdir():
            if path.is_file() and path.name not in _SKIP and not path.name.endswith(_WEIGHTS):
                shutil.copy2(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps({**cfg, **farskip.to_hf_keys()}, indent=2) + "\n")
        for path in extras:
            if path.exists():
                shutil.copy2(path, tmp / path.name)
        for path in tmp.iterdir():  # safetensors and mkdtemp create owner-only files
            path.chmod(0o644)
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
