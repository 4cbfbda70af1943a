"""Command line of `python -m sglang_farskip.fcsd`; every input is checked here, before any
weight is loaded, and reported as one `error:` line with exit code 2."""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors import safe_open

from .. import checkpoint
from ..config import FarSkipConfig
from ..errors import ArgumentParser, UserError
from ..tools.convert import farskip_from_args, read_source_config

STATE_SUFFIX = ".fcsd-state"  # OUT_DIR + this: training state, metrics, resumable checkpoints


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m sglang_farskip.fcsd",
        description="FarSkip-Collective Self-Distillation: train a FarSkip copy of a DeepSeek-V3 checkpoint "
        "to match the original (forward KL at T=1 on the logits) and write it as a servable checkpoint. "
        "Multi-GPU: torchrun --nproc-per-node N -m sglang_farskip.fcsd ... (PyTorch FSDP2).",
    )
    p.add_argument("teacher", type=Path, metavar="TEACHER_DIR", help="original DeepSeek-V3 checkpoint (bf16/fp32)")
    p.add_argument("data", type=Path, metavar="DATA", help=".txt or .jsonl ({'text'} or chat {'messages'})")
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="new directory for the FarSkip checkpoint")
    g = p.add_argument_group("FarSkip variant (the config keys of sglang_farskip.config)")
    g.add_argument("--start-layer", type=int, default=0, metavar="N", help="first converted layer (default 0)")
    g.add_argument("--end-layer", type=int, default=None, metavar="M", help="last converted layer, inclusive")
    g.add_argument("--attn-only", action="store_true", help="rewire only the attention input")
    g.add_argument("--mlp-only", action="store_true", help="rewire only the MLP input")
    g = p.add_argument_group("training (defaults: the paper's section 5.1)")
    g.add_argument("--tokens", type=float, default=5e8, help="training tokens (default 5e8; the paper: up to 1e10)")
    g.add_argument("--batch-tokens", type=int, default=2**17, help="tokens per optimiser step (default 2^17)")
    g.add_argument("--seq-len", type=int, default=4096, help="packed window length (default 4096)")
    g.add_argument("--micro-batch", type=int, default=1, help="windows per forward per rank (default 1)")
    g.add_argument("--lr", type=float, default=2e-5, help="peak AdamW learning rate (default 2e-5)")
    g.add_argument("--min-lr-ratio", type=float, default=0.5, help="cosine floor / peak (default 0.5: 2e-5 -> 1e-5)")
    g.add_argument("--warmup-steps", type=int, default=1000, help="linear warm-up steps (default 1000)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm, 0 = off (default 1)")
    g.add_argument("--ce-weight", type=float, default=0.0,
                   help="loss = (1-w) KL + w CE; default 0 (pure FCSD); 1 = plain fine-tuning, for comparison")
    g.add_argument("--kl-chunk", type=int, default=1024,
                   help="tokens per logits chunk in the loss (default 1024: ~0.7 GB per fp32 [chunk, 163840] tensor)")
    g.add_argument("--no-activation-checkpointing", action="store_true", help="keep every layer's activations")
    g.add_argument("--time-budget", type=float, default=0.0, metavar="S", help="stop after S seconds of training steps, evaluations not counted (0 = none)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the teacher's tokenizer run its own code (e.g. Moonlight's tiktoken tokenizer); "
                   "the model always runs on transformers' DeepseekV3 modules")
    g = p.add_argument_group("evaluation, early stopping, checkpoints")
    g.add_argument("--eval-every", type=int, default=1000, help="held-out evaluation every N steps (default 1000)")
    g.add_argument("--eval-tokens", type=int, default=2**18, help="held-out tokens (last windows of DATA; default 2^18)")
    g.add_argument("--patience", type=int, default=20,
                   help="stop after this many evaluations in a row whose held-out KL (with --ce-weight W: "
                   "(1-W) KL + W CE) is worse than the best by more than --threshold (default 20, the paper's); "
                   "0 = never stop early. The output is the best evaluated student either way")
    g.add_argument("--threshold", type=float, default=0.02, help="relative degradation that counts (default 0.02)")
    g.add_argument("--save-every", type=int, default=1000, help="resumable checkpoint every N steps (default 1000)")
    g.add_argument("--resume", action="store_true", help=f"continue from OUT_DIR{STATE_SUFFIX}")
    g.add_argument("--log-every", type=int, default=10, help="training metrics every N steps (default 10)")
    return p


def check_teacher(path: Path) -> dict:
    """The teacher's config.json, if it is a stock, unquantised DeepSeek-V3 checkpoint."""
    try:
        cfg, _ = read_source_config(path)
    except UserError as e:  # convert's words for convert's users
        raise UserError(str(e).replace("convert a checkpoint", "pass a teacher")) from None
    # The student is transformers' DeepseekV3 built from the teacher's weights: it must start as
    # exactly the teacher, or the distillation starts from a different model than it serves.
    arch = checkpoint.architecture(cfg)
    try:
        gated = checkpoint.gated_attention(cfg)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    if arch != checkpoint.DEEPSEEK_V3_ARCH or gated:
        raise UserError(
            f"{path} is {arch}{' with gated attention' if gated else ''}: FCSD's student (transformers' "
            f"DeepseekV3) has no attention gate, so it could not start equal to this teacher; Instella-MoE is "
            f"FarSkip-native already (serve it as it is); FCSD takes {checkpoint.DEEPSEEK_V3_ARCH} checkpoints"
        )
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, supported):
            raise UserError(
                f"{path}: {key}={cfg[key]!r}; transformers' DeepseekV3 (the student's modules) routes with "
                f"{key}={supported!r} only, so the student would not equal the teacher; FCSD cannot train this checkpoint"
            )
    if cfg.get("farskip") is True:
        raise UserError(
            f"{path} is already a FarSkip checkpoint (config.json farskip: true): FCSD needs the original model "
            f"as its teacher; pass the checkpoint it was made from"
        )
    quant = cfg.get("quantization_config")
    if quant or _has_fp8_scales(path):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "weight_scale_inv tensors"
        raise UserError(
            f"{path} holds quantised weights ({method}); FCSD trains in bf16/fp32 and has no dequantisation "
            f"path: dequantise to bf16 first (e.g. DeepSeek-V3's inference/fp8_cast_bf16.py) and pass that copy"
        )
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise UserError(
            f"{path}: moe_layer_freq={cfg['moe_layer_freq']}; transformers' DeepseekV3 (the student's modules) "
            f"makes every layer after first_k_dense_replace MoE, so only moe_layer_freq 1 is supported"
        )
    if not checkpoint.shard_files(path):
        raise UserError(f"{path} has no *.safetensors weights: pass a checkpoint saved as safetensors")
    return cfg


def _has_fp8_scales(path: Path) -> bool:
    names = checkpoint.weight_map(path)
    if names is not None:
        return any(k.endswith("weight_scale_inv") for k in names)
    for f in checkpoint.shard_files(path)[:1]:
        with safe_open(str(f), framework="pt") as st:
            return any(k.endswith("weight_scale_inv") for k in st.keys())
    return False


def validate(args: argparse.Namespace) -> tuple[dict, FarSkipConfig]:
    """Raise UserError on the first bad input; returns (teacher config, FarSkip config)."""
    cfg = check_teacher(args.teacher)
    farskip = farskip_from_args(args, cfg["num_hidden_layers"])
    if args.out.exists() or args.out.is_symlink():
        raise UserError(f"output directory {args.out} exists: choose a new path (nothing is ever overwritten)")
    state = state_dir(args.out)
    if state.exists() and not args.resume:
        raise UserError(f"{state} holds an interrupted run: pass --resume to continue it, or remove it")
    if args.resume and not state.exists():
        raise UserError(f"--resume but {state} does not exist: start without --resume")
    if not args.data.is_file():
        raise UserError(f"data file {args.data} does not exist: pass a .txt or .jsonl file")
    if args.data.suffix not in (".txt", ".jsonl"):
        raise UserError(f"data file {args.data}: unknown format {args.data.suffix!r}; pass a .txt or .jsonl file")
    if args.data.stat().st_size == 0:
        raise UserError(f"data file {args.data} is empty: pass a file with training text")
    for name in ("batch_tokens", "seq_len", "micro_batch", "eval_every", "save_every", "log_every", "kl_chunk"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.batch_tokens % args.seq_len:
        raise UserError(f"--batch-tokens {args.batch_tokens} is not a multiple of --seq-len {args.seq_len}")
    if not 0.0 <= args.ce_weight <= 1.0:
        raise UserError(f"--ce-weight {args.ce_weight}: must be between 0 and 1")
    if args.tokens < args.batch_tokens:
        raise UserError(f"--tokens {args.tokens:g} is less than one step (--batch-tokens {args.batch_tokens})")
    return cfg, farskip


def state_dir(out: Path) -> Path:
    return out.with_name(out.name + STATE_SUFFIX)
