"""Speculative decoding on CPU with the stock wiring (`--farskip-mode off`): NGRAM and EAGLE
(DeepSeek's NextN layer, a top-1 chain and a top-2 tree).

1. The torch-native twins of the kernel-package ops SGLang calls on CPU
   (python/cpu_shim/sgl_kernel/speculative.py), each against its definition on random inputs:
   a direct loop written from the GPU kernel (for the three tree ops from the CUDA kernels in
   `sglang/kernels/jit/include/sgl_kernel/speculative/{eagle,ngram}.cuh`, for the others from
   their Triton kernels), and SGLang's own Triton kernel run by Triton's interpreter on CPU
   tensors in a fresh process (the kernel source is read from the installed SGLang; nothing of
   SGLang is imported).
2. Real servers, float32, greedy: NGRAM, EAGLE 2 steps/top-1/3 tokens and EAGLE 2/top-2/4
   side by side, on a checkpoint whose MTP layer predicts what the target will
   (tests/speculative.py), against the reference's stock wiring
   (`FarSkipConfig(enabled=False)`), one request at a time and all at once; the accept length
   SGLang reports is asserted (EAGLE well above 1, NGRAM too on a prompt asked twice).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kernel import speculative as twins

SGLANG = Path(importlib.util.find_spec("sglang").origin).parent  # found, not imported
TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------- upstream's Triton kernels
UPSTREAM_KERNELS = {
    "srt/mem_cache/allocation.py": ["assign_req_to_token_pool"],
    "kernels/ops/speculative/cache_locs.py": ["assign_extend_cache_locs", "assign_draft_cache_locs_contiguous"],
    "kernels/ops/speculative/reconstruct_tree.py": ["_reconstruct_tree_mask_kernel"],
    "kernels/ops/speculative/spec_tree.py": ["TreeMaskMode", "sgl_build_tree_kernel_efficient_triton",
                                              "verify_tree_greedy_kernel_triton"],
    "kernels/ops/speculative/eagle.py": ["fill_bonus_tokens", "fill_accept_out_cache_loc"],
}


def load_upstream_kernels() -> dict:
    """SGLang's Triton kernels, from the installed source files. Call it in a process started
    with TRITON_INTERPRET=1 (triton.language must be imported in interpreter mode): the
    kernels then run on CPU tensors. Only the kernel functions are executed; their modules'
    imports would start SGLang's CPU engine."""
    import enum

    import triton
    import triton.language as tl

    namespace = {"triton": triton, "tl": tl, "torch": torch, "IntEnum": enum.IntEnum}
    for rel, names in UPSTREAM_KERNELS.items():
        tree = ast.parse((SGLANG / rel).read_text())
        nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
        assert sorted(n.name for n in nodes) == sorted(names), rel
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(SGLANG / rel), "exec"), namespace)
    return namespace


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------- random inputs
def _slot_table(rng: random.Random, rows: int = 6, width: int = 40) -> torch.Tensor:
    return torch.tensor([[rng.randrange(1, 10_000) for _ in range(width)] for _ in range(rows)], dtype=torch.int32)


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """parent of each node (-1 for node 0, the root), every parent before its child."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _tree_mask(parent: list[int]) -> torch.Tensor:
    """[n, n]: row i marks i and its ancestors (NGRAM's QLEN_ONLY mask)."""
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parent[j]
    return mask


def _eagle_draft(rng: random.Random, topk: int, depth: int, n: int) -> tuple[list[int], list[int]]:
    """(parent_list row, selected_index row) as SGLang's EAGLE draft produces them
    (`select_top_k_tokens` then `organize_draft_results`): candidate ids are positions in the
    flattened per-step score list (step 0: topk ids, each later step topk*topk ids, the children
    of that step's parents); parent_list holds, per step but the last, the ids its expansion
    grew from (step 0: -1 and 0..topk-1); the n-1 best cumulative scores are selected, sorted."""
    scores = [rng.random() for _ in range(topk)]
    all_scores = list(scores)
    chosen = list(range(topk))  # ids expanded by the next step
    chosen_scores = list(scores)
    parent_list = [-1] + list(range(topk))
    for step in range(1, depth):
        base = topk + (step - 1) * topk * topk
        expanded = []
        for j, parent_score in enumerate(chosen_scores):
            for k in range(topk):
                s = parent_score * rng.random()
                all_scores.append(s)
                expanded.append((s, base + j * topk + k))
        best = sorted(expanded, reverse=True)[:topk]
        chosen = [cid for _, cid in best]
        chosen_scores = [s for s, _ in best]
        if step < depth - 1:
            parent_list += chosen
    order = sorted(range(len(all_scores)), key=lambda c: -all_scores[c])[: n - 1]
    return parent_list, sorted(order)


# ----------------------------------------------------------------- the CUDA kernels, as loops
def cuda_reconstruct(mask: torch.Tensor, seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """ngram.cuh reconstructIndicesFromTreeMask for one request: (positions, next_token,
    next_sibling)."""
    n = mask.shape[0]
    m = mask.tolist()
    positions, next_token, next_sibling = [], [], []
    for tid in range(n):
        depth, parent = 0, -1
        for i in range(tid - 1, -1, -1):
            if m[tid][i]:
                depth += 1
                if parent == -1:
                    parent = i
        positions.append(depth + seq_len)
        next_token.append(next((i for i in range(tid + 1, n) if m[i][tid]), -1))
        sib = -1
        if parent != -1:
            for i in range(tid + 1, n):
                if m[i][parent] and not any(m[i][j] for j in range(parent + 1, i)):
                    sib = i
                    break
        next_sibling.append(sib)
    return positions, next_token, next_sibling


def cuda_build_tree(parent_list: list[int], selected: list[int], seq_len: int, topk: int, n: int):
    """eagle.cuh build_tree_efficient (QLEN_ONLY) for one request: (mask [n, n], positions,
    next_token, next_sibling)."""
    next_token, next_sibling = [-1] * n, [-1] * n
    mask = [[False] * n for _ in range(n)]
    positions = [0] * n
    for tid in range(n):  # the CUDA threads of one block
        mask[tid][0] = True
        if tid == 0:
            positions[0] = seq_len
            for i in range(n - 1, 0, -1):
                parent_tb = selected[i - 1] // topk
                pos = 0
                if parent_tb > 0:
                    token = parent_list[parent_tb]
                    pos = next((p + 1 for p in range(n - 1) if selected[p] == token), n)
                if pos == n:
                    continue
                if next_token[pos] == -1:
                    next_token[pos] = i
                else:
                    next_sibling[i], next_token[pos] = next_token[pos], i
        else:
            cur, position = tid - 1, 0
            while True:
                position += 1
                mask[tid][cur + 1] = True
                parent_tb = selected[cur] // topk
                if parent_tb == 0:
                    break
                token = parent_list[parent_tb]
                cur = next(p for p in range(n - 1) if selected[p] == token)
            positions[tid] = position + seq_len
    return mask, positions, next_token, next_sibling


def cuda_verify(cand, ridx, nxt, sib, target_flat, steps):
    """eagle.cuh VerifyTreeGreedy for one request: (accept_index, accepted count, {flat: token}
    written to predicts)."""
    last = ridx[0]
    accept = [last] + [-1] * (steps - 1)
    written, num, cur = {}, 0, 0
    for _ in range(1, steps):
        cur = nxt[cur]
        while cur != -1:
            if cand[cur] == target_flat[last]:
                written[last] = target_flat[last]
                num += 1
                accept[num] = ridx[cur]
                last = ridx[cur]
                break
            cur = sib[cur]
        if cur == -1:
            break
    written[last] = target_flat[last]
    return accept, num, written

# ----------------------------------------------------------------- the simple kernels, as loops
def loop_assign_req_to_token_pool(rows, table, start, end, locs):
    """allocation.py assign_req_to_token_pool: program pid writes its span from its packed
    offset, the sum of the spans before it."""
    table = table.clone()
    for pid in range(len(rows)):
        offset = int((end[:pid] - start[:pid]).sum())
        for j in range(int(start[pid]), int(end[pid])):
            table[rows[pid], j] = locs[offset + j - int(start[pid])]
    return table


def loop_assign_extend_cache_locs(rows, table, start, end, out):
    out = out.clone()
    for pid in range(len(rows)):
        offset = int((end[:pid] - start[:pid]).sum())
        for j in range(int(start[pid]), int(end[pid])):
            out[offset + j - int(start[pid])] = table[rows[pid], j]
    return out


def loop_assign_draft_cache_locs_contiguous(rows, table, seq_lens, topk, steps):
    width = topk * steps
    out = torch.zeros(len(rows) * width, dtype=torch.int64)
    for pid in range(len(rows)):
        for j in range(width):
            out[pid * width + j] = table[rows[pid], int(seq_lens[pid]) + j]
    return out


def loop_fill_accept_out_cache_loc(accept_flat, locs, out):
    out = out.clone()
    for pid in range(len(accept_flat)):
        dst = int((accept_flat[:pid] != -1).sum())
        if accept_flat[pid] > -1:
            out[dst] = locs[accept_flat[pid]]
    return out


# ----------------------------------------------------------------- each twin against its definition
# check_*(kernels, ...): the twin on random inputs against the direct loop and, when `kernels`
# (load_upstream_kernels()) is given, against SGLang's Triton kernel on the same inputs.
def _spans_case(seed):
    """Four requests' pool rows and [start, end) position spans of 0-7 tokens."""
    rng = random.Random(seed)
    bs = 4
    rows = torch.tensor(rng.sample(range(6), bs), dtype=torch.int64)
    start = torch.tensor([rng.randrange(0, 20) for _ in range(bs)], dtype=torch.int64)
    end = start + torch.tensor([rng.randrange(0, 8) for _ in range(bs)])
    return rng, bs, rows, start, end


def check_assign_req_to_token_pool(kernels, seed):
    rng, bs, rows, start, end = _spans_case(seed)
    locs = torch.tensor([rng.randrange(1, 10_000) for _ in range(int((end - start).sum()))], dtype=torch.int64)
    table = _slot_table(rng)
    ours = table.clone()
    twins.assign_req_to_token_pool_cpu(rows, ours, start, end, locs, table.shape[1])
    assert torch.equal(ours, loop_assign_req_to_token_pool(rows, table, start, end, locs))
    if kernels:
        theirs = table.clone()
        kernels["assign_req_to_token_pool"][(bs,)](rows, theirs, start, end, locs, table.shape[1], _next_pow2(bs))
        assert torch.equal(ours, theirs)


def check_assign_extend_cache_locs(kernels, seed):
    rng, bs, rows, start, end = _spans_case(seed)
    table = _slot_table(rng)
    blank = torch.full((int((end - start).sum()) + 3,), -7, dtype=torch.int64)  # a tail past the total
    ours = blank.clone()
    twins.assign_extend_cache_locs_cpu(rows, table, start, end, ours, table.shape[1])
    assert torch.equal(ours, loop_assign_extend_cache_locs(rows, table, start, end, blank))
    assert ours[-3:].tolist() == [-7] * 3
    if kernels:
        theirs = blank.clone()
        kernels["assign_extend_cache_locs"][(bs,)](rows, table, start, end, theirs, table.shape[1], _next_pow2(bs))
        assert torch.equal(ours, theirs)


def check_assign_draft_cache_locs_contiguous(kernels, topk, steps):
    rng = random.Random(topk * 10 + steps)
    bs = 3
    rows = torch.tensor(rng.sample(range(6), bs), dtype=torch.int64)
    seq_lens = torch.tensor([rng.randrange(1, 20) for _ in range(bs)], dtype=torch.int64)
    table = _slot_table(rng)
    ours = torch.zeros(bs * topk * steps, dtype=torch.int64)
    twins.assign_draft_cache_locs_contiguous_cpu(rows, table, seq_lens, ours, table.shape[1], topk, steps)
    assert torch.equal(ours, loop_assign_draft_cache_locs_contiguous(rows, table, seq_lens, topk, steps))
    if kernels:
        theirs = torch.zeros_like(ours)
        kernels["assign_draft_cache_locs_contiguous"][(bs,)](rows, table, seq_lens, theirs, table.shape[1],
                                                             topk, steps)
        assert torch.equal(ours, theirs)


def check_reconstruct_indices_from_tree_mask(kernels, seed):
    rng = random.Random(seed)
    bs, n = 3, 6
    masks = torch.stack([_tree_mask(_random_tree(rng, n)) for _ in range(bs)])
    seq = torch.tensor([rng.randrange(1, 50) for _ in range(bs)], dtype=torch.int64)

    def outputs():
        return (torch.zeros(bs * n, dtype=torch.int64), *(torch.zeros(bs, n, dtype=torch.int64) for _ in range(3)))

    ours = outputs()
    twins.reconstruct_indices_from_tree_mask(masks.flatten(), seq, *ours, bs, n)
    positions, ridx, nxt, sib = ours
    assert ridx.flatten().tolist() == list(range(bs * n))
    for b in range(bs):
        want = cuda_reconstruct(masks[b], int(seq[b]))
        assert (positions.view(bs, n)[b].tolist(), nxt[b].tolist(), sib[b].tolist()) == want
    assert (sib >= 0).any() and (nxt >= 0).any()
    if kernels:
        theirs = outputs()
        kernels["_reconstruct_tree_mask_kernel"][(bs,)](masks.flatten(), seq, *theirs, n, _next_pow2(n))
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def _build_tree_inputs(seed: int, topk: int, depth: int, n: int, bs: int = 3):
    rng = random.Random(seed)
    drafts = [_eagle_draft(rng, topk, depth, n) for _ in range(bs)]
    parent_list = torch.tensor([p for p, _ in drafts], dtype=torch.int64).view(bs, -1)
    selected = torch.tensor([s for _, s in drafts], dtype=torch.int64).view(bs, n - 1)
    seq = torch.tensor([rng.randrange(1, 30) for _ in range(bs)], dtype=torch.int64)
    return parent_list, selected, seq


def _tree_outputs(bs: int, n: int, mask_numel: int):
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)  # next_* arrive -1 (eagle_utils.py)
    return torch.ones(mask_numel, dtype=torch.bool), torch.zeros(bs * n, dtype=torch.int64), *retrieve


def _upstream_build_tree(kernels, parent_list, selected, seq, outputs, topk, depth, n, mode):
    kernels["sgl_build_tree_kernel_efficient_triton"][(seq.numel(),)](
        parent_list, selected, seq, torch.cumsum(seq, 0) - seq, *outputs, topk=topk, depth=depth,
        draft_token_num=n, tree_mask_mode=mode, batch_size=seq.numel(),
        parent_list_stride=parent_list.shape[1], selected_index_stride=selected.stride(0))


def check_build_tree_qlen_only(kernels, topk, depth, n):
    bs = 3
    parent_list, selected, seq = _build_tree_inputs(topk * 100 + depth * 10 + n, topk, depth, n, bs)
    ours = _tree_outputs(bs, n, bs * n * n)
    twins.build_tree_kernel_efficient_cpu(parent_list, selected, seq, *ours, topk, depth, n, 1)
    mask, positions, ridx, nxt, sib = ours
    assert ridx.flatten().tolist() == list(range(bs * n))
    for b in range(bs):
        want = cuda_build_tree(parent_list[b].tolist(), selected[b].tolist(), int(seq[b]), topk, n)
        got = (mask.view(bs, n, n)[b].tolist(), positions.view(bs, n)[b].tolist(), nxt[b].tolist(), sib[b].tolist())
        assert got == want
    if topk > 1:  # a real tree: some node has a sibling
        assert (sib >= 0).any()
    if kernels:
        theirs = _tree_outputs(bs, n, bs * n * n)
        _upstream_build_tree(kernels, parent_list, selected, seq, theirs, topk, depth, n, 1)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def check_build_tree_full_mask(kernels):
    """FULL_MASK: each request's [n, seq_len + n] block; the prefix columns are the caller's."""
    topk, depth, n, bs = 2, 3, 6, 3
    parent_list, selected, seq = _build_tree_inputs(7, topk, depth, n, bs)
    numel = int(seq.sum()) * n + bs * n * n
    ours = _tree_outputs(bs, n, numel)
    twins.build_tree_kernel_efficient_cpu(parent_list, selected, seq, *ours, topk, depth, n, 0)
    qlen = _tree_outputs(bs, n, bs * n * n)
    twins.build_tree_kernel_efficient_cpu(parent_list, selected, seq, *qlen, topk, depth, n, 1)
    base = 0
    for b in range(bs):  # the same tree rows after the (untouched, all-True) prefix columns
        s = int(seq[b])
        block = ours[0][base:base + n * (s + n)].view(n, s + n)
        assert block[:, :s].all() and torch.equal(block[:, s:], qlen[0].view(bs, n, n)[b])
        base += n * (s + n)
    for a, b in zip(ours[1:], qlen[1:]):
        assert torch.equal(a, b)
    if kernels:
        theirs = _tree_outputs(bs, n, numel)
        _upstream_build_tree(kernels, parent_list, selected, seq, theirs, topk, depth, n, 0)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def check_verify_tree_greedy(kernels, topk, depth, n):
    bs = 4
    parent_list, selected, seq = _build_tree_inputs(topk + depth + n, topk, depth, n, bs)
    mask, positions, ridx, nxt, sib = _tree_outputs(bs, n, bs * n * n)
    twins.build_tree_kernel_efficient_cpu(parent_list, selected, seq, mask, positions, ridx, nxt, sib,
                                          topk, depth, n, 1)
    rng = random.Random(n)
    # A vocabulary of two: drafts are often right, so paths of different lengths are accepted.
    candidates = torch.tensor([[rng.randrange(2) for _ in range(n)] for _ in range(bs)], dtype=torch.int64)
    target = torch.tensor([[rng.randrange(2) for _ in range(n)] for _ in range(bs)], dtype=torch.int64)
    steps = depth + 1

    def outputs():
        return (torch.full((bs * n,), -5, dtype=torch.int32), torch.full((bs, steps), -1, dtype=torch.int32),
                torch.zeros(bs, dtype=torch.int32))

    ours = outputs()
    twins.verify_tree_greedy_cpu(predicts=ours[0], accept_index=ours[1], accept_token_num=ours[2],
                                 candidates=candidates, retrive_index=ridx, retrive_next_token=nxt,
                                 retrive_next_sibling=sib, target_predict=target)
    predicts, accept, num = ours
    for b in range(bs):
        want_accept, want_num, written = cuda_verify(candidates[b].tolist(), ridx[b].tolist(), nxt[b].tolist(),
                                                     sib[b].tolist(), target.flatten().tolist(), steps)
        assert accept[b].tolist() == want_accept and int(num[b]) == want_num
        row = predicts.view(bs, n)[b].tolist()
        assert {b * n + i: t for i, t in enumerate(row) if t != -5} == written
    assert len(set(num.tolist())) > 1  # different accept lengths in one batch
    if kernels:
        theirs = outputs()
        kernels["verify_tree_greedy_kernel_triton"][(bs,)](
            *theirs, candidates, ridx, nxt, sib, target, batch_size=bs, num_speculative_tokens=steps,
            num_draft_tokens=n)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def check_fill_bonus_tokens(kernels, seed):
    rng = random.Random(seed)
    bs, stride = 5, 4
    tokens = torch.tensor([rng.randrange(100) for _ in range(bs * stride)], dtype=torch.int32)
    lens = torch.tensor([rng.randrange(1, stride + 1) for _ in range(bs)], dtype=torch.int32)
    ours = torch.zeros(bs, dtype=torch.int32)
    twins.fill_bonus_tokens_cpu(tokens, lens, ours, stride)
    assert ours.tolist() == [int(tokens[stride * i + int(lens[i]) - 1]) for i in range(bs)]
    if kernels:
        theirs = torch.zeros_like(ours)
        kernels["fill_bonus_tokens"][(bs,)](tokens, lens, theirs, stride)
        assert torch.equal(ours, theirs)


def check_fill_accept_out_cache_loc(kernels, seed):
    rng = random.Random(seed)
    bs, steps, n = 3, 4, 6
    accept = torch.full((bs, steps), -1, dtype=torch.int32)
    for b in range(bs):
        m = rng.randrange(1, steps + 1)
        accept[b, :m] = torch.tensor(sorted(rng.sample(range(b * n, (b + 1) * n), m)), dtype=torch.int32)
    locs = torch.tensor([rng.randrange(1, 10_000) for _ in range(bs * n)], dtype=torch.int64)
    blank = torch.full((bs * steps,), -9, dtype=torch.int64)
    ours = blank.clone()
    twins.fill_accept_out_cache_loc_cpu(accept.flatten(), locs, ours)
    assert torch.equal(ours, loop_fill_accept_out_cache_loc(accept.flatten(), locs, blank))
    if kernels:
        theirs = blank.clone()
        size = accept.numel()
        kernels["fill_accept_out_cache_loc"][(size,)](accept.flatten(), locs, theirs, _next_pow2(size))
        assert torch.equal(ours, theirs)


CHECKS = [
    *[(check_assign_req_to_token_pool, (seed,)) for seed in range(3)],
    *[(check_assign_extend_cache_locs, (seed,)) for seed in range(3)],
    *[(check_assign_draft_cache_locs_contiguous, p) for p in [(1, 3), (2, 2), (3, 4)]],
    *[(check_reconstruct_indices_from_tree_mask, (seed,)) for seed in range(4)],
    *[(check_build_tree_qlen_only, p) for p in [(1, 2, 3), (1, 3, 4), (2, 2, 4), (2, 3, 6), (3, 3, 8)]],
    (check_build_tree_full_mask, ()),
    *[(check_verify_tree_greedy, p) for p in [(1, 3, 4), (2, 3, 6), (3, 3, 8)]],
    *[(check_fill_bonus_tokens, (seed,)) for seed in range(2)],
    *[(check_fill_accept_out_cache_loc, (seed,)) for seed in range(3)],
]


# ----------------------------------------------------------------- twin unit tests
@pytest.mark.parametrize("check,params", CHECKS, ids=[f"{c.__name__[6:]}{p}" for c, p in CHECKS])
def test_twin_against_direct_loop(check, params):
    check(None, *params)


def run_against_upstream() -> int:
    """Every check against SGLang's Triton kernels (in a process with TRITON_INTERPRET=1)."""
    kernels = load_upstream_kernels()
    for check, params in CHECKS:
        check(kernels, *params)
    return len(CHECKS)


def test_twins_against_upstream_triton_kernels():
    """The same checks against SGLang's own Triton kernels, run by Triton's interpreter on CPU
    in a fresh process (interpreter mode must be on before triton.language is imported)."""
    code = "import test_spec_cpu as t; print('checked', t.run_against_upstream())"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"checked {len(CHECKS)}" in proc.stdout


def test_every_twin_is_reachable_and_the_rest_still_raises():
    """SGLang imports the twins from sgl_kernel's top level (all but one) and from
    sgl_kernel.speculative; any other kernel name still fails when called."""
    import sgl_kernel
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    assert reconstruct_indices_from_tree_mask is twins.reconstruct_indices_from_tree_mask
    for name, fn in twins.TWINS.items():
        assert getattr(sgl_kernel, name) is fn
    assert len(twins.TWINS) == 8
    for missing in (sgl_kernel.build_draft_decode_metadata_cpu, sgl_kernel.speculative.rotate_input_ids_cpu,
                    sgl_kernel.copy_all_layer_kv_cache_cpu):
        with pytest.raises(RuntimeError, match="no sgl_kernel build"):
            missing(torch.zeros(1))


# ----------------------------------------------------------------- real servers
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def spec_served(tmp_path_factory):
    """The three speculative servers side by side on one MTP checkpoint, with their results
    (sequential, then concurrent), and the reference's greedy tokens."""
    from parity import FLOAT32, ONE_THREAD
    from sglang_farskip.testbed.servers import side_by_side
    from speculative import SPEC_FLAGS, ask_all, reference_greedy, spec_prompts

    from sglang_farskip.config import FarSkipConfig
    from sglang_farskip.tools.demo_model import build_checkpoint, predictable_mtp

    root = tmp_path_factory.mktemp("spec")
    path = predictable_mtp(build_checkpoint(root / "base", seed=0), root / "mtp")
    prompts = spec_prompts()
    runs = {name: {"args": ["--model-path", str(path), *FLOAT32, "--farskip-mode", "off", *flags],
                   "env": ONE_THREAD}
            for name, flags in SPEC_FLAGS.items()}
    # Three starts side by side on two cores shared with other servers took up to ~5 minutes
    # (an idle machine: ~2); a start that is slow is not what this file tests.
    with side_by_side(runs, timeout=START_TIMEOUT_S) as servers:
        results = {name: ask_all(server, prompts) for name, server in servers.items()}
    expected = reference_greedy(path, prompts, farskip=FarSkipConfig(enabled=False))
    return results, expected


@pytest.mark.parametrize("run", ["ngram", "eagle_chain", "eagle_tree"])
def test_speculative_greedy_equals_reference(spec_served, run):
    from speculative import assert_greedy_equal

    results, expected = spec_served
    worst = assert_greedy_equal(*results[run], expected)
    print(f"{run}: largest chosen-logprob difference from the reference {worst:.2e}")


@pytest.mark.parametrize("run,least", [("eagle_chain", 2.0), ("eagle_tree", 2.0), ("ngram", 2.0)])
def test_accept_length_reported(spec_served, run, least):
    """SGLang's mean accept length per request (tokens per verify step, bonus included; at most
    3 for the chain, 4 otherwise): the MTP layer's drafts are mostly right; n-gram drafts are
    when the answer is in the n-gram store (the repeated prompt)."""
    results, _ = spec_served
    sequential, _ = results[run]
    lengths = [meta["spec_accept_length"] for meta in sequential]
    print(f"{run}: accept length per prompt {[round(x, 2) for x in lengths]}")
    assert all(length >= 1.0 for length in lengths), lengths
    best = lengths[-1] if run == "ngram" else min(lengths)
    assert best > least, lengths
