"""The FarSkip lane loop exists once (`sglang_farskip.schedule`) and everything runs it: the
served model, the bare GPU check's stack, the FCSD student; and the planner's program is the
same sequence of computes, launches and waits. No servers: fast.

Equality here is exact (event sequences, bitwise tensors) except the student's gradients under
checkpointing, which recompute the same float ops in the same order: equal bit for bit too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_farskip import schedule
from sglang_farskip.config import FarSkipConfig
from sglang_farskip.plan import shapes, simulation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    from sglang_farskip.checks import gpu as gc
    return gc


@pytest.fixture
def steps(monkeypatch):
    """Every call of schedule.layer_step, as (layer, the ops object it ran over)."""
    calls = []
    real = schedule.layer_step

    def spy(k, w, ops, comm, x, lanes, **kw):
        calls.append((k, ops))
        return real(k, w, ops, comm, x, lanes, **kw)

    monkeypatch.setattr(schedule, "layer_step", spy)
    return calls


# ------------------------------------------------------------------ recording ops and communicator
class Recorder:
    """A communicator and the ops of every layer, writing one event list in program order."""

    def __init__(self):
        self.events: list[tuple] = []
        self.launches = 0

    def start_all_reduce(self, t, *, lane="", layer=-1):
        cid, self.launches = self.launches, self.launches + 1
        self.events.append(("launch", lane, layer, cid))
        return _RecordedHandle(self, cid, t)

    def mark_compute(self):
        pass

    def drain(self):
        pass

    def ops(self, k: int):
        rec, x = self, torch.zeros(1)

        def compute(name):
            def op(*args):
                rec.events.append(("compute", name, k))
                return (x, args[0]) if name == "norm" else x
            return op

        return SimpleNamespace(input_add_norm=compute("norm"), post_add_norm=compute("norm"),
                               attention=compute("attention"), dense_mlp=compute("dense_mlp"),
                               shared_experts=compute("shared"), routed_experts=compute("routed"))


class _RecordedHandle:
    def __init__(self, rec, cid, t):
        self.rec, self.cid, self.t = rec, cid, t

    def wait(self):
        self.rec.events.append(("wait", self.cid))
        return self.t

    def join(self):
        return self


def _schedule_events(shape: shapes.Shape) -> list[tuple]:
    fs, rec = shape.farskip, Recorder()
    wiring = [schedule.LayerWiring(fs.attn_skips_prev_routed(k), fs.mlp_skips_attn(k), shape.is_moe(k))
              for k in range(shape.layers)]
    x, lanes = schedule.run_layers(torch.zeros(1), [rec.ops(k) for k in range(shape.layers)], wiring, rec)
    schedule.finish(x, lanes, rec.ops(shape.layers).input_add_norm)
    # The planner labels a lane by what it carries: the attention lane holds s alone in a layer
    # whose attention output went on lane "attn" first.
    attn_alone = {e[2] for e in rec.events if e[:2] == ("launch", "attn")}
    label = {"attn": "AR(a)", "routed": "AR(r)"}
    return [("launch", label.get(e[1]) or ("AR(s)" if e[2] in attn_alone else "AR(a+s)"), e[2], e[3])
            if e[0] == "launch" else e for e in rec.events]


def _program_events(shape: shapes.Shape) -> list[tuple]:
    costs = simulation.Costs(**{f.name: 1.0 for f in dataclasses.fields(simulation.Costs)})
    out = []
    for i in simulation.farskip_program(shape, costs, blocking=False).ins:
        out.append({"compute": ("compute", i.name, i.layer), "launch": ("launch", i.name, i.layer, i.cid),
                    "wait": ("wait", i.cid)}[i.kind])
    return out


# Dense layers first and between MoE layers (moe_layer_freq 2), every wiring variant, converted
# ranges that start and end inside the stack, and the stock wiring (nothing converted).
CONFIG = dict(shapes.BUILTIN_MODELS["deepseek-v3"], num_hidden_layers=7, first_k_dense_replace=1, moe_layer_freq=2)
VARIANTS = {
    "all": FarSkipConfig(True),
    "range-2-4": FarSkipConfig(True, 2, 4),
    "attn-only": FarSkipConfig(True, attn_only=True),
    "mlp-only-from-3": FarSkipConfig(True, 3, mlp_only=True),
    "stock": FarSkipConfig(False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_planner_program_is_the_schedule(variant):
    shape = dataclasses.replace(shapes.shape_from_config(CONFIG, variant), farskip=VARIANTS[variant])
    assert [shape.is_moe(k) for k in range(7)] == [False, False, True, False, True, False, True]
    got, want = _schedule_events(shape), _program_events(shape)
    assert got == want, next((i, g, w) for i, (g, w) in enumerate(zip(got + [None], want + [None])) if g != w)


def test_schedule_events_read_like_the_design():
    """One hand-checked layer pair, so that the equality above is not between two wrong things:
    MoE layer 2 of the full wiring waits the attention lane before its attention, the routed
    lane of layer 1 (none: dense) and launches AR(a+s) before the routed experts run."""
    shape = dataclasses.replace(shapes.shape_from_config(CONFIG, "all"), farskip=FarSkipConfig(True))
    ev = _schedule_events(shape)
    layer2 = ev[ev.index(("compute", "norm", 2)) - 1: ev.index(("compute", "norm", 3)) - 1]
    a_s_1 = next(e[3] for e in ev if e[:3] == ("launch", "AR(a+s)", 1))
    assert layer2 == [("wait", a_s_1), ("compute", "norm", 2), ("compute", "attention", 2),
                      ("compute", "norm", 2), ("compute", "shared", 2), ("launch", "AR(a+s)", 2, a_s_1 + 1),
                      ("compute", "routed", 2), ("launch", "AR(r)", 2, a_s_1 + 2)]


# --------------------------------------------------------------------- who runs the schedule
def test_gpu_check_stack_runs_the_schedule(gpu_check, steps):
    gc = gpu_check
    # TP=1: every expert local, so every token has a routed part (at one rank of TP=8 most
    # tokens' routed parts are zero, and a lost routed sum could hide under the median).
    stack = gc.build(gc.TINY, 1, 0, 3, seed=1, dtype=torch.float32, device="cpu")
    x = torch.randn(5, gc.TINY.hidden, generator=torch.Generator().manual_seed(0))
    out = gc.farskip_forward(stack, x, gc.cpu_comm("sync", 1))
    assert [k for k, _ in steps] == [0, 1, 2]
    assert all(isinstance(ops, gc.ShardOps) and ops.layer is stack.layers[k] for k, ops in steps)
    assert gc.rel_err(out, gc.spec_forward([stack], x)) < gc.WIRING_TOL


def test_gpu_check_broken_lanes_live_outside_the_schedule(gpu_check):
    """Each control changes exactly one handle: layer BROKEN_LAYER's "attn+shared"; both move
    the result far past the check's tolerance at world 1 (skip-join: the identity backend has
    no join to skip, so the early read equals the sum; the 2-rank runs of
    test_bare_gpu_check show that one failing)."""
    gc = gpu_check
    stack = gc.build(gc.TINY, 8, 0, 3, seed=1, dtype=torch.float32, device="cpu")
    x = torch.randn(5, gc.TINY.hidden, generator=torch.Generator().manual_seed(0))
    comm = gc.cpu_comm("sync", 1)
    clean = gc.farskip_forward(stack, x, comm)
    dropped = gc.farskip_forward(stack, x, comm, "drop-partial")
    assert gc.rel_err(dropped, clean) > 0.1
    assert torch.equal(gc.farskip_forward(stack, x, comm, "skip-join"), clean)
    broken = gc.BrokenLane(comm, "drop-partial")
    t = torch.ones(3)
    for lane, layer in [("attn+shared", 0), ("routed", gc.BROKEN_LAYER), ("attn+shared", 2)]:
        assert torch.equal(broken.start_all_reduce(t, lane=lane, layer=layer).wait(), t)
    assert not broken.start_all_reduce(t, lane="attn+shared", layer=gc.BROKEN_LAYER).wait().any()


def test_served_model_runs_the_schedule(steps, monkeypatch):
    """FarSkipDeepseekV2Model.forward on stand-ins for upstream's modules (SGLang builds the
    real ones only inside a server): it goes through schedule.layer_step once per layer, with
    the model's wiring, and gives what the schedule gives on the same ops."""
    from sglang_farskip import parallel
    from sglang_farskip.models import deepseek_v3 as served
    from sglang_farskip.models.instella_moe import InstellaMoEForCausalLM

    assert served.LayerWiring is schedule.LayerWiring
    assert issubclass(InstellaMoEForCausalLM, served.FarSkipDeepseekV3ForCausalLM)
    monkeypatch.setattr(parallel, "dp_rows", lambda forward_batch, n: None)  # no DP attention
    torch.manual_seed(0)
    H, T = 8, 3
    layers = [_FakeLayer(H, moe=k > 0) for k in range(3)]
    wiring = [schedule.LayerWiring(True, k != 1, k > 0) for k in range(3)]
    rec = Recorder()
    model = SimpleNamespace(comm=SimpleNamespace(profiler=None, start_all_reduce=rec.start_all_reduce,
                                                 mark_compute=rec.mark_compute, drain=rec.drain),
                            embed_tokens=torch.nn.Embedding(16, H), layers=layers, wiring=wiring,
                            norm=_FusedNorm(H))
    mode = SimpleNamespace(is_decode=lambda: False, is_idle=lambda: False)
    ids = torch.tensor([1, 5, 7])
    with torch.no_grad():
        out = served.FarSkipDeepseekV2Model.forward(model, ids, torch.arange(T),
                                                    SimpleNamespace(forward_mode=mode))
        assert [k for k, _ in steps] == [0, 1, 2]
        assert all(isinstance(ops, served._ServedLayer) and ops.layer is layers[k] for k, ops in steps)
        # The schedule on plain ops over the same modules: the same numbers.
        plain = [SimpleNamespace(
            input_add_norm=schedule.add_then_norm(l.input_layernorm),
            post_add_norm=schedule.add_then_norm(l.post_attention_layernorm),
            attention=lambda h, l=l: l.self_attn(hidden_states=h),
            dense_mlp=l.mlp, shared_experts=lambda y, l=l: l.mlp._forward_shared_experts(y),
            routed_experts=lambda y, l=l: l.mlp.routed(y)) for l in layers]
        x, lanes = schedule.run_layers(model.embed_tokens(ids), plain, wiring, schedule.OneRank())
        want = schedule.finish(x, lanes, schedule.add_then_norm(model.norm))
    assert torch.equal(out, want)  # fused (s + x) or plain (x + s): the same float adds
    assert ("launch", "attn", 1, 1) in rec.events  # layer 1 reads h + a: its own "attn" lane


class _FusedNorm(torch.nn.Module):
    """SGLang's RMSNorm call convention: norm(x) or norm(x, residual) -> (norm(x + r), x + r)."""

    def __init__(self, h):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(h))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return y if residual is None else (y, x)


class _FakeSharedMLP(torch.nn.Module):
    """Upstream's DeepseekV2MLP as far as the served forward looks: a gate_up_proj whose
    quant method may flag the AMX backend (plain bf16/fp32 weights here: it does not)."""

    def __init__(self, h):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(h, h, bias=False)

    def forward(self, y):
        return self.gate_up_proj(y)


class _FakeMoE(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.shared_experts = _FakeSharedMLP(h)
        self.routed = torch.nn.Linear(h, h, bias=False)

    def _forward_shared_experts(self, y):
        return self.shared_experts(y)

    def forward_normal(self, y, skip_shared_experts, return_moe_output):
        assert skip_shared_experts and return_moe_output
        r = self.routed(y)
        return SimpleNamespace(_replace=lambda shared: SimpleNamespace(get_merged=lambda: r))


class _FakeLayer(torch.nn.Module):
    def __init__(self, h, moe):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _FusedNorm(h), _FusedNorm(h)
        attn = torch.nn.Linear(h, h, bias=False)
        self.self_attn = lambda positions=None, hidden_states=None, forward_batch=None, zero_allocator=None: \
            attn(hidden_states)
        self.self_attn.prepare_qkv_latent = None
        self.attn = attn
        if moe:
            self.mlp = _FakeMoE(h)
        else:
            dense = torch.nn.Linear(h, h, bias=False)
            self.mlp = lambda y, forward_batch=None: dense(y)
            self.dense = dense


def test_student_runs_the_schedule_and_checkpointing_still_applies(steps):
    """The FCSD student's layers go through schedule.layer_step; with transformers' gradient
    checkpointing on, each layer's forward runs again in backward (the recompute), and the
    gradients are the ones without checkpointing, bit for bit (the same ops, the same order)."""
    from transformers import DeepseekV3Config

    from sglang_farskip.fcsd.student import FarSkipStudent

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, farskip=True,
                           farskip_start_idx=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    student = FarSkipStudent(cfg).train()
    assert [l.wiring.attn_skips_prev_routed for l in student.model.layers] == [False, True, True]
    ids = torch.randint(0, 64, (2, 6))

    def grads():
        student.zero_grad()
        student.model(ids).square().mean().backward()
        return {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    plain = grads()
    assert [k for k, _ in steps] == [0, 1, 2]  # one forward, no recompute
    steps.clear()
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads()
    assert [k for k, _ in steps] == [0, 1, 2, 2, 1, 0]  # forward, then each layer again in backward
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)
