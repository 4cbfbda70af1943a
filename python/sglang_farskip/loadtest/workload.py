"""What the load test sends: the tokenizer facts random prompts need, and text-dataset prompts.

Random token prompts are drawn inside the locustfile (one fresh prompt per request); this
module only tells it the vocabulary size and which ids are special. Text-dataset prompts are
cut here from a text file into windows of --input-len tokens and written as a prompts file.
"""

from __future__ import annotations

import json
from pathlib import Path


class WorkloadError(ValueError):
    """Bad workload input; the message names the problem and the fix."""


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers start-up cost

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise WorkloadError(
            f"no tokenizer at {path}: pass --tokenizer with a checkpoint directory that holds "
            "tokenizer.json (or the file itself)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exception on a malformed file
        raise WorkloadError(f"{file} is not a Hugging Face tokenizer.json ({e})") from None


def vocabulary(tok) -> tuple[int, list[int]]:
    """(vocabulary size, ids of special tokens): random prompts never contain a BOS/EOS."""
    specials = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return tok.get_vocab_size(with_added_tokens=True), specials


def _read_text(path: Path) -> str:
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"--dataset-path {path} does not exist") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"--dataset-path {path} is not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return raw
    # JSONL: one document per line, its text under "text" or "prompt".
    docs = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise WorkloadError(f"{path}:{lineno} is not JSON") from None
        text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise WorkloadError(f"{path}:{lineno} has no string 'text' or 'prompt' field")
        docs.append(text)
    return "\n\n".join(docs)


def text_prompts(tok, dataset_path: str | Path, input_len: int) -> list[dict]:
    """Consecutive, non-overlapping windows of input_len tokens of the dataset, as text.

    Sent as text (the point of a text dataset), so the server tokenizes it itself: it may add a
    BOS and merge differently at the cut, and each record keeps the server's prompt_tokens.
    """
    if input_len < 1:
        raise WorkloadError(f"--input-len {input_len}: prompts need at least 1 token")
    ids = tok.encode(_read_text(Path(dataset_path)), add_special_tokens=False).ids
    count = len(ids) // input_len
    if count == 0:
        raise WorkloadError(
            f"--dataset-path {dataset_path} holds {len(ids)} tokens, fewer than one prompt of "
            f"--input-len {input_len}: use a longer text or a smaller --input-len")
    return [
        {"text": tok.decode(ids[k * input_len:(k + 1) * input_len]), "input_len": input_len}
        for k in range(count)
    ]


def write_prompts(prompts: list[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
