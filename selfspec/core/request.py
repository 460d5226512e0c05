"""What one request asks for: ``GenerationOptions``, one frozen object checked once, when it is made.

It plays the part of transformers' ``GenerationConfig`` for selfspec's API (``SpecModel.stream`` / ``generate`` /
``generate_plain``), its server and its benchmark: each of them builds one and hands it on. A field left at None takes
the model's own generation config's value when the request decodes (its repetition penalty, stop strings and minimum
length), as ``model.generate`` does; what depends on the model (token ids inside its vocabulary, the context length)
is checked when the request meets it (``selfspec.core.generate.check_request``).

The checks of the counts (``check_max_new_tokens`` and its siblings) live here once, for these options and for
callers of the decoding loop alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from selfspec.core.logprobs import MAX_TOP
from selfspec.core.sampling import Sampling


def check_max_new_tokens(max_new_tokens: Any) -> int:
    """An int >= 1: the TypeError or ValueError says what was found."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens: expected an int >= 1, found {max_new_tokens!r} "
                        f"({type(max_new_tokens).__name__})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, found {max_new_tokens}")
    return max_new_tokens


def check_min_new_tokens(min_new_tokens: Any) -> int:
    """An int >= 0."""
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, found {min_new_tokens!r}")
    return min_new_tokens


def check_logprobs(name: str, k: Any) -> int | None:
    """None, or how many alternatives per token to report: an int in 0..MAX_TOP."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP):
        raise ValueError(f"{name}: expected None or 0..{MAX_TOP} alternatives per token (an int), found {k!r}")
    return k


def _stops(stop: Any) -> tuple[str, ...] | None:
    """None (the model's own stop strings), or a tuple of stop strings from a string or a list of them."""
    if stop is None or isinstance(stop, str):
        return None if stop is None else (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
        return tuple(stop)
    raise TypeError(f"stop: expected a string or a list of strings, found {stop!r:.80}")


def _bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or its pairs) -> sorted-as-given (token, bias) pairs; the ranges are Sampling's to check."""
    pairs = bias.items() if isinstance(bias, Mapping) else (bias or ())
    return tuple((int(k), float(v)) for k, v in pairs)


@dataclass(frozen=True)
class GenerationOptions:
    """One request's decoding options, as ``model.generate`` takes them (and OpenAI's penalties and logit bias).
    Checked when made; ``replace(**changes)`` makes a checked copy."""

    max_new_tokens: int = 256
    """the most new tokens to generate."""
    temperature: float = 0.0
    """0: greedy (exact); > 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """nucleus sampling's mass (1.0 = off)."""
    top_k: int = 0
    """keep the k likeliest tokens (0 = off)."""
    min_p: float = 0.0
    """keep tokens at least min_p times as likely as the likeliest (0 = off)."""
    seed: int | None = None
    """makes a sampled request repeatable (None: torch's global generator)."""
    repetition_penalty: float | None = None
    """transformers' repetition penalty (1.0 = off); None: the model's generation config's."""
    presence_penalty: float = 0.0
    """OpenAI's, on the answer's tokens (0 = off)."""
    frequency_penalty: float = 0.0
    """OpenAI's, on the answer's tokens (0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits; a {token id: bias} dict is taken too."""
    stop: tuple[str, ...] | None = None
    """stop strings: decoding ends after the token that completes one (it stays in the output); () for none; None:
    the model's generation config's. A string or a list is taken too."""
    min_new_tokens: int | None = None
    """no end-of-sequence token before this many new tokens; None: the generation config's min_new_tokens and
    min_length."""
    logprobs: int | None = None
    """k: report the target's log-probability of each new token and its k likeliest alternatives (None: none)."""
    prompt_logprobs: int | None = None
    """k: the same for the prompt's tokens after the first (None: none)."""
    chat: bool = True
    """apply the chat template to a text prompt."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stops(self.stop))
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        check_max_new_tokens(self.max_new_tokens)
        if self.min_new_tokens is not None:
            check_min_new_tokens(self.min_new_tokens)
        check_logprobs("logprobs", self.logprobs)
        check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed: expected an int or None, found {self.seed!r:.40} ({type(self.seed).__name__})")
        if not isinstance(self.chat, bool):
            raise TypeError(f"chat: expected True or False, found {self.chat!r:.40}")
        self.sampling(1.0 if self.repetition_penalty is None else self.repetition_penalty)  # the sampling fields

    def sampling(self, repetition_penalty: float, **warpers: float) -> Sampling:
        """The Sampling these options decode with, given the repetition penalty in force (this request's, else the
        model's) and the model's own sampling warpers (typical_p, epsilon_cutoff, eta_cutoff)."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=repetition_penalty, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias, **warpers)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def replace(self, **changes: Any) -> "GenerationOptions":
        """A copy with ``changes`` (field names of these options), checked as a new one is."""
        if unknown := sorted(set(changes) - FIELDS):
            raise TypeError(f"unknown generation option(s) {', '.join(unknown)}: expected some of "
                            f"{', '.join(sorted(FIELDS))}")
        return dataclasses.replace(self, **changes)


FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationOptions))
"""the names ``GenerationOptions`` takes."""


def options_from(options: GenerationOptions | None, overrides: Mapping[str, Any]) -> GenerationOptions:
    """``options`` (None: the defaults) with keyword ``overrides``, as the API's calls take them."""
    base = options if options is not None else GenerationOptions()
    if not isinstance(base, GenerationOptions):
        raise TypeError(f"options: expected a GenerationOptions, found {type(base).__name__} {base!r:.60}")
    return base.replace(**overrides) if overrides else base


def split_options(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments -> (those naming generation options, the others)."""
    return ({k: v for k, v in kwargs.items() if k in FIELDS}, {k: v for k, v in kwargs.items() if k not in FIELDS})

