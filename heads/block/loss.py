"""The block drafter's training objective: which blocks a row trains (``sample_anchors``) and the loss per block
offset (``block_loss``), read on the draft vocabulary (selfspec/core/draft_vocab.py).

The index shift, once. Pair j of a row is (f_j, x_{j+1}); its output predicts x_{j+2} (block offset 0, as drafting's
last true pair predicts the token after the root). Anchor j's mask i (i = 0 .. K-2) sits at position j + 1 + i and
predicts x_{j+3+i} (block offset 1 + i). A prediction of token x_t is compared with the target's own distribution for
it, the LM head at f_{t-1} (a DFlash draft, heads/block/dflash.py, has no pair outputs: its anchor j's block drafts
every offset k = 0 .. K-1 from slot 1 + k, x_{j+2+k}, the same positions):

    position          j          j+1         j+2         j+3        ...
    target            f_j ─────▶ f_{j+1} ──▶ p(x_{j+2})  p(x_{j+3}) ...
    pair j            (f_j, x_{j+1}) ──────▶ q(x_{j+2})                     offset 0
    anchor j, mask 0                         (mask_0 at j+1) ──▶ q(x_{j+3})  offset 1
    anchor j, mask i                                  (mask_i at j+1+i) ──▶ q(x_{j+3+i}), offset 1 + i

Offset 0 is scored at every pair whose x_{j+2} is a training token (labels != -100: assistant tokens on chat data);
offset 1 + i at every sampled anchor whose x_{j+3+i} is one. loss_k is, with p_target restricted to V' and
renormalised, KL(p || q) (``kind="kl"``), KL(q || p) (``"rkl"``), the total variation 1/2 |p - q|_1 (``"tv"``: one
minus the chance rejection sampling accepts a draft from q), the Jensen-Shannon divergence (``"jsd"``), the
cross-entropy of the data's token where it lies in V' (``"ce"``), or DSpark's (1 - ce_mix)·TV + ce_mix·CE
(``"tv_ce"``), a mean over the offset's scored positions; total = sum_k decay**k * loss_k. A conditioned block
(heads/block/condition.py) adds, at offsets >= 1, the Markov bias of the true token before the predicted one (teacher
forcing), and its confidence head's binary cross-entropy (acceptance: the draft's argmax is the target's argmax on V'). Accuracy (hits) is agreement with the target's own greedy
token over the full vocabulary, per offset: what greedy acceptance needs.

Anchors. A row trains A blocks (``block.anchors``), anchored at pairs whose block has at least one training token to
predict: the candidates are split into A equal strata in text order and one anchor is drawn uniformly in each
(every part of a row is trained, no two anchors in one stratum), by a generator seeded with (recipe seed, the row's
dataset index). So a row trains the same blocks in every epoch, on every process count and after a resume, and the
held-out measure is the same at every evaluation; a row with fewer candidates than A trains them all.

Shapes: B batch, T time, n = T - 1 pairs, A anchors, K block size, M = K - 1, N scored predictions of an offset,
D hidden size, V vocabulary, V' draft vocabulary, R ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.training.losses import DIVERGENCES, IGNORE_INDEX, MedusaLoss, confidence_bce, divergence, head_weights

SEED_STRIDE = 1_000_003
"""the anchor generator's seed is seed * SEED_STRIDE + the row's dataset index (a prime: no two rows of two seeds
collide below a million rows)."""


def sample_anchors(labels: torch.Tensor, block_size: int, count: int, seed: int, index: torch.Tensor,
                   first_offset: int = 1) -> torch.Tensor:
    """labels [B, T], index [B] (each row's dataset index) -> anchors [B, A] (A = ``count``): sorted pair indices j
    whose block holds a training token, one per stratum; -1 where a row has fewer. The block anchor j trains is
    x_{j+2+first_offset} .. x_{j+K+1}: offsets 1..K-1 for selfspec's block head (offset 0 is every pair's), all K
    (first_offset 0) for a DFlash draft, whose block drafts every offset."""
    B, T = labels.shape
    start, M = 2 + first_offset, block_size - first_offset
    trained = (labels[:, start:] != IGNORE_INDEX).int().cpu()  # [B, T - start] x_t a training token, t >= start
    windows = F.pad(trained, (0, block_size + 1)).unfold(1, M, 1)[:, : T - 1]  # [B, n, M] anchor j's targets
    candidates = windows.any(-1)  # [B, n]
    anchors = torch.full((B, count), -1, dtype=torch.long)
    for b in range(B):
        c = candidates[b].nonzero().flatten()  # [m] in text order
        m = c.numel()
        if m <= count:
            anchors[b, :m] = c
            continue
        g = torch.Generator().manual_seed(seed * SEED_STRIDE + int(index[b]))
        edges = torch.arange(count + 1) * m // count  # strata [edges[a], edges[a + 1])
        width = edges[1:] - edges[:-1]  # [A] each >= 1 since m > count
        picks = edges[:-1] + (torch.rand(count, generator=g) * width).long().clamp(max=width - 1)
        anchors[b] = c[picks]
    return anchors.to(labels.device)


BLOCK_LOSSES = ("kl", "ce", "rkl", "tv", "jsd", "tv_ce")
"""what ``block_loss`` can train on (``loss.kind``): the distances of heads/training/losses.py ``divergence`` to the
target's distribution, the cross-entropy of the data's token, or DSpark's mix (1 - ce_mix)·TV + ce_mix·CE."""


def block_loss(
    pairs: torch.Tensor, blocks: torch.Tensor, anchors: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
    head, kind: str = "kl", decay: float = 0.8, ranks: int = 5, input_ids: torch.Tensor | None = None,
    ce_mix: float = 0.1, confidence_weight: float = 0.1,
) -> MedusaLoss:
    """pairs [B, n, D] and blocks [B, A, M, D] of ``BlockHead.forward`` at ``anchors`` [B, A], or pairs None and
    blocks [B, A, K, D] (a DFlash draft's, heads/block/dflash.py: block offset k from slot k of the block); features
    [B, T, D] the target's final hidden states; labels [B, T] aligned with the input (-100 = not a training token).
    One row of the result per block offset k = 0 .. K-1. ranks=0 skips the accuracy (a full-vocabulary pass): hits
    [K, 0], count 0.

    A conditioned block (heads/block/condition.py) needs input_ids [B, T]: offset k >= 1's prediction of x_t gets the
    Markov bias of the true x_{t-1} (teacher forcing: what the target accepts), and its confidence head is trained
    with weight ``confidence_weight`` (a binary cross-entropy, added to each offset's loss) on whether the draft's
    argmax there is the target's."""
    B, T = labels.shape
    A = blocks.shape[1]
    M = blocks.shape[2] - (pairs is None)  # the offsets after 0
    if (features.shape[:2] != (B, T) or anchors.shape != (B, A)
            or (pairs is not None and pairs.shape[:2] != (B, T - 1))):
        raise ValueError(f"expected features [B, T, D], pairs [B, T - 1, D] and anchors [B, A] with B, T, A = {B}, {T}, "
                         f"{A} (labels [B, T]), found {list(features.shape)}, "
                         f"{None if pairs is None else list(pairs.shape)} and {list(anchors.shape)}")
    if kind not in BLOCK_LOSSES:
        raise ValueError(f"loss kind: expected one of {list(BLOCK_LOSSES)}, found {kind!r}")
    if head.chained and (input_ids is None or input_ids.shape != (B, T)):
        raise ValueError(f"a conditioned block's loss needs the input ids [B, T] = {[B, T]} (the tokens before each "
                         f"block position), found {None if input_ids is None else list(input_ids.shape)}")
    losses, hits, counts = [], [], []
    for k in range(M + 1):
        out, b, t = _offset(k, pairs, blocks, anchors, labels)  # [N, D], [N], [N]: predictions of x_t in row b
        prev = None if not head.chained or (k == 0 and pairs is not None) else input_ids[b, t - 1]  # [N] x_{t-1}
        loss_k, hit, count = _scored(out, features[b, t - 1].float(), labels[b, t], prev, head, kind, ranks, ce_mix,
                                     confidence_weight)
        losses.append(loss_k)
        hits.append(hit)
        counts.append(count)
    per_offset = torch.stack(losses)
    weights = head_weights(M + 1, decay).to(per_offset.device)
    return MedusaLoss(total=(weights * per_offset).sum(), per_head=per_offset.detach(), hits=torch.stack(hits),
                      count=torch.tensor(counts, dtype=torch.long))


def _offset(k: int, pairs: torch.Tensor | None, blocks: torch.Tensor, anchors: torch.Tensor,
            labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block offset k's scored predictions: their outputs [N, D], rows [N] and predicted positions t [N]."""
    T = labels.shape[1]
    if k == 0 and pairs is not None:  # pair j predicts x_{j+2}
        scored = torch.zeros_like(labels, dtype=torch.bool)[:, : T - 1]  # [B, n]
        scored[:, : T - 2] = labels[:, 2:] != IGNORE_INDEX
        b, j = scored.nonzero(as_tuple=True)
        return pairs[b, j], b, j + 2
    t = anchors + 2 + k  # [B, A] mask k - 1 (a DFlash draft: slot k) of anchor j predicts x_{j+2+k}
    scored = (anchors >= 0) & (t < T)
    scored &= labels.gather(1, t.clamp(max=T - 1)) != IGNORE_INDEX
    b, a = scored.nonzero(as_tuple=True)
    return blocks[b, a, k - (pairs is not None)], b, t[b, a]


def _scored(out: torch.Tensor, f_prev: torch.Tensor, y: torch.Tensor, prev: torch.Tensor | None, head, kind: str,
            ranks: int, ce_mix: float, confidence_weight: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One offset's loss (a mean over its N predictions; 0 with none), hits [R] and count, from the head's outputs
    [N, D], the target's final states before the predicted tokens f_prev [N, D], the data's tokens y [N] and, for a
    conditioned block's offsets >= 1, the true tokens before them prev [N] (None: no Markov bias here)."""
    code = None if prev is None else head.prev_code(prev)  # [N, r] or None
    logits = head.conditioned_logits(out, code) if head.chained else head.logits(out)
    q_log = torch.log_softmax(logits.float(), dim=-1)  # [N, V']
    N = out.shape[0]
    target_head = head.verifier_lm_head  # the target's LM head (a DFlash draft's own lm_head is another module)
    with torch.no_grad():
        p_log = torch.log_softmax(head.draft_vocab.linear(target_head, f_prev).float(), dim=-1)  # [N, V']
    loss = _distance(kind, p_log, q_log, y, head, ce_mix)
    if getattr(head, "confidence", None) is not None:
        accepted = q_log.argmax(-1) == p_log.argmax(-1)  # [N] (the target's argmax on the draft vocabulary)
        loss = loss + confidence_weight * confidence_bce(head.confidence_logits(out, code), accepted)
    if not ranks:
        return loss, torch.zeros(0, dtype=torch.long), 0
    with torch.no_grad():
        weight = target_head.weight.detach()  # [V, D]
        bias = None if getattr(target_head, "bias", None) is None else target_head.bias.detach()
        target_top = torch.cat([F.linear(chunk.to(weight.dtype), weight, bias).argmax(-1)
                                for chunk in f_prev.split(512)]) if N else y.new_empty(0)  # [N] the target's token
        vocab_ids = head.draft_vocab.tokens.to(out.device)  # [V']
        top = vocab_ids[q_log.topk(min(ranks, q_log.shape[-1]), dim=-1).indices]  # [N, R] base token ids
        hit = (top == target_top[:, None]).sum(0)
    return loss, F.pad(hit, (0, ranks - hit.numel())).cpu(), N


def _distance(kind: str, p_log: torch.Tensor, q_log: torch.Tensor, y: torch.Tensor, head, ce_mix: float) -> torch.Tensor:
    """The mean over N rows of the distance ``kind`` between the target's p and the draft's q (both [N, V'] log
    probabilities), or of the cross-entropy of the data's tokens y [N] where they lie in V' (``ce``), or the mix."""
    N = q_log.shape[0]
    if kind in DIVERGENCES:
        return divergence(kind, p_log, q_log).sum() / max(N, 1)
    vocab_ids = head.draft_vocab.tokens.to(q_log.device)  # [V']
    to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=q_log.device)
    to_draft[vocab_ids] = torch.arange(vocab_ids.numel(), device=q_log.device)
    yd = to_draft[y]  # [N] the data's token in V' (-1: outside it)
    ok = yd >= 0
    ce = -q_log[ok].gather(1, yd[ok][:, None]).sum() / max(int(ok.sum()), 1)
    if kind == "ce":
        return ce
    return (1.0 - ce_mix) * divergence("tv", p_log, q_log).sum() / max(N, 1) + ce_mix * ce  # tv_ce
