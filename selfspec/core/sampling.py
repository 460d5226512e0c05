"""How a next-token distribution is drawn from logits: one function for speculative and plain decoding alike.

The order and the tie rules match transformers' logits processors (a logit bias, the repetition penalty, the
end-of-sequence block of ``min_new_tokens``, the generation config's other processors (``selfspec.core.processors``),
presence / frequency penalties as a custom processor after them, then temperature, top-k, top-p, min-p and the
typical-p / epsilon / eta warpers), so greedy and sampled decoding through selfspec and ``model.generate(...)`` pick
from the same scores; tests pin this. The penalties and the end-of-sequence block depend on the text before each
position: in a tree, each node's text is the committed tokens and the drafts on its path (``repeated``, ``counted``,
and its depth for ``block_eos``); ``path_scores`` applies them all.

Shapes: T committed tokens, N tree nodes, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.generation.logits_process import EpsilonLogitsWarper, EtaLogitsWarper, TypicalLogitsWarper

from selfspec.core.processors import Processors, by_depth
from selfspec.core.tree import Tree


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. ``temperature == 0`` means greedy decoding (argmax, exact)."""

    temperature: float = 0.0
    """0 for greedy; > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    min_p: float = 0.0
    """keep the tokens whose probability, after top-p, is at least min_p times the most likely token's (0 = off)."""
    repetition_penalty: float = 1.0
    """transformers' repetition penalty (CTRL): the logits of tokens already in the text (the prompt included) are
    divided by it, multiplied where negative, before anything else; greedy decoding too. 1.0 = off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the answer (not the prompt) already holds. 0 = off."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the answer already holds it. 0 = off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token, bias) pairs added to the logits first, as OpenAI's ``logit_bias`` and transformers' one-token
    ``sequence_bias``."""
    typical_p: float = 1.0
    """locally typical sampling's mass, after min-p (1.0 = off); with epsilon_cutoff and eta_cutoff, transformers'
    own warpers, in its order (what a generation config may ask for)."""
    epsilon_cutoff: float = 0.0
    """drop tokens less likely than this (0 = off)."""
    eta_cutoff: float = 0.0
    """eta sampling's cut (0 = off)."""

    def __post_init__(self) -> None:
        for name, types in (("temperature", (int, float)), ("top_k", (int,)), ("top_p", (int, float)),
                            ("min_p", (int, float)), ("repetition_penalty", (int, float)),
                            ("presence_penalty", (int, float)), ("frequency_penalty", (int, float)),
                            ("typical_p", (int, float)), ("epsilon_cutoff", (int, float)), ("eta_cutoff", (int, float))):
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
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1] (1.0 = off), got {self.typical_p}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (0 = off), got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
            if not (ok and pair[0] >= 0 and isinstance(pair[1], (int, float)) and -100 <= pair[1] <= 100):
                raise ValueError(f"logit_bias must hold (token id >= 0, bias in [-100, 100]) pairs, got {pair!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def repeated(text: torch.Tensor, vocab: int, tree: Tree | None = None,
             tree_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens already in the text before each next token, as (row, token) index pairs, each pair once: text [T]
    -> pairs for one row; with a tree rooted at the text's last token and its tokens [N] -> pairs for N rows, row i
    adding the drafts on the path to node i. (Index pairs, not a [N, V] mask: a few thousand pairs against a
    vocabulary of tens of thousands per row.)"""
    seen = torch.unique(text)  # [U]
    rows = 1 if tree is None else len(tree)
    row = torch.arange(rows, device=text.device).repeat_interleave(seen.numel())  # [rows * U]
    col = seen.repeat(rows)
    if tree is None:
        return row, col
    in_text = torch.zeros(vocab, dtype=torch.bool, device=text.device)
    in_text[seen] = True
    node, ancestor = tree.on(text.device).ancestors.nonzero(as_tuple=True)  # node i, then each j on its path
    token = tree_tokens[ancestor]
    new = ~in_text[token]  # the text's tokens are penalised in every row already
    key = torch.unique(node[new] * vocab + token[new])  # a token twice on a path: once
    return torch.cat([row, key // vocab]), torch.cat([col, key % vocab])


def penalize_repeats(logits: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor], penalty: float) -> torch.Tensor:
    """logits [N, V], (row, token) pairs (``repeated``) -> float32 logits [N, V] (a copy) with the repetition penalty
    applied as transformers applies it (on float32 scores: divided where positive, multiplied where negative)."""
    scores = logits.to(torch.float32, copy=True)
    row, col = pairs
    hit = scores[row, col]
    scores[row, col] = torch.where(hit < 0, hit * penalty, hit / penalty)
    return scores


def counted(answer: torch.Tensor, vocab: int, tree: Tree | None = None,
            tree_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How often each token already occurs in the answer before each next token, as (row, token, count): answer [G]
    (the new tokens so far) -> one row; with a tree rooted at the answer's last token and its tokens [N] -> N rows,
    row i adding the drafts on the path to node i (the root is the answer's own last token: not counted twice)."""
    rows = 1 if tree is None else len(tree)
    keys = answer[None, :].expand(rows, -1) + torch.arange(rows, device=answer.device)[:, None] * vocab  # [rows, G]
    keys = keys.reshape(-1)
    if tree is not None:
        node, ancestor = tree.on(answer.device).ancestors.nonzero(as_tuple=True)
        drafted = ancestor > 0
        keys = torch.cat([keys, node[drafted] * vocab + tree_tokens[ancestor[drafted]]])
    key, count = torch.unique(keys, return_counts=True)
    return key // vocab, key % vocab, count


def penalize_presence(logits: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      presence: float, frequency: float) -> torch.Tensor:
    """logits [N, V], (row, token, count) (``counted``) -> float32 logits [N, V] (a copy) less frequency * count +
    presence for every token already in the row's answer: OpenAI's presence and frequency penalties."""
    scores = logits.to(torch.float32, copy=True)
    row, col, count = counts
    scores[row, col] -= frequency * count.to(torch.float32) + presence
    return scores


def path_scores(logits: torch.Tensor, sampling: Sampling, text: torch.Tensor, prompt_length: int,
                tree: Tree | None = None, tree_tokens: torch.Tensor | None = None, short: torch.Tensor | None = None,
                eos: Sequence[int] = (), processors: Processors = Processors()) -> torch.Tensor:
    """The scores each next token is chosen from, for a text [T] whose first ``prompt_length`` tokens are the prompt:
    logits [1, V] after the text, or [N, V] after each node of a tree rooted at its last token (tokens [N]) -> the same
    with everything ``generate`` applies before sampling, for each row's own text and in its order: the logit bias
    (and the generation config's sequence bias), the repetition penalty, the end-of-sequence block of min_new_tokens
    in the rows ``short`` (bool [N]) marks, the generation config's other processors, the presence / frequency
    penalties. ``logits`` itself when none is asked for (``unprocessed``, and no row ``short``)."""
    if short is None and unprocessed(sampling, processors):
        return logits
    vocab = logits.shape[-1]
    if sampling.logit_bias:
        bias = torch.zeros(vocab, dtype=torch.float32, device=logits.device)
        for token, value in sampling.logit_bias:
            if token >= vocab:
                raise ValueError(f"logit_bias names token {token}; this model's vocabulary has {vocab} (0..{vocab - 1})")
            bias[token] += value
        logits = logits.float() + bias
    logits = by_depth(processors.before, logits, text, tree, tree_tokens)
    if sampling.repetition_penalty != 1.0:
        logits = penalize_repeats(logits, repeated(text, vocab, tree, tree_tokens), sampling.repetition_penalty)
    if short is not None:
        logits = block_eos(logits, short, list(eos))
    logits = by_depth(processors.after, logits, text, tree, tree_tokens)
    if sampling.presence_penalty or sampling.frequency_penalty:
        counts = counted(text[prompt_length:], vocab, tree, tree_tokens)
        logits = penalize_presence(logits, counts, sampling.presence_penalty, sampling.frequency_penalty)
    return logits


def unprocessed(sampling: Sampling, processors: Processors) -> bool:
    """Whether ``path_scores`` returns the logits as they are (no bias, penalty or processor asked for; the
    end-of-sequence block of min_new_tokens aside, which the caller knows per step): the one list of what it applies,
    which its own early return reads too."""
    return (not sampling.logit_bias and not processors.before and not processors.after
            and sampling.repetition_penalty == 1.0 and not sampling.presence_penalty and not sampling.frequency_penalty)


class PresencePenalty:
    """OpenAI's presence and frequency penalties as a transformers logits processor, for ``model.generate`` (which has
    none): ``generate(..., logits_processor=LogitsProcessorList([PresencePenalty(prompt_length, p, f)]))``."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(input_ids.shape[0]):
            counts = counted(input_ids[i, self.prompt_length:], scores.shape[-1])
            out.append(penalize_presence(scores[i: i + 1], counts, self.presence, self.frequency))
        return torch.cat(out)


def block_eos(logits: torch.Tensor, rows: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """logits [N, V], rows bool [N] -> logits [N, V] (a copy where any row is blocked) with the end-of-sequence tokens
    at -inf in the chosen rows: transformers' ``min_new_tokens`` / ``min_length``, for the nodes whose text is still
    shorter than asked."""
    if not eos or not bool(rows.any()):
        return logits
    out = logits.clone()
    out[rows.nonzero()[:, :1], torch.tensor(eos, device=logits.device)] = float("-inf")
    return out


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p, min-p and the warpers typical-p, epsilon and eta. logits [..., V]
    -> probs [..., V] (float32)."""
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
    if sampling.min_p > 0.0:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    warpers = ([TypicalLogitsWarper(mass=sampling.typical_p)] if sampling.typical_p < 1.0 else []) + \
        ([EpsilonLogitsWarper(epsilon=sampling.epsilon_cutoff)] if sampling.epsilon_cutoff > 0.0 else []) + \
        ([EtaLogitsWarper(epsilon=sampling.eta_cutoff, device=scores.device)] if sampling.eta_cutoff > 0.0 else [])
    if warpers:  # transformers' own, on rows of [B, V] (they do not read the text)
        flat = scores.reshape(-1, scores.shape[-1])
        for warp in warpers:
            flat = warp(None, flat)
        scores = flat.reshape(scores.shape)
    return scores.softmax(dim=-1)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """One token from logits [V]: the argmax when greedy, else a draw from process_logits."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    probs = process_logits(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator))
