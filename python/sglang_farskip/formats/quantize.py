"""Requantize a bf16 DeepSeek-V3 checkpoint (FCSD's output, or any bf16 copy) into DeepSeek's
own block-FP8 layout, the format DeepSeek-V3 ships in and SGLang's DeepSeek guides serve.

    python -m sglang_farskip.formats.quantize SRC DST [--max-shard-size 5GB] [--force]

What DST gets (sglang_farskip.formats.fp8 holds the format's rules):
- every tensor `fp8.is_quantized` names (the linear layers of each decoder layer, the MTP
  layer's included) as float8 e4m3 with a float32 `weight_scale_inv` per 128 x 128 block;
- the rest as the release stores them: bf16 (embeddings, lm_head, norms, the router gate, the
  MTP layer's eh_proj, enorm/hnorm and shared_head), the routers' correction bias in float32;
- safetensors shards of at most --max-shard-size with a `model.safetensors.index.json`;
- config.json with DeepSeek's `quantization_config` and `"dtype": "bfloat16"`; every other
  top-level file (tokenizer, generation config, remote code) copied as is.

It prints the round-trip error of what it quantized (dequantized against the source). Every
problem is one `error:` line (exit 2) before anything is written; DST appears only complete.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_farskip import checkpoint
from sglang_farskip.errors import ArgumentParser, UserError, run_main
from sglang_farskip.formats import fp8

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?)B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 100KB")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2).upper()])


def check_source(src: Path) -> dict:
    """SRC's config.json, if SRC is a bf16 DeepSeek-V3 checkpoint this tool can represent in FP8."""
    cfg = checkpoint.read_config(src, "give the directory of a bf16 DeepSeek-V3 checkpoint")
    arch = checkpoint.architecture(cfg)
    if arch == checkpoint.INSTELLA_ARCH:
        raise UserError(f"{src} is Instella-MoE, which AMD ships in bf16 only; sglang_farskip requantizes "
                        "DeepSeek-V3 checkpoints: serve Instella-MoE in bf16")
    checkpoint.check_architecture(cfg, src, "give a DeepSeek-V3 checkpoint")
    if fp8.weight_format(cfg) == "fp8":
        raise UserError(f"{src} is already block FP8 (config.json has quantization_config): serve it as it is")
    problem = fp8.fused_projection_problem(cfg)
    if problem:
        raise UserError(f"{problem}; serve this checkpoint in bf16")
    if not checkpoint.shard_files(src):
        raise UserError(f"{src} has no *.safetensors weights: save the checkpoint with safetensors")
    return cfg


def _tensors(src: Path):
    """(name, tensor) over SRC's shards, in file order, experts under per-expert names (the demo's
    and transformers' MTP layer holds them fused; the release has them per expert)."""
    for file in checkpoint.shard_files(src):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield from checkpoint.per_expert(name, f.get_tensor(name))


def _converted(name: str, t: torch.Tensor, errors: list[float]) -> dict[str, torch.Tensor]:
    if not fp8.is_quantized(name):
        keep = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        return {name: t.to(keep) if t.is_floating_point() else t}
    if t.dim() != 2:
        raise UserError(f"{name}: a {t.dim()}-D tensor {tuple(t.shape)} where DeepSeek's layout has a 2-D weight")
    if not bool(torch.isfinite(t).all()):
        raise UserError(f"{name}: holds inf or NaN, which block FP8 cannot represent: fix the source weights")
    q, scale = fp8.quantize(t)
    w = t.float()
    errors.append(float((fp8.dequantize(q, scale) - w).norm() / w.norm().clamp(min=1e-30)))
    return {name: q, name + fp8.SCALE_SUFFIX: scale}


def _write_shards(tensors, out: Path, max_bytes: int) -> dict[str, str]:
    """Write shards of at most max_bytes (a bigger single tensor gets a shard of its own); returns
    the weight map. Shards are renamed to model-0000K-of-0000N once N is known."""
    weight_map, shard, size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, size
        if shard:
            files.append((out / f"shard-{len(files):05d}.tmp", list(shard)))
            save_file(shard, str(files[-1][0]), metadata={"format": "pt"})
        shard, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            flush()
        shard[name] = t.contiguous()
        size += nbytes
    flush()
    for k, (tmp, names) in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        tmp.rename(out / final)
        weight_map.update({n: final for n in names})
    return weight_map


def quantize_checkpoint(src: Path, dst: Path, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Write DST (a new directory) from SRC; returns a summary: tensors quantized, and the
    relative round-trip error ||dequant(quant(W)) - W|| / ||W|| per tensor (mean and max)."""
    cfg = check_source(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        errors: list[float] = []
        converted = (item for name, t in _tensors(src) for item in _converted(name, t, errors).items())
        weight_map = _write_shards(converted, tmp, max_shard_bytes)
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        (tmp / checkpoint.INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        cfg = {**cfg, "quantization_config": dict(fp8.QUANTIZATION_CONFIG), "dtype": "bfloat16"}
        cfg.pop("torch_dtype", None)
        (tmp / checkpoint.CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        weights = set(checkpoint.shard_files(src)) | {src / checkpoint.INDEX}
        for entry in src.iterdir():
            if entry.name != checkpoint.CONFIG and entry not in weights and entry.suffix != ".safetensors":
                copy = shutil.copytree if entry.is_dir() else shutil.copy2
                copy(entry, tmp / entry.name)
        checkpoint.make_readable(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "quantized_tensors": len(errors),
        "relative_error_mean": sum(errors) / max(len(errors), 1),
        "relative_error_max": max(errors, default=0.0),
        "shards": len(set(weight_map.values())),
        "bytes": total,
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m sglang_farskip.formats.quantize",
                            description="Requantize a bf16 DeepSeek-V3 checkpoint into DeepSeek's block-FP8 layout.")
    parser.add_argument("src", type=Path, help="bf16 checkpoint directory (e.g. FCSD's output)")
    parser.add_argument("dst", type=Path, help="new checkpoint directory")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)

    def run() -> int:
        max_bytes = parse_size(args.max_shard_size)
        src, dst = args.src.absolute(), args.dst.absolute()
        if src == dst or src in dst.parents:
            raise UserError(f"DST {dst} is inside SRC {src}: choose a directory outside it")
        if dst.exists() and not args.force:
            raise UserError(f"{dst} exists: choose another directory or pass --force to replace it")
        s = quantize_checkpoint(src, dst, max_bytes)
        print(f"{dst}: {s['quantized_tensors']} tensors in block FP8, {s['shards']} shard(s), "
              f"{s['bytes'] / 1e6:.1f} MB; round trip ||dequant(W8) - W|| / ||W||: "
              f"mean {s['relative_error_mean']:.4f}, max {s['relative_error_max']:.4f}")
        return 0

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
