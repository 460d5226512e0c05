"""Draft vocabularies: heads that draft only from the V' tokens most frequent in their training data (FR-Spec, EAGLE-3).

Every head that reads the target's LM head pays for a [V, D] matrix per call: on SmolLM2 (V = 49,152, D = 576) that is
56 MB in bf16, read once per Medusa step and once per Hydra / EAGLE / exit-head depth. The V' = 8,192 most frequent training tokens
cover ~96% of ShareGPT's assistant tokens; drafting from their rows reads a sixth of the matrix (what that saves per
step is measured in docs/benchmarks/log.md, "... and draft vocabularies"). Nothing changes for
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
from torch import nn

from heads.training.losses import IGNORE_INDEX


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


def count_vocabulary(vocab, train_rows, tokenizer) -> None:
    """Fill a head's draft vocabulary (``selfspec.core.draft_vocab.DraftVocab``) with the most frequent training
    tokens of ``train_rows`` and the end of turn; nothing for heads drafting from every token, or without rows."""
    if vocab.size is not None and train_rows is not None:
        vocab.set(draft_vocabulary(train_rows, vocab.size, vocab.vocab_size, end_of_turn(tokenizer)))


def draft_vocab_size(size: int, lm_head) -> int | None:
    """The draft vocabulary size of Medusa / Hydra / exit heads from its recipe key (heads.draft_vocab,
    exit.draft_vocab): None (every token) for 0 or a vocabulary no larger than it."""
    V = int(lm_head.weight.shape[0])
    return size if 0 < size < V else None
