"""What one request asks for: ``GenerationOptions``, one frozen object checked once, when it is made; and
``Decoding``, the same options bound to one model, as the decoding loop runs them.

``GenerationOptions`` plays the part of transformers' ``GenerationConfig`` for selfspec's API (``SpecModel.stream`` /
``generate`` / ``generate_plain``), its server and its benchmark: each of them builds one and hands it on. A field left
at None takes the model's own generation config's value when the request decodes (its repetition penalty, sampling
warpers, stop strings and minimum length), as ``model.generate`` does; what depends on the model (token ids inside its
vocabulary, the context length) is checked when the request meets it (``selfspec.core.generate.check_request``).

``Decoding`` is what ``generate.stream``, ``batch.Job`` and so the server's batcher take: those options with the
model's defaults filled in, and what only a model and its tokenizer make of them (its end-of-sequence tokens, the stop
strings' criteria, the generation config's logits processors, the seeded generator). Every option is still read from
the one ``GenerationOptions`` it holds.

The checks of the counts (``check_max_new_tokens`` and its siblings) live here once, for these options and for
callers of the decoding loop alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

from selfspec.core.logprobs import MAX_TOP
from selfspec.core.processors import Processors
from selfspec.core.sampling import Sampling
from selfspec.core.stopping import Criterion

AcceptRule = Literal["exact", "typical"]


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
    typical_p: float | None = None
    """locally typical sampling's mass (1.0 = off); None: the model's generation config's."""
    epsilon_cutoff: float | None = None
    """drop tokens less likely than this (0 = off); None: the model's generation config's."""
    eta_cutoff: float | None = None
    """eta sampling's cut (0 = off); None: the model's generation config's."""
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
        self.sampling()  # the sampling fields

    def sampling(self) -> Sampling:
        """The Sampling these options decode with; a field left to the model (None) counts as off here: fill it in
        first (``SpecModel`` does, from the generation config)."""
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        return Sampling(**{k: v for k, v in given.items() if v is not None})

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
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
"""the options ``Sampling`` takes: every one of them is a field of ``GenerationOptions`` too."""


def options_from(options: GenerationOptions | None, overrides: Mapping[str, Any]) -> GenerationOptions:
    """``options`` (None: the defaults) with keyword ``overrides``, as the API's calls take them."""
    base = options if options is not None else GenerationOptions()
    if not isinstance(base, GenerationOptions):
        raise TypeError(f"options: expected a GenerationOptions, found {type(base).__name__} {base!r:.60}")
    return base.replace(**overrides) if overrides else base


def split_options(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments -> (those naming generation options, the others)."""
    return ({k: v for k, v in kwargs.items() if k in FIELDS}, {k: v for k, v in kwargs.items() if k not in FIELDS})



@dataclass(frozen=True)
class Decoding:
    """One request bound to one model: what ``generate.stream`` decodes and ``batch.Job`` holds. Its options are
    read from ``options`` alone; the other fields are what the model and its tokenizer make of them.

    ``SpecModel`` builds one from a request (its options with the generation config's defaults filled in); the
    loop's own callers may build one from its keywords (``Decoding.of``)."""

    options: GenerationOptions
    """the request, the model's defaults filled in (a field still None counts as off: no penalty, no stop string,
    no minimum length)."""
    eos_token_id: tuple[int, ...] = ()
    """the end-of-sequence tokens (an int or a list is taken too)."""
    stopping_criteria: tuple[Criterion, ...] = ()
    """transformers' stopping criteria (``selfspec.core.stopping.stop_strings`` for the options' stop strings),
    checked after every new token as ``generate`` checks them."""
    processors: Processors = Processors()
    """the generation config's logits processors (``selfspec.core.processors.from_config``), applied to each node's
    own text."""
    generator: torch.Generator | None = None
    """the generator sampling draws from (``SpecModel``: one seeded with the options' seed); None: torch's global."""
    accept_rule: AcceptRule = "exact"
    """'exact' (lossless), or 'typical' (Medusa's typical acceptance: lossy, sampling only)."""
    sampling: Sampling = field(init=False, repr=False, compare=False)
    """``options.sampling()``, made once."""

    def __post_init__(self) -> None:
        if not isinstance(self.options, GenerationOptions):
            raise TypeError(f"options: expected a GenerationOptions, found {type(self.options).__name__}")
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", (eos,) if isinstance(eos, int) else tuple(eos or ()))
        object.__setattr__(self, "stopping_criteria", tuple(self.stopping_criteria))
        object.__setattr__(self, "sampling", self.options.sampling())
        if self.accept_rule not in ("exact", "typical"):
            raise ValueError(f"accept_rule must be 'exact' or 'typical', found {self.accept_rule!r}")
        if self.accept_rule == "typical" and self.sampling.greedy:
            raise ValueError("typical acceptance is a sampling rule: set temperature > 0, or use accept_rule='exact'")

    @classmethod
    def of(cls, max_new_tokens: int, sampling: Sampling = Sampling(), **keywords: Any) -> "Decoding":
        """The loop's keywords (``generate.stream(target, drafter, ids, 64, sampling=..., logprobs=3)``) as one
        Decoding: max_new_tokens, sampling and the options min_new_tokens, logprobs and prompt_logprobs become its
        ``options``; eos_token_id, stopping_criteria, processors, generator and accept_rule are its own fields."""
        own = {f.name for f in dataclasses.fields(cls) if f.init} - {"options"}
        loop_options = {"min_new_tokens", "logprobs", "prompt_logprobs"}
        if unknown := sorted(set(keywords) - own - loop_options):
            raise TypeError(f"unknown decoding argument(s) {', '.join(unknown)}: expected some of "
                            f"{', '.join(sorted(own | loop_options | {'max_new_tokens', 'sampling'}))}")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling: expected a Sampling, found {type(sampling).__name__} {sampling!r:.60}")
        options = GenerationOptions(max_new_tokens=max_new_tokens, stop=(),
                                    **{k: getattr(sampling, k) for k in SAMPLING_FIELDS},
                                    **{"min_new_tokens": 0, **{k: v for k, v in keywords.items() if k in loop_options}})
        return cls(options, **{k: v for k, v in keywords.items() if k in own})

    @property
    def eos(self) -> list[int]:
        return list(self.eos_token_id)

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def min_new_tokens(self) -> int:
        return self.options.min_new_tokens or 0


def as_decoding(decoding: "Decoding | int | None", keywords: Mapping[str, Any]) -> Decoding:
    """What the loop's entry points take: a Decoding, or max_new_tokens (an int, or a keyword) with the loop's
    keywords (``Decoding.of``); not both."""
    if isinstance(decoding, Decoding):
        if keywords:
            raise TypeError(f"give a Decoding or keywords, not both: found {', '.join(sorted(keywords))} beside it")
        return decoding
    if decoding is not None:
        return Decoding.of(decoding, **keywords)
    if "max_new_tokens" not in keywords:
        raise TypeError("expected a Decoding, or max_new_tokens (and the loop's keywords)")
    return Decoding.of(**keywords)
