"""`python -m sglang_farskip.fcsd`: validate, load, train, write the servable checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import sys

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from ..errors import UserError, fail
from .cli import parser, state_dir, validate
from .data import Windows, tokenize_file
from .models import build, init_runtime
from .output import full_state_dict, write_checkpoint
from .trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # bad flags (2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        cfg, farskip = validate(args)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.teacher, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load the teacher's tokenizer from {args.teacher} ({str(e).splitlines()[0]}): "
                            f"FCSD tokenises DATA with it; pass --trust-remote-code if the checkpoint ships its "
                            f"own tokenizer code") from None
        tokens = tokenize_file(args.data, tokenizer)
    except UserError as e:
        return fail(str(e))
    rt = init_runtime()
    try:
        per_step = args.batch_tokens // args.seq_len
        if per_step % (rt.world * args.micro_batch):
            return fail(f"--batch-tokens / --seq-len = {per_step} windows per step do not split evenly over "
                        f"{rt.world} ranks x --micro-batch {args.micro_batch}: adjust --batch-tokens")
        # every rank evaluates the same number of windows (FSDP2 runs collectives in each forward)
        eval_windows = math.ceil(math.ceil(args.eval_tokens / args.seq_len) / rt.world) * rt.world
        try:
            windows = Windows(tokens, args.seq_len, eval_windows, args.seed)
        except UserError as e:
            return fail(str(e))
        state = state_dir(args.out)
        if rt.main:
            state.mkdir(parents=True, exist_ok=True)
            print(f"fcsd: {farskip.describe(cfg['num_hidden_layers'])}; {tokens.numel()} data tokens = "
                  f"{windows.train.shape[0]} training + {eval_windows} held-out windows of {args.seq_len}; "
                  f"{rt.world} process(es) on {rt.device.type}", file=sys.stderr)
        torch.manual_seed(args.seed)
        distiller = build(args.teacher, farskip, rt, ce_weight=args.ce_weight, chunk=args.kl_chunk,
                          checkpointing=not args.no_activation_checkpointing)
        trainer = Trainer(args, distiller, windows, rt, state)
        if args.resume:
            trainer.resume()
        result = trainer.train()
        weights = full_state_dict(distiller.student)
        if rt.main:
            write_checkpoint(args.out, args.teacher, weights, farskip,
                             extras=[state / "metrics.jsonl", state / "curves.png"])
            shutil.rmtree(state)
            print(json.dumps({"out": str(args.out), **result}))
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
