"""Training text -> fixed-length token windows.

    .txt     one document per blank-line-separated block
    .jsonl   one object per line: {"text": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}
             (chat rendered with the teacher's own chat template)

Documents are tokenised with the teacher's tokenizer (its BOS added as it would be at inference;
a chat template adds its own), joined with EOS, and cut into windows of seq_len tokens. The last
windows are held out for evaluation; the rest are shuffled per epoch with a fixed seed, so the
batch of step n is a function of n alone (what makes a resumed run see the same data).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError


def _documents(path: Path):
    if path.suffix == ".txt":
        for block in path.read_text(errors="replace").split("\n\n"):
            if block.strip():
                yield "text", block
        return
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg}): each line must be one JSON object") from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            yield "text", obj["text"]
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            yield "messages", obj["messages"]
        else:
            raise UserError(f'{path}:{n}: expected {{"text": str}} or {{"messages": [...]}}: fix that line')


def tokenize_file(path: Path, tokenizer) -> torch.Tensor:
    """All documents of `path` as one 1-D token tensor."""
    if not path.is_file():
        raise UserError(f"data file {path} does not exist: pass a .txt or .jsonl file")
    if path.suffix not in (".txt", ".jsonl"):
        raise UserError(f"data file {path}: unknown format {path.suffix!r}; pass a .txt or .jsonl file")
    if tokenizer.eos_token_id is None:
        raise UserError("the teacher's tokenizer has no EOS token to separate documents: fix its tokenizer_config.json")
    ids: list[int] = []
    for kind, doc in _documents(path):
        if kind == "messages":
            if not tokenizer.chat_template:
                raise UserError(f"{path} has chat messages but the teacher's tokenizer has no chat template: use text")
            text = tokenizer.apply_chat_template(doc, tokenize=False)
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids += tokenizer(doc)["input_ids"]
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class Windows:
    """Packed windows [n, seq_len], split into training and held-out windows."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, eval_windows: int, seed: int):
        n = tokens.numel() // seq_len
        if n < eval_windows + 1:
            raise UserError(
                f"the data gives {tokens.numel()} tokens = {n} windows of --seq-len {seq_len}, but "
                f"{eval_windows} are held out for evaluation and training needs at least one more: "
                f"add data, or lower --seq-len / --eval-tokens"
            )
        windows = tokens[: n * seq_len].view(n, seq_len)  # [N*T] -> [n, T]
        self.train, self.eval = windows[: n - eval_windows], windows[n - eval_windows :]
        self.seed = seed
        self._order = (-1, None)  # (epoch, permutation of the training windows)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.train.shape[0], generator=gen))
        return self._order[1]

    def batch(self, step: int, per_step: int) -> torch.Tensor:
        """The `per_step` training windows of optimiser step `step` (0-based), [per_step, T]."""
        n = self.train.shape[0]
        first = step * per_step
        rows = []
        for i in range(first, first + per_step):
            epoch, pos = divmod(i, n)
            rows.append(self._permutation(epoch)[pos])
        return self.train[torch.stack(rows)]


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: the next token, IGNORE at each window's last position."""
    from .loss import IGNORE

    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return labels
