"""Mark a DeepSeek-V3 (or Instella-MoE) Hugging Face checkpoint as FarSkip, without copying its weights.

    python -m sglang_farskip.tools.convert SRC DST [--start-layer N] [--end-layer M]
                                     [--attn-only | --mlp-only] [--force]

DST gets its own config.json (SRC's plus the FarSkip keys, see sglang_farskip.config) and a
symlink to every other top-level entry of SRC (weights, index, tokenizer, subdirectories).
FarSkip changes only how layers are wired, not the parameters, so nothing else changes. Note
that a model which was not trained (or distilled) with FarSkip wiring will produce different,
usually worse, outputs: conversion is for FarSkip-trained weights, or for timing.

Every problem is reported before anything is written, as one `error: ...` line on stderr with
exit code 2; DST appears only complete (built in a temporary directory, then renamed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from sglang_farskip.config import DEFAULT_END_IDX, FarSkipConfig
from sglang_farskip import checkpoint
from sglang_farskip.errors import ArgumentParser, UserError, fail

CONFIG = checkpoint.CONFIG


@dataclasses.dataclass(frozen=True)
class Plan:
    src: Path
    dst: Path
    config: dict  # DST's config.json
    farskip: FarSkipConfig
    num_layers: int
    links: list[str]  # top-level entries of SRC to symlink
    was_farskip: bool


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m sglang_farskip.tools.convert",
        description="Mark a DeepSeek-V3 Hugging Face checkpoint as FarSkip: DST gets a new "
        "config.json and symlinks to every other file of SRC.",
    )
    p.add_argument("src", type=Path, metavar="SRC", help="DeepSeek-V3 checkpoint directory")
    p.add_argument("dst", type=Path, metavar="DST", help="new directory (must not exist, or be empty)")
    p.add_argument("--start-layer", type=int, default=0, metavar="N", help="first converted layer (default 0)")
    p.add_argument(
        "--end-layer", type=int, default=None, metavar="M", help="last converted layer, inclusive (default: the last)"
    )
    p.add_argument("--attn-only", action="store_true", help="rewire only the attention input")
    p.add_argument("--mlp-only", action="store_true", help="rewire only the MLP input")
    p.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    return p


def read_source_config(src: Path) -> tuple[dict, int]:
    """SRC's config.json and its number of layers, if SRC is a checkpoint FarSkip is defined for."""
    cfg = checkpoint.read_config(src, missing_hint="pass the directory of a DeepSeek-V3 checkpoint")
    checkpoint.check_architecture(cfg, src, fix="convert a checkpoint")
    return cfg, checkpoint.num_layers(cfg, src)


def farskip_from_args(args: argparse.Namespace, num_layers: int) -> FarSkipConfig:
    # Checked here with the flag names; FarSkipConfig re-checks with the config key names.
    start = args.start_layer
    end = DEFAULT_END_IDX if args.end_layer is None else args.end_layer
    last = num_layers - 1
    if args.attn_only and args.mlp_only:
        raise UserError(
            "--attn-only and --mlp-only together convert nothing: pass at most one (neither = rewire both inputs)"
        )
    if start < 0:
        raise UserError(f"--start-layer {start} is negative: layers are numbered 0..{last}")
    if start > last:
        raise UserError(
            f"--start-layer {start} is beyond the model's last layer {last} ({num_layers} layers, 0-based): "
            f"no layer would be converted; pass --start-layer between 0 and {last}"
        )
    if end < start:
        raise UserError(
            f"empty layer range: --end-layer {end} < --start-layer {start} (the range is inclusive); "
            f"pass --end-layer >= --start-layer"
        )
    farskip = FarSkipConfig(
        enabled=True, start_idx=start, end_idx=end, attn_only=args.attn_only, mlp_only=args.mlp_only
    )
    farskip.check_layers(num_layers)
    return farskip


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _check_dst(src: Path, dst: Path, force: bool) -> None:
    src_real, dst_real = src.resolve(), dst.resolve()
    if dst_real == src_real:
        raise UserError(f"DST {dst} is the source checkpoint itself: pass a new directory for the FarSkip copy")
    if _is_within(dst_real, src_real):
        raise UserError(f"DST {dst} is inside SRC {src}: pass a directory outside the source checkpoint")
    if _is_within(src_real, dst_real):
        raise UserError(f"SRC {src} is inside DST {dst}: replacing DST would delete it; pass another DST")
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        if not force:
            raise UserError(f"DST {dst} exists and is not a directory: remove it, choose another path, or pass --force")
    elif dst.is_dir() and any(dst.iterdir()) and not force:
        raise UserError(f"DST {dst} exists and is not empty: choose a new directory, or pass --force to replace it")


def plan(args: argparse.Namespace) -> Plan:
    """Validate everything; raise UserError on the first problem. Writes nothing."""
    src, dst = args.src, args.dst
    cfg, num_layers = read_source_config(src)
    farskip = farskip_from_args(args, num_layers)
    _check_dst(src, dst, args.force)
    was_farskip = cfg.get("farskip") is True
    new_cfg = dict(cfg)
    new_cfg.update(farskip.to_hf_keys())  # replaces any FarSkip keys SRC already had
    links = sorted(p.name for p in src.iterdir() if p.name != CONFIG)
    return Plan(src, dst, new_cfg, farskip, num_layers, links, was_farskip)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def write(p: Plan) -> None:
    """Build DST in a temporary directory beside it, then rename it into place."""
    src_abs = p.src.resolve()  # absolute link targets: DST may live anywhere
    p.dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.dst.name}.tmp-", dir=p.dst.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(p.config, indent=2) + "\n")
        for name in p.links:
            os.symlink(src_abs / name, tmp / name)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it owner-only
        old = None
        if p.dst.exists() or p.dst.is_symlink():
            # Only reached when empty or --force: move aside, so the swap is one rename.
            old = p.dst.parent / f"{tmp.name}.old"
            os.rename(p.dst, old)
        os.rename(tmp, p.dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        _remove(old)


def _summary(p: Plan) -> str:
    keys = " ".join(f"{k}={json.dumps(v)}" for k, v in p.farskip.to_hf_keys().items())
    lines = [
        f"converted {p.src} -> {p.dst}",
        f"  {p.farskip.describe(p.num_layers)}",
        f"  config.json: {keys}",
        f"  symlinked from SRC (not copied): {', '.join(p.links) if p.links else '(nothing else in SRC)'}",
    ]
    if p.was_farskip:
        lines.append("  note: SRC was already FarSkip; its FarSkip keys were replaced")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # bad flags (code 2) or --help (0): keep main() a plain function
        return e.code if isinstance(e.code, int) else 2
    try:
        p = plan(args)
        write(p)
    except UserError as e:
        return fail(e)
    except OSError as e:  # e.g. permission denied while writing; DST was left untouched
        return fail(f"cannot write {args.dst}: {e}; check the path and its permissions")
    print(_summary(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
