"""Torch-native twins of the kernel-package ops SGLang 0.5.23's speculative decoding calls on CPU.

SGLang's NGRAM and EAGLE workers have CPU branches (`is_cpu()`) that call `*_cpu` ops of
sgl_kernel's CPU build, which PyPI does not ship. These are plain-PyTorch versions with the same
call signatures and in-place contracts. What each must compute is defined by its GPU twin in the
installed SGLang (the Triton kernels in `sglang/kernels/ops/speculative/` and the CUDA kernels
in `sglang/kernels/jit/include/sgl_kernel/speculative/`); tests/test_spec_cpu.py checks every one
against that definition. Call sites (installed SGLang, approximate lines):

    assign_req_to_token_pool_cpu            srt/mem_cache/allocation.py ~746
    assign_extend_cache_locs_cpu            kernels/ops/speculative/cache_locs.py ~740, ~763
    assign_draft_cache_locs_contiguous_cpu  kernels/ops/speculative/cache_locs.py ~99
    reconstruct_indices_from_tree_mask      kernels/ops/speculative/reconstruct_tree.py ~185
    build_tree_kernel_efficient_cpu         kernels/ops/speculative/spec_tree.py ~412
    verify_tree_greedy_cpu                  kernels/ops/speculative/spec_tree.py ~510
    fill_bonus_tokens_cpu                   kernels/ops/speculative/eagle.py ~40
    fill_accept_out_cache_loc_cpu           kernels/ops/speculative/eagle.py ~80

The tree ops walk linked lists whose steps depend on each other; they run as Python loops over
`.tolist()` copies (a batch is a few requests times a few draft tokens) and write back once.
Every other name in this module, like the rest of the stand-in, raises when called.

Only page size 1 is covered (the CPU path's only page size), and of the tree-mask modes
FULL_MASK and QLEN_ONLY (SGLang uses QLEN_ONLY on CPU; nothing there bit-packs).
"""

from __future__ import annotations

import torch

_QLEN_ONLY, _FULL_MASK = 1, 0


def _rows(req_to_token: torch.Tensor, pool_len: int) -> torch.Tensor:
    # The kernels address req_to_token as rows of pool_len entries; callers pass its width.
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token {tuple(req_to_token.shape)} is not [rows, {pool_len}]")
    return req_to_token


def _spans(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, position in the packed slot vector) per request."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    spans, packed = [], 0
    for s, e in zip(starts, ends):
        spans.append((s, e, packed))
        packed += e - s
    return spans


def _packed_spans(start_offset, end_offset, out_cache_loc):
    """`_spans`, refusing an out_cache_loc too short for the packed total."""
    spans = _spans(start_offset, end_offset)
    needed = spans[-1][2] + spans[-1][1] - spans[-1][0] if spans else 0
    if needed > out_cache_loc.numel():
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots, the offsets need {needed}")
    return spans


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """Scatter: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i]-start[i]
    entries of out_cache_loc (packed request after request)."""
    table = _rows(req_to_token, pool_len)
    spans = _packed_spans(start_offset, end_offset, out_cache_loc)
    for row, (s, e, packed) in zip(req_pool_indices.tolist(), spans):
        table[row, s:e] = out_cache_loc[packed:packed + e - s].to(table.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """Gather, the inverse of the above: the slots at req_to_token[req_pool_indices[i],
    start[i]:end[i]], packed request after request into out_cache_loc. Entries past the packed
    total are left alone (callers may size out_cache_loc for the largest case)."""
    table = _rows(req_to_token, pool_len)
    spans = _packed_spans(start_offset, end_offset, out_cache_loc)
    for row, (s, e, packed) in zip(req_pool_indices.tolist(), spans):
        out_cache_loc[packed:packed + e - s] = table[row, s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                           pool_len, topk, num_steps):
    """The topk*num_steps draft slots reserved after each request's sequence: out_cache_loc
    [i*topk*num_steps : (i+1)*topk*num_steps] = req_to_token[req_pool_indices[i],
    seq_lens[i] : seq_lens[i] + topk*num_steps]. (Positions are not written: SGLang asserts
    the CPU caller passes none.)"""
    table = _rows(req_to_token, pool_len)
    width = topk * num_steps
    if out_cache_loc.numel() != req_pool_indices.numel() * width:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots, expected "
                         f"{req_pool_indices.numel()} x {width}")
    rows = req_pool_indices.to(torch.long)
    cols = seq_lens.to(torch.long)[:, None] + torch.arange(width, device=table.device)
    out_cache_loc.view(-1, width)[:] = table[rows[:, None], cols].to(out_cache_loc.dtype)


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                       retrive_next_token, retrive_next_sibling, batch_size,
                                       draft_token_num):
    """NGRAM's draft tree, given as a [bs, n, n] mask (row i marks the nodes i sees: its
    ancestors, itself), turned into what verification walks:
      positions[b*n+i]          verified_seq_len[b] + number of strict ancestors of i
      retrive_index[b, i]       b*n + i
      retrive_next_token[b, i]  first child of i: the smallest k > i that has i as an ancestor
      retrive_next_sibling[b,i] the smallest k > i with the same parent as i (the parent being
                                the nearest strict ancestor); -1 for a root and where none.
    Written in place."""
    n = draft_token_num
    if batch_size == 0:
        return
    mask = tree_mask.reshape(-1)[: batch_size * n * n].view(batch_size, n, n).to(torch.bool)
    below = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-1)  # j < i
    ancestors = mask & below  # [b, i, j]: j a strict ancestor of i
    col = torch.arange(n, device=mask.device)
    depth = ancestors.sum(-1)  # [b, i]
    # Nearest ancestor = the largest ancestor index (ancestors precede their descendants).
    parent = torch.where(ancestors, col, -1).amax(-1)  # [b, i]
    # First child of i: smallest k with ancestors[k, i]; n stands for "none" in the min.
    child = torch.where(ancestors, col[:, None], n).amin(-2)  # [b, i] (reduced over rows k)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & below[None]  # [b, k, i], k > i
    sibling = torch.where(same_parent, col[:, None], n).amin(-2)  # [b, i]
    sibling = torch.where((parent >= 0) & (sibling < n), sibling, -1)
    seq = verified_seq_len.to(torch.long).view(-1, 1)
    positions.view(batch_size, n)[:] = (depth + seq).to(positions.dtype)
    retrive_index.view(batch_size, n)[:] = (torch.arange(batch_size, device=mask.device)[:, None] * n
                                            + col).to(retrive_index.dtype)
    retrive_next_token.view(batch_size, n)[:] = torch.where(child < n, child, -1).to(retrive_next_token.dtype)
    retrive_next_sibling.view(batch_size, n)[:] = sibling.to(retrive_next_sibling.dtype)


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk,
                                    depth, draft_token_num, tree_mask_mode):
    """EAGLE's draft tree from the draft's top-k bookkeeping (SGLang's `organize_draft_results`):
    node 0 is the verified token; node i > 0 is the draft token selected_index[b, i-1] (an index
    into the flattened per-step candidates), whose parent candidate is
    parent_list[b, selected_index[b, i-1] // topk] (0: the root). Writes
      retrive_index / retrive_next_token / retrive_next_sibling  (first-child / next-sibling
                     lists; children are linked so that the smallest index comes first; both
                     next_* tensors arrive filled with -1),
      positions      verified_seq_len + depth,
      tree_mask      row i of each request's n x n block (QLEN_ONLY) or of its
                     [n, seq_len + n] block (FULL_MASK, prefix columns left as they are, the
                     caller fills them): node i sees the root, itself and its ancestors.
    A node whose parent is not among the selected nodes (SGLang's kernel prints "invalid eagle
    tree") is left unlinked, as upstream does."""
    if tree_mask_mode not in (_FULL_MASK, _QLEN_ONLY):
        raise NotImplementedError(f"tree mask mode {tree_mask_mode} (bit-packed) has no CPU twin")
    n = draft_token_num
    bs = verified_seq_len.numel()
    parents = parent_list.tolist()
    selected = selected_index.tolist()
    seq_lens = verified_seq_len.tolist()
    next_token = retrive_next_token.view(bs, n).tolist()
    next_sibling = retrive_next_sibling.view(bs, n).tolist()
    pos_out = [[0] * n for _ in range(bs)]
    flat_mask = tree_mask.view(-1)
    mask_base = 0
    for b in range(bs):
        sel, seq = selected[b], seq_lens[b]
        # node of a selected candidate id: node k+1 holds selected[k]
        node_of = {}
        for k in range(n - 1):
            node_of.setdefault(sel[k], k + 1)

        def parent_node(i: int) -> int | None:
            """The tree node of node i's parent (0 = root); None if it was not selected."""
            parent_candidate = sel[i - 1] // topk
            if parent_candidate == 0:
                return 0
            return node_of.get(parents[b][parent_candidate])

        # Linking from the largest index down and pushing to the front leaves each
        # child list in increasing order, as upstream's single-thread loop does.
        for i in range(n - 1, 0, -1):
            p = parent_node(i)
            if p is None:
                continue
            if next_token[b][p] != -1:
                next_sibling[b][i] = next_token[b][p]
            next_token[b][p] = i
        rows = torch.zeros(n, n, dtype=torch.bool)
        rows[:, 0] = True
        pos_out[b][0] = seq
        for i in range(1, n):
            node, steps = i, 0
            # At most `depth` hops to the root; a malformed (cyclic) tree stops there.
            while node not in (None, 0) and steps < depth:
                rows[i, node] = True
                steps += 1
                node = parent_node(node)
            pos_out[b][i] = seq + steps
        if tree_mask_mode == _QLEN_ONLY:
            flat_mask[b * n * n:(b + 1) * n * n] = rows.view(-1).to(flat_mask.device)
        else:
            block = flat_mask[mask_base:mask_base + n * (seq + n)].view(n, seq + n)
            block[:, seq:] = rows.to(flat_mask.device)
            mask_base += n * (seq + n)
    device = retrive_index.device
    retrive_index.view(bs, n)[:] = torch.arange(bs * n, device=device).view(bs, n).to(retrive_index.dtype)
    retrive_next_token.view(bs, n)[:] = torch.tensor(next_token, dtype=retrive_next_token.dtype, device=device)
    retrive_next_sibling.view(bs, n)[:] = torch.tensor(next_sibling, dtype=retrive_next_sibling.dtype,
                                                       device=device)
    positions.view(bs, n)[:] = torch.tensor(pos_out, dtype=positions.dtype, device=device)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy verification: from the root, repeatedly move to the first child (then its
    siblings, in list order) whose draft token equals the target's argmax at the current node;
    stop when none matches or accept_index is full. Per request b writes
      accept_index[b, 0..m]      flat indices (b*n + node) of the root and the m accepted nodes,
      accept_token_num[b]        m (the bonus token not counted),
      predicts[flat]             the target's token at each accepted node and at the last one
                                 (the bonus token); other entries are left alone."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = retrive_index.tolist()
    nxt = retrive_next_token.tolist()
    sib = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    flat_predicts = predicts.view(-1)
    for b in range(bs):
        last = ridx[b][0]
        accepted = [last]
        node = 0
        for _ in range(1, steps):
            node = nxt[b][node]
            want = target[last]
            while node != -1 and cand[b][node] != want:
                node = sib[b][node]
            if node == -1:
                break
            flat_predicts[last] = want
            last = ridx[b][node]
            accepted.append(last)
        accept_index[b, :len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
        flat_predicts[last] = target[last]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = the last accepted token of request i: accept_tokens viewed as rows of
    accept_stride, entry accept_lens[i] - 1 (accept_lens counts the bonus token)."""
    rows = accept_tokens.reshape(-1, accept_stride)
    last = accept_lens.to(torch.long).view(-1, 1) - 1
    bonus_tokens.view(-1)[:] = rows.gather(1, last).view(-1).to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The KV slots of the accepted tokens, compacted: for the entries of accept_index (flat,
    in order) that are not -1, out_cache_loc at that index, written to the front of
    accept_out_cache_loc; the rest of it is left alone."""
    flat = accept_index.reshape(-1).to(torch.long)
    kept = flat[flat != -1]
    accept_out_cache_loc.view(-1)[: kept.numel()] = out_cache_loc.view(-1)[kept].to(accept_out_cache_loc.dtype)


TWINS = {
    f.__name__: f
    for f in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        reconstruct_indices_from_tree_mask,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
    )
}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from sgl_kernel import MissingKernel

    return MissingKernel(f"speculative.{name}")
