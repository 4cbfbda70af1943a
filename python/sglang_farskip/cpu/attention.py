"""SGLang's MLA prefill paths (MHA over decompressed K/V) on CPU, and which path ran.

DeepSeek-style attention has two forms in SGLang 0.5.23, chosen per batch by a handler of the
attention backend (`sglang/srt/models/deepseek_common/attention_backend_handler.py`):
    MHA             prefill, no cached prefix: K/V decompressed from the new tokens' latent,
                    ordinary causal attention, head size qk_nope+qk_rope (q, k) and v_head (v)
    MHA_CHUNKED_KV  prefill on a cached prefix: the new tokens causally (returning the
                    log-sum-exp), then each chunk of the prefix's latent, decompressed, attended
                    by every new token, merged by log-sum-exp (`merge_state`)
    MLA             absorbed: queries against the compressed cache itself (decode, and on CPU
                    by default every batch)
GPU backends run all three. torch_native implements only the absorbed form, so by default the
CPU handler picks MLA for every batch (also `--farskip-cpu-attention absorbed`). With
`--farskip-cpu-attention mha` it follows upstream's GPU rules (triton's for a batch without a
prefix, flashinfer/fa3's for a prefix of at least SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD tokens,
absorbed MLA otherwise and for decode), and `TorchNativeMLAPrefillBackend` computes the MHA
calls in plain PyTorch (an explicit float32 softmax, per request).

Upstream's own code runs in between: the latent is still written to the compressed cache by
`forward_normal_prepare`, decode still reads it absorbed. Two GPU kernels on that path get CPU
twins (rows of sglang_farskip/boundary/table.csv, installed on CPU runs only; for a non-CPU tensor
they still call upstream's kernel): `merge_state` through an AROUND hook, and the chunk-index
builder, a Triton kernel, by replacing the module attribute upstream looks up at call time.
The torch_native MLA handler (`handle_attention_torch_native`) and the chunked-prefix backend
list entry are registry rows of the same table.

Evidence, when `--farskip-cpu-attention` is given: every rank counts the method chosen for
layer 0 (once per forward) and, for each chunked-prefix forward, its number of prefix chunks,
and publishes both in its /farskip/info report (`attention_methods`, `prefix_chunks`). Without
the flag nothing is counted: that would be a file write per forward.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging

import torch

from sglang_farskip import options

logger = logging.getLogger("sglang_farskip.cpu")


# ----------------------------------------------------------------- which method, and counting it
def cpu_attention() -> str:
    """"absorbed", "mha", or "" when --farskip-cpu-attention was not given (absorbed, uncounted)."""
    return options.current().cpu_attention or ""


_evidence = {"attention_methods": collections.Counter(), "prefix_chunks": collections.Counter()}


def _record(kind: str, key: str) -> None:
    """Count one forward (called at layer 0) and publish the counts in this rank's report."""
    if not cpu_attention():
        return
    from sglang.srt.runtime_context import get_parallel

    from sglang_farskip.models.status import update_rank_status

    _evidence[kind][key] += 1
    update_rank_status(get_parallel().tp_rank, **{k: dict(v) for k, v in _evidence.items()})


def handle_attention_torch_native(attn, forward_batch):
    """The attention handler SGLang calls for torch_native, per layer and batch."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as abh
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    method = abh._dispatch_mla_subtype(attn, forward_batch)  # absorbed MLA
    if cpu_attention() == "mha" and forward_batch.forward_mode.is_extend_without_speculative():
        prefix = sum(forward_batch.extend_prefix_lens_cpu or [0])
        if prefix == 0:
            method = AttnForwardMethod.MHA
        elif prefix >= attn.chunked_prefix_cache_threshold and not attn.disable_chunked_prefix_cache:
            method = AttnForwardMethod.MHA_CHUNKED_KV
        if method in (AttnForwardMethod.MHA, AttnForwardMethod.MHA_CHUNKED_KV):
            attn.attn_mha.farskip_mha = True  # tells the backend this RadixAttention takes K/V, not latents
    if attn.layer_id == 0:
        _record("attention_methods", method.name)
    return method


# ----------------------------------------------------------------- the backend
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """One request: q [n, H, dqk], k [m, H, dqk], v [m, H, dv] -> (out [n, H, dv], lse [n, H]).
    causal: query i sees keys 0 .. m-n+i (the new tokens are the last n of the m)."""
    n, m = q.shape[0], k.shape[0]
    if m == 0:  # nothing to attend (a request without prefix in this chunk): weight 0 in the merge
        return q.new_zeros(n, q.shape[1], v.shape[-1]), q.new_full((n, q.shape[1]), float("-inf"), dtype=torch.float32)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale  # [H, n, m]
    if causal:
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)  # [H, n]
    probs = (scores - lse[..., None]).exp()
    out = torch.einsum("hnm,mhd->nhd", probs, v.float())  # [n, H, dv]
    return out.to(v.dtype), lse.transpose(0, 1).contiguous()  # lse [H, n] -> [n, H]


@contextlib.contextmanager
def _padding_fits(forward_batch):
    """DP attention pads every rank's batch to the MLP-sync size with requests of sequence
    length 1 (`get_cpu_graph_seq_len_fill_value`). A speculative batch gives each request several
    new tokens (a draft extend: the accepted tokens), so a padded one claims more new tokens than
    its length, and upstream's extend cannot place its queries (seen: a RuntimeError on
    concurrent EAGLE requests). Only padding can be that short: for this call its length covers
    its tokens (it reads slots of the padding request, and its rows are dropped)."""
    seq_lens = forward_batch.seq_lens
    need = forward_batch.extend_prefix_lens + forward_batch.extend_seq_lens
    short = seq_lens < need
    if not bool(short.any()):
        yield
        return
    forward_batch.seq_lens = torch.maximum(seq_lens, need.to(seq_lens.dtype))
    try:
        yield
    finally:
        forward_batch.seq_lens = seq_lens


@functools.cache  # one class: cpu/spec.py subclasses it into the backend SGLang builds
def mla_prefill_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeMLAPrefillBackend(TorchNativeAttnBackend):
        """torch_native, plus the MHA calls of SGLang's MLA prefill methods (RadixAttention
        `attn_mha`, marked by the handler); every other call is upstream's."""

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if not getattr(layer, "farskip_mha", False):
                with _padding_fits(forward_batch):
                    return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            H = layer.tp_q_head_num
            q = q.view(-1, H, layer.qk_head_dim)  # [T, H*dqk] -> [T, H, dqk]
            new_lens = forward_batch.extend_seq_lens_cpu
            if forward_batch.attn_attend_prefix_cache:  # one chunk of the cached prefix
                chunk = forward_batch.prefix_chunk_idx
                kv_lens = forward_batch.prefix_chunk_seq_lens_cpu[chunk].tolist()
                causal = False  # every new token comes after the whole prefix
                if layer.layer_id == 0 and chunk == forward_batch.num_prefix_chunks - 1:
                    _record("prefix_chunks", str(forward_batch.num_prefix_chunks))
            else:  # the new tokens themselves
                kv_lens, causal = new_lens, True
            out = q.new_empty(q.shape[0], H, layer.v_head_dim)
            lse = q.new_empty(q.shape[0], H, dtype=torch.float32)
            q0 = k0 = 0
            for n, m in zip(new_lens, kv_lens):
                out[q0:q0 + n], lse[q0:q0 + n] = attend(q[q0:q0 + n], k[k0:k0 + m], v[k0:k0 + m],
                                                        layer.scaling, causal)
                q0, k0 = q0 + n, k0 + m
            return (out, lse) if forward_batch.mha_return_lse else out

        def get_cpu_graph_seq_len_fill_value(self):
            # DP attention pads every DP rank's batch to the MLP-sync size (forward_batch_info,
            # `prepare_mlp_sync_batch`); a padded request gets this sequence length. 1, as
            # upstream's CPU backend uses: the padded rows read one real slot and are dropped.
            return 1

    return TorchNativeMLAPrefillBackend


# ----------------------------------------------------------------- CPU twins of two GPU kernels
def merge_state_cpu(prefix_output, prefix_lse, suffix_output, suffix_lse, output=None, output_lse=None):
    """Two attention results over disjoint key sets -> the result over their union:
    lse = log(e^lse1 + e^lse2), out = (e^lse1 out1 + e^lse2 out2) / e^lse. Shapes [T, H, d] and
    [T, H]; writes into output/output_lse when given (upstream's contract)."""
    lse = torch.logaddexp(prefix_lse, suffix_lse)
    w1 = (prefix_lse - lse).exp().nan_to_num(0.0)[..., None]  # -inf - -inf: both empty, weight 0
    w2 = (suffix_lse - lse).exp().nan_to_num(0.0)[..., None]
    merged = (w1 * prefix_output.float() + w2 * suffix_output.float()).to(prefix_output.dtype)
    if output is None:
        return merged, lse
    output.copy_(merged)
    if output_lse is not None:
        output_lse.copy_(lse)
    return output, output_lse


class ChunkIndicesOnCpu:
    """`create_chunked_prefix_cache_kv_indices[grid](...)`, a Triton kernel, with a PyTorch
    twin for CPU tensors: the cache slots of prefix positions [start, start+len) of each request."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(req_to_token, req_pool_indices, starts, seq_lens, cu_seq_lens, out, stride):
            if out.device.type != "cpu":
                return self.kernel[grid](req_to_token, req_pool_indices, starts, seq_lens, cu_seq_lens, out, stride)
            for b in range(req_pool_indices.shape[0]):
                s, n, o = int(starts[b]), int(seq_lens[b]), int(cu_seq_lens[b])
                out[o:o + n] = req_to_token[req_pool_indices[b], s:s + n]
        return launch


def merge_state_any_device(original, prefix_output, *args, **kwargs):
    """AROUND merge_state (forward_mha imports it at call time): the PyTorch twin on CPU."""
    if prefix_output.device.type == "cpu":
        return merge_state_cpu(prefix_output, *args, **kwargs)
    return original(prefix_output, *args, **kwargs)
