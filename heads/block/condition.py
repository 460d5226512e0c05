"""What the conditioned block adds to the block head (heads/block/model.py): a low-rank "Markov" logit bias keyed on
the token before each block position, and a confidence head per position (DSpark's two levers, DeepSpec 2026).

Why. One forward of the block head drafts positions 0 .. K-1 together: mask query k does not know which token the
drafter chose at k - 1, so a block position's distribution is a blend over every continuation of the one before it
("of course" and "of the" both pull the next position). A bias keyed on the previous token is a cheap correction
that can be chained after the forward, per tree node:

    logits_k(. | x_{k-1}) = lm_head(h_k) + bias(x_{k-1}),    bias(t) = up(down(e(t)))     [V'] rank r

    e(t)   the target's own input embedding of t (frozen, held by reference)           [D]
    down   Linear D -> r, no bias                                                         code(t) [r]
    up     Linear r -> V' (the draft vocabulary), no bias, zero at the start             bias(t) [V']

The embedding is the target's, not a table of the head's own: the previous token may be any token of the target's
vocabulary (the root, or a training token outside the draft vocabulary), similar tokens get similar biases from the
start, and it costs D·r + r·V' parameters (37k + 524k on SmolLM2 at r = 64, V' = 8192) instead of a V' x r table
that cannot key tokens outside V'. ``up`` starts at zero, so a new conditioned head drafts what the unconditioned one
would until training moves it. Block offset 0 gets no bias: its query is the last true pair, whose input holds the
root itself.

The confidence head reads a position's state (and, conditioned, the code of the token before it) and says how likely
the target is to accept that position's draft, given that the ones before it were accepted:

    c_k(x_{k-1}) = sigmoid(w . h_k + u . code(x_{k-1}) + b)       (u . code only with the bias, at offsets >= 1)

trained with a binary cross-entropy against whether the draft's argmax there (conditioned on the true token before
it: teacher forcing) is the target's own greedy token. A branch whose product of confidences falls below
``confidence_min`` stops (heads/block/chained.py).

Shapes: N rows, D hidden size, r rank, V' draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovBias(nn.Module):
    """bias(t) = up(down(e(t))): [N] previous tokens (target ids) -> [N, V'] logit biases on the draft vocabulary."""

    def __init__(self, hidden_size: int, rank: int, draft_vocab_size: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)  # [D] -> [r]
        self.up = nn.Linear(rank, draft_vocab_size, bias=False)  # [r] -> [V']
        nn.init.normal_(self.down.weight, std=hidden_size ** -0.5)
        nn.init.zeros_(self.up.weight)  # no bias at the start: the unconditioned block's drafts

    def code(self, embedded: torch.Tensor) -> torch.Tensor:
        """The previous tokens' embeddings [N, D] -> their codes [N, r]."""
        return self.down(embedded.to(self.down.weight.dtype))

    def bias(self, code: torch.Tensor) -> torch.Tensor:
        """codes [N, r] -> logit biases [N, V']."""
        return self.up(code)


class Confidence(nn.Module):
    """c = sigmoid(w . h + u . code + b): states [N, D] (and codes [N, r] when conditioned) -> logits [N]."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.state = nn.Linear(hidden_size, 1)  # w, b
        self.code = nn.Linear(rank, 1, bias=False) if rank else None  # u
        nn.init.zeros_(self.state.weight)
        nn.init.zeros_(self.state.bias)  # 1/2 everywhere at the start
        if self.code is not None:
            nn.init.zeros_(self.code.weight)

    def forward(self, states: torch.Tensor, code: torch.Tensor | None = None) -> torch.Tensor:
        out = self.state(states.to(self.state.weight.dtype))[..., 0]  # [N]
        if code is not None and self.code is not None:
            out = out + self.code(code.to(self.code.weight.dtype))[..., 0]
        return out
