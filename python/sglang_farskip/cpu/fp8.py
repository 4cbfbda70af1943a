"""DeepSeek's block-FP8 checkpoints on a CPU without AMX: torch-native linear and MoE methods.

SGLang 0.5.23 serves block FP8 on CPU only through its AMX kernels (`Fp8LinearMethod` and
`Fp8MoEMethod` assert `cpu_has_amx_support()`, layers/quantization/fp8.py ~827, ~2185), which
need a CPU build of sgl-kernel that PyPI does not ship. Here the two methods are subclassed: the
FP8 weights and their 128 x 128 `weight_scale_inv` blocks are loaded by upstream's own code and
kept in memory as FP8 (so the footprint is the checkpoint's), and each forward dequantizes the
weights it needs (sglang_farskip.formats.fp8.dequantize) and runs a plain matmul in the activation dtype:

    linear:  y = x @ dequant(W, S)^T  (+ bias)            x [T, K] bf16, W [N, K] e4m3, S [N/128, K/128]
    MoE:     upstream's torch-native expert loop (moe_forward_native, with cpu/environment.py's
             EP>1 fix) over experts dequantized one at a time, only those that got tokens

So a layer computes what the same checkpoint dequantized to bf16 computes, except kv_b_proj in
absorbed MLA, which SGLang's loader itself requantizes per tensor on CPU (formats/fp8.py says more).
Activations are not quantized (GPU kernels quantize them per 128 channels): the CPU path is
for checking FarSkip's wiring and serving small models, not for matching GPU FP8 bit for bit.

Installed as an AFTER hook on `Fp8Config.get_quant_method` (a row of
sglang_farskip/boundary/table.csv: plugin load, CPU runs only); a CPU where SGLang's AMX path is
available keeps upstream's (`without_amx`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from sglang.srt.layers.quantization import fp8 as upstream

from sglang_farskip.formats import fp8


def _freeze(layer: torch.nn.Module, *names: str) -> None:
    """Keep the loaded FP8 tensors as they are (upstream's CPU branch would repack them for AMX)."""
    for name in names:
        setattr(layer, name, Parameter(getattr(layer, name).data, requires_grad=False))


# The subclasses keep upstream's class names: SGLang picks its weight loader by the quant method's
# class *name* (linear.py's WEIGHT_LOADER_V2_SUPPORTED lists "Fp8LinearMethod"); another name
# gets the v1 loader, which narrows block scales as if they were weights.
class Fp8LinearMethod(upstream.Fp8LinearMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _freeze(layer, "weight", "weight_scale_inv")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        return F.linear(x, fp8.dequantize(layer.weight, layer.weight_scale_inv, x.dtype), bias)


class _DequantizedExperts:
    """What upstream's `moe_forward_native` reads of a MoE layer, with each expert's weights
    dequantized when the loop reaches it: w13 [2I, H] (gate rows, then up), w2 [H, I]."""

    class _Weights:
        def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
            self.q, self.scale_inv, self.dtype = q, scale_inv, dtype

        def __getitem__(self, expert: int) -> torch.Tensor:
            return fp8.dequantize(self.q[expert], self.scale_inv[expert], self.dtype)

    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype):
        self.num_experts = layer.num_experts
        self.w13_weight = self._Weights(layer.w13_weight, layer.w13_weight_scale_inv, dtype)
        self.w2_weight = self._Weights(layer.w2_weight, layer.w2_weight_scale_inv, dtype)


class Fp8MoEMethod(upstream.Fp8MoEMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _freeze(layer, "w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        self.moe_runner_config = moe_runner_config  # no kernel runner: apply() runs the loop

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe import fused_moe_native
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states  # [T, H]
        # The module attribute, looked up now: cpu/environment.py wraps it for EP > 1.
        out = fused_moe_native.moe_forward_native(
            _DequantizedExperts(layer, x.dtype), x, dispatch_output.topk_output, self.moe_runner_config
        )
        return StandardCombineInput(hidden_states=out)


def torch_native_methods(method, config, layer, *args, **kwargs):
    """AFTER `Fp8Config.get_quant_method`: upstream's block-FP8 methods -> ours (exact types, so
    the FP4-expert and NPU variants upstream derives from them are never swapped)."""
    if not getattr(method, "block_quant", False):
        return method  # per-tensor FP8: upstream's (launcher refuses it before, see fp8.weight_format)
    if type(method) is upstream.Fp8LinearMethod:
        return Fp8LinearMethod(config)
    if type(method) is upstream.Fp8MoEMethod:
        return Fp8MoEMethod(config)
    return method


def without_amx() -> bool:
    """Whether the hook is installed: where SGLang's AMX path is available it serves FP8 itself."""
    from sglang.srt.utils.common import cpu_has_amx_support

    return not cpu_has_amx_support()
