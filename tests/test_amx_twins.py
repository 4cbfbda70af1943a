"""The torch-native twins of sgl_kernel's AMX-path CPU ops (python/cpu_shim/sgl_kernel/amx.py),
each against a second formula written from the math (loops, float64, complex rotations), or
SGLang's own torch-native definition where it has one (the router). Inputs are bfloat16, as on
the served path; tolerances are bf16 rounding of the outputs (one ulp near the largest values,
2**-8 relative) unless the output is float32.

Each check is a function taking the twin, so `test_checks_catch_planted_bugs` can feed it a
twin with a planted bug and see it fail. `test_registration` checks the opt-in switch in fresh
processes: with FARSKIP_CPU_AMX_TWINS=1 the ops resolve and SGLang reports AMX support,
without it nothing is registered.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sgl_kernel import amx

BF16 = torch.bfloat16


def _rand(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _close(got, want, rtol=2**-7, atol=1e-3):
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got - want).abs().max().item()
    assert torch.allclose(got, want, rtol=rtol, atol=atol), err


def _dot_linear(x, w, bias=None):  # y[m, n] = sum_k x[m, k] w[n, k], float64
    y = (x.double()[:, None, :] * w.double()[None, :, :]).sum(-1)
    return y if bias is None else y + bias.double()


def _silu_mul_math(h):
    d = h.shape[-1] // 2
    g, u = h[..., :d].double(), h[..., d:].double()
    return g / (1 + torch.exp(-g)) * u


def _rms_math(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.double()


# ------------------------------------------------------------------ checks
def check_linear(linear=amx.weight_packed_linear, convert=amx.convert_weight_packed):
    x, w, b = _rand(5, 64), _rand(48, 64, seed=1), _rand(48, seed=2).float()
    packed = convert(w)
    assert packed.data_ptr() != w.data_ptr() and torch.equal(packed, w)  # plain layout, own copy
    got = linear(x, packed, b, True)
    assert got.dtype == BF16
    _close(got, _dot_linear(x, w, b))


def check_bmm(bmm=amx.bmm_cpu):
    # As SGLang calls it: out is a transposed view of [M, B*N] (forward_mla_fused_rope_cpu.py).
    heads, m, k, n = 3, 4, 32, 16
    a, w = _rand(m, heads, k), _rand(heads, n, k, seed=1)
    output = torch.empty(m, heads * n, dtype=BF16)
    bmm(output.view(m, heads, n).transpose(0, 1), a.transpose(0, 1), w, True, None)
    want = torch.stack([_dot_linear(a[:, h], w[h]) for h in range(heads)], 1).reshape(m, heads * n)
    _close(output, want)


def check_silu_and_mul(fn=amx.silu_and_mul_cpu):
    x = _rand(6, 64, scale=3)
    _close(fn(x), _silu_mul_math(x))


def check_rmsnorm(fn=amx.rmsnorm_cpu):
    x, w = _rand(5, 64, scale=4), _rand(64, seed=1)
    _close(fn(x, w, 1e-6), _rms_math(x, w, 1e-6))


def check_fused_add_rmsnorm(fn=amx.fused_add_rmsnorm_cpu):
    x, r, w = _rand(5, 64), _rand(5, 64, seed=1), _rand(64, seed=2)
    x0, r0 = x.clone(), r.clone()
    fn(x, r, w, 1e-6)
    total = x0.double() + r0.double()
    _close(r, total)
    _close(x, _rms_math(total, w, 1e-6))


def check_biased_grouped_topk(fn=amx.biased_grouped_topk_cpu):
    """Against SGLang's torch-native router, which the non-AMX path runs."""
    from sglang.srt.layers.moe.topk import biased_grouped_topk_impl

    t, e = 16, 16
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.1
    for scale in (None, 2.5):
        weights, ids = fn(torch.zeros(t, 8), logits, bias, 4, True, 4, 2, 0, scale, None)
        want_w, want_ids = biased_grouped_topk_impl(
            torch.zeros(t, 8), logits, bias, 4, True, num_expert_group=4, topk_group=2,
            routed_scaling_factor=scale, apply_routed_scaling_factor_on_output=scale is not None)[:2]
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        # The same experts with the same weights (the order of the k slots is free).
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), want_ids.to(torch.int32).gather(1, want_order))
        torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


def _expert_mlp(x, w1, w2):  # one token [H] through one expert, float64
    return _dot_linear(_silu_mul_math(_dot_linear(x[None], w1)).to(BF16), w2)[0]


def check_fused_experts(fn=amx.fused_experts_cpu):
    t, h, i, e, k = 6, 64, 32, 4, 2
    x, w1, w2 = _rand(t, h), _rand(e, 2 * i, h, scale=0.2, seed=1), _rand(e, h, i, scale=0.2, seed=2)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 3]], dtype=torch.int32)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(3))
    got = fn(x, w1, w2, weights, ids, False, 0, None, None, None, None, None, None, None, None, None, True, "silu")
    want = torch.stack([sum(weights[r, s].double() * _expert_mlp(x[r], w1[ids[r, s]], w2[ids[r, s]])
                            for s in range(k)) for r in range(t)])
    _close(got, want)


def check_shared_expert(fn=amx.shared_expert_cpu):
    t, h, i = 5, 64, 32
    x, w1, w2 = _rand(t, h), _rand(2 * i, h, scale=0.2, seed=1), _rand(h, i, scale=0.2, seed=2)
    routed = _rand(t, h, seed=3)
    want = torch.stack([_expert_mlp(x[r], w1, w2) for r in range(t)]) + 2.5 * routed.double()
    x_in = x.clone()
    got = fn(x_in, w1, w2, routed, 2.5, True, False, False, None, None, None, True)
    _close(got, want)
    assert got.data_ptr() == x_in.data_ptr()  # inplace: written over hidden_states


def check_qkv_proj_with_rope(fn=amx.qkv_proj_with_rope_fused_weight):
    t, hidden, q_lora, kv_lora, rope, nope, heads = 3, 64, 32, 32, 16, 16, 2
    x = _rand(t, hidden)
    qkv_a = _rand(q_lora + kv_lora + rope, hidden, scale=0.2, seed=1)
    q_b = _rand(heads * (nope + rope), q_lora, scale=0.2, seed=2)
    w_kc = _rand(heads, kv_lora, nope, scale=0.2, seed=3)  # as SGLang packs it: [heads, kv_lora, nope]
    qn, kvn = _rand(q_lora, seed=4), _rand(kv_lora, seed=5)
    positions = torch.tensor([0, 5, 9])
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).double() / rope))
    angles = torch.arange(16).double()[:, None] * inv[None]
    cache = torch.cat((angles.cos(), angles.sin()), -1).to(BF16)  # rows [cos | sin]
    q, k, v = fn(x, qkv_a, q_b, w_kc, qn, kvn, positions, cache, 1e-6, False, False, None, None, None,
                 True, None, q_lora, kv_lora, rope)

    def rotate(vec, pos):  # interleaved pairs as complex numbers, times e^{i*angle}
        c = torch.complex(vec[..., 0::2].double(), vec[..., 1::2].double())
        rot = torch.polar(torch.ones_like(inv), pos * inv)
        return torch.view_as_real(c * rot).flatten(-2)

    # Rounded to bf16 where the kernel stores its intermediates (qkv_proj.cpp: the a-projection,
    # the normed q_a, the q_b projection), so the comparison is of the formula, not of rounding.
    a = _dot_linear(x, qkv_a).to(BF16)
    qa = _rms_math(a[:, :q_lora], qn, 1e-6).to(BF16)
    qq = _dot_linear(qa, q_b).to(BF16).view(t, heads, nope + rope)
    for r in range(t):
        p = float(positions[r])
        for hd in range(heads):
            want_nope = (qq[r, hd, :nope][None, :] * w_kc[hd].double()).sum(-1)
            _close(q[r, hd, :kv_lora], want_nope)
            _close(q[r, hd, kv_lora:], rotate(qq[r, hd, nope:], p))
        _close(k[r, 0, :kv_lora], _rms_math(a[r, q_lora:q_lora + kv_lora], kvn, 1e-6))
        _close(k[r, 0, kv_lora:], rotate(a[r, q_lora + kv_lora:], p))
    assert v.data_ptr() == k.data_ptr() and v.shape == (t, 1, kv_lora)  # V is a view of K's latent


def check_fp8_scaled_mm(fn=amx.fp8_scaled_mm_cpu):
    from sglang_farskip.formats import fp8

    w = torch.randn(160, 256, generator=torch.Generator().manual_seed(1))  # a cut block in N
    q, scale = fp8.quantize(w)
    x = _rand(4, 256)
    got = fn(x, q, scale, [128, 128], None, BF16, True)
    _close(got, _dot_linear(x, fp8.dequantize(q, scale, BF16)))


def check_fp8_experts(fn=amx.fused_experts_cpu):
    """FP8 experts (per-expert block scales, as Fp8MoEMethod passes them) = the same experts
    with their weights dequantized (fp8.dequantize), through the bf16 formula above."""
    from sglang_farskip.formats import fp8

    t, h, i, e = 4, 256, 128, 2
    w1 = [fp8.quantize(torch.randn(2 * i, h, generator=torch.Generator().manual_seed(10 + x)) * 0.05) for x in range(e)]
    w2 = [fp8.quantize(torch.randn(h, i, generator=torch.Generator().manual_seed(20 + x)) * 0.05) for x in range(e)]
    q1, s1 = torch.stack([q for q, _ in w1]), torch.stack([s for _, s in w1])
    q2, s2 = torch.stack([q for q, _ in w2]), torch.stack([s for _, s in w2])
    x, ids = _rand(t, h), torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.int32)
    weights = torch.rand(t, 2, generator=torch.Generator().manual_seed(3))
    got = fn(x, q1, q2, weights, ids, False, 2, s1, s2, None, None, [128, 128], None, None, None, None, True, "silu")
    d1 = [fp8.dequantize(q, s, BF16) for q, s in w1]
    d2 = [fp8.dequantize(q, s, BF16) for q, s in w2]
    want = torch.stack([sum(weights[r, k].double() * _expert_mlp(x[r], d1[ids[r, k]], d2[ids[r, k]])
                            for k in range(2)) for r in range(t)])
    _close(got, want)


CHECKS = [check_linear, check_bmm, check_silu_and_mul, check_rmsnorm, check_fused_add_rmsnorm,
          check_biased_grouped_topk, check_fused_experts, check_shared_expert, check_qkv_proj_with_rope,
          check_fp8_scaled_mm, check_fp8_experts]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_twin_matches_its_definition(check):
    check()


# ------------------------------------------------------------------ the checks can fail
def _gate_up_swapped(h):
    d = h.shape[-1] // 2
    return torch.nn.functional.silu(h[..., d:]) * h[..., :d]


PLANTED = {
    "rmsnorm: centred like a LayerNorm": (check_rmsnorm, lambda x, w, eps: (
        torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=eps) * w.float()).to(x.dtype)),
    "topk: bias left in the weights": (check_biased_grouped_topk, lambda h, g, b, *a: amx.biased_grouped_topk_cpu(
        h, g + torch.log(torch.sigmoid(g + b) / torch.sigmoid(g)), b, *a)),
    "bmm: weight not transposed back": (check_bmm, lambda out, a, w, v, s: out.copy_(
        torch.bmm(a.float(), w.float().transpose(1, 2).flip(1)))),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_checks_catch_planted_bugs(name):
    check, broken = PLANTED[name]
    with pytest.raises(AssertionError):
        check(broken)


def test_checks_catch_swapped_gate_and_up(monkeypatch):
    monkeypatch.setattr(amx, "_silu_mul", _gate_up_swapped)
    for check in (check_fused_experts, check_shared_expert):
        with pytest.raises(AssertionError):
            check()


# ------------------------------------------------------------------ the switch
PROBE = """
import sgl_kernel, torch
from sglang.srt.utils.common import cpu_has_amx_support
ops = torch.ops.sgl_kernel
print(hasattr(ops, "convert_weight_packed"), cpu_has_amx_support(),
      ops.rmsnorm_cpu(torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), 1e-6).sum().item()
      if hasattr(ops, "rmsnorm_cpu") else None)
"""


def test_registration():
    """Registered at `import sgl_kernel` only when asked; then SGLang sees AMX support, on a CPU
    with AMX tiles or without (the twins stand in for both)."""
    for value, want in (("1", "True True 64.0"), ("0", "False False None")):
        env = {**os.environ, amx.ENV: value}
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[-2].strip() == want, out.stdout
