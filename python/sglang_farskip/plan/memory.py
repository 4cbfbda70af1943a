"""Memory: what a DeepSeek-V3-family checkpoint's weights take in each format, and whether a
TP/EP group of GPUs holds them with room left for the KV cache.

Weights are counted tensor by tensor, under the Hugging Face names and shapes DeepSeek ships
(`main_tensors`, `mtp_tensors`), so that which tensors are FP8 is decided by
`fp8.is_quantized(name)` alone: a quantized [N, K] weight costs N x K bytes plus a float32 scale
per 128 x 128 block, every other tensor 2 bytes an element (bf16).

Fit, per GPU of a group of N (the planner's --tp):

    weights/GPU   = all weights / N        experts split by EP, attention and the dense MLP by TP,
                                           embeddings and lm_head vocab-parallel, the MTP layer
                                           (when the config has one) alike
    budget/GPU    = (1 - HEADROOM) x HBM   HEADROOM left to activations, CUDA graphs, the
                                           framework (SGLang 0.5.23 reserves at least 10 GiB on
                                           a card over 60 GiB, more with larger chunked-prefill
                                           and CUDA-graph batches: about 7-15% of these cards)
    KV cache/GPU  = budget - weights/GPU
    KV per token  = layers x (kv_lora_rank + qk_rope_head_dim) x 2   (MLA's latent, bf16:
                                           SGLang's default --kv-cache-dtype auto)
    tokens        = KV cache/GPU / KV per token, times dp: under TP attention every rank keeps
                                           the latent of all the group's tokens; under DP
                                           attention each DP rank keeps its own sequences'

Not counted: that SGLang replicates some tensors on every TP rank instead of splitting them
(q_a_proj, kv_a_proj_with_mqa, the router, the norms: 1.05B parameters of DeepSeek-V3 with its MTP
layer, 1.8 GB more per GPU in bf16 on 8 GPUs, 1.0 GB in fp8), the MTP layer's own KV cache, an
FP8 KV cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

from sglang_farskip.formats import fp8
from sglang_farskip.plan.shapes import Shape

FORMATS = ("bf16", "fp8")
BF16 = 2  # bytes per element of every tensor fp8.is_quantized leaves alone, and of the KV cache
SCALE = 4  # bytes of one block's float32 weight_scale_inv
HEADROOM = 0.10  # of each GPU's memory, kept for activations, CUDA graphs and the framework

Tensor = tuple[str, tuple[int, ...]]


# ================================================================== the checkpoint's tensors
def _mlp(prefix: str, s: Shape, width: int) -> Iterator[Tensor]:
    yield f"{prefix}gate_proj.weight", (width, s.hidden)
    yield f"{prefix}up_proj.weight", (width, s.hidden)
    yield f"{prefix}down_proj.weight", (s.hidden, width)


def _attention(p: str, s: Shape) -> Iterator[Tensor]:
    qk = s.heads * (s.nope + s.rope)
    if s.q_lora:
        yield f"{p}q_a_proj.weight", (s.q_lora, s.hidden)
        yield f"{p}q_a_layernorm.weight", (s.q_lora,)
        yield f"{p}q_b_proj.weight", (qk, s.q_lora)
    else:
        yield f"{p}q_proj.weight", (qk, s.hidden)
    yield f"{p}kv_a_proj_with_mqa.weight", (s.kv_lora + s.rope, s.hidden)
    yield f"{p}kv_a_layernorm.weight", (s.kv_lora,)
    yield f"{p}kv_b_proj.weight", (s.heads * (s.nope + s.v_head), s.kv_lora)
    yield f"{p}o_proj.weight", (s.hidden, s.heads * s.v_head)
    if s.gated_attention:  # Instella's attention gate (checkpoint.py)
        yield f"{p}gate_proj.weight", (s.heads * s.v_head, s.hidden)


def _decoder_layer(s: Shape, k: int) -> Iterator[Tensor]:
    p = f"model.layers.{k}."
    yield f"{p}input_layernorm.weight", (s.hidden,)
    yield f"{p}post_attention_layernorm.weight", (s.hidden,)
    yield from _attention(f"{p}self_attn.", s)
    if not s.is_moe(k):
        yield from _mlp(f"{p}mlp.", s, s.dense_inter)
        return
    yield f"{p}mlp.gate.weight", (s.experts, s.hidden)  # the router
    yield f"{p}mlp.gate.e_score_correction_bias", (s.experts,)  # noaux_tc's bias: a few KB
    for e in range(s.experts):
        yield from _mlp(f"{p}mlp.experts.{e}.", s, s.moe_inter)
    if s.shared:
        yield from _mlp(f"{p}mlp.shared_experts.", s, s.moe_inter * s.shared)


def main_tensors(s: Shape) -> Iterator[Tensor]:
    yield "model.embed_tokens.weight", (s.vocab, s.hidden)
    for k in range(s.layers):
        yield from _decoder_layer(s, k)
    yield "model.norm.weight", (s.hidden,)
    if not s.tied_embeddings:
        yield "lm_head.weight", (s.vocab, s.hidden)


def mtp_tensors(s: Shape) -> Iterator[Tensor]:
    """The MTP layers as DeepSeek ships them, numbered after the main ones: a full decoder
    layer plus its own embedding copy, enorm/hnorm, eh_proj [H, 2H] and shared_head."""
    for k in range(s.layers, s.layers + s.mtp_layers):
        p = f"model.layers.{k}."
        yield f"{p}embed_tokens.weight", (s.vocab, s.hidden)
        yield f"{p}enorm.weight", (s.hidden,)
        yield f"{p}hnorm.weight", (s.hidden,)
        yield f"{p}eh_proj.weight", (s.hidden, 2 * s.hidden)
        yield f"{p}shared_head.norm.weight", (s.hidden,)
        yield f"{p}shared_head.head.weight", (s.vocab, s.hidden)
        yield from _decoder_layer(s, k)


def tensor_bytes(name: str, dims: tuple[int, ...], fmt: str) -> int:
    elements = math.prod(dims)
    if fmt == "fp8" and fp8.is_quantized(name):
        rows, cols = dims
        return elements + -(-rows // fp8.BLOCK) * -(-cols // fp8.BLOCK) * SCALE
    return elements * BF16


# ================================================================== totals and fit
@dataclasses.dataclass(frozen=True)
class Weights:
    fmt: str
    params: int  # the main model
    mtp_params: int
    nbytes: int  # main model + MTP, in `fmt`
    mtp_bytes: int

    def params_text(self) -> str:
        mtp = f" + MTP {self.mtp_params / 1e9:.1f}B" if self.mtp_params else ""
        return f"{(self.params + self.mtp_params) / 1e9:.1f}B parameters ({self.params / 1e9:.1f}B{mtp})"


def weights(s: Shape, fmt: str) -> Weights:
    def count(tensors):
        params = nbytes = 0
        for name, dims in tensors:
            params += math.prod(dims)
            nbytes += tensor_bytes(name, dims, fmt)
        return params, nbytes

    (params, main_bytes), (mtp_params, mtp_bytes) = count(main_tensors(s)), count(mtp_tensors(s))
    return Weights(fmt, params, mtp_params, main_bytes + mtp_bytes, mtp_bytes)


def kv_bytes_per_token(s: Shape) -> int:
    return s.layers * (s.kv_lora + s.rope) * BF16


@dataclasses.dataclass(frozen=True)
class Fit:
    """`weights` on `gpus` GPUs of `hbm` bytes each (the module docstring's arithmetic)."""

    weights: Weights
    gpu: str
    gpus: int
    hbm: int
    kv_token: int
    dp: int = 1

    @property
    def per_gpu(self) -> float:
        return self.weights.nbytes / self.gpus

    @property
    def usable(self) -> float:
        return (1 - HEADROOM) * self.hbm

    @property
    def kv_per_gpu(self) -> float:
        return self.usable - self.per_gpu

    @property
    def fits(self) -> bool:
        return self.kv_per_gpu > 0

    @property
    def tokens(self) -> int:
        return int(max(0.0, self.kv_per_gpu) // self.kv_token) * self.dp

    def verdict(self) -> str:
        w, group = self.weights, f"{self.gpus} x {self.gpu}"
        held = f"{size(self.gpus * self.hbm)} ({size(self.gpus * self.usable)} after {HEADROOM:.0%} headroom)"
        if not self.fits:
            return f"does not fit: {size(w.nbytes)} of {w.fmt} weights, {group} hold {held}"
        return (f"fits: {size(w.nbytes)} of {w.fmt} weights, {group} hold {held}; "
                f"{size(self.kv_per_gpu)} per GPU left for KV cache = {self.tokens:,} tokens")

    def report(self, fmt_note: str) -> list[str]:
        """The planner's memory lines for this layout."""
        w = self.weights
        return [f"memory, {w.fmt} weights ({fmt_note}), {self.gpus} x {self.gpu}: {self.verdict()}",
                f"  weights: {w.params_text()}, {size(self.per_gpu)} per GPU split evenly (experts by EP, attention and dense MLP by TP, "
                f"embeddings and lm_head vocab-parallel)",
                f"  per GPU: {size(self.hbm)} ({self.gpu}), {size(self.usable)} after "
                f"{HEADROOM:.0%} for activations, CUDA graphs and the framework; KV cache (MLA latent, bf16) "
                f"{self.kv_token:,} B per token" + (f", {self.dp} DP-attention ranks" if self.dp > 1 else "")]

    def as_json(self) -> dict:
        return {"format": self.weights.fmt, "gpu": self.gpu, "gpus": self.gpus, "hbm_bytes_per_gpu": self.hbm,
                "params": self.weights.params, "mtp_params": self.weights.mtp_params,
                "weight_bytes": self.weights.nbytes, "mtp_bytes": self.weights.mtp_bytes,
                "weight_bytes_per_gpu": self.per_gpu, "headroom": HEADROOM,
                "kv_bytes_per_gpu": max(0.0, self.kv_per_gpu), "kv_bytes_per_token": self.kv_token,
                "kv_tokens": self.tokens, "dp": self.dp, "fits": self.fits, "verdict": self.verdict()}


def size(nbytes: float) -> str:
    """Bytes as vendors and disks count them: TB = 1e12, GB = 1e9."""
    return f"{nbytes / 1e12:.3f} TB" if nbytes >= 1e12 else f"{nbytes / 1e9:.1f} GB"


def fit(s: Shape, fmt: str, gpu: str, hbm: int, gpus: int, dp: int = 1) -> Fit:
    return Fit(weights(s, fmt), gpu, gpus, hbm, kv_bytes_per_token(s), dp)
