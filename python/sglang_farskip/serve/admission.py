"""Every generate request checked against the model and the server before a scheduler sees it.

SGLang validates most of what a client sends (sampling values, stop strings, grammars, lengths
against the context), but a few fields reach a kernel or a scheduler assertion unchecked, and
there one request from any key holder ends the server (and, deployed, restarts both nodes):
- `top_logprobs_num` (OpenAI: `logprobs` / `top_logprobs`) above the vocabulary: `topk` raises
  in the scheduler; far below that it still makes every step sort a large top-k;
- token ids outside `[0, vocab)` in `input_ids` or a token-id prompt: the embedding lookup raises;
- `logprob_start_len` negative other than -1: a scheduler assertion;
- `n` (parallel samples), `best_of` and the size of a batch: unbounded, so one request can ask
  for more work than the server does in hours (n=100000 wedged the demo server).
Each is answered here with a 400 naming the field the client sent, its value and the limit.

Where it runs (SGLang's hook registry, no patch; rows of sglang_farskip/boundary/table.csv): the
HTTP process only (the launcher installs them after `configure()`), at these points:
1. `TokenizerManager.generate_request` (BEFORE): every route that generates passes here, before
   SGLang expands `n` or tokenizes; a ValueError is SGLang's own 400 on non-streaming routes,
   an in-stream error on streaming ones;
2. the OpenAI completion and chat converters (AFTER): the same check with the OpenAI field
   names, before a stream starts, so a streaming request also gets a 400 (OpenAI error shape);
3. `/generate`'s `serve_generate_request` (AROUND): likewise for SGLang's native route;
4. `/v1/detokenize`'s converter (AFTER): ids outside the vocabulary (a 500 otherwise).
"""

from __future__ import annotations

from typing import Any, Optional


# SGLang's field -> what an OpenAI client calls it (completions; chat differs in one name).
COMPLETION_NAMES = {"top_logprobs_num": "logprobs", "max_new_tokens": "max_tokens", "input_ids": "prompt"}
CHAT_NAMES = {**COMPLETION_NAMES, "top_logprobs_num": "top_logprobs", "input_ids": "messages"}


class Refused(ValueError):
    """A request the server will not run; SGLang turns a ValueError into a 400."""

    status_code = 400


def request_token_budget(options: Any, context_len: int) -> int:
    """--farskip-max-request-tokens, or max_n sequences of the full context (so that any one
    request within --farskip-max-n passes)."""
    return options.max_request_tokens or options.max_n * context_len


def _per_item(value: Any, count: int) -> list:
    """A field SGLang accepts as one value or one per batch item, as a list of `count`."""
    if isinstance(value, list):
        return value
    return [value] * count


def _token_lists(input_ids: Any) -> list[list[int]]:
    if not input_ids:
        return []
    return input_ids if isinstance(input_ids[0], list) else [input_ids]


def problems(obj: Any, *, vocab_size: int, context_len: int, limits: Any,
             names: Optional[dict] = None) -> list[str]:
    """What is wrong with `obj` (SGLang's GenerateReqInput, as a client sent it: not yet
    normalized), one line per field: the client's name for it, the value, the limit."""
    names = names or {}

    def name(field: str) -> str:
        return names.get(field, field)

    found = []
    token_lists = _token_lists(obj.input_ids)
    for ids in token_lists:
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            found.append(f"{name('input_ids')}: token id {bad} is outside the vocabulary [0, {vocab_size})")
            break

    if obj.text is not None:
        items = len(obj.text) if isinstance(obj.text, list) else 1
    else:
        items = max(1, len(token_lists))
    params = _per_item(obj.sampling_params or {}, items)

    top_k_cap = min(limits.max_logprobs, vocab_size)
    for k in _per_item(obj.top_logprobs_num, items):
        if k is not None and not 0 <= k <= top_k_cap:
            found.append(f"{name('top_logprobs_num')}={k}: give 0 to {top_k_cap} top log-probabilities "
                         f"(this server's maximum, --farskip-max-logprobs)")
            break
    for start in _per_item(obj.logprob_start_len, items):
        if start is not None and start < -1:
            found.append(f"logprob_start_len={start}: give -1 (only the generated tokens) or a prompt "
                         "position from 0")
            break

    for p in params:
        n = p.get("n", 1) if isinstance(p, dict) else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limits.max_n:
            found.append(f"n={n}: give 1 to {limits.max_n} samples per prompt (this server's maximum, "
                         "--farskip-max-n)")
            return found  # the totals below would only repeat it

    budget = request_token_budget(limits, context_len)
    total = 0
    for i in range(items):
        p = params[i] if i < len(params) and isinstance(params[i], dict) else {}
        new = p.get("max_new_tokens", 128)  # SGLang's default when the client gives none
        prompt = len(token_lists[i]) if i < len(token_lists) else 0
        n = p.get("n", 1)
        # No max_new_tokens (chat's default): up to the context; a text prompt counts when tokenized.
        total += n * min(context_len, prompt + (context_len if new is None else new))
    if total > budget:
        found.append(
            f"the request asks for {total} tokens ({items} prompt(s) x n, prompt + {name('max_new_tokens')} "
            f"each, capped at the context of {context_len}): at most {budget} per request "
            "(--farskip-max-request-tokens): send fewer prompts, a smaller n or a smaller "
            f"{name('max_new_tokens')}"
        )
    return found


def check(obj: Any, *, vocab_size: int, context_len: int, limits: Any, names: Optional[dict] = None) -> None:
    found = problems(obj, vocab_size=vocab_size, context_len=context_len, limits=limits, names=names)
    if found:
        raise Refused("; ".join(found))


# ---------------------------------------------------------------- the hooks (HTTP process)
_limits: Any = None  # options.RuntimeOptions, set by configure()


def _model(tokenizer_manager) -> dict:
    return {"vocab_size": tokenizer_manager.model_config.vocab_size,
            "context_len": tokenizer_manager.context_len}


def before_generate(self, obj, *args, **kwargs):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput):
        check(obj, limits=_limits, **_model(self))
    return None


def _openai_check(names: dict):
    def after_convert(result, self, request, *args, **kwargs):
        from sglang.srt.managers.io_struct import GenerateReqInput

        adapted = result[0]
        best_of = getattr(request, "best_of", None)
        if best_of is not None and not 1 <= best_of <= _limits.max_n:
            raise Refused(f"best_of={best_of}: give 1 to {_limits.max_n} (this server's maximum, --farskip-max-n)")
        if isinstance(adapted, GenerateReqInput):
            check(adapted, limits=_limits, names=names, **_model(self.tokenizer_manager))
        return None

    return after_convert


def detokenize_check(result, self, request, *args, **kwargs):
    """AFTER OpenAIServingDetokenize._convert_to_internal_request: ids the tokenizer cannot
    decode (a 500 from SGLang otherwise) are the client's error."""
    tokens = request.tokens if isinstance(request.tokens, list) else []
    vocab_size = self.tokenizer_manager.model_config.vocab_size
    for ids in (tokens if tokens and isinstance(tokens[0], list) else [tokens]):
        bad = [t for t in ids if isinstance(t, int) and not 0 <= t < vocab_size]
        if bad:
            raise Refused(f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return None


async def around_serve_generate(original, obj, request, *args, **kwargs):
    from sglang.srt.entrypoints import http_server

    try:
        check(obj, limits=_limits, **_model(http_server._global_state.tokenizer_manager))
    except Refused as e:
        return http_server._create_error_response(e)
    return await original(obj, request, *args, **kwargs)


completion_check = _openai_check(COMPLETION_NAMES)
chat_check = _openai_check(CHAT_NAMES)


def configure(limits: Any) -> None:
    """Launcher only, in the process that serves HTTP, before it installs the hooks; `limits`:
    the launcher's RuntimeOptions (max_logprobs, max_n, max_request_tokens)."""
    global _limits
    _limits = limits
