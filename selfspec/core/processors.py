"""The logits processors a model's generation config asks for, applied to each tree node's own text as transformers
applies them.

``model.generate`` builds processors from the checkpoint's generation config (``no_repeat_ngram_size``,
``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``, ``begin_suppress_tokens``, ``forced_bos_token_id``,
``forced_eos_token_id``, ``exponential_decay_length_penalty``); they read the text before the next token. In a tree,
node i's text is the committed tokens and the drafts on its path, so each node gets transformers' own processor over
its own text: the nodes of one depth share a length and go through it as one batch. ``selfspec.core.sampling.path_scores``
runs them in ``generate``'s order (``before``: the sequence bias, ahead of the repetition penalty; ``after``: the
rest, after the end-of-sequence block of min_new_tokens).

Shapes: T committed tokens, N tree nodes, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from selfspec.core.tree import Tree

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""transformers' logits processor: (input_ids [B, L], scores [B, V]) -> scores [B, V]."""

@dataclass(frozen=True)
class Processors:
    before: tuple[Processor, ...] = ()
    """applied first, before the repetition penalty (transformers' sequence bias)."""
    after: tuple[Processor, ...] = ()
    """applied after the end-of-sequence block of min_new_tokens, in transformers' order."""


def from_config(gen: Any, prompt_length: int, max_new_tokens: int, eos: Sequence[int], device: str | torch.device
                = "cpu") -> Processors:
    """The processors ``model.generate`` builds from generation config ``gen`` for a prompt of ``prompt_length``
    tokens and ``max_new_tokens`` new ones (its max_length is their sum), eos the end-of-sequence ids."""
    before, after = [], []
    eos_ids = list(eos) or None
    if gen.sequence_bias is not None:
        before.append(SequenceBiasLogitsProcessor(sequence_bias=gen.sequence_bias))
    if gen.no_repeat_ngram_size is not None and gen.no_repeat_ngram_size > 0:
        after.append(NoRepeatNGramLogitsProcessor(gen.no_repeat_ngram_size))
    if gen.bad_words_ids is not None:
        after.append(NoBadWordsLogitsProcessor(gen.bad_words_ids, eos_ids))
    if gen.forced_bos_token_id is not None:
        after.append(ForcedBOSTokenLogitsProcessor(gen.forced_bos_token_id))
    if gen.forced_eos_token_id is not None:
        after.append(ForcedEOSTokenLogitsProcessor(prompt_length + max_new_tokens, gen.forced_eos_token_id,
                                                   device=device))
    if gen.exponential_decay_length_penalty is not None and eos_ids:
        after.append(ExponentialDecayLengthPenalty(gen.exponential_decay_length_penalty, eos_ids, prompt_length))
    if gen.suppress_tokens is not None:
        after.append(SuppressTokensLogitsProcessor(gen.suppress_tokens, device=device))
    if gen.begin_suppress_tokens is not None:
        begin = prompt_length + (1 if prompt_length == 1 and gen.forced_bos_token_id is not None else 0)
        after.append(SuppressTokensAtBeginLogitsProcessor(gen.begin_suppress_tokens, begin, device=device))
    return Processors(tuple(before), tuple(after))


def by_depth(processors: Sequence[Processor], scores: torch.Tensor, text: torch.Tensor, tree: Tree | None = None,
             tree_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """scores [N, V] after each node of a tree rooted at text's last token (tokens [N]; no tree: [1, V] after the
    text [T]) -> the processors' scores, each row's from its own text (the nodes of one depth as one batch)."""
    if not processors:
        return scores
    if tree is None:
        groups = [(torch.tensor([0]), text[None])]
    else:
        depths = tree.depth_tensor
        groups = []
        for d in range(int(depths.max()) + 1):
            rows = (depths == d).nonzero()[:, 0]  # [n]
            drafts = torch.stack([tree_tokens[list(tree.path_to(int(i))[1:])] for i in rows]) if d else \
                text.new_zeros(len(rows), 0)  # [n, d]: the drafts on each path, after the root
            groups.append((rows, torch.cat([text.expand(len(rows), -1), drafts.to(text.device)], dim=1)))
    out = scores.float().clone()
    for rows, ids in groups:
        rows = rows.to(out.device)
        part = out[rows]
        for proc in processors:
            part = proc(ids, part)
        out[rows] = part
    return out
