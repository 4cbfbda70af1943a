"""SGLang 0.5.23's speculative decoding (NGRAM, EAGLE with DeepSeek's NextN layer) on CPU.

SGLang's speculative workers have CPU branches, but three things they reach are missing on a CPU
without AMX, where attention runs on `torch_native` (the kernel-package ops they call have
torch-native twins in the sgl_kernel stand-in, python/cpu_shim/sgl_kernel/speculative.py):

1. Target verify. The verify forward (ForwardMode.TARGET_VERIFY) carries no extend_* fields:
   every request extends by the draft's `draft_token_num` tokens past `seq_lens`, and the draft
   tokens see the verified prefix plus their tree ancestors (SGLang's QLEN_ONLY mask on CPU,
   `spec_info.custom_mask`, [bs, n, n]) or, for a chain (`tree_topk == 1`), the earlier draft
   tokens. torch_native reads extend_prefix_lens there and fails. Upstream's CPU counterpart,
   intel_amx_backend.py (~70-123), derives exactly that; so does `forward_extend` below.
2. EAGLE's draft decode. `DraftBackendFactory` (speculative/draft_utils.py) knows a multi-step
   draft-decode backend for intel_amx but none for torch_native, and says "EAGLE is not
   supported". `TorchNativeMultiStepDraftBackend` is one (any top-k, page size 1): step s of
   candidate k of request b attends to b's verified prefix and to k's own draft slots
   0..s, laid out as `assign_draft_cache_locs_contiguous` reserves them (seq_len + k*num_steps
   + s), which is what upstream's `generate_draft_decode_kv_indices` (cache_locs.py) gives the
   GPU backends. The draft's extend gets a plain instance of the torch_native backend. A hook
   on the factory adds both for `torch_native`.
3. `DeepseekV2ForCausalLM.set_embed_and_head` (the NextN draft shares the target's embedding
   and head) ends in `torch.cuda.synchronize()`, which raises without a CUDA driver; on CPU the
   hook below does the same swap without it.

The hooks and the backend are rows of sglang_farskip/boundary/table.csv, installed on CPU runs
(every SGLang process, plugin load).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("sglang_farskip.cpu")


# ----------------------------------------------------------------- attention over gathered slots
def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  visible: torch.Tensor | None) -> torch.Tensor:
    """One request's queries against its gathered keys: q [n, Hq, dqk], k [m, Hk, dqk],
    v [m, Hk, dv], visible [n, m] bool or None (all visible) -> [n, Hq, dv]. Hk may divide Hq
    (absorbed MLA has one latent "head"). Softmax in float32, as cpu_mha.attend."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale  # [H, n, m]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v.float()).to(q.dtype)


def verify_visibility(seq_len: int, n: int, tree: torch.Tensor | None) -> torch.Tensor:
    """[n, seq_len + n]: the verified prefix for every draft token, then among the draft
    tokens the tree's rows (tree [n, n], row i = what token i sees, itself included) or, with
    no tree, the causal chain."""
    drafts = tree if tree is not None else torch.ones(n, n, dtype=torch.bool).tril()
    return torch.cat([torch.ones(n, seq_len, dtype=torch.bool), drafts.to(torch.bool).cpu()], dim=1)


def _save_kv(backend, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)


def _check_plain_self_attention(layer) -> None:
    # What the verify and draft-decode paths below implement; anything else is another model.
    if layer.is_cross_attention or (layer.sliding_window_size or -1) > -1 or (layer.logit_cap or 0) > 0:
        raise NotImplementedError(
            f"sglang_farskip's CPU speculative attention covers plain causal self-attention only "
            f"(layer {layer.layer_id}: cross={layer.is_cross_attention}, "
            f"window={layer.sliding_window_size}, logit_cap={layer.logit_cap})")


# ----------------------------------------------------------------- the backend
@functools.cache
def backend_class():
    """The torch_native backend SGLang builds on CPU: cpu_mha's (MLA dispatch, MHA prefill)
    plus target verify and the draft-decode step of the multi-step backend."""
    from sglang_farskip.cpu.attention import mla_prefill_backend_class

    base = mla_prefill_backend_class()

    class TorchNativeSpeculativeBackend(base):
        # Set by TorchNativeMultiStepDraftBackend on its per-step instances: (slot rows of
        # every draft row, and how many of each row's slots this step attends to).
        draft_decode_rows: tuple[list[torch.Tensor], list[int]] | None = None

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            _check_plain_self_attention(layer)
            _save_kv(self, layer, forward_batch, k, v, save_kv_cache)
            spec = forward_batch.spec_info
            n = spec.draft_token_num
            # DP attention pads the batch to the MLP-sync size with requests that have no draft
            # tree (no mask, a fill length): only the real ones are attended, the padding's rows
            # stay zero and are dropped. SGLang counts the real tokens before padding.
            real = forward_batch.global_num_token_non_padded_cpu
            bs = forward_batch.batch_size if real is None else real // n
            # A chain needs no mask (causal is exact); NGRAM (-1) and EAGLE top-k > 1 trees do.
            tree = None
            if spec.tree_topk != 1 and spec.custom_mask is not None and spec.custom_mask.numel() > 0:
                tree = spec.custom_mask.reshape(-1)[: bs * n * n].view(bs, n, n)
            H = layer.tp_q_head_num
            q = q.reshape(-1, H, layer.qk_head_dim)
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            table = self.req_to_token_pool.req_to_token
            out = q.new_zeros(q.shape[0], H, layer.v_head_dim)
            seq_lens = forward_batch.seq_lens.tolist()
            rows = forward_batch.req_pool_indices.tolist()
            for b in range(bs):
                slots = table[rows[b], : seq_lens[b] + n].to(torch.long)
                visible = verify_visibility(seq_lens[b], n, None if tree is None else tree[b])
                out[b * n:(b + 1) * n] = attend_masked(
                    q[b * n:(b + 1) * n], k_cache[slots], v_cache[slots], layer.scaling,
                    visible.to(q.device))
            return out.view(-1, H * layer.v_head_dim)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if self.draft_decode_rows is None:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            _check_plain_self_attention(layer)
            _save_kv(self, layer, forward_batch, k, v, save_kv_cache)
            slot_rows, lengths = self.draft_decode_rows
            H = layer.tp_q_head_num
            q = q.reshape(-1, H, layer.qk_head_dim)
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            out = q.new_empty(q.shape[0], H, layer.v_head_dim)
            for r, (slots, m) in enumerate(zip(slot_rows, lengths)):
                out[r:r + 1] = attend_masked(q[r:r + 1], k_cache[slots[:m]], v_cache[slots[:m]],
                                             layer.scaling, None)
            return out.view(-1, H * layer.v_head_dim)

    return TorchNativeSpeculativeBackend


def draft_slot_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, topk: int, num_steps: int) -> list[torch.Tensor]:
    """The KV slots of draft row b*topk + k: request b's verified prefix, then candidate k's
    num_steps draft slots (seq_len + k*num_steps + s). Same rows as upstream's
    `build_draft_decode_metadata_cpu` / `generate_draft_decode_kv_indices` at page size 1."""
    rows = []
    for req, seq in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        line = req_to_token[req].to(torch.long)
        for cand in range(topk):
            start = seq + cand * num_steps
            rows.append(torch.cat([line[:seq], line[start:start + num_steps]]))
    return rows


class TorchNativeMultiStepDraftBackend:
    """EAGLE's draft decode on torch_native: one backend per draft step but the last (which
    only samples), each told which slots its rows attend to. The interface SGLang's EAGLE
    worker uses: `attn_backends`, `init_forward_metadata(forward_batch)`."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if model_runner.token_to_kv_pool_allocator.page_size != 1:
            raise NotImplementedError("EAGLE draft decode on torch_native needs --page-size 1")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        cls = backend_class()
        self.attn_backends = [cls(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        rows = draft_slot_rows(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                               forward_batch.seq_lens, self.topk, self.speculative_num_steps)
        seq_lens = forward_batch.seq_lens.repeat_interleave(self.topk).tolist()
        for step, backend in enumerate(self.attn_backends):
            backend.init_forward_metadata(forward_batch)
            # Step s has written its own token: prefix + s + 1 slots.
            backend.draft_decode_rows = (rows, [seq + step + 1 for seq in seq_lens])


# ----------------------------------------------------------------- hooks
def draft_backends_with_torch_native(original, factory, backend_name, backend_map, error_template,
                                      stamps_children=False):
    """AROUND DraftBackendFactory._create_backend: its backend tables are built per call, so
    torch_native joins them here. `stamps_children` marks the multi-step decode table."""
    if "torch_native" not in backend_map:
        if stamps_children:
            def create():
                return "torch_native", TorchNativeMultiStepDraftBackend(
                    factory.draft_model_runner, factory.topk, factory.speculative_num_steps)
        else:
            def create():
                return "torch_native", backend_class()(factory.draft_model_runner)
        backend_map = {**backend_map, "torch_native": create}
    return original(factory, backend_name, backend_map, error_template, stamps_children)


def set_embed_and_head_on_cpu(original, model, embed, head):
    """AROUND DeepseekV2ForCausalLM.set_embed_and_head: upstream's swap, minus the CUDA
    cache release and synchronize that have nothing to do on CPU and raise without a driver."""
    if embed.device.type != "cpu":
        return original(model, embed, head)
    del model.model.embed_tokens.weight
    del model.lm_head.weight
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head


def torch_native_backend(model_runner):
    """The factory SGLang's attention registry calls for "torch_native" on CPU (a registry row of
    sglang_farskip/boundary/table.csv): one backend class for every path above."""
    return backend_class()(model_runner)
