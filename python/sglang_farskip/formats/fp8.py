"""DeepSeek-V3's block-FP8 weight format: the one place that says what it is.

DeepSeek ships its weights as float8 e4m3 in 128 x 128 blocks. A quantized linear weight W [N, K]
is stored as

    W.weight            [N, K]                       float8_e4m3fn
    W.weight_scale_inv  [ceil(N/128), ceil(K/128)]   float32
    W ~= weight * weight_scale_inv   (each scale broadcast over its block; DeepSeek's own
                                      `weight_dequant` multiplies, the name notwithstanding)

and config.json carries QUANTIZATION_CONFIG. The release quantizes the linear layers of every
decoder layer (attention projections, dense MLP, routed and shared experts), the MTP layer's
decoder block included, and keeps the rest in bf16: embeddings, lm_head, norms, the router gate
and its correction bias, and the MTP layer's eh_proj, enorm/hnorm and shared_head
(`is_quantized`). Activations are quantized on the fly ("dynamic") by the GPU kernels.

Used by the requantizer (quantize.py), the reference (dequantizing, reference.py), the demo's FP8
kind, the CPU serving path (cpu/fp8.py) and the planner's memory figures (plan/memory.py).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from sglang_farskip.config import config_value
from sglang_farskip.errors import UserError

BLOCK = 128
DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}

# The linear weights of a decoder layer (model.layers.N., the MTP layer's included).
_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$"
)


def is_quantized(name: str) -> bool:
    """Whether DeepSeek's release stores tensor `name` in FP8 (with a `<name>_scale_inv`)."""
    return bool(_QUANTIZED.match(name))


def weight_format(cfg: Any) -> str:
    """"fp8" for DeepSeek's block-FP8 layout, "bf16" for an unquantized checkpoint (whatever its
    stored float type); anything else is a UserError naming what was found. `cfg`: config.json
    as a dict, or a transformers config."""
    quant = config_value(cfg, "quantization_config")
    if not quant:
        return "bf16"
    quant = dict(quant)
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method == "fp8" and list(block or []) == [BLOCK, BLOCK] and quant.get("fmt", "e4m3") == "e4m3":
        return "fp8"
    raise UserError(
        f"quantization_config {quant!r} is not DeepSeek's block FP8 (quant_method fp8, e4m3, "
        f"weight_block_size [{BLOCK}, {BLOCK}]), the one quantized format sglang_farskip serves and "
        "checks: serve a bf16 copy, or requantize one with `python -m sglang_farskip.formats.quantize`"
    )


def _blocks(t: torch.Tensor) -> tuple[int, int]:
    n, k = t.shape
    return -(-n // BLOCK), -(-k // BLOCK)


def _per_element(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[nb, kb] block scales -> [N, K], each scale repeated over its (possibly cut) block."""
    return scale.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]), each block scaled
    so its largest magnitude maps to 448 (an all-zero block gets scale 1)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    w = w.float()
    nb, kb = _blocks(w)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))  # [nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _per_element(scale, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize` (exact for what it stored): [N, K] in `dtype`, computed in float32."""
    if scale_inv.shape != _blocks(q):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not match {_blocks(q)} blocks of "
                         f"weight {tuple(q.shape)}")
    return (q.float() * _per_element(scale_inv.float(), q.shape)).to(dtype)


def as_cpu_loader_stores_kv_b(q: torch.Tensor, scale_inv: torch.Tensor, tp_size: int = 1) -> torch.Tensor:
    """kv_b_proj as SGLang's loader keeps it for absorbed MLA on CPU (and wherever the block is not
    128 x 128 on CUDA): each TP rank's rows (a column-parallel shard: its heads) dequantized,
    requantized to e4m3 with one scale for the shard (`block_quant_to_tensor_quant`), multiplied
    back; float32 [N, K]. On CUDA with 128 x 128 blocks the loader dequantizes exactly instead, so
    CPU and GPU FP8 differ here by design."""
    shards = []
    for w in dequantize(q, scale_inv).chunk(tp_size, dim=0):
        scale = FP8_MAX / w.abs().max().clamp(min=1e-12)  # as input_to_float8 computes it
        shards.append((w * scale).clamp(-FP8_MAX, FP8_MAX).to(DTYPE).float() * scale.reciprocal())
    return torch.cat(shards)


def fused_projection_problem(cfg: Any) -> str | None:
    """Why SGLang would load this config's FP8 weights wrongly, or None. SGLang's loader
    concatenates q_a_proj and kv_a_proj_with_mqa with their block scales
    (deepseek_weight_loader.py ~476): the join must fall on a block edge, or kv rows silently take
    q_a's scales."""
    q_lora = config_value(cfg, "q_lora_rank")
    if q_lora and q_lora % BLOCK:
        return (f"q_lora_rank {q_lora} is not a multiple of {BLOCK}: SGLang fuses q_a_proj and "
                f"kv_a_proj_with_mqa, whose {BLOCK}-row scale blocks must then meet at a block edge")
    return None
