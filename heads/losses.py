"""The Medusa loss: a weighted sum of per-head losses, and each head's top-r accuracy on the same positions.

The index shift, stated once for the whole package. The LM head at position t predicts token t+1; head k (k = 1..K)
at position t predicts token t+1+k, k steps beyond it. With the labels aligned to the input (labels[t] is the token at
position t, or -100 where it is not a target: prompt, padding), head k at position t is trained on labels[t+1+k]:

    position        t     t+1    t+2    t+3    t+4
    LM head     (t) ─────▶ x
    head 1      (t) ────────────▶ x
    head 2      (t) ───────────────────▶ x
    head k      (t) ──────────────────────────▶ labels[t+1+k]

So head k is scored at positions t = 0 .. T-2-k: its logits[k-1, :, :T-1-k] against labels[:, 1+k:].

Self-distillation (``kind="kl"``) replaces the data's token by the target's own distribution for it: the target's
logits at position t+k are its distribution for token t+1+k, so head k at t is trained on
KL(p_target(. | tokens <= t+k) || q_head_k(. | tokens <= t)), on the same positions as the cross-entropy.

Total loss: sum_k w_k * loss_k with w_k = decay**(k-1). Each loss_k is a mean over the head's valid positions (0 when
it has none). Shapes: K heads, B batch, T time, V vocabulary, N valid positions of one head, R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """[K, R] long: positions where head k's rank-r candidate is the label (candidates ranked by logit)."""
    count: torch.Tensor
    """[K] long: positions head k was scored on."""

    def accuracy(self, top: int) -> torch.Tensor:
        """[K] fraction of positions where the label is among head k's ``top`` best candidates (0 with no positions)."""
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
    target_logits [B, T, V] are the target's own logits at every position. Accuracy is always measured against the
    labels, over the top ``ranks`` candidates of each head.
    """
    K, B, T, V = logits.shape
    if labels.shape != (B, T):
        raise ValueError(f"expected labels [B, T] = {[B, T]} to match logits [K, B, T, V], found {list(labels.shape)}")
    if kind not in ("ce", "kl"):
        raise ValueError(f"loss kind: expected 'ce' or 'kl', found {kind!r}")
    if kind == "kl" and (target_logits is None or target_logits.shape != (B, T, V)):
        found = None if target_logits is None else list(target_logits.shape)
        raise ValueError(f"kind='kl' needs the target's logits [B, T, V] = {[B, T, V]}, found {found}")
    weights = head_weights(K, decay).to(logits.device)
    losses, hits, counts = [], [], []
    for k in range(1, K + 1):
        n_pos = max(T - 1 - k, 0)
        head = logits[k - 1, :, :n_pos]  # [B, T-1-k, V]   positions t = 0 .. T-2-k
        label = labels[:, 1 + k : 1 + k + n_pos]  # [B, T-1-k]   labels[t+1+k]
        valid = label != IGNORE_INDEX  # [B, T-1-k]
        q_logits = head[valid].float()  # [N, V]
        y = label[valid]  # [N]
        n = y.numel()
        if kind == "ce":
            loss_k = F.cross_entropy(q_logits, y, reduction="sum") / max(n, 1)
        else:
            p_logits = target_logits[:, k : k + n_pos][valid].float()  # [N, V]   target at t+k -> token t+1+k
            log_p = F.log_softmax(p_logits, dim=-1)
            log_q = F.log_softmax(q_logits, dim=-1)
            loss_k = (log_p.exp() * (log_p - log_q)).sum() / max(n, 1)
        losses.append(loss_k)
        with torch.no_grad():
            top = q_logits.topk(min(ranks, V), dim=-1).indices  # [N, R]
            hit = (top == y[:, None]).sum(0)  # [R]
            hits.append(F.pad(hit, (0, ranks - hit.numel())))
            counts.append(n)
    per_head = torch.stack(losses)  # [K]
    return MedusaLoss(
        total=(weights * per_head).sum(),
        per_head=per_head.detach(),
        hits=torch.stack(hits).cpu(),
        count=torch.tensor(counts, dtype=torch.long),
    )
