"""The Medusa loss: a weighted sum of per-head losses, and each head's top-r accuracy on the same positions.

The index shift, stated once for the whole package. The LM head at position t predicts token t+1; head k (k = 1..K)
at position t predicts token t+1+k, k steps beyond it. With the labels aligned to the input (labels[t] is the token at
position t, or -100 where it is not a target: prompt, padding), head k at position t is trained on labels[t+1+k]:

    position        t     t+1    t+2    t+3    t+4
    LM head     (t) ─────▶ x
    head 1      (t) ────────────▶ x
    head 2      (t) ───────────────────▶ x
    head k      (t) ──────────────────────────▶ labels[t+1+k]

``head_targets`` applies this shift (targets[k-1, :, t] = labels[:, t+1+k]) and ``gather_scored`` the matching one
for the target's logits (position t+k); nothing else in the package shifts.

Self-distillation (``kind="kl"``) replaces the data's token by the target's own distribution for it: the target's
logits at position t+k are its distribution for token t+1+k, so head k at t is trained on
KL(p_target(. | tokens <= t+k) || q_head_k(. | tokens <= t)), on the same positions as the cross-entropy.

Total loss: sum_k w_k * loss_k with w_k = decay**(k-1). Each loss_k is a mean over the head's scored positions (0 when
it has none). Two entry points compute the same numbers:

- ``medusa_loss(logits [K, B, T, V], labels [B, T])``: the whole sequence, as MedusaHeads returns it;
- ``scored_loss(logits [K, N, V], targets [K, N])``: N positions already gathered (the trainer runs the heads only on
  positions some head is scored on; on chat data that skips the prompts, and it never builds [K, B, T, V]);
  ``batch_loss`` is it for a batch, or one per row of the batch (held-out counts).

On a draft vocabulary (``vocab``: the V' token ids heads draft from, heads/training/draft_vocab.py) the heads' logits
are [K, N, V'] and the loss is read there, as drafting reads them: the cross-entropy of the data's token where it lies
in V' (a token outside V' is no head's to draft, so it teaches nothing), the KL to the target's distribution
restricted to V' and renormalised; accuracy still counts every scored position, a token outside V' as a miss at every
rank (what the tree built from it will meet when drafting). With the frozen LM head shared, the logits on V' cost V'/V
of a full-vocabulary pass (on SmolLM2, 8,192 of 49,152 rows): the bulk of a training step on a CPU.

Shapes: K heads, B batch, T time, V vocabulary, V' draft vocabulary, N gathered positions, R ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MedusaLoss:
    total: torch.Tensor
    """scalar: sum_k w_k * per_head[k], differentiable."""
    per_head: torch.Tensor
    """[K] each head's loss (detached)."""
    hits: torch.Tensor
    """[K, R] long: positions where head k's rank-r candidate is the target token (candidates ranked by logit)."""
    count: torch.Tensor
    """[K] long: positions head k was scored on."""

    def accuracy(self, top: int) -> torch.Tensor:
        """[K] share of positions where the target is among head k's ``top`` best candidates (0 with no positions)."""
        return self.hits[:, :top].sum(1).double() / self.count.clamp(min=1).double()

    @property
    def top1(self) -> torch.Tensor:
        return self.accuracy(1)

    @property
    def top5(self) -> torch.Tensor:
        return self.accuracy(5)


def head_weights(num_heads: int, decay: float) -> torch.Tensor:
    """[K] w_k = decay**(k-1) for k = 1..K."""
    return torch.tensor([decay**k for k in range(num_heads)], dtype=torch.float32)


def head_targets(labels: torch.Tensor, num_heads: int, first: int = 1) -> torch.Tensor:
    """labels [B, T] -> targets [K, B, T]: targets[k-1, :, t] = labels[:, t+1+k], -100 where t+1+k >= T.

    first: the look-ahead of the first head (1 for Medusa heads; 0 for an exit head, which predicts t+1 like the LM
    head): targets[j, :, t] = labels[:, t+1+first+j].
    """
    B, T = labels.shape
    targets = labels.new_full((num_heads, B, T), IGNORE_INDEX)
    for j in range(num_heads):
        shift = 1 + first + j
        if T > shift:
            targets[j, :, : T - shift] = labels[:, shift:]
    return targets


def gather_scored(
    labels: torch.Tensor, num_heads: int, target_logits: torch.Tensor | None = None, first: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """The positions some head is scored on, and what each head is scored against there.

    labels [B, T] -> (scored [B, T] bool, targets [K, N] from ``head_targets``, and when target_logits [B, T, V] are
    given, K tensors [N, V]: the target's logits at t+k, its distribution for the token head k predicts at t).
    first: the first head's look-ahead, as in ``head_targets`` (0 for an exit head: the target's logits at t).
    """
    T = labels.shape[1]
    targets = head_targets(labels, num_heads, first)  # [K, B, T]
    scored = (targets != IGNORE_INDEX).any(0)  # [B, T]
    b, t = scored.nonzero(as_tuple=True)  # [N], [N]
    shifted = None
    if target_logits is not None:  # rows where t+k >= T are clamped; head k does not score them (target -100)
        shifted = [target_logits[b, (t + k).clamp(max=T - 1)] for k in range(first, first + num_heads)]
    return scored, targets[:, scored], shifted


def scored_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    decay: float = 0.8,
    kind: str = "ce",
    target_logits: Sequence[torch.Tensor] | torch.Tensor | None = None,
    ranks: int = 5,
    vocab: torch.Tensor | None = None,
) -> MedusaLoss:
    """logits [K, N, V] (or [K, N, V'] with ``vocab``); targets [K, N] (token ids from ``head_targets``, -100 = not
    scored).

    kind "kl": target_logits[k-1] [N, V] are the target's logits for the token head k predicts at each position (the
    target at t+k). Accuracy is always measured against ``targets``, over the top ``ranks`` candidates of each head;
    ranks=0 measures none (hits [K, 0], count 0). vocab [V']: the draft vocabulary the logits are on (see the module
    docstring; the target's logits may then be [N, V] or already [N, V']); None: the whole vocabulary.
    """
    K, N, V = logits.shape
    if targets.shape != (K, N):
        raise ValueError(f"expected targets [K, N] = {[K, N]} to match logits [K, N, V], found {list(targets.shape)}")
    if kind not in ("ce", "kl"):
        raise ValueError(f"loss kind: expected 'ce' or 'kl', found {kind!r}")
    if vocab is not None and vocab.shape != (V,):
        raise ValueError(f"expected the draft vocabulary [V'] = [{V}] of the logits [K, N, V'], found {list(vocab.shape)}")
    shapes = set() if target_logits is None else {tuple(p.shape) for p in target_logits}
    shape = shapes.pop() if len(shapes) == 1 else None  # (N, width), the same for every head
    # the target's logits are [N, V]; on a draft vocabulary [N, V'], or over the whole vocabulary (restricted below)
    fits = shape is not None and shape[0] == N and (shape[1] == V or (vocab is not None and shape[1] > int(vocab.max())))
    if kind == "kl" and not (fits and len(target_logits) == K):
        found = None if target_logits is None else [list(p.shape) for p in target_logits]
        want = "V" if vocab is None else f"V' = {V} (on the draft vocabulary) or the whole vocabulary (> {int(vocab.max())})"
        raise ValueError(f"kind='kl' needs the target's logits, one [N, {want}] per head ({K}) with N = {N}, "
                         f"found {found}")
    to_draft = None
    if vocab is not None:  # base token id -> column of the logits (-1: outside the draft vocabulary)
        size = max(int(vocab.max()), int(targets.max()) if targets.numel() else 0) + 1
        to_draft = torch.full((size,), -1, dtype=torch.long, device=logits.device)
        to_draft[vocab.to(logits.device)] = torch.arange(V, device=logits.device)
    weights = head_weights(K, decay).to(logits.device)
    losses, hits, counts = [], [], []
    for k, head in enumerate(logits.unbind(0)):  # unbind: its backward writes each head's gradient once
        valid = targets[k] != IGNORE_INDEX  # [N]
        q_logits = head[valid].float()  # [n, V] or [n, V']
        y = targets[k][valid]  # [n] base token ids
        n = y.numel()
        if kind == "ce" and to_draft is None:
            loss_k = F.cross_entropy(q_logits, y, reduction="sum") / max(n, 1)
        elif kind == "ce":
            col = to_draft[y]  # [n] column of y (-1: not in V')
            learn = col >= 0
            loss_k = F.cross_entropy(q_logits[learn], col[learn], reduction="sum") / max(int(learn.sum()), 1)
        else:
            p_logits = target_logits[k][valid]  # [n, V] or already [n, V']
            if vocab is not None and p_logits.shape[-1] != V:
                p_logits = p_logits[:, vocab.to(p_logits.device)]  # [n, V'] renormalised by the softmax below
            log_p = F.log_softmax(p_logits.float(), dim=-1)
            log_q = F.log_softmax(q_logits, dim=-1)
            loss_k = (log_p.exp() * (log_p - log_q)).sum() / max(n, 1)
        losses.append(loss_k)
        with torch.no_grad():
            top = q_logits.topk(min(ranks, V), dim=-1).indices  # [n, R] columns
            if vocab is not None:
                top = vocab.to(top.device)[top]  # [n, R] base token ids
            hit = (top == y[:, None]).sum(0)  # [R]
            hits.append(F.pad(hit, (0, ranks - hit.numel())).cpu())
            counts.append(n if ranks else 0)
    per_head = torch.stack(losses)  # [K]
    return MedusaLoss(total=(weights * per_head).sum(), per_head=per_head.detach(), hits=torch.stack(hits),
                      count=torch.tensor(counts, dtype=torch.long))


def medusa_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    decay: float = 0.8,
    kind: str = "ce",
    target_logits: torch.Tensor | None = None,
    ranks: int = 5,
) -> MedusaLoss:
    """logits [K, B, T, V] of MedusaHeads; labels [B, T] aligned with the input (-100 = ignore).

    kind "ce": cross-entropy against labels[t+1+k]; kind "kl": KL to softmax(target_logits[:, t+k]) where
    target_logits [B, T, V] are the target's own logits at every position.
    """
    K, B, T, V = logits.shape
    if labels.shape != (B, T):
        raise ValueError(f"expected labels [B, T] = {[B, T]} to match logits [K, B, T, V], found {list(labels.shape)}")
    if kind == "kl" and (target_logits is None or target_logits.shape != (B, T, V)):
        found = None if target_logits is None else list(target_logits.shape)
        raise ValueError(f"kind='kl' needs the target's logits [B, T, V] = {[B, T, V]}, found {found}")
    scored, targets, shifted = gather_scored(labels, K, target_logits if kind == "kl" else None)
    return scored_loss(logits[:, scored], targets, decay, kind, shifted, ranks)  # logits [K, N, V]


def batch_loss(logits: torch.Tensor, scored: torch.Tensor, targets: torch.Tensor,
               shifted: list[torch.Tensor] | None, decay: float, kind: str, ranks: int, per_row: bool = False,
               vocab: torch.Tensor | None = None) -> MedusaLoss | list[MedusaLoss]:
    """``scored_loss`` of a batch's gathered positions (``gather_scored``: scored [B, T], targets [K, N], shifted K x
    [N, V]; logits [K, N, V] or [K, N, V'] on ``vocab``), or with ``per_row`` a list with one MedusaLoss per row of the
    batch (for exact held-out counts across processes)."""
    if not per_row:
        return scored_loss(logits, targets, decay, kind, shifted, ranks, vocab)
    row_of = scored.nonzero()[:, 0]  # [N]
    outs = []
    for b in range(scored.shape[0]):
        m = row_of == b
        outs.append(scored_loss(logits[:, m], targets[:, m], decay, kind,
                                None if shifted is None else [p[m] for p in shifted], ranks, vocab))
    return outs


# ------------------------------------------------------------------------------------------ distribution distances
DIVERGENCES = ("kl", "rkl", "tv", "jsd")
"""the distances ``divergence`` computes between the target's distribution p and the draft's q."""


def divergence(kind: str, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """log_p, log_q [N, V] (log-probabilities: each row sums to 1 in probability) -> [N], one distance per row:

        kl   KL(p || q) = sum p (log p - log q)            forward KL (mass-covering)
        rkl  KL(q || p) = sum q (log q - log p)            reverse KL (mode-seeking)
        tv   TV(p, q)   = 1/2 sum |p - q|                  total variation: 1 - TV is the chance a draft drawn from q
                                                           is accepted by rejection sampling against p (DSpark's L1)
        jsd  JSD(p, q)  = 1/2 KL(p || m) + 1/2 KL(q || m),  m = (p + q) / 2   (bounded by log 2)

    Gradients flow into both arguments (the caller detaches the target's)."""
    if log_p.shape != log_q.shape:
        raise ValueError(f"expected log_p and log_q of one shape [N, V], found {list(log_p.shape)} and "
                         f"{list(log_q.shape)}")
    p, q = log_p.exp(), log_q.exp()
    if kind == "kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "jsd":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        return 0.5 * (p * (log_p - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    raise ValueError(f"divergence kind: expected one of {list(DIVERGENCES)}, found {kind!r}")


def confidence_bce(logits: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """logits [N] of a confidence head, accepted [N] bool (whether the target kept that position's draft) -> the mean
    binary cross-entropy (0 with no rows): sigmoid(logit) learns the chance of acceptance."""
    if logits.numel() == 0:
        return logits.sum()
    return F.binary_cross_entropy_with_logits(logits.float(), accepted.float())
