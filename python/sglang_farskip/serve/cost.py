"""What one request costs the server, in tokens: the one cost model admission.py checks against
the per-request budget (`--farskip-max-request-tokens`).

For each prompt of a request (a batch item, a Vertex instance, a scored item):

    cost = prompt tokens + rows x new tokens x (1 + per-step extras / EXTRAS_PER_TOKEN)

- rows: the sequences the scheduler decodes for it: `beam_width` for a beam request (SGLang
  runs beam_width rows and returns n of them: io_struct's _handle_beam_search_parallel_sampling,
  beam_search/coordinator.py), else `n` (n parallel samples, each a request of its own);
- new tokens: `max_new_tokens`, or, when the client leaves it unset (None, as OpenAI chat
  does), up to the context; never past the context (SGLang refuses that itself);
- per-step extras: work the scheduler does for every generated token besides the token: the
  top-k log-probabilities asked for, the `token_ids_logprob` ids, the stop strings and stop
  regexes matched after each step. EXTRAS_PER_TOKEN of them weigh as much as one token.

The request's cost is the sum over its prompts. Prompt tokens are exact only once SGLang has
tokenized a text prompt; before that a text prompt counts 0 (a lower bound, so the early check
refuses only what tokenizing could not rescue) and the check after tokenization counts it.
"""

from __future__ import annotations

from typing import Any, Optional

EXTRAS_PER_TOKEN = 64
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default when a client sends none


def _count(value: Any) -> int:
    if value is None:
        return 0
    return 1 if isinstance(value, str) else len(value)


def rows(params: dict) -> int:
    """The sequences the scheduler decodes for one prompt."""
    beam = params.get("beam_width") or 1
    return beam if beam > 1 else params.get("n", 1) or 1


def new_tokens(params: dict, prompt_tokens: int, context_len: int) -> int:
    new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    room = max(0, context_len - prompt_tokens)
    return room if new is None else min(new, room)


def extras_per_step(params: dict, top_logprobs_num: Optional[int], token_ids_logprob: Any,
                    return_logprob: bool) -> int:
    logprobs = (top_logprobs_num or 0) + _count(token_ids_logprob) if return_logprob else 0
    return logprobs + _count(params.get("stop")) + _count(params.get("stop_regex"))


def prompt_cost(prompt_tokens: int, params: dict, context_len: int, extras: int = 0) -> int:
    """The cost of one prompt of a request (see the module's docstring)."""
    generated = rows(params) * new_tokens(params, prompt_tokens, context_len)
    return prompt_tokens + generated + generated * extras // EXTRAS_PER_TOKEN
