"""How a next-token distribution is drawn from logits: one function for speculative and plain decoding alike.

The order and the tie rules match transformers' logits warpers (temperature, then top-k, then top-p), so sampling
through selfspec and ``model.generate(do_sample=True, ...)`` draw from the same distribution; a test pins this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. ``temperature == 0`` means greedy decoding (argmax, exact)."""

    temperature: float = 0.0
    """0 for greedy; > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""

    def __post_init__(self) -> None:
        for name, types in (("temperature", (int, float)), ("top_k", (int,)), ("top_p", (int, float))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, types):
                expected = "an int" if types == (int,) else "a number"
                raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
        if not (self.temperature >= 0.0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits [..., V] -> probs [..., V] (float32)."""
    if sampling.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding takes the argmax of the raw logits")
    scores = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - sampling.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """One token from logits [V]: the argmax when greedy, else a draw from process_logits."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    probs = process_logits(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator))
