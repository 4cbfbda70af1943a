"""The fields of one request a client controls, each typed and bounded: what admission.py checks
before SGLang tokenizes a request. One line per problem, naming the field as the client sent it,
its value, the limit and the fix.

Why each bound (SGLang 0.5.23, read at the source):
- `sampling_params` keys are SamplingParams' API fields, each of its declared type: a string
  where a number goes (`max_new_tokens: "10"`) is a 500 in the tokenizer manager, and the
  internal fields (`is_normalized`, `stop_strs`, ...) skip SGLang's own normalization, so that
  the scheduler reads unset values every step;
- `n`, `best_of` and `beam_width`: the sequences decoded per prompt (see cost.py);
- `top_k` above the vocabulary: SGLang bounds it only from below, and 1e12 overflows the int32
  tensor the scheduler builds for a batch's sampling (the scheduler ends);
- `token_ids_logprob`: the ids whose log-probabilities every step gathers, unbounded upstream;
- `logit_bias`: values are added to float32 logits: 1e39 is +inf there, then NaN probabilities;
- stop strings are searched in the whole output after every step (`stop_str in decoded_text`),
  so their length is bounded; stop regexes run on the scheduler thread after every step over a
  tail as long as the longest match (`get_max_seq_length`: unbounded for `*` and `+`): each must
  have a bounded longest match, no repetition or alternation inside a repetition (exponential
  backtracking), and a bounded search (REGEX_STEPS);
- token ids outside the vocabulary, `top_logprobs_num` above it, a negative `logprob_start_len`:
  an embedding lookup, `topk` or an assertion in the scheduler raises;
- embedding overrides (`/v1/score`'s `query_embed_overrides`, `/v1/embeddings`' `embed_overrides`)
  of another width than the model's hidden size: a shape mismatch in the model runner;
- prompt positions the scheduler reads at (`token_indices_to_pool`, `multi_item_delimiter_indices`:
  /v1/score fills them in, but /generate takes them from the client's JSON) outside the prompt:
  an IndexError in the logits processor.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from re import _constants as sre, _parser as sre_parse
from typing import Any, Callable

LOGIT_BIAS_MAX = 100.0  # OpenAI's documented range, -100 to 100
REGEX_STEPS = 65536  # about a millisecond of backtracking per stop regex and decode step
# SamplingParams' fields that SGLang fills in itself (its "Internal fields" section).
INTERNAL = frozenset({"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"})
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def shown(value: Any, width: int = 60) -> str:
    """A value for a message: a 30 MB string is not echoed back."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _kind(annotation: Any) -> str:
    """A declared type as a client reads it: `Optional[Set[int]]` is "a list of integers or null"."""
    args, origin = typing.get_args(annotation), typing.get_origin(annotation)
    if origin is typing.Union:
        kinds = [_kind(a) for a in args if a is not type(None)]
        return " or ".join(kinds + (["null"] if type(None) in args else []))
    if origin in (list, set):
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"an object of {_plural(args[1])}"
    return _KINDS.get(annotation, str(annotation).replace("typing.", ""))


def _plural(annotation: Any) -> str:
    return _kind(annotation).split(" ", 1)[-1] + "s"


def _types() -> dict[str, Any]:
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    return {f.name: f.type for f in msgspec.structs.fields(SamplingParams) if f.name not in INTERNAL}


def _typed(key: str, value: Any, kind: Any) -> bool:
    import msgspec

    try:
        msgspec.convert(value, kind, strict=True)
        return True
    except msgspec.ValidationError:
        return False


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# The prompt and its media: their list forms also describe one prompt (several images, ...).
_PROMPT_FIELDS = {"text", "image_data", "video_data", "audio_data"}


@functools.lru_cache(maxsize=None)
def per_item_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """The fields of SGLang's request dataclass `cls` declared `Union[List[T], T]`: one value for
    the request (a value or an object, as `sampling_params`), or a list of one per prompt of a
    batch. SGLang checks that list's length for a
    batch only for some of them, and for a single prompt only for a few (extra_key, cache_salt,
    kv_hints): `return_hidden_states: []` on one prompt went on to the scheduler and ended it
    (found by the fuzzer), and a list `rid` is a 500. Each as (name, whether an object is one of
    its values)."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        hint = hints.get(field.name)
        args = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else ()
        kinds = [typing.get_origin(a) for a in args if a is not type(None)]
        if field.name not in _PROMPT_FIELDS and list in kinds and any(k is not list for k in kinds):
            takes_objects = dict in kinds or any(a is dict or typing.get_origin(a) is dict for a in args)
            found.append((field.name, takes_objects))
    return tuple(found)


def per_item_problems(obj: Any, items: int, batch: bool) -> list[str]:
    """A per-item field given as a list: none for a single prompt, one per prompt for a batch."""
    found = [f"{name}: set by the server, not by a client: leave it out"
             for name in SERVER_SET if getattr(obj, name, None) is not None]
    for name, takes_objects in per_item_fields(type(obj)):
        value = getattr(obj, name, None)
        if isinstance(value, dict) and not takes_objects:
            found.append(f"{name}: an object ({shown(value)}): give one value, or a list of one per prompt")
        if not isinstance(value, list):
            continue
        if not batch:
            found.append(f"{name}: a list ({shown(value)}) for a single prompt: give one value (a list "
                         "gives one value per prompt of a batch)")
        elif len(value) != items:
            found.append(f"{name}: {len(value)} values for a batch of {items} prompts: give one value, "
                         "or one per prompt")
    return found


# Set by the tokenizer manager, never by a client (io_struct: "should be initialized by
# tokenizer manager"): a client's `lora_id` string on a batch ended in an IndexError, a 500.
SERVER_SET = ("lora_id", "http_worker_ipc")


def split_problem(obj: Any) -> str | None:
    """SGLang's own normalization and split of a request into its prompts, tried on a copy. It
    assumes shapes it does not check (a string `rid` on an embedding batch is an AssertionError,
    a 500): whatever else it raises there than its own ValueError (a 400 anyway) is the client's
    request it cannot split, named here instead of a 500."""
    trial = copy.deepcopy(obj)
    try:
        trial.normalize_batch_and_arguments()
        if isinstance(trial.rid, list) and trial.rid:
            # The first and the last item: a per-prompt value too short for the expanded batch
            # fails at the last. Not every item: 1024 prompts x n 16 took 2 s of the event loop.
            trial[0], trial[len(trial.rid) - 1]
    except ValueError:
        return None
    except Exception as e:  # noqa: BLE001 - exactly the unchecked shapes this reports
        return (f"the request's per-prompt fields do not fit its prompts ({type(e).__name__}: {e}): give "
                "each such field one value, or a list of one per prompt")
    return None


def session_problems(session: Any) -> list[str]:
    """`session_params` becomes `SessionParams(**session_params)` in the tokenizer manager: an
    unknown key or a value of another type was a 500 (found by the fuzzer: `{"": null}`)."""
    import msgspec
    from sglang.srt.managers.io_struct import SessionParams

    if session is None:
        return []
    kinds = {f.name: f.type for f in msgspec.structs.fields(SessionParams)}
    if not isinstance(session, dict):
        return [f"session_params: {shown(session)}: give an object with {', '.join(kinds)}"]
    for key, value in session.items():
        if key not in kinds:
            return [f"session_params: unknown key {shown(key)}: give only {', '.join(kinds)}"]
        if not _typed(key, value, kinds[key]):
            return [f"session_params.{key}={shown(value)}: give {_kind(kinds[key])}"]
    return []


def sampling_problems(params: Any, *, limits: Any, vocab_size: int, name: Callable[[str], str]) -> list[str]:
    """What is wrong with one prompt's sampling parameters (a dict as the client sent it)."""
    if not isinstance(params, dict):
        return [f"sampling_params={shown(params)}: give an object of sampling parameters"]
    types = _types()
    unknown = sorted(set(params) - set(types))
    if unknown:
        return [f"sampling_params: unknown field(s) {', '.join(map(repr, unknown))}: give only "
                f"{', '.join(sorted(types))}"]
    found = []
    for key, value in params.items():
        if not _typed(key, value, types[key]):
            found.append(f"{name(key)}={shown(value)}: give {_kind(types[key])}")
    if found:
        return found  # the bounds below read the values as their types

    cap = limits.max_n
    n, beam = params.get("n", 1), params.get("beam_width")
    if n is not None and not 1 <= n <= cap:
        found.append(f"n={n}: give 1 to {cap} samples per prompt (this server's maximum, --farskip-max-n)")
    if beam is not None and not 1 <= beam <= cap:
        found.append(f"beam_width={beam}: give 1 to {cap} beams per prompt (this server's maximum, --farskip-max-n)")

    top_k = params.get("top_k")
    if top_k is not None and top_k != -1 and not 1 <= top_k <= vocab_size:
        found.append(f"top_k={top_k}: give -1 (the whole vocabulary) or 1 to {vocab_size} (the vocabulary's size)")

    chars = limits.max_stop_chars
    for stop in _as_list(params.get("stop")):
        if len(stop) > chars:
            found.append(f"{name('stop')}: a stop string of {len(stop)} characters: give at most {chars} "
                         "(--farskip-max-stop-chars)")
            break
    for pattern in _as_list(params.get("stop_regex")):
        problem = regex_problem(pattern, chars)
        if problem:
            found.append(f"stop_regex={shown(pattern)}: {problem}")
            break

    bias = params.get("logit_bias") or {}
    if len(bias) > vocab_size:
        found.append(f"{name('logit_bias')}: {len(bias)} entries: give at most one per token of the vocabulary ({vocab_size})")
    for token, value in bias.items():
        if not (math.isfinite(value) and abs(value) <= LOGIT_BIAS_MAX):
            found.append(f"{name('logit_bias')}[{shown(token)}]={value}: give a bias from -{LOGIT_BIAS_MAX:g} to "
                         f"{LOGIT_BIAS_MAX:g} (added to float32 logits; {value} is not finite there)")
            break
    stop_ids = params.get("stop_token_ids") or []
    if len(stop_ids) > vocab_size:
        found.append(f"stop_token_ids: {len(stop_ids)} ids: give at most the vocabulary's {vocab_size}")
    return found


def regex_problem(pattern: str, max_chars: int) -> str | None:
    """Why a stop regex could hold the scheduler thread, or None."""
    from sglang.srt.sampling.sampling_params import get_max_seq_length

    try:
        parsed = sre_parse.parse(pattern)
    except Exception as e:  # re.error, RecursionError, OverflowError: SGLang's own check says more
        return f"not a regular expression ({e})"
    longest = get_max_seq_length(pattern)
    if longest > max_chars:
        return (f"it can match {'without bound' if longest >= 2**30 else f'{longest} characters'}: the scheduler "
                f"searches that much output after every step; give a pattern matching at most {max_chars} "
                "characters (bounded repeats such as {0,50} instead of * or +; --farskip-max-stop-chars)")
    try:
        steps = _backtracking(parsed) * (longest + 1)
    except _Nested:
        return ("a repetition or alternation inside a repetition can backtrack exponentially on the scheduler "
                "thread: repeat a single character or class, e.g. [ab]{0,10} instead of (a|b){0,10}")
    if steps > REGEX_STEPS:
        return (f"its repetitions can take about {steps} steps per search, after every generated token: "
                f"give narrower repeats (at most {REGEX_STEPS})")
    return None


class _Nested(Exception):
    pass


def _backtracking(parsed) -> int:
    """How many ways a match can be tried at one position: the product of each repetition's
    range (alternatives add); raises _Nested for a repetition or alternation inside a repetition."""
    work = 1
    for op, av in parsed:
        if op in _REPEATS:
            low, high, inner = av
            if high > 1 and _repeats_or_branches(inner):
                raise _Nested
            work *= (high - low + 1) * (_backtracking(inner) if high <= 1 else 1)
        elif op == sre.SUBPATTERN:
            work *= _backtracking(av[-1])
        elif op == sre.BRANCH:
            work *= sum(_backtracking(branch) for branch in av[1])
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            work *= _backtracking(av[1])
        elif op == sre.ATOMIC_GROUP:
            work *= _backtracking(av)
    return work


def _repeats_or_branches(parsed) -> bool:
    for op, av in parsed:
        if op in _REPEATS or op == sre.BRANCH:
            return True
        inner = {sre.SUBPATTERN: lambda: av[-1], sre.ATOMIC_GROUP: lambda: av,
                 sre.ASSERT: lambda: av[1], sre.ASSERT_NOT: lambda: av[1]}.get(op)
        if inner and _repeats_or_branches(inner()):
            return True
    return False


POSITION_FIELDS = ("token_indices_to_pool", "multi_item_delimiter_indices")


def position_problems(obj: Any, prompt_len: int) -> list[str]:
    """Positions of one tokenized prompt that must lie inside it."""
    found = []
    for field in POSITION_FIELDS:
        stack = [getattr(obj, field, None)]
        while stack:
            value = stack.pop()
            if isinstance(value, (list, tuple)):
                stack += value
            elif value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                        or not 0 <= value < prompt_len):
                found.append(f"{field}: position {shown(value)} is outside the prompt of {prompt_len} tokens")
                break
    return found


def override_problems(overrides: Any, hidden_size: int, prompt_len: int | None = None) -> list[str]:
    """Embedding overrides (SGLang's PositionalEmbeds, or lists of tensors) of the model's width,
    finite, at positions inside the prompt."""
    import torch

    from sglang.srt.managers.embed_types import PositionalEmbeds

    tensors, positions = [], []
    for item in overrides if isinstance(overrides, list) else [overrides]:
        if item is None:
            continue
        if not isinstance(item, (PositionalEmbeds, torch.Tensor)):  # raw JSON on /generate
            return ["embedding overrides as plain numbers are not taken on this route; give them "
                    "through /v1/score (query_embed_overrides, item_embed_overrides) or /v1/embeddings "
                    "(embed_overrides)"]
        embeds = getattr(item, "embeds", item)
        positions += list(getattr(item, "positions", []) or [])
        tensors += embeds if isinstance(embeds, list) else [embeds]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        width = t.shape[-1] if t.dim() else 0
        if t.dim() not in (1, 2) or width != hidden_size:
            return [f"embedding overrides of shape {list(t.shape)}: give vectors of the model's hidden size, "
                    f"{hidden_size} numbers each"]
        if not bool(torch.isfinite(t).all()):
            return ["embedding overrides: give finite numbers (NaN or infinity found)"]
    if prompt_len is not None and any(not 0 <= p < prompt_len for p in positions):
        return [f"embedding overrides at positions outside the prompt of {prompt_len} tokens"]
    return []
