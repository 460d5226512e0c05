"""The EAGLE head's training loss over its unrolled drafting steps, read on its draft vocabulary
(selfspec/core/draft_vocab.py).

The index shift, once. Pair i of a row is (f_i, x_{i+1}): the target's final hidden state at position i and the token
that followed. The head's output at pair i is its prediction of f_{i+1}, the LM head's input for token x_{i+2}:

    position      i          i+1          i+2
    target      f_i ───────▶ f_{i+1} ──LM head──▶ p(x_{i+2})
    head        (f_i, x_{i+1}) ─▶ f̂_{i+1} ──LM head rows V'──▶ q(x_{i+2})

Every unrolled step u (``EagleHead.forward``) predicts the same f_{i+1} at pair i, from u of its own earlier
predictions (drafting depth u + 1); pairs i < u have no such chain and are not scored. A pair is scored where x_{i+2}
is a training token (labels[i+2] != -100: assistant tokens on chat data).

loss_u = KL(p_target restricted to V' and renormalised || q) (``kind="kl"``) or the cross-entropy of the data's token
when it is in V' (``kind="ce"``), plus ``feature_weight`` * smooth-L1(f̂_{i+1}, f_{i+1}) (EAGLE's feature regression);
total = sum_u decay**u * loss_u. Accuracy (hits) is agreement with the target's own greedy token over the full
vocabulary: what greedy acceptance needs, and what a draft vocabulary that misses a token cannot reach.

Shapes: U unrolled steps, B batch, T time, n = T - 1 pairs, N scored pairs, D hidden size, V vocabulary,
V' draft vocabulary, R ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.training.losses import IGNORE_INDEX, MedusaLoss, head_weights


def eagle_loss(
    outs: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, head, lm_head: torch.nn.Module,
    kind: str = "kl", decay: float = 0.8, feature_weight: float = 0.1, ranks: int = 5,
) -> MedusaLoss:
    """outs [U, B, n, D] of ``EagleHead.forward``; features [B, T, D] the target's final hidden states; labels [B, T]
    aligned with the input (-100 = not a training token); lm_head the target's LM head (frozen; its bias, if any, counts).
    Accuracy (hits, count) is agreement with the target's own top token over the full vocabulary, which costs a
    full-vocabulary pass: ranks=0 skips it (hits [U, 0], count 0)."""
    U, B, n, D = outs.shape
    if features.shape[:2] != (B, n + 1) or labels.shape != (B, n + 1):
        raise ValueError(f"expected features [B, T, D] and labels [B, T] with B, T = {B}, {n + 1}, found "
                         f"{list(features.shape)} and {list(labels.shape)}")
    if kind not in ("ce", "kl"):
        raise ValueError(f"loss kind: expected 'ce' or 'kl', found {kind!r}")
    scored = torch.zeros(B, n, dtype=torch.bool, device=labels.device)
    scored[:, : n - 1] = labels[:, 2:] != IGNORE_INDEX  # pair i predicts x_{i+2}
    b, i = scored.nonzero(as_tuple=True)  # [N]
    f_next = features[b, i + 1].float()  # [N, D] what every step predicts at pair i
    vocab_ids = head.draft_vocab.tokens.to(features.device)  # [V']
    with torch.no_grad():
        weight = lm_head.weight.detach()  # [V, D]
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        target_top = torch.cat([F.linear(chunk.to(weight.dtype), weight, bias).argmax(-1)
                                for chunk in f_next.split(512)]) if len(f_next) and ranks else b.new_empty(0)  # [N]
        p_log = torch.log_softmax(head.draft_vocab.linear(lm_head, f_next).float(), dim=-1)  # [N, V']
        to_draft = torch.full((weight.shape[0],), -1, dtype=torch.long, device=features.device)
        to_draft[vocab_ids] = torch.arange(vocab_ids.numel(), device=features.device)
        data_y = to_draft[labels[b, i + 2].clamp(min=0)]  # [N] the data's token in V' (-1: outside it)
    weights = head_weights(U, decay).to(outs.device)
    losses, hits, counts = [], [], []
    for u in range(U):
        keep = i >= u  # [N] pairs with a chain of u own predictions behind them
        out_u = outs[u][b[keep], i[keep]]  # [n_u, D]
        q_log = torch.log_softmax(head.logits(out_u).float(), dim=-1)  # [n_u, V']
        m = max(int(keep.sum()), 1)
        if kind == "kl":
            p = p_log[keep]
            loss_u = (p.exp() * (p - q_log)).sum() / m
        else:
            y = data_y[keep]
            ok = y >= 0
            loss_u = -q_log[ok].gather(1, y[ok][:, None]).sum() / max(int(ok.sum()), 1)
        if feature_weight:
            loss_u = loss_u + feature_weight * F.smooth_l1_loss(out_u.float(), f_next[keep], reduction="sum") / (m * D)
        losses.append(loss_u)
        if not ranks:
            hits.append(torch.zeros(0, dtype=torch.long))
            counts.append(0)
            continue
        with torch.no_grad():
            top = vocab_ids[q_log.topk(min(ranks, q_log.shape[-1]), dim=-1).indices]  # [n_u, R] base token ids
            hit = (top == target_top[keep][:, None]).sum(0)
            hits.append(F.pad(hit, (0, ranks - hit.numel())).cpu())
            counts.append(int(keep.sum()))
    per_head = torch.stack(losses)
    return MedusaLoss(total=(weights * per_head).sum(), per_head=per_head.detach(), hits=torch.stack(hits),
                      count=torch.tensor(counts, dtype=torch.long))
