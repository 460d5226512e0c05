"""Draft vocabularies: heads that draft only from the V' tokens most frequent in their training data (FR-Spec, EAGLE-3).

Every head that reads the target's LM head pays for a [V, D] matrix per call: on SmolLM2 (V = 49,152, D = 576) that is
56 MB in bf16, read once per Medusa step and once per Hydra / EAGLE / exit-head depth. The V' = 8,192 most frequent training tokens
cover ~96% of ShareGPT's assistant tokens; drafting from their rows reads a sixth of the matrix (measured on the 2-core
CPU in bf16: ~4 ms less per read, against a 44 ms one-token decoding step; docs/BENCHMARKS.md §10). Nothing changes for
correctness: the target verifies every drafted token, so output is lossless whatever the heads propose; a token outside
V' is simply never proposed.

    python -m heads.add_vocab runs/medusa-smollm2/heads --size 8192 [--out DIR]

adds a draft vocabulary to a Medusa, Hydra or exit-head checkpoint trained without one, counted on the data its
recipe names (``recipe.data``; ShareGPT by default). New training runs store one themselves (``heads.draft_vocab``,
``exit.draft_vocab``, ``eagle.draft_vocab``; default 8192).

Shapes: V vocabulary, V' draft vocabulary, D hidden size.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from heads.losses import IGNORE_INDEX

def token_counts(rows, vocab_size: int) -> np.ndarray:
    """[V] how often each token is a training token (labels != -100) of ``rows`` (a datasets.Dataset with "labels")."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows.iter(batch_size=1024):
        flat = np.fromiter((t for row in batch["labels"] for t in row if t != IGNORE_INDEX), dtype=np.int64)
        counts += np.bincount(flat, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(rows, size: int, vocab_size: int, always: tuple[int, ...] = (),
                     counts: np.ndarray | None = None) -> torch.Tensor:
    """The ``size`` token ids most frequent among the training tokens (labels != -100) of ``rows`` (a datasets.Dataset
    with a "labels" column; or ``counts`` from ``token_counts``), with ``always`` (e.g. end-of-turn tokens) included;
    ties by smaller id. Sorted, long [V']."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary: expected a size in 1..{vocab_size}, found {size}")
    counts = (token_counts(rows, vocab_size) if counts is None else counts).copy()
    counts[list(always)] = counts.max() + 1
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then smaller id
    return torch.from_numpy(np.sort(order[:size])).long()


def end_of_turn(tokenizer) -> tuple[int, ...]:
    """The token ids a draft vocabulary always holds: the tokenizer's end of turn, when it has one."""
    return tuple(t for t in (getattr(tokenizer, "eos_token_id", None),) if t is not None)


def check_draft_tokens(tokens, size: int, vocab_size: int) -> torch.Tensor:
    """``tokens`` as a long [size] tensor of distinct ids in [0, vocab_size), or a ValueError saying what is wrong."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if tokens.shape != (size,) or tokens.unique().numel() != tokens.numel():
        raise ValueError(f"expected {size} distinct token ids, found {tuple(tokens.shape)} with "
                         f"{tokens.unique().numel()} distinct")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"draft token ids must lie in [0, {vocab_size}), found {int(tokens.min())}..{int(tokens.max())}")
    return tokens


class DraftVocab(nn.Module):
    """The draft vocabulary of Medusa, Hydra, EAGLE or exit heads: a persistent ``tokens`` buffer [V'] when ``size``
    is set (stored in the checkpoint as ``draft_vocab.tokens``), nothing at all when it is None (the whole vocabulary,
    and the checkpoints of heads trained before draft vocabularies existed; an EAGLE head always has one). ``linear``
    is the frozen LM head on those rows."""

    def __init__(self, size: int | None, vocab_size: int):
        super().__init__()
        self.size, self.vocab_size = size, vocab_size
        if size is not None:
            self.register_buffer("tokens", torch.arange(size), persistent=True)  # [V'] long, sorted
        else:
            self.tokens = None
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def set(self, tokens) -> None:
        if self.size is None:
            raise ValueError("these heads draft from the whole vocabulary (draft_vocab_size None); build them with a "
                             "draft_vocab_size to give them a draft vocabulary")
        self.tokens.copy_(check_draft_tokens(tokens, self.size, self.vocab_size).to(self.tokens.device))
        self._rows = None

    def rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight [V', D] and bias [V'] (or None) on the draft vocabulary; cached, since drafting reads
        them every step (rebuilt when the vocabulary, the weight or its device changes)."""
        weight = lm_head.weight.detach()
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        if self.tokens is None:
            return weight, bias
        cached = self._rows  # keyed on the Parameter itself: weight.detach() is a new tensor at every call
        if (cached is None or cached[0] is not self.tokens or cached[1] is not lm_head.weight
                or cached[2].device != weight.device or cached[2].dtype != weight.dtype):
            index = self.tokens.to(weight.device)
            cached = self._rows = (self.tokens, lm_head.weight, weight[index], None if bias is None else bias[index])
        return cached[2], cached[3]

    def linear(self, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> logits [..., V'] through the frozen LM head's rows of the draft vocabulary."""
        weight, bias = self.rows(lm_head)
        return F.linear(x.to(weight.dtype), weight, bias)

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] -> [..., V'] (projections other than the frozen LM head)."""
        return logits if self.tokens is None else logits[..., self.tokens.to(logits.device)]

    def base_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary -> the base's token ids."""
        return index if self.tokens is None else self.tokens.to(index.device)[index]


def with_draft_vocab(heads: nn.Module, tokens: torch.Tensor, rebuild) -> nn.Module:
    """A copy of ``heads`` (Medusa or Hydra heads, an exit head) whose config and buffer hold the draft vocabulary
    ``tokens``; ``rebuild(config)`` makes empty heads of the same kind on the same base."""
    config = dataclasses.replace(heads.config, draft_vocab_size=int(tokens.numel()))
    new = rebuild(config)
    state = {k: v for k, v in heads.state_dict().items() if not k.startswith("draft_vocab.")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"draft_vocab.tokens"}:
        raise RuntimeError(f"rebuilding the heads with a draft vocabulary: missing {missing}, unexpected {unexpected}")
    new.draft_vocab.set(tokens)
    weight = next(heads.parameters(), None)  # an exit head of 0 blocks has none
    if weight is None:
        return new.eval()
    return new.to(device=weight.device, dtype=weight.dtype).eval()  # as stored: bf16 heads stay bf16
