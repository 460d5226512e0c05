"""Where decoding stops before max_new_tokens: at an end-of-sequence token, a stop string, or any stopping criterion of
transformers, checked after every new token as ``model.generate`` checks them.

A speculative step adds several tokens at once; plain decoding would have stopped after the first of them that
completes a stop string, so the step's tokens are cut there (``first_stop``). The criteria are transformers' own
(``StopStringCriteria`` for stop strings: it matches a string across token boundaries, and across the prompt's end,
exactly as ``generate(stop_strings=..., tokenizer=...)`` does), called on the text up to each new token in turn.

Shapes: T tokens so far (the prompt included).
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria

Criterion = Callable[..., torch.Tensor]
"""a transformers ``StoppingCriteria`` (or any callable alike): (input_ids [1, T], scores) -> bool [1]. selfspec
passes scores=None: criteria that read the scores cannot be checked here."""


def stop_strings(tokenizer: PreTrainedTokenizerBase, strings: str | Sequence[str] | None) -> list[Criterion]:
    """The criterion ``generate(stop_strings=strings, tokenizer=tokenizer)`` uses; [] for no strings. Raises on an empty
    string (it would stop at once; ``generate`` cannot match one either)."""
    strings = [strings] if isinstance(strings, str) else list(strings or [])
    if not strings:
        return []
    bad = [s for s in strings if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop strings must be non-empty strings, found {bad[0]!r}")
    return [StopStringCriteria(tokenizer, strings)]


def first_stop(criteria: Sequence[Criterion], tokens: torch.Tensor, n_new: int,
               eos: Collection[int] = (), new: Sequence[int] | None = None) -> int | None:
    """tokens [T], the last n_new of them new -> the index j (0..n_new-1) of the first new token that is an
    end-of-sequence token or after which a criterion says stop (plain decoding ends there, that token included), or
    None. new: those n_new tokens as numbers where the caller has them (no read of ``tokens``)."""
    start = tokens.shape[0] - n_new
    new = tokens[start:].tolist() if new is None else list(new)
    for j in range(n_new):
        if new[j] in eos:
            return j
        ids = tokens[None, : start + j + 1]  # [1, t]: the text as generate holds it after new token j
        if any(bool(c(ids, None).any()) for c in criteria):
            return j
    return None
