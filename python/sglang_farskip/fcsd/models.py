"""Teacher + student in one module, placed on devices by PyTorch FSDP2 under torchrun, or plainly
on one device. No collective is written here: FSDP2 issues them all."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ..config import FarSkipConfig
from .data import next_token_labels
from .loss import distill_loss, eval_sums
from .student import FarSkipStudent, stock_hidden

EVAL_KEYS = ("kl", "agree", "tokens", "ce_student", "ce_teacher", "ce_tokens")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1


def init_runtime() -> Runtime:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain `python -m` run is one process."""
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        return Runtime(dist.get_rank(), dist.get_world_size(), device)
    return Runtime(0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))


class Distiller(nn.Module):
    """forward(ids [B, T]) -> (loss sum, KL sum, CE sum) over B*T tokens. The loss is computed
    inside this module's forward so that, under FSDP2, the student's lm_head is gathered."""

    def __init__(self, student: FarSkipStudent, teacher: DeepseekV3ForCausalLM, ce_weight: float, chunk: int):
        super().__init__()
        self.student, self.teacher = student, teacher
        self.ce_weight, self.chunk = ce_weight, chunk

    def forward(self, ids: torch.Tensor, evaluate: bool = False):
        labels = next_token_labels(ids).flatten()  # [B, T] -> [B*T]
        with self._teacher_gathered(), torch.no_grad():
            t_hidden = stock_hidden(self.teacher, ids).flatten(0, 1)  # [B, T, H] -> [B*T, H]
        with torch.no_grad() if evaluate else contextlib.nullcontext():
            s_hidden = self.student.model(ids).flatten(0, 1)
        with self._teacher_gathered():
            s_w, t_w = self.student.lm_head.weight, self.teacher.lm_head.weight
            if evaluate:
                sums = eval_sums(s_hidden, s_w, t_hidden, t_w, labels, chunk=self.chunk)
                return torch.tensor([sums[k] for k in EVAL_KEYS], dtype=torch.float64, device=ids.device)
            return distill_loss(s_hidden, s_w, t_hidden, t_w, labels, ce_weight=self.ce_weight, chunk=self.chunk)

    @contextlib.contextmanager
    def _teacher_gathered(self):
        # The teacher's top-level parameters (embeddings, final norm, lm_head) form one FSDP unit
        # that is read outside the teacher's own forward (only its body runs through hooks).
        if isinstance(self.teacher, FSDPModule):
            self.teacher.unshard()
            try:
                yield
            finally:
                self.teacher.reshard()
        else:
            yield


def _config(teacher_dir) -> DeepseekV3Config:
    cfg = DeepseekV3Config.from_pretrained(teacher_dir)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(teacher_dir, farskip: FarSkipConfig, rt: Runtime, *, ce_weight: float, chunk: int,
          checkpointing: bool) -> Distiller:
    """Student (init = teacher weights, FarSkip wiring) and frozen teacher. On GPU the student keeps
    fp32 master weights and computes in bf16; the teacher is bf16. On CPU everything is fp32."""
    cuda = rt.device.type == "cuda"
    t_dtype = torch.bfloat16 if cuda else torch.float32
    if rt.sharded:
        student, teacher = _build_sharded(teacher_dir, rt, t_dtype)
    else:
        student = FarSkipStudent.from_pretrained(teacher_dir, dtype=torch.float32, attn_implementation="sdpa")
        teacher = DeepseekV3ForCausalLM.from_pretrained(teacher_dir, dtype=t_dtype, attn_implementation="sdpa")
        student.to(rt.device), teacher.to(rt.device)
    student.set_farskip(farskip)
    student.config.use_cache = False
    if checkpointing:  # transformers' own per-layer checkpointing (GradientCheckpointingLayer)
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.train()
    teacher.eval().requires_grad_(False)
    distiller = Distiller(student, teacher, ce_weight, chunk)
    if rt.sharded:
        fully_shard(distiller, mp_policy=_mixed_precision(cuda))
    return distiller


def _mixed_precision(cuda: bool) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()


def _build_sharded(teacher_dir, rt: Runtime, t_dtype: torch.dtype):
    """Rank 0 reads the checkpoint; every rank builds empty (meta) models, FSDP2 shards them per
    decoder layer, and the weights are broadcast from rank 0 into the shards (a 16B model is read
    once, not once per GPU)."""
    cfg = _config(teacher_dir)
    full = {}
    if rt.main:
        full["student"] = FarSkipStudent.from_pretrained(teacher_dir, dtype=torch.float32).state_dict()
        full["teacher"] = DeepseekV3ForCausalLM.from_pretrained(teacher_dir, dtype=t_dtype).state_dict()
    models = {}
    with torch.device("meta"):
        models["student"] = FarSkipStudent(cfg).to(torch.float32)
        models["teacher"] = DeepseekV3ForCausalLM(cfg).to(t_dtype)
    for module in models["teacher"].modules():  # transformers keeps the routing bias in fp32
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias = module.e_score_correction_bias.float()
    mp = _mixed_precision(rt.device.type == "cuda")
    for name, model in models.items():
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp if name == "student" else MixedPrecisionPolicy())
        if name == "teacher":
            fully_shard(model)  # its own unit: frozen, gathered explicitly by Distiller
        model.to_empty(device=rt.device)
        # rotary inv_freq is a non-persistent buffer: not in any state dict, recompute it
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg).to(rt.device)
        set_model_state_dict(
            model, full.get(name, {}), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
    full.clear()
    return models["student"], models["teacher"]
