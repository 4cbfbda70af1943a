"""Torch-native twins of the sgl_kernel CPU ops on SGLang 0.5.23's "AMX" path (opt-in, for tests).

Why they exist: SGLang's Xeon deployments run with sgl-kernel's CPU build, and SGLang then takes
its AMX branches (`cpu_has_amx_support()`: AMX tiles *and* `torch.ops.sgl_kernel.
convert_weight_packed` registered). PyPI ships no such build, so on these machines SGLang takes
its torch-native branches instead, and FarSkip was never run on the code paths a Xeon
deployment uses (issue 35 item 4: upstream's MoE returns a merged tensor there). With
`FARSKIP_CPU_AMX_TWINS=1` in the environment, `import sgl_kernel` (the stand-in) registers
these plain-PyTorch ops under `torch.ops.sgl_kernel`, which turns SGLang's AMX branches on,
so FarSkip can be tested on them. They are slow (float32 matmuls, Python loops over experts)
and not meant for serving. Without the variable nothing is registered and SGLang keeps its
torch-native path.

When: SGLang reads `cpu_has_amx_support()` at import of many modules (`_is_cpu_amx_available =
cpu_has_amx_support()` at module level in layers/layernorm.py, activation.py, moe/topk.py,
quantization/unquant.py, model_executor/model_runner.py, ...). That function imports
sgl_kernel itself before it looks for the op (`_is_intel_amx_backend_available`,
utils/common.py ~353), and caches the answer: registering at `import sgl_kernel` is in time.

Schemas are those of the installed SGLang's call sites (e.g. `fused_experts_cpu` with an int
`moe_comp_method` and zero points, `shared_expert_cpu` without activation scales), which are
newer than some published sgl-kernel sources. What each op computes was read from sgl-kernel's
CPU sources (gemm.cpp, moe.cpp, norm.cpp, activation.cpp, topk.cpp, qkv_proj.cpp, bmm.cpp);
tests/test_amx_twins.py checks every twin against a second formula written from the math.

Weight layout: the real `convert_weight_packed` reorders weights into AMX's VNNI blocks. The
twin keeps the plain row-major layout ([out, in], or [E, out, in] for experts) and every twin
that takes a "packed" weight (`is_vnni=True`) reads that plain layout; no other code reads
packed weights. Precision follows the kernels: bfloat16/float16 in and out, float32 inside,
rounded to the activation dtype where the kernel stores an intermediate (the MoE's
silu-and-mul output, the MLA projections).

Covered: bf16/fp16 weights, FP8 block-quantized weights (w8a16: dequantized to the activation
dtype, then as bf16), silu activation, tensor parallelism 1 (the shared-memory all-reduce of
TP > 1 raises). Not covered (absent, so a call fails loudly): the intel_amx attention backend's
ops (decode/extend attention; use --attention-backend torch_native, the launcher's default),
int8/int4 ops, rotary_embedding_cpu and the other model-specific fused ops.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

ENV = "FARSKIP_CPU_AMX_TWINS"

_FP8 = (torch.float8_e4m3fn,)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


# ------------------------------------------------------------------ evidence
_called: set[str] = set()


def _announce(name: str) -> None:
    """One stderr line per op and process the first time it runs: the proof, in a server's log,
    that SGLang took the AMX branch that calls it."""
    if name not in _called:
        _called.add(name)
        print(f"[farskip-amx-twin] pid {os.getpid()} first call: sgl_kernel.{name}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ helpers
def _dequant_block(w: torch.Tensor, scale: torch.Tensor, block: list[int], dtype) -> torch.Tensor:
    """Block-FP8 weight [..., N, K] with scales [..., ceil(N/bn), ceil(K/bk)] -> `dtype`.
    The kernels (gemm_fp8.cpp, moe_fp8.cpp) unpack a block to bf16 and multiply by its scale."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return (w.float() * s).to(dtype)


def _weight(w: torch.Tensor, dtype, scale=None, block=None) -> torch.Tensor:
    if w.dtype in _FP8:
        if scale is None or block is None:
            raise ValueError("an FP8 weight needs its block scales and block size")
        return _dequant_block(w, scale, list(block), dtype)
    if w.dtype == torch.float32:
        # The kernels take fp32 weights unpacked and [K, N] (gemm.cpp); SGLang never packs them
        # (amx_utils.dtype_is_supported), so no AMX branch sends one here.
        raise NotImplementedError("float32 weights are not on SGLang's AMX path")
    return w


def _linear(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) in float32: the float32 accumulation of the AMX tiles."""
    out = x.float() @ w.float().t()
    return out if bias is None else out + bias.float()


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


# ------------------------------------------------------------------ the twins
def convert_weight_packed(weight):
    # A fresh contiguous copy in the plain layout (SGLang passes transposed views, e.g. MLA's
    # w_kc / w_vc with dims 1 and 2 swapped, and expects the packed tensor in that shape).
    return weight.clone(memory_format=torch.contiguous_format)


def weight_packed_linear(mat1, mat2, bias, is_vnni):
    return _linear(mat1, _weight(mat2, mat1.dtype), bias).to(mat1.dtype)


def fp8_scaled_mm_cpu(mat1, mat2, scales2, block_size, bias, out_dtype, is_vnni):
    return _linear(mat1, _weight(mat2, mat1.dtype, scales2, block_size), bias).to(out_dtype)


def bmm_cpu(out, mat1, mat2, is_vnni, scale):
    # out [B, M, N] = mat1 [B, M, K] @ mat2 [B, N, K]^T; out is a strided view the caller reads
    # through another tensor (forward_mla_fused_rope_cpu.py), so it is written in place.
    # An FP8 mat2 has one per-tensor scale here (MLA's w_kc / w_vc).
    w = (mat2.float() * scale.float()).to(mat1.dtype) if mat2.dtype in _FP8 else mat2
    out.copy_(torch.bmm(mat1.float(), w.float().transpose(1, 2)))


def silu_and_mul_cpu(input):
    return _silu_mul(input.float()).to(input.dtype)


def rmsnorm_cpu(input, weight, eps):
    return _rms(input, weight, eps).to(input.dtype)


def fused_add_rmsnorm_cpu(input, residual, weight, eps):
    # residual <- input + residual; input <- rmsnorm(that sum) * weight (norm.cpp: the sum is
    # taken in float32, stored back in the activation dtype, and normalized in float32).
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms(total, weight, eps))


def biased_grouped_topk_cpu(hidden_states, gating_output, correction_bias, topk, renormalize,
                            num_expert_group, topk_group, num_fused_shared_experts,
                            routed_scaling_factor, num_token_non_padded):
    """DeepSeek-V3 routing (topk.cpp): experts chosen by sigmoid score + correction bias among
    the `topk_group` groups whose two best biased scores sum highest; weights are the unbiased
    sigmoid scores, renormalized, times routed_scaling_factor when one is given."""
    if num_fused_shared_experts:
        raise NotImplementedError("biased_grouped_topk_cpu twin: fused shared experts")
    scores = gating_output.float().sigmoid()  # [T, E]
    t, e = scores.shape
    biased = scores + correction_bias.float()
    groups = biased.view(t, num_expert_group, -1)
    best_groups = groups.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices  # [T, topk_group]
    allowed = torch.zeros(t, num_expert_group, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed.repeat_interleave(e // num_expert_group, 1)
    ids = biased.masked_fill(~allowed, float("-inf")).topk(topk, -1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


_UNQUANT, _INT8, _FP8_W8A16 = 0, 1, 2  # sglang.srt.layers.amx_utils.CPUQuantMethod


def fused_experts_cpu(hidden_states, w1, w2, topk_weights, topk_ids, inplace, moe_comp_method,
                      w1_scale, w2_scale, w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha,
                      limit, is_vnni, activation=None):
    """out[t] = sum_k topk_weights[t, k] * (silu(x W1g^T) * (x W1u^T)) W2^T, expert topk_ids[t, k];
    w1 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. The silu-and-mul result is stored in
    the activation dtype (moe.cpp's intermediate cache), the weighted sum kept in float32."""
    if moe_comp_method not in (_UNQUANT, _FP8_W8A16):
        raise NotImplementedError(f"fused_experts_cpu twin: quant method {moe_comp_method}")
    if activation not in (None, "silu") or alpha is not None or limit is not None:
        raise NotImplementedError(f"fused_experts_cpu twin: activation {activation!r}, alpha {alpha}, limit {limit}")
    dtype = hidden_states.dtype
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        if expert < 0:  # expert-parallel: owned by another rank
            continue
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        x = hidden_states[rows]
        a = _weight(w1[expert], dtype, None if w1_scale is None else w1_scale[expert], block_size)
        b = _weight(w2[expert], dtype, None if w2_scale is None else w2_scale[expert], block_size)
        h = _silu_mul(_linear(x, a, None if w1_bias is None else w1_bias[expert])).to(dtype)
        y = _linear(h, b, None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, rows, y * topk_weights[rows, slots].float()[:, None])
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out.to(dtype)


def shared_expert_cpu(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor, inplace,
                      use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size, is_vnni):
    """silu-and-mul MLP of the shared expert, plus fused_experts_out * routed_scaling_factor:
    the whole DeepSeek MoE output (moe.cpp), written over hidden_states when inplace."""
    if use_int8_w8a8:
        raise NotImplementedError("shared_expert_cpu twin: int8")
    dtype = hidden_states.dtype
    a = _weight(w1, dtype, w1_scale, block_size)
    b = _weight(w2, dtype, w2_scale, block_size)
    out = _linear(_silu_mul(_linear(hidden_states, a)).to(dtype), b)
    if fused_experts_out is not None:
        out = out + fused_experts_out.float() * (1.0 if routed_scaling_factor is None else routed_scaling_factor)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out.to(dtype)


def qkv_proj_with_rope_fused_weight(hidden_states, qkv_a_proj_weight, q_b_proj_weight, w_kc,
                                    q_a_layernorm_weight, kv_a_layernorm_weight, positions,
                                    cos_sin_cache, eps, use_int8_w8a8, use_fp8_w8a16,
                                    qkv_a_proj_scale, q_b_proj_scale, w_scale, is_vnni, block_size,
                                    q_lora_rank, kv_lora_rank, qk_rope_head_dim):
    """MLA's absorbed query and latent key/value in one op (qkv_proj.cpp):
        [q_a | kv_a] = x @ qkv_a^T ; q_a, kv_a[:, :kv_lora] RMS-normed ;
        q = q_a @ q_b^T -> [T, heads, nope + rope] ;
        q_input = [q_nope @ w_kc[h]^T | rope(q_pe)] , k_input = [kv_a_normed | rope(k_pe)] ;
        v_input = k_input[..., :kv_lora] (a view: K and V share storage).
    w_kc is [heads, kv_lora, nope] (SGLang packs it transposed). RoPE is DeepSeek's
    interleaved form (pairs 2i, 2i+1; cos_sin_cache rows are [cos | sin])."""
    if use_int8_w8a8:
        raise NotImplementedError("qkv_proj_with_rope_fused_weight twin: int8")
    dtype = hidden_states.dtype
    t = hidden_states.shape[0]
    heads, _, nope = w_kc.shape
    qkv_a = _weight(qkv_a_proj_weight, dtype, qkv_a_proj_scale, block_size)
    q_b = _weight(q_b_proj_weight, dtype, q_b_proj_scale, block_size)
    a = _linear(hidden_states, qkv_a).to(dtype)
    q_a, kv_a = a[:, :q_lora_rank], a[:, q_lora_rank:]
    q_a = _rms(q_a, q_a_layernorm_weight, eps).to(dtype)
    latent = _rms(kv_a[:, :kv_lora_rank], kv_a_layernorm_weight, eps).to(dtype)
    q = _linear(q_a, q_b).to(dtype).view(t, heads, -1)
    kc = w_kc.float() * w_scale.float() if w_kc.dtype in _FP8 else w_kc.float()
    q_nope = torch.einsum("thd,hld->thl", q[..., :nope].float(), kc.to(dtype).float()).to(dtype)
    cos, sin = cos_sin_cache[positions].float().chunk(2, -1)  # [T, rope/2] each

    def rope(x):  # [T, n, rope], interleaved pairs
        even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack((even * c - odd * s, odd * c + even * s), -1).flatten(-2).to(dtype)

    q_input = torch.cat((q_nope, rope(q[..., nope:nope + qk_rope_head_dim])), -1)
    k_input = torch.cat((latent, rope(kv_a[:, None, kv_lora_rank:]).squeeze(1)), -1)[:, None]
    return q_input.contiguous(), k_input, k_input.narrow(-1, 0, kv_lora_rank)


def init_cpu_threads_env(cpu_ids):
    # The kernel pins one OpenMP thread per listed core. The twins run on torch's own threads,
    # left as the launcher set them, so the AMX and torch-native paths compare like for like.
    return f"farskip AMX twins: no thread binding (asked for cores {cpu_ids})"


def initialize(size, rank):
    pass  # the kernel opens its shared-memory all-reduce segment here; the twins have none


def _tp_only_one(*args):
    raise NotImplementedError(
        "sgl_kernel's shared-memory collectives have no twin: the AMX twins cover "
        "tensor parallelism 1 only"
    )


# (schema, function); schemas from the installed SGLang's call sites and sgl-kernel's
# torch_extension_cpu.cpp.
OPS = {
    "convert_weight_packed": ("convert_weight_packed(Tensor weight) -> Tensor", convert_weight_packed),
    "weight_packed_linear": (
        "weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor",
        weight_packed_linear),
    "fp8_scaled_mm_cpu": (
        "fp8_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, Tensor? bias, "
        "ScalarType out_dtype, bool is_vnni) -> Tensor", fp8_scaled_mm_cpu),
    "bmm_cpu": ("bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()", bmm_cpu),
    "silu_and_mul_cpu": ("silu_and_mul_cpu(Tensor input) -> Tensor", silu_and_mul_cpu),
    "rmsnorm_cpu": ("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor", rmsnorm_cpu),
    "fused_add_rmsnorm_cpu": (
        "fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        fused_add_rmsnorm_cpu),
    "biased_grouped_topk_cpu": (
        "biased_grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
        "bool renormalize, int num_expert_group, int topk_group, int num_fused_shared_experts, "
        "float? routed_scaling_factor, Tensor? num_token_non_padded) -> (Tensor, Tensor)",
        biased_grouped_topk_cpu),
    "fused_experts_cpu": (
        "fused_experts_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, "
        "Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, "
        "bool is_vnni, str? activation=None) -> Tensor", fused_experts_cpu),
    "shared_expert_cpu": (
        "shared_expert_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor? fused_experts_out, "
        "float? routed_scaling_factor, bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, Tensor? w1_scale, "
        "Tensor? w2_scale, int[]? block_size, bool is_vnni) -> Tensor", shared_expert_cpu),
    "qkv_proj_with_rope_fused_weight": (
        "qkv_proj_with_rope_fused_weight(Tensor hidden_states, Tensor qkv_a_proj_weight, Tensor q_b_proj_weight, "
        "Tensor w_kc, Tensor q_a_layernorm_weight, Tensor kv_a_layernorm_weight, Tensor positions, "
        "Tensor cos_sin_cache, float eps, bool use_int8_w8a8, bool use_fp8_w8a16, Tensor? qkv_a_proj_scale, "
        "Tensor? q_b_proj_scale, Tensor? w_scale, bool is_vnni, int[]? block_size, int q_lora_rank, "
        "int kv_lora_rank, int qk_rope_head_dim) -> (Tensor, Tensor, Tensor)",
        qkv_proj_with_rope_fused_weight),
    "init_cpu_threads_env": ("init_cpu_threads_env(str cpu_ids) -> str", init_cpu_threads_env),
    "initialize": ("initialize(int size, int rank) -> ()", initialize),
    "shm_allreduce": ("shm_allreduce(Tensor(a!) data, int reduce_op) -> ()", _tp_only_one),
    "shm_allgather": ("shm_allgather(Tensor data, int dim) -> Tensor", _tp_only_one),
}

# Names SGLang reads from torch.ops.sgl_kernel at import (module level, on its AMX branch) for
# other models and attention backends: they resolve to a kernel that raises when called.
ABSENT = (
    "apply_rotary_pos_emb_cpu", "conv3d_embed_cpu", "decode_attention_cpu", "extend_attention_cpu",
    "flash_attn_varlen_func", "fused_dual_residual_rmsnorm_cpu", "fused_gdn_gating_cpu",
    "fused_moe_router_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu", "fused_scale_residual_norm_scale_shift",
    "fused_sigmoid_gating_delta_rule_update_cpu", "fused_sigmoid_mul_cpu",
)

_library = None


def register() -> None:
    """Define and implement every op in OPS under torch.ops.sgl_kernel (idempotent)."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, (schema, fn) in OPS.items():
        lib.define(schema)
        lib.impl(name, _announced(name, fn), "CompositeExplicitAutograd")
    _library = lib  # kept alive: dropping the Library object would unregister the ops
    # The twins are plain PyTorch and need no AMX tiles, so they stand in for the tiles too.
    # SGLang's AMX path also asks torch whether the CPU has them (utils/common.py reads
    # torch.cpu._is_amx_tile_supported() once, at import; scripts/bootstrap.sh's .pth imports
    # this package first when the twins are on), and on a CPU without them (an AMD EPYC CI
    # machine) the twins were registered and never called.
    torch.cpu._is_amx_tile_supported = lambda: True
    from sgl_kernel import MissingKernel  # the package's own raising stand-in

    namespace = torch.ops.sgl_kernel
    for name in ABSENT:
        if not hasattr(namespace, name):  # a real op of that name (another library) wins
            setattr(namespace, name, MissingKernel(name))


def _announced(name, fn):
    def run(*args, **kwargs):
        _announce(name)
        return fn(*args, **kwargs)

    run.__name__ = name
    return run
