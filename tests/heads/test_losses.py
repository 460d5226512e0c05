"""The Medusa loss: the index shift (head k at t is trained on labels[t+1+k]), ignored positions, weights, KL,
accuracy, and the gathered form the trainer uses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from heads.training.losses import IGNORE_INDEX, gather_scored, head_weights, medusa_loss, scored_loss

K, B, T, V = 3, 2, 12, 50


def labels_arange() -> torch.Tensor:
    """[B, T] distinct tokens per position, so that each shift names a different token."""
    return torch.stack([torch.arange(T) + 3, torch.arange(T) + 20])


def oracle_logits(labels: torch.Tensor, shift: int, scale: float = 100.0) -> torch.Tensor:
    """logits [K, B, T, V] where head k (1-based) at t puts all mass on labels[t + shift + k] (when it exists)."""
    logits = torch.zeros(K, B, T, V)
    for k in range(1, K + 1):
        for t in range(T):
            if 0 <= t + shift + k < T:
                logits[k - 1, torch.arange(B), t, labels[:, t + shift + k]] = scale
    return logits


def test_only_the_right_shift_gives_zero_loss_and_exact_accuracy():
    labels = labels_arange()
    right = medusa_loss(oracle_logits(labels, shift=1), labels)
    assert right.per_head.max().item() < 1e-30
    assert right.top1.tolist() == [1.0, 1.0, 1.0]
    assert right.count.tolist() == [B * (T - 1 - k) for k in range(1, K + 1)]
    for wrong_shift in (0, 2):  # the LM-head-like shift t+k, and one too far
        wrong = medusa_loss(oracle_logits(labels, shift=wrong_shift), labels)
        assert wrong.per_head.min().item() > 10.0
        assert wrong.top1.max().item() == 0.0


def test_ignored_labels_are_not_scored():
    labels = labels_arange()
    logits = oracle_logits(labels, shift=1)
    masked = labels.clone()
    masked[:, 5:] = IGNORE_INDEX
    out = medusa_loss(logits, masked)
    # head k is scored on positions t with t+1+k < 5: 4-k positions per row
    assert out.count.tolist() == [B * (4 - k) for k in range(1, K + 1)]
    assert out.top1.tolist() == [1.0, 1.0, 1.0]
    # garbage logits on ignored positions change nothing
    noisy = logits.clone()
    for k in range(1, K + 1):
        noisy[k - 1, :, 4 - k :] = torch.randn(B, T - 4 + k, V) * 50
    assert torch.equal(medusa_loss(noisy, masked).per_head, out.per_head)


def test_total_is_decay_weighted_sum_of_per_head_cross_entropy():
    torch.manual_seed(0)
    logits, labels = torch.randn(K, B, T, V), torch.randint(0, V, (B, T))
    out = medusa_loss(logits, labels, decay=0.5)
    for k in range(1, K + 1):
        ref = F.cross_entropy(logits[k - 1, :, : T - 1 - k].reshape(-1, V), labels[:, 1 + k :].reshape(-1))
        assert out.per_head[k - 1].item() == pytest.approx(ref.item(), rel=1e-6)
    assert head_weights(K, 0.5).tolist() == [1.0, 0.5, 0.25]
    expected = sum(0.5 ** (k - 1) * out.per_head[k - 1].item() for k in range(1, K + 1))
    assert out.total.item() == pytest.approx(expected, rel=1e-6)


def test_top5_counts_ranks_below_five():
    labels = labels_arange()
    logits = torch.zeros(K, B, T, V)
    logits[..., 40:44] = 10.0  # four decoys always rank above the label
    for k in range(1, K + 1):
        for t in range(T - 1 - k):
            logits[k - 1, torch.arange(B), t, labels[:, t + 1 + k]] = 5.0  # the label: rank 4
    out = medusa_loss(logits, labels, ranks=6)
    assert out.top1.tolist() == [0.0] * K
    assert out.top5.tolist() == [1.0] * K
    assert out.hits[:, 4].tolist() == out.count.tolist()


def test_kl_is_zero_only_when_head_k_at_t_matches_target_at_t_plus_k():
    torch.manual_seed(1)
    target = torch.randn(B, T, V) * 3
    labels = torch.randint(0, V, (B, T))
    right = torch.zeros(K, B, T, V)
    off = torch.zeros(K, B, T, V)
    for k in range(1, K + 1):
        right[k - 1, :, : T - k] = target[:, k:]  # head k at t  <-  target at t+k
        off[k - 1, :, : T - k - 1] = target[:, k + 1 :]  # one too far
    assert medusa_loss(right, labels, kind="kl", target_logits=target).per_head.abs().max().item() < 1e-5
    assert medusa_loss(off, labels, kind="kl", target_logits=target).per_head.min().item() > 0.5
    with pytest.raises(ValueError, match="kind='kl' needs the target's logits"):
        medusa_loss(right, labels, kind="kl")


def test_sequence_too_short_for_a_head_gives_zero_not_nan():
    labels = torch.randint(0, V, (B, 3))
    out = medusa_loss(torch.randn(K, B, 3, V, requires_grad=True), labels)
    assert out.count.tolist() == [B * 1, 0, 0]
    assert all(math.isfinite(x) for x in out.per_head.tolist())
    assert out.per_head[1:].tolist() == [0.0, 0.0]
    out.total.backward()


def test_shape_mismatch_says_expected_and_found():
    with pytest.raises(ValueError, match=r"expected labels \[B, T\] = \[2, 12\].*found \[2, 11\]"):
        medusa_loss(torch.zeros(K, B, T, V), torch.zeros(B, T - 1, dtype=torch.long))


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_loss_on_gathered_positions_equals_the_whole_sequence_loss(kind):
    """The trainer runs the heads only where some head is scored; that must not change a single number."""
    torch.manual_seed(2)
    logits, target = torch.randn(K, B, T, V), torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    labels[0, :6] = IGNORE_INDEX  # a prompt
    labels[1, 9:] = IGNORE_INDEX  # padding
    whole = medusa_loss(logits, labels, kind=kind, target_logits=target, ranks=7)
    scored, targets, shifted = gather_scored(labels, K, target if kind == "kl" else None)
    assert scored.sum() < B * T  # positions no head is scored on were dropped
    gathered = scored_loss(logits[:, scored], targets, kind=kind, target_logits=shifted, ranks=7)
    assert torch.equal(whole.per_head, gathered.per_head) and torch.equal(whole.hits, gathered.hits)
    assert torch.equal(whole.count, gathered.count)
    # head k at t is scored on labels[t+1+k]; labels[0, :6] are ignored, so row 0's first scored position is t = 2,
    # where only head 3 (k = 3) has a target: labels[0, 6]
    assert scored[0].nonzero()[0].item() == 2
    assert targets[:, 0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, labels[0, 6].item()]
    unmeasured = scored_loss(logits[:, scored], targets, kind=kind, target_logits=shifted, ranks=0)
    assert torch.equal(unmeasured.per_head, gathered.per_head)  # ranks=0: the same loss, no accuracy measured
    assert unmeasured.hits.shape == (K, 0) and unmeasured.count.tolist() == [0] * K


def test_on_a_draft_vocabulary_the_loss_reads_its_columns_and_counts_tokens_outside_it_as_misses():
    """scored_loss(vocab=...): logits [K, N, V'] over V' token ids. The cross-entropy of a token in V' is the
    cross-entropy over V' alone; a token outside V' teaches nothing but is a miss at every rank; the KL is to the
    target's distribution restricted to V' and renormalised."""
    torch.manual_seed(0)
    vocab = torch.tensor([2, 5, 7, 11, 13, 17, 19, 23, 29, 31])  # V' = 10 of V = 50
    N = 40
    full = torch.randn(K, N, V) * 3
    targets = vocab[torch.randint(0, len(vocab), (K, N))]
    targets[:, ::4] = 40  # every 4th position's token lies outside V'
    targets[1, 1] = IGNORE_INDEX
    out = scored_loss(full[..., vocab], targets, vocab=vocab, ranks=10)
    for k in range(K):
        valid = targets[k] != IGNORE_INDEX
        inside = valid & torch.isin(targets[k], vocab)
        col = (targets[k][inside][:, None] == vocab).float().argmax(1)
        want = F.cross_entropy(full[k][inside][:, vocab], col)
        assert math.isclose(out.per_head[k].item(), want.item(), rel_tol=1e-5)
        assert out.count[k].item() == int(valid.sum())  # outside V' still counted ...
        masked = full[k].clone()
        masked[:, [t for t in range(V) if t not in vocab.tolist()]] = float("-inf")
        rank = (masked[valid] > masked[valid].gather(1, targets[k][valid].clamp(min=0)[:, None])).sum(1)
        hits = [int(((rank == r) & torch.isin(targets[k][valid], vocab)).sum()) for r in range(10)]
        assert out.hits[k].tolist() == hits  # ... as a miss at every rank
    assert out.hits.sum() < out.count.sum()
    # the full-vocabulary loss of the same logits differs: the softmax there runs over all 50 tokens
    assert not torch.allclose(scored_loss(full, targets).per_head, out.per_head)

    # KL on V': zero when the head's logits equal the target's on V' (whatever the target puts outside V')
    target = [torch.randn(N, V) * 2 for _ in range(K)]
    same = torch.stack([p[:, vocab] + 1.5 for p in target])  # shifted: the softmax over V' is the same
    kl = scored_loss(same, targets, kind="kl", target_logits=target, vocab=vocab)
    assert kl.per_head.abs().max().item() < 1e-5
    restricted = scored_loss(same * 0.5, targets, kind="kl", target_logits=[p[:, vocab] for p in target], vocab=vocab)
    assert torch.equal(restricted.per_head,  # the target's logits given on V' already (TargetStates' logit_rows)
                       scored_loss(same * 0.5, targets, kind="kl", target_logits=target, vocab=vocab).per_head)
    with pytest.raises(ValueError, match=r"V' = 10 \(on the draft vocabulary\) or the whole vocabulary"):
        scored_loss(same, targets, kind="kl", target_logits=[p[:, :20] for p in target], vocab=vocab)
    off = scored_loss(torch.zeros(K, N, len(vocab)), targets, kind="kl", target_logits=target, vocab=vocab)
    p_v = F.softmax(target[0][targets[0] != IGNORE_INDEX][:, vocab], -1)
    want = (p_v * (p_v.log() - math.log(1 / len(vocab)))).sum(-1).mean()
    assert math.isclose(off.per_head[0].item(), want.item(), rel_tol=1e-5)
    with pytest.raises(ValueError, match=r"draft vocabulary \[V'\] = \[10\]"):
        scored_loss(full[..., vocab], targets, vocab=vocab[:5])


# ------------------------------------------------------------------------------------------ distribution distances
def test_the_divergences_are_their_hand_computed_values():
    """p = (1/2, 1/2), q = (1/4, 3/4): every value worked out by hand, in nats."""
    from heads.training.losses import divergence

    log_p = torch.tensor([[0.5, 0.5]]).log()
    log_q = torch.tensor([[0.25, 0.75]]).log()
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.14384
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # 0.13081
    m = (0.375, 0.625)
    jsd = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])) \
        + 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1]))  # 0.03382
    want = {"kl": kl, "rkl": rkl, "tv": 0.25, "jsd": jsd}
    for kind, value in want.items():
        assert divergence(kind, log_p, log_q).item() == pytest.approx(value, abs=1e-6), kind
    assert kl == pytest.approx(0.143841, abs=1e-6) and rkl == pytest.approx(0.130812, abs=1e-6)
    assert jsd == pytest.approx(0.033822, abs=1e-6)
    same = divergence("tv", log_p, log_p)
    assert same.item() == 0.0
    # rows are independent, each distance >= 0, JSD <= log 2 and TV <= 1 at disjoint supports
    far = torch.tensor([[1.0 - 1e-12, 1e-12], [0.5, 0.5]]).log()
    other = torch.tensor([[1e-12, 1.0 - 1e-12], [0.5, 0.5]]).log()
    assert divergence("tv", far, other).tolist() == pytest.approx([1.0, 0.0], abs=1e-9)
    assert divergence("jsd", far, other)[0].item() == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(ValueError, match=r"expected one of \['kl', 'rkl', 'tv', 'jsd'\], found 'l2'"):
        divergence("l2", log_p, log_q)
    with pytest.raises(ValueError, match=r"of one shape \[N, V\], found \[1, 2\] and \[1, 3\]"):
        divergence("kl", log_p, torch.zeros(1, 3))


def test_the_divergences_gradients_move_q_towards_p():
    from heads.training.losses import divergence

    log_p = torch.tensor([[0.7, 0.2, 0.1]]).log()
    for kind in ("kl", "rkl", "tv", "jsd"):
        z = torch.zeros(1, 3, requires_grad=True)
        before = divergence(kind, log_p, torch.log_softmax(z, -1)).item()
        for _ in range(50):
            loss = divergence(kind, log_p, torch.log_softmax(z, -1)).sum()
            (grad,) = torch.autograd.grad(loss, z)
            z = (z - 0.5 * grad).detach().requires_grad_()
        assert divergence(kind, log_p, torch.log_softmax(z, -1)).item() < 0.2 * before, kind


def test_the_confidence_bce_is_its_hand_computed_value():
    from heads.training.losses import confidence_bce

    logits = torch.tensor([0.0, math.log(3.0)])  # sigmoid: 1/2, 3/4
    accepted = torch.tensor([True, False])
    assert confidence_bce(logits, accepted).item() == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-6)
    assert confidence_bce(torch.zeros(0), torch.zeros(0, dtype=torch.bool)).item() == 0.0
