"""The CPU stand-in for sgl_kernel and the two upstream CPU fixes, checked directly."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from sglang_farskip.cpu.environment import cpu_environment


def test_stand_in_imports_but_every_call_raises():
    import sgl_kernel
    from sgl_kernel.scalar_type import ScalarType  # imported by SGLang at module level

    assert sgl_kernel.IS_FARSKIP_CPU_STAND_IN
    for kernel in (sgl_kernel.copy_all_layer_kv_cache_cpu, ScalarType, sgl_kernel.ops.anything):
        with pytest.raises(RuntimeError, match="no sgl_kernel build"):
            kernel(torch.zeros(1))


def test_stand_in_is_after_site_packages():
    """A real sgl_kernel (GPU images) must win: the stand-in's directory comes last."""
    import sgl_kernel

    shim_dir = os.path.dirname(os.path.dirname(sgl_kernel.__file__))
    site = [p for p in sys.path if p.endswith("site-packages")]
    assert sys.path.index(shim_dir) > sys.path.index(site[0])


def test_cpu_environment_splits_cores_between_ranks():
    env = cpu_environment(ranks_on_this_node=2, cores=2)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and env["OMP_NUM_THREADS"] == "1"
    env = cpu_environment(ranks_on_this_node=1, cores=8)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-7" and "OMP_NUM_THREADS" not in env
    assert cpu_environment(4, 2)["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|0|1"


def test_fixes_in_a_fresh_sglang_process():
    """Both fixes, applied the way SGLang applies plugins, in a process of their own (SGLang
    must see SGLANG_USE_CPU_ENGINE at import time)."""
    code = r'''
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
from sglang.srt.layers.moe import fused_moe_native
from sglang.srt.layers.moe.topk import StandardTopKOutput
import types

attn = types.SimpleNamespace(layer_id=0)  # outside a server: no --farskip-cpu-attention, absorbed
handler = AttentionBackendRegistry.get_handler("torch_native")
assert handler(attn, None) == AttnForwardMethod.MLA, handler(attn, None)

# EP: the expert owned by another rank arrives as id -1 and must contribute nothing.
torch.manual_seed(0)
E, H, I = 2, 8, 4
layer = types.SimpleNamespace(num_experts=E, w13_weight=torch.randn(E, 2 * I, H),
                              w2_weight=torch.randn(E, H, I))
cfg = types.SimpleNamespace(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None)
x = torch.randn(3, H)
ids = torch.tensor([[1, -1], [-1, 0], [0, 1]])
w = torch.rand(3, 2)
out = fused_moe_native.moe_forward_native(layer, x, StandardTopKOutput(w, ids, None), cfg)
def expert(e, v):
    g, u = (v @ layer.w13_weight[e].T).chunk(2, -1)
    return (torch.nn.functional.silu(g) * u) @ layer.w2_weight[e].T
want = torch.stack([
    w[0, 0] * expert(1, x[0]), w[1, 1] * expert(0, x[1]),
    w[2, 0] * expert(0, x[2]) + w[2, 1] * expert(1, x[2])])
torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
print("OK")
'''
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "farskip_cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
