"""The training loop: AdamW + cosine with warm-up (torch / transformers), held-out evaluation
with early stopping, resumable checkpoints through torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from tqdm import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from .data import Windows
from .models import EVAL_KEYS, Distiller, Runtime
from .plot import plot_curves


BEST_META = "farskip-best.json"  # inside state/best: the step and objective of those weights

# Test-only fault injection: FARSKIP_FCSD_TEST_CRASH="WHERE:STEP" stops the run at that exact
# point, as a kill there would (tests/test_fcsd.py interrupts runs with it and resumes them).
# WHERE is "step" (right after training step STEP) or "eval" (in the evaluation at STEP, after
# any new best/ is written and before its metrics are logged).
CRASH_ENV = "FARSKIP_FCSD_TEST_CRASH"


class SimulatedCrash(BaseException):
    """A BaseException, so that nothing on the way out can catch it (nothing catches a kill)."""


def _crash_point(where: str, step: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{where}:{step}":
        raise SimulatedCrash(f"{CRASH_ENV}={where}:{step}")


class Trainer:
    def __init__(self, args, distiller: Distiller, windows: Windows, rt: Runtime, state: Path):
        self.args, self.model, self.windows, self.rt, self.state = args, distiller, windows, rt, state
        self.steps = int(args.tokens // args.batch_tokens)
        self.per_step = args.batch_tokens // args.seq_len
        self.warmup = min(args.warmup_steps, self.steps)
        if self.warmup < args.warmup_steps and rt.main:
            print(f"note: --warmup-steps {args.warmup_steps} exceeds the {self.steps} steps of --tokens; "
                  f"warming up over all {self.steps}", file=sys.stderr)
        params = [p for p in distiller.student.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, self.warmup, self.steps, min_lr_rate=args.min_lr_ratio
        )
        self.last_eval = None
        self.progress = {"step": 0, "elapsed_s": 0.0, "train_s": 0.0, "best": math.inf, "best_step": -1, "bad_evals": 0,
                         "stopped": ""}
        # One GPU without FSDP: fp32 master weights, bf16 compute (FSDP2's MixedPrecisionPolicy otherwise)
        cuda_single = rt.device.type == "cuda" and not rt.sharded
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda_single else contextlib.nullcontext

    # ------------------------------------------------------------------------------- metrics
    def log(self, record: dict) -> None:
        if self.rt.main:
            with open(self.state / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.rt.sharded:
            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out KL(t||s) per token, top-1 agreement, student and teacher perplexity."""
        self.model.student.eval()
        sums = torch.zeros(len(EVAL_KEYS), dtype=torch.float64, device=self.rt.device)
        mine = self.windows.eval[self.rt.rank :: self.rt.world]  # equal counts per rank: run.py rounds the held-out windows up
        for lo in range(0, mine.shape[0], self.args.micro_batch):
            with self.autocast():
                sums += self.model(mine[lo : lo + self.args.micro_batch].to(self.rt.device), evaluate=True)
        self.model.student.train()
        s = dict(zip(EVAL_KEYS, self._all_sum(sums).tolist()))
        kl, ce, w = s["kl"] / s["tokens"], s["ce_student"] / s["ce_tokens"], self.args.ce_weight
        return {
            "kl": kl,
            "top1": s["agree"] / s["tokens"],
            "ppl": math.exp(ce),
            "teacher_ppl": math.exp(s["ce_teacher"] / s["ce_tokens"]),
            "objective": (1 - w) * kl + w * ce,  # the training loss on held-out data: KL for FCSD
        }

    # ---------------------------------------------------------------------------- checkpoints
    def _dcp_state(self, with_optimizer: bool) -> dict:
        if not with_optimizer:
            return {"model": get_model_state_dict(self.model.student)}
        model_sd, optim_sd = get_state_dict(self.model.student, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        state.update(scheduler=self.scheduler.state_dict(), progress=dict(self.progress))
        return state

    def _settle(self, name: str) -> None:
        """Rank 0: finish a replacement of state/<name> that a kill interrupted. _save renames the
        old copy to <name>.old before the new one takes its name, so at every moment one whole
        copy exists under one of the two names; a half-written <name>.tmp is dropped."""
        final, tmp, old = (self.state / n for n in (name, f"{name}.tmp", f"{name}.old"))
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists():
            if final.exists():
                shutil.rmtree(old)
            else:
                old.rename(final)

    def _save(self, name: str, with_optimizer: bool, meta: dict | None = None) -> None:
        """Write state/<name> atomically: written as <name>.tmp (with `meta` as BEST_META), then
        renamed by rank 0."""
        final, tmp, old = (self.state / n for n in (name, f"{name}.tmp", f"{name}.old"))
        if self.rt.main:
            self._settle(name)
        self._barrier()
        dcp.save(self._dcp_state(with_optimizer), checkpoint_id=str(tmp))
        self._barrier()
        if self.rt.main:
            if meta is not None:
                (tmp / BEST_META).write_text(json.dumps(meta))
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def _load(self, name: str, with_optimizer: bool) -> None:
        state = self._dcp_state(with_optimizer)
        dcp.load(state, checkpoint_id=str(self.state / name))
        if not with_optimizer:
            set_model_state_dict(self.model.student, state["model"])
        else:
            set_state_dict(self.model.student, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress.update(state["progress"])

    def _barrier(self) -> None:
        if self.rt.sharded:
            dist.barrier()

    def resume(self) -> None:
        """Continue from state/last. A run killed before its first checkpoint has none: it starts
        over (same seed, same data order, so it ends as the uninterrupted run would). best/ can
        be newer than last/ (an evaluation after the checkpoint found a better student): the
        best step and objective are then taken from best/ itself, so that the two always agree."""
        if self.rt.main:
            self._settle("last")
            self._settle("best")
        self._barrier()
        if not (self.state / "last").exists():
            if self.rt.main:
                print("note: the interrupted run had saved no checkpoint yet (--save-every): starting over",
                      file=sys.stderr)
                shutil.rmtree(self.state / "best", ignore_errors=True)
                for leftover in ("metrics.jsonl", "curves.png"):
                    (self.state / leftover).unlink(missing_ok=True)
            self._barrier()
            return
        self._load("last", with_optimizer=True)
        best = self.state / "best" / BEST_META
        if best.exists():
            meta = json.loads(best.read_text())
            self.progress["best"], self.progress["best_step"] = meta["objective"], meta["step"]
        metrics = self.state / "metrics.jsonl"
        if self.rt.main and metrics.exists():  # drop what the interrupted run logged after its checkpoint
            kept = [line for line in metrics.read_text().splitlines()
                    if json.loads(line).get("step", 0) <= self.progress["step"]]
            metrics.write_text("".join(line + "\n" for line in kept))

    # ----------------------------------------------------------------------------------- loop
    def _step(self, step: int) -> dict:
        batch = self.windows.batch(step, self.per_step)[self.rt.rank :: self.rt.world]  # [per_rank, T]
        tokens = batch.numel()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for lo in range(0, batch.shape[0], self.args.micro_batch):
            ids = batch[lo : lo + self.args.micro_batch].to(self.rt.device)
            with self.autocast():
                loss, kl, ce = self.model(ids)
            # per-token mean over this rank's batch; FSDP2 averages the gradients over ranks
            (loss / tokens).backward()
            totals += torch.stack([kl, ce]).double()
        params = [p for p in self.model.student.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.args.grad_clip if self.args.grad_clip > 0 else math.inf)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals = self._all_sum(totals) / (tokens * self.rt.world)
        return {"kl": totals[0].item(), "ce": totals[1].item(), "grad_norm": float(norm), "lr": lr}

    def _after_eval(self, step: int, metrics: dict) -> bool:
        """Track the best held-out objective (KL unless --ce-weight); True when early stopping fires."""
        p, a = self.progress, self.args
        if metrics["objective"] < p["best"]:
            p["best"], p["best_step"] = metrics["objective"], step
            self._save("best", with_optimizer=False, meta={"step": step, "objective": metrics["objective"]})
        worse = metrics["objective"] > p["best"] * (1 + a.threshold)
        p["bad_evals"] = p["bad_evals"] + 1 if worse else 0
        if a.patience and p["bad_evals"] >= a.patience:
            p["stopped"] = (f"early stop at step {step}: held-out objective worse than the best ({p['best']:.4g} at "
                            f"step {p['best_step']}) by > {a.threshold:.0%} for {a.patience} evaluations")
            return True
        return False

    def _eval_and_log(self, step: int, t0: float) -> bool:
        metrics = self.last_eval = self.evaluate()
        stop = self._after_eval(step, metrics)
        _crash_point("eval", step)
        self.log({"event": "eval", "step": step, "tokens": step * self.args.batch_tokens,
                  "elapsed_s": round(self.progress["elapsed_s"] + time.monotonic() - t0, 2),
                  "train_s": round(self.progress["train_s"], 2), **metrics})
        if self.rt.main:
            plot_curves(self.state / "metrics.jsonl", self.state / "curves.png")
        return stop

    def train(self) -> dict:
        """Run to the token budget, the time budget or early stopping; leave the best evaluated
        weights in the student. Returns the final evaluation."""
        a, p = self.args, self.progress
        t0 = time.monotonic()
        start = p["step"]
        if start == 0:
            self.log({"event": "start", "steps": self.steps, "warmup_steps": self.warmup,
                      "batch_tokens": a.batch_tokens, "world": self.rt.world, "ce_weight": a.ce_weight})
            stop = self._eval_and_log(0, t0)
        else:
            stop = bool(p["stopped"])
        bar = tqdm(total=self.steps, initial=start, disable=not self.rt.main, desc="fcsd", unit="step",
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)
        step = start
        last_log = time.monotonic()
        while not stop and step < self.steps:
            t_step = time.monotonic()
            out = self._step(step)
            p["train_s"] += time.monotonic() - t_step
            step += 1
            p["step"] = step
            _crash_point("step", step)
            bar.update(1)
            bar.set_postfix(kl=f"{out['kl']:.4f}", lr=f"{out['lr']:.2e}", best=f"{p['best']:.4f}")
            elapsed = p["elapsed_s"] + time.monotonic() - t0
            if step % a.log_every == 0 or step == self.steps:
                now = time.monotonic()
                rate = a.log_every * a.batch_tokens / max(now - last_log, 1e-9)
                last_log = now
                self.log({"event": "train", "step": step, "tokens": step * a.batch_tokens, "elapsed_s": round(elapsed, 2),
                          "train_s": round(p["train_s"], 2), "tok_per_s": round(rate, 1), **out})
            over_time = a.time_budget and p["train_s"] >= a.time_budget
            if over_time:
                p["stopped"] = f"time budget of {a.time_budget:g} s of training steps reached at step {step}"
            if step % a.eval_every == 0 or step == self.steps or over_time:
                stop = self._eval_and_log(step, t0) or bool(over_time)
            if step % a.save_every == 0 and not stop and step < self.steps:
                p["elapsed_s"] += time.monotonic() - t0
                t0 = time.monotonic()
                self._save("last", with_optimizer=True)
        bar.close()
        p["elapsed_s"] += time.monotonic() - t0
        if p["best_step"] != step:
            self._load("best", with_optimizer=False)
            final = self.evaluate()
        else:
            final = self.last_eval or self.evaluate()
        self.log({"event": "final", "step": step, "output_step": p["best_step"], "stopped": p["stopped"],
                  "elapsed_s": round(p["elapsed_s"], 2), "train_s": round(p["train_s"], 2), **final})
        return {**final, "output_step": p["best_step"], "steps": step, "stopped": p["stopped"]}
