"""Every request checked against the model and the server before a scheduler sees it, on what
the scheduler will really do: a 400 naming the field as the client sent it, its value, the limit
and the fix, instead of a crashed scheduler or a server busy for minutes.

Two checks, the same cost model (cost.py) against the per-request budget:
1. before tokenizing: every field a client controls, typed and bounded (fields.py); the number
   of prompts (`--farskip-max-batch`) and the characters of text (`--farskip-max-request-chars`),
   which bound what tokenizing itself costs; the cost with token-id prompts counted and text
   prompts at 0 tokens (a lower bound);
2. where SGLang has the token ids (`TokenizerManager._validate_one_request`, which every prompt
   form passes once tokenized: text, chat, token ids, each item of a batch, embeddings, scored
   items, Vertex instances): the cost of each prompt, summed over the request's prompts.
   A batch's items are tokenized and sent one by one; the item that takes the sum over the
   budget is refused, and SGLang aborts the request's items already sent (its own clean-up of
   a failed request), which were within the budget.

Where it runs (SGLang's hook registry, no patch; rows of sglang_farskip/boundary/table.csv): the
HTTP process only (the launcher installs them after `configure()`):
- `TokenizerManager.generate_request` (AROUND): every route that generates or embeds passes here
  (/generate, /v1/*, Vertex, /v1/score): check 1, and a fresh sum for check 2;
- `TokenizerManager._validate_one_request` (AFTER): check 2;
- `OpenAIServingBase.handle_request` (AROUND): every OpenAI route (/v1/chat/completions, whose
  converter tokenizes the messages, /v1/tokenize, /v1/score, ...): the prompts and characters
  of text before anything is tokenized;
- the OpenAI completion and chat converters (AFTER) and /generate's `serve_generate_request`
  (AROUND): check 1 with the client's field names, before a stream starts, so that a streaming
  request gets a 400 too (a refusal after tokenizing comes inside the stream, as SGLang's own
  context-length refusal does);
- `/v1/detokenize`'s converter (AFTER): ids outside the vocabulary (a 500 otherwise).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Optional

from sglang_farskip.serve import cost, fields

# SGLang's field -> what an OpenAI client calls it (completions; chat differs in one name).
COMPLETION_NAMES = {"top_logprobs_num": "logprobs", "max_new_tokens": "max_tokens", "input_ids": "prompt"}
CHAT_NAMES = {**COMPLETION_NAMES, "top_logprobs_num": "top_logprobs", "input_ids": "messages"}
CHARS_PER_TOKEN = 8  # --farskip-max-request-chars' default: this many characters per budget token


class Refused(ValueError):
    """A request the server will not run; SGLang turns a ValueError into a 400."""

    status_code = 400


@dataclass(frozen=True)
class Model:
    vocab_size: int
    context_len: int
    hidden_size: int


def request_token_budget(options: Any, context_len: int) -> int:
    """--farskip-max-request-tokens, or the model's context: by default a request may cost what
    one sequence of the full context costs (16 of them took minutes on the CPU demo, each a
    server-wide stall for every other client)."""
    return options.max_request_tokens or context_len


def request_char_budget(options: Any, context_len: int) -> int:
    """--farskip-max-request-chars, or CHARS_PER_TOKEN per token of the token budget."""
    return options.max_request_chars or CHARS_PER_TOKEN * request_token_budget(options, context_len)


def _per_item(value: Any, count: int) -> list:
    """A field SGLang accepts as one value or one per batch item, as a list of `count`."""
    if isinstance(value, list):
        return value
    return [value] * count


def _token_lists(input_ids: Any) -> list:
    if not input_ids:
        return []
    return input_ids if isinstance(input_ids[0], list) else [input_ids]


def _texts(text: Any) -> list:
    if text is None:
        return []
    return text if isinstance(text, list) else [text]


def _budget_line(total: int, budget: int, name) -> str:
    return (f"the request asks for {total} tokens (for each prompt: its tokens + n (or beam_width) x "
            f"{name('max_new_tokens')}, plus per-step extras): at most {budget} per request "
            f"(--farskip-max-request-tokens): send fewer or shorter prompts, a smaller n or a smaller "
            f"{name('max_new_tokens')}")


def problems(obj: Any, *, model: Model, limits: Any, names: Optional[dict] = None) -> list[str]:
    """What is wrong with `obj` (SGLang's GenerateReqInput or EmbeddingReqInput, as a client sent
    it: not yet normalized), before tokenizing: one line per field."""
    names = names or {}

    def name(field: str) -> str:
        return names.get(field, field)

    found = []
    token_lists = _token_lists(obj.input_ids)
    texts = _texts(obj.text)
    items = len(texts) if obj.text is not None else max(1, len(token_lists))
    if items > limits.max_batch:
        return [f"the request holds {items} prompts: give at most {limits.max_batch} per request "
                "(--farskip-max-batch): split it into several requests"]
    chars = sum(len(t) for t in texts if isinstance(t, str))
    char_budget = request_char_budget(limits, model.context_len)
    if chars > char_budget:
        return [f"the request holds {chars} characters of text: at most {char_budget} per request "
                "(--farskip-max-request-chars), checked before tokenizing: send less text"]
    for ids in token_lists:
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < model.vocab_size), None) if isinstance(ids, list) else ids
        if bad is not None:
            found.append(f"{name('input_ids')}: token id {fields.shown(bad)} is outside the vocabulary "
                         f"[0, {model.vocab_size})")
            break
    batch = isinstance(obj.text, list) or bool(token_lists and isinstance(obj.input_ids[0], list))
    found += fields.per_item_problems(obj, items, batch)
    found += fields.session_problems(getattr(obj, "session_params", None))
    if found:
        return found  # the checks below index the per-item fields by prompt
    overrides = getattr(obj, "positional_embed_overrides", None)
    if overrides is not None:
        found += fields.override_problems(overrides, model.hidden_size)
    if not hasattr(obj, "top_logprobs_num"):  # an EmbeddingReqInput: no generation, no n
        if not found:
            found += [problem] if (problem := fields.split_problem(obj)) else []
        return found

    params = _per_item(obj.sampling_params or {}, items)
    if len(params) != items:
        return found + [f"sampling_params: {len(params)} of them for {items} prompts: give one, or one per prompt"]
    for p in params:
        bad = fields.sampling_problems(p, limits=limits, vocab_size=model.vocab_size, name=name)
        if bad:
            return found + bad  # one prompt's problems say it; the totals below would only repeat them

    top_k_cap = min(limits.max_logprobs, model.vocab_size)
    tops = _per_item(obj.top_logprobs_num, items)
    for k in tops:
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= top_k_cap):
            found.append(f"{name('top_logprobs_num')}={fields.shown(k)}: give 0 to {top_k_cap} top "
                         "log-probabilities (this server's maximum, --farskip-max-logprobs)")
            break
    ids_logprob = obj.token_ids_logprob
    id_lists = ids_logprob if ids_logprob and isinstance(ids_logprob[0], list) else [ids_logprob] * items
    for ids in id_lists:
        if ids and len(ids) > limits.max_logprobs:
            found.append(f"token_ids_logprob: {len(ids)} ids: give at most {limits.max_logprobs} "
                         "(this server's maximum, --farskip-max-logprobs)")
            break
    for start in _per_item(obj.logprob_start_len, items):
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < -1):
            found.append(f"logprob_start_len={fields.shown(start)}: give -1 (only the generated tokens) or a "
                         "prompt position from 0")
            break
    if found:
        return found

    budget = request_token_budget(limits, model.context_len)
    logprob = _per_item(obj.return_logprob, items)
    total = 0
    for i in range(items):
        prompt = len(token_lists[i]) if obj.text is None and i < len(token_lists) else 0
        extras = cost.extras_per_step(params[i], tops[i], id_lists[i] if i < len(id_lists) else None,
                                      bool(logprob[i]))
        total += cost.prompt_cost(prompt, params[i], model.context_len, extras)
    if total > budget:
        found.append(_budget_line(total, budget, name))
    if not found:
        # Last, once n and the batch are bounded: SGLang's split expands n x prompts (n = 2**31
        # first made it build lists of that length, and the server died).
        found += [problem] if (problem := fields.split_problem(obj)) else []
    return found


def check(obj: Any, *, model: Model, limits: Any, names: Optional[dict] = None) -> None:
    found = problems(obj, model=model, limits=limits, names=names)
    if found:
        raise Refused("; ".join(found))


class Tally:
    """The cost of one request's prompts so far, as SGLang tokenizes them."""

    def __init__(self, budget: int) -> None:
        self.budget, self.total, self.prompts = budget, 0, 0


# The request being tokenized: set by around_generate in the task that runs SGLang's
# generate_request (its batch's tokenizing tasks inherit it).
_tally: contextvars.ContextVar[Optional[Tally]] = contextvars.ContextVar("farskip_request_tally", default=None)


def charge(obj: Any, prompt_tokens: int, *, model: Model, tally: Tally) -> None:
    """Check 2: add one tokenized prompt's cost (obj: that prompt's sub-request)."""
    if not hasattr(obj, "top_logprobs_num"):  # embedding: the prompt alone
        tally.total += prompt_tokens
    else:
        params = obj.sampling_params or {}
        extras = cost.extras_per_step(params, obj.top_logprobs_num, obj.token_ids_logprob, bool(obj.return_logprob))
        tally.total += cost.prompt_cost(prompt_tokens, params, model.context_len, extras)
    tally.prompts += 1
    if tally.total > tally.budget:
        raise Refused(_budget_line(tally.total, tally.budget, lambda f: f)
                      + f" (counted once tokenized, over its first {tally.prompts} prompt(s))")


# ---------------------------------------------------------------- the hooks (HTTP process)
_limits: Any = None  # options.RuntimeOptions, set by configure()


def model_of(tokenizer_manager) -> Model:
    config = tokenizer_manager.model_config
    return Model(vocab_size=config.vocab_size, context_len=tokenizer_manager.context_len,
                 hidden_size=config.hidden_size)


def around_generate(original, self, obj, *args, **kwargs):
    """AROUND TokenizerManager.generate_request: check 1, then a fresh tally for check 2 in the
    task that runs SGLang's generator (the tasks it starts to tokenize a batch inherit it)."""
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput

    async def checked():
        model = model_of(self)
        if isinstance(obj, (GenerateReqInput, EmbeddingReqInput)):
            check(obj, limits=_limits, model=model)
        _tally.set(Tally(request_token_budget(_limits, model.context_len)))
        async for response in original(self, obj, *args, **kwargs):
            yield response

    return checked()


def after_validate_one(result, self, obj, input_ids, *args, **kwargs):
    """AFTER TokenizerManager._validate_one_request (SGLang's own length checks passed, the
    prompt truncated where the server allows it): check 2 for this prompt."""
    model = model_of(self)
    prompt = len(input_ids) if input_ids is not None else 0
    for overrides in (getattr(obj, "positional_embed_overrides", None), getattr(obj, "embed_overrides", None)):
        if overrides is not None:
            found = fields.override_problems(overrides, model.hidden_size, prompt_len=prompt)
            if found:
                raise Refused("; ".join(found))
    found = fields.position_problems(obj, prompt)
    if found:
        raise Refused("; ".join(found))
    tally = _tally.get() or Tally(request_token_budget(_limits, model.context_len))
    charge(obj, prompt, model=model, tally=tally)
    return None


# The OpenAI request fields that hold one prompt each when given as a list.
PROMPT_LISTS = ("prompt", "input", "items", "documents")


def _text_chars(value: Any) -> int:
    """Characters in every string of a parsed request (iterative: a deeply nested body is data)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, (list, tuple)):
            stack += v
        elif hasattr(v, "__pydantic_fields__"):
            stack += vars(v).values()
    return total


def openai_size_problem(request: Any, model: Model) -> Optional[str]:
    for field in PROMPT_LISTS:
        value = getattr(request, field, None)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) and len(value) > _limits.max_batch:
            return (f"{field}: {len(value)} prompts: give at most {_limits.max_batch} per request "
                    "(--farskip-max-batch): split it into several requests")
    chars, budget = _text_chars(request), request_char_budget(_limits, model.context_len)
    if chars > budget:
        return (f"the request holds {chars} characters of text: at most {budget} per request "
                "(--farskip-max-request-chars), checked before tokenizing: send less text")
    return None


async def around_openai(original, self, request, raw_request, *args, **kwargs):
    """AROUND OpenAIServingBase.handle_request: what tokenizing will cost, before it starts."""
    problem = openai_size_problem(request, model_of(self.tokenizer_manager))
    if problem:
        return self.create_error_response(message=problem, err_type="BadRequest", status_code=400)
    return await original(self, request, raw_request, *args, **kwargs)


def _openai_check(names: dict):
    def after_convert(result, self, request, *args, **kwargs):
        from sglang.srt.managers.io_struct import GenerateReqInput

        adapted = result[0]
        best_of = getattr(request, "best_of", None)
        if best_of is not None and not 1 <= best_of <= _limits.max_n:
            raise Refused(f"best_of={best_of}: give 1 to {_limits.max_n} (this server's maximum, --farskip-max-n)")
        if isinstance(adapted, GenerateReqInput):
            check(adapted, limits=_limits, names=names, model=model_of(self.tokenizer_manager))
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
        check(obj, limits=_limits, model=model_of(http_server._global_state.tokenizer_manager))
    except Refused as e:
        return http_server._create_error_response(e)
    return await original(obj, request, *args, **kwargs)


completion_check = _openai_check(COMPLETION_NAMES)
chat_check = _openai_check(CHAT_NAMES)


def configure(limits: Any) -> None:
    """Launcher only, in the process that serves HTTP, before it installs the hooks; `limits`:
    the launcher's RuntimeOptions (max_logprobs, max_n, max_request_tokens, max_batch,
    max_request_chars, max_stop_chars)."""
    global _limits
    _limits = limits
