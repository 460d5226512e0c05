"""Lossless sampling: a tree drafter does not change the distribution of the sampled tokens.

Method. The exact joint probability of the first tokens is enumerated from the target's own processed distributions
(``process_logits``: temperature 0.8, top-p 0.9), samples are drawn with seeded generators, and a chi-square
goodness-of-fit test compares counts with expectations (cells with an expected count below 5 are pooled; a sample in a
cell of probability 0 fails outright).

Bound. Each check rejects when its p-value is below ALPHA = 1e-3: a correct sampler fails a check with probability at
most 1e-3 over the choice of seed (about 5e-3 for the whole file). The seeds are fixed, so the outcome is
reproducible. The p-value uses the Wilson-Hilferty approximation of the chi-square tail (scipy is not a dependency);
``test_chi_square_tail`` pins it against tabulated quantiles.

Power. The same checks on deliberately wrong rules (always accept the first child; forget the residual after a
rejection) must fail, so passing means something.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections import Counter
from typing import Callable

import pytest
import torch

from conftest import tiny_model
from selfspec import Acceptance, Draft, Drafter, DraftState, Sampling, Target, Tree, process_logits, sample_accept
from selfspec.core.generate import generate
from selfspec.testing import RandomDrafter
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.layerskip import LayerSkipDrafter
from selfspec.core.tree import DynamicTree

ALPHA = 1e-3
LOOP_MODULE = importlib.import_module("selfspec.core.generate")  # the module (``selfspec.core.generate`` is the function)
SAMPLING = Sampling(temperature=0.8, top_p=0.9)
TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])  # 3 candidates, then 2 and 1 below them


# ------------------------------------------------------------------------------------------------ the statistics
def chi_square_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), by Wilson-Hilferty: (X/df)^(1/3) is close to normal."""
    if x <= 0:
        return 1.0
    mean, var = 1.0 - 2.0 / (9 * df), 2.0 / (9 * df)
    z = ((x / df) ** (1.0 / 3.0) - mean) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def goodness_of_fit(counts: Counter, probs: dict, n: int) -> float:
    """p-value of counts (n samples) against exact cell probabilities; 0.0 if a sample fell where probability is 0."""
    if any(probs.get(cell, 0.0) <= 0.0 for cell in counts):
        return 0.0
    cells = sorted(probs, key=lambda c: probs[c], reverse=True)
    bins: list[tuple[float, int]] = []  # (expected, observed)
    pooled_e, pooled_o = 0.0, 0
    for cell in cells:
        e = n * probs[cell]
        if e >= 5.0:
            bins.append((e, counts.get(cell, 0)))
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + counts.get(cell, 0)
    if pooled_e > 0:
        if pooled_e < 5.0 and bins:  # too small on its own: merge with the smallest bin
            e, o = bins.pop()
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        bins.append((pooled_e, pooled_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return chi_square_sf(stat, max(len(bins) - 1, 1))


@pytest.mark.parametrize("df, x, p", [(10, 23.209, 1e-2), (10, 29.588, 1e-3), (30, 59.703, 1e-3), (100, 149.449, 1e-3),
                                      (30, 29.336, 0.5)])
def test_chi_square_tail(df, x, p):
    """Against tabulated chi-square quantiles: within 10% at the tail probabilities used here."""
    assert chi_square_sf(x, df) == pytest.approx(p, rel=0.1)


# ------------------------------------------------------------------------------- deliberately wrong rules (power)
def first_child_always(tree, tokens, p_target, q_draft=None, generator=None) -> Acceptance:
    """Wrong: accepts the first child at every level, then samples the bonus from the target."""
    node, path = 0, [0]
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    return Acceptance(path=tuple(path), bonus=int(torch.multinomial(p_target[node].float(), 1, generator=generator)))


def no_residual(tree, tokens, p_target, q_draft=None, generator=None) -> Acceptance:
    """Wrong: the min(1, p/q) test, but after a rejection p is left as it was (no residual) for the next child and
    the bonus."""
    node, path = 0, [0]
    while True:
        p = p_target[node].double()
        kept = None
        for child in tree.children[node]:
            c = int(tokens[child])
            q = 1.0 if q_draft is None else float(q_draft[child, c])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, float(p[c]) / max(q, 1e-30)):
                kept = child
                break
        if kept is None:
            return Acceptance(path=tuple(path), bonus=int(torch.multinomial(p.float(), 1, generator=generator)))
        node = kept
        path.append(node)


# ------------------------------------------------------------------- the pure rule over stub distributions
V_STUB = 6


def _stub_world(seed: int):
    """Target p0 [V] (first token) and p1 [V, V] (second token after the first); draft q0, q1 of the same shapes."""
    g = torch.Generator().manual_seed(seed)
    p0 = process_logits(torch.randn(V_STUB, generator=g) * 0.8, SAMPLING)
    p1 = process_logits(torch.randn(V_STUB, V_STUB, generator=g) * 0.8, SAMPLING)
    q0 = torch.softmax(torch.randn(V_STUB, generator=g), -1)  # a real draft distribution, unlike p
    q1 = torch.softmax(torch.randn(V_STUB, V_STUB, generator=g), -1)
    return p0, p1, q0, q1


def _stub_samples(rule: Callable, drafts: str, n: int, seed: int) -> tuple[Counter, dict]:
    """n draws of the first two tokens (x1, x2) through ``rule`` on TREE; returns counts and exact probabilities."""
    p0, p1, q0, q1 = _stub_world(seed)
    g = torch.Generator().manual_seed(seed + 1)
    uniform = torch.full((V_STUB,), 1.0 / V_STUB)
    counts: Counter = Counter()
    n_nodes = len(TREE)
    for _ in range(n):
        tokens = torch.zeros(n_nodes, dtype=torch.long)
        q = torch.zeros(n_nodes, V_STUB)
        p = torch.zeros(n_nodes, V_STUB)
        p[0] = p0
        for i in range(1, n_nodes):
            parent = TREE.parents[i]
            dist = q0 if parent == 0 else q1[tokens[parent]]  # [V] the draft's distribution after the parent
            if drafts == "sampled":  # i.i.d. from q: repeats among siblings are allowed
                tokens[i] = torch.multinomial(dist, 1, generator=g)
                q[i] = dist
            else:  # deterministic: the draft's top candidates, rank r = r-th most likely under q
                tokens[i] = torch.argsort(dist, descending=True)[TREE.ranks[i]]
            p[i] = p1[tokens[i]] if TREE.depths[i] == 1 else uniform  # the bonus after depth 2 is not measured
        acc = rule(TREE, tokens, p, q if drafts == "sampled" else None, generator=g)
        emitted = [int(tokens[i]) for i in acc.path[1:]] + [acc.bonus]
        if len(emitted) == 1:  # only the bonus: the next step would sample x2 from the target directly
            emitted.append(int(torch.multinomial(p1[emitted[0]], 1, generator=g)))
        counts[tuple(emitted[:2])] += 1
    probs = {(a, b): float(p0[a] * p1[a, b]) for a in range(V_STUB) for b in range(V_STUB) if p0[a] * p1[a, b] > 0}
    return counts, probs


@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_sample_accept_keeps_the_target_distribution(drafts):
    """Tree rejection sampling over stub distributions: the joint of the first two tokens is the target's."""
    n = 4000
    counts, probs = _stub_samples(sample_accept, drafts, n, seed=11)
    assert goodness_of_fit(counts, probs, n) > ALPHA


@pytest.mark.parametrize("rule, drafts", [(first_child_always, "sampled"), (first_child_always, "deterministic"),
                                          (no_residual, "sampled"), (no_residual, "deterministic")])
def test_the_check_catches_wrong_rules(rule, drafts):
    n = 1500
    counts, probs = _stub_samples(rule, drafts, n, seed=11)
    assert goodness_of_fit(counts, probs, n) < ALPHA


# ---------------------------------------------------------------------------- through the decoding loop
V_LOOP = 8
PROMPT = torch.tensor([1, 2, 3, 4])


class SampledTreeDrafter(Drafter):
    """Draws every node's token i.i.d. from a fixed distribution per depth (a real q, blind to the context)."""

    def __init__(self, tree: Tree, q_by_depth: torch.Tensor, seed: int):
        self.tree, self.q_by_depth = tree, q_by_depth  # [depth, V]
        self.generator = torch.Generator().manual_seed(seed)

    def draft(self, state: DraftState) -> Draft:
        q = torch.zeros(len(self.tree), self.q_by_depth.shape[-1])  # [N, V]
        tokens = state.tokens[-1:].repeat(len(self.tree))  # [N]
        for i in range(1, len(self.tree)):
            q[i] = self.q_by_depth[self.tree.depths[i] - 1]
            tokens[i] = torch.multinomial(q[i], 1, generator=self.generator)
        return Draft(tree=self.tree, tokens=tokens, q=q)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


@pytest.fixture(scope="module")
def loop_world():
    """A vocabulary-8 model and the exact joint of its first three sampled tokens after PROMPT."""
    return world(tiny_model("llama", vocab=V_LOOP, initializer_range=0.3, seed=1))


@pytest.fixture(scope="module")
def sliding_world():
    """The same with a Gemma-3 whose sliding window (2) is shorter than PROMPT: every sample is drawn beyond it."""
    model = tiny_model("gemma3", vocab=V_LOOP, initializer_range=0.3, seed=1, sliding_window=2)
    assert PROMPT.shape[0] > 2
    return world(model)


def world(model, penalty: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
          bias: tuple[tuple[int, float], ...] = ()) -> tuple[Target, dict]:
    """(Target, the exact joint of the first three sampled tokens after PROMPT, from full forwards without a cache)."""
    grid = torch.cartesian_prod(torch.arange(V_LOOP), torch.arange(V_LOOP))  # [V*V, 2] every (x1, x2)
    ids = torch.cat([PROMPT.expand(grid.shape[0], -1), grid], dim=1)  # [V*V, T + 2]
    with torch.inference_mode():
        logits = model(ids).logits[:, -3:].float()  # [V*V, 3, V]
    logits = logits.clone()  # a normal tensor (inference tensors cannot be updated in place outside inference mode)
    if penalty != 1.0:  # each position penalised for the text before it, by transformers' own processor
        from transformers import RepetitionPenaltyLogitsProcessor

        rule = RepetitionPenaltyLogitsProcessor(penalty)
        for k in range(3):
            logits[:, k] = rule(ids[:, : ids.shape[1] - 2 + k], logits[:, k].clone())
    for token, value in bias:  # OpenAI's logit_bias: added to every position's logits
        logits[:, :, token] += value
    if presence or frequency:  # each position penalised for the answer before it, by selfspec's logits processor
        from selfspec.core.sampling import PresencePenalty

        rule = PresencePenalty(PROMPT.shape[0], presence, frequency)
        for k in range(3):
            logits[:, k] = rule(ids[:, : ids.shape[1] - 2 + k], logits[:, k].clone())
    probs = process_logits(logits, SAMPLING)  # [V*V, 3, V]
    p1 = probs[0, 0]  # [V]
    p2 = probs[::V_LOOP, 1]  # [V, V] row x1
    p3 = probs[:, 2].reshape(V_LOOP, V_LOOP, V_LOOP)  # [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    exact = {tuple(c): float(joint[tuple(c)]) for c in torch.nonzero(joint > 0).tolist()}
    return Target(model), exact


def _loop_counts(target: Target, make_drafter: Callable, n: int, seed: int, sampling: Sampling = SAMPLING) -> Counter:
    counts: Counter = Counter()
    drafter = make_drafter()
    for i in range(n):
        out = generate(target, drafter, PROMPT, 4, sampling=sampling, generator=torch.Generator().manual_seed(seed + i))
        counts[tuple(out.tokens[:3])] += 1
    return counts


def eagle_drafter(target: Target):
    """An EAGLE head (random weights) on the loop world's model: a dynamic tree of 4 nodes, 2 deep, per step."""
    from heads.eagle.config import EagleConfig
    from heads.eagle.drafter import EagleDrafter
    from heads.eagle.model import EagleHead

    model = target.model
    torch.manual_seed(7)
    head = EagleHead(EagleConfig.for_model(model, draft_vocab_size=V_LOOP), model.get_input_embeddings(),
                     model.get_output_embeddings())
    return EagleDrafter(head.eval(), depth=2, topk=2, budget=4)


def block_drafter(target: Target):
    """A block drafter (random weights, masks that matter) on the loop world's model: blocks of 2, a dynamic tree of 4
    nodes per step by product of per-position probabilities."""
    from heads.block.config import BlockConfig
    from heads.block.drafter import BlockDrafter
    from heads.block.model import BlockHead

    model = target.model
    torch.manual_seed(9)
    head = BlockHead(BlockConfig.for_model(model, block_size=2, draft_vocab_size=V_LOOP), model.get_input_embeddings(),
                     model.get_output_embeddings())
    with torch.no_grad():
        head.mask.normal_(std=0.5)
    return BlockDrafter(head.eval(), DynamicTree(4))


def hydra_drafter(target: Target):
    """Hydra heads (random weights) on the loop world's model, drafting a 3-node tree 2 deep whose depth-2 node
    depends on the depth-1 token above it."""
    from heads.hydra.drafter import HydraDrafter
    from heads.hydra.model import HydraConfig, HydraHeads

    model = target.model
    heads = HydraHeads(HydraConfig.for_model(model, num_heads=2), model.get_input_embeddings(),
                       model.get_output_embeddings())
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return HydraDrafter(heads.eval(), [[0], [1], [0, 0]])


def policy_drafter(target: Target, arms: list):
    """A per-request policy (selfspec/drafts/policy.py) whose rule picks the last of ``arms`` for this prompt."""
    from selfspec.drafts.policy import Policy, PolicyDrafter, Ridge

    f, a = 2 * target.hidden_size + 1, len(arms)
    bias = torch.zeros(a, dtype=torch.float64)
    bias[-1] = 1.0
    ridge = Ridge(mean=torch.zeros(f, dtype=torch.float64), scale=torch.ones(f, dtype=torch.float64),
                  weights=torch.zeros(f, a, dtype=torch.float64), bias=bias)
    policy = Policy(arms=tuple(f"arm{i}" for i in range(a)), ridge=ridge, base_model="tiny",
                    hidden_size=target.hidden_size, vocab_size=V_LOOP, dtype="float32")
    return PolicyDrafter(policy, arms)


@pytest.mark.parametrize("drafter", ["sampled-q", "random-deterministic", "eagle", "block", "hydra", "merged",
                                     "policy", "layerskip-dynamic"])
def test_loop_sampling_keeps_the_target_distribution(loop_world, drafter):
    """selfspec.core.generate with a depth-2 tree drafter (4 new tokens: the draft after the first is 2 levels deep):
    the joint of the first three tokens equals plain sampling from the target (process_logits of its logits)."""
    target, exact = loop_world
    q_by_depth = torch.softmax(torch.randn(2, V_LOOP, generator=torch.Generator().manual_seed(5)), -1)
    make = {
        "sampled-q": lambda: SampledTreeDrafter(TREE, q_by_depth, seed=3),
        "random-deterministic": lambda: RandomDrafter(TREE, V_LOOP, seed=3),
        "eagle": lambda: eagle_drafter(target),
        "block": lambda: block_drafter(target),
        "hydra": lambda: hydra_drafter(target),
        # a sampled draft and a deterministic one as one tree (q dropped: every node a point mass)
        "merged": lambda: MergedDrafter([SampledTreeDrafter(TREE, q_by_depth, seed=3), RandomDrafter(TREE, V_LOOP, seed=4)]),
        # a per-request policy handing every request to its sampled (q-carrying) EAGLE arm
        "policy": lambda: policy_drafter(target, [RandomDrafter(TREE, V_LOOP, seed=4), eagle_drafter(target)]),
        # the target minus its second layer, growing a 4-node tree 2 deep each step by its own probabilities
        "layerskip-dynamic": lambda: LayerSkipDrafter(target, (1,), tree=DynamicTree(4, max_rank=2, depth=2)),
    }[drafter]
    n = 1000
    counts = _loop_counts(target, make, n, seed=1000)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert len(counts) >= 15  # really a distribution over many sequences, not a near-constant


def draft_model_drafter(target: Target, tree) -> "ModelDrafter":
    """A separate draft model (another random model of the vocabulary, so its q is far from the target's p) sampling
    its drafts from its own q: a static tree (TREE) or 4 nodes 2 deep by its own probabilities."""
    from selfspec.drafts.draft_model import ModelDrafter

    return ModelDrafter(tiny_model("llama", vocab=V_LOOP, initializer_range=0.3, seed=12, num_hidden_layers=1), target,
                        tree)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_loop_sampling_with_a_draft_model_keeps_the_target_distribution(loop_world, tree):
    """A draft model draws each node from its own q (without replacement among siblings) and the loop accepts with
    min(1, p/q) on each node's q: the joint of the first three tokens equals plain sampling from the target."""
    target, exact = loop_world
    shape = TREE if tree == "static" else DynamicTree(4, max_rank=2, depth=2)
    drafter = draft_model_drafter(target, shape)
    draft = drafter.draft(DraftState(tokens=PROMPT, prompt_length=PROMPT.shape[0], hidden=torch.zeros(1), cache=None,
                                     sampling=SAMPLING, generator=torch.Generator().manual_seed(0)))
    assert draft.q is not None and draft.q.shape == (len(draft.tree), V_LOOP) and len(draft.tree) > 2
    n = 1000
    counts = _loop_counts(target, lambda: drafter, n, seed=5000)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert len(counts) >= 15


def test_draft_model_check_catches_a_rule_that_ignores_q_after_a_rejection(loop_world, monkeypatch):
    """The same check fails when the acceptance tests min(1, p/q) but ignores q after a rejection (p is not replaced
    by norm(max(p - q, 0))). (Dropping q altogether is no such failure: a node taken as a point mass on its token is
    accepted with probability p(token) and removed from p, which is lossless whatever drew it, only less often
    accepted.)"""
    target, exact = loop_world
    monkeypatch.setattr(LOOP_MODULE, "sample_accept", no_residual)
    n = 1000
    counts = _loop_counts(target, lambda: draft_model_drafter(target, TREE), n, seed=5000)
    assert goodness_of_fit(counts, exact, n) < ALPHA


@pytest.mark.parametrize("drafter", ["sampled-q", "layerskip-dynamic"])
def test_loop_sampling_beyond_a_sliding_window_keeps_the_target_distribution(sliding_world, drafter):
    """As above, on a model whose sliding window the prompt already exceeds (the sliding layers slide every step)."""
    target, exact = sliding_world
    q_by_depth = torch.softmax(torch.randn(2, V_LOOP, generator=torch.Generator().manual_seed(5)), -1)
    make = {"sampled-q": lambda: SampledTreeDrafter(TREE, q_by_depth, seed=3),
            "layerskip-dynamic": lambda: LayerSkipDrafter(target, (1,), tree=DynamicTree(4, max_rank=2, depth=2))}[drafter]
    n = 1000
    counts = _loop_counts(target, make, n, seed=2000)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert len(counts) >= 15


@pytest.fixture(scope="module")
def penalised_world():
    """The loop world's model with a repetition penalty of 4 (a vocabulary of 8 repeats often: it matters here)."""
    return world(tiny_model("llama", vocab=V_LOOP, initializer_range=0.3, seed=1), penalty=4.0)


@pytest.mark.parametrize("drafter", ["sampled-q", "random-deterministic"])
def test_loop_sampling_with_a_repetition_penalty_keeps_the_target_distribution(penalised_world, loop_world, drafter):
    """With repetition_penalty, every tree node's distribution is penalised for the tokens on its own path: the joint
    of the first three tokens equals plain sampling with transformers' penalty, and differs from the joint without.
    (Penalising a node for the committed text only, not its own path, fails the random-deterministic check:
    p ~ 3e-8.)"""
    target, exact = penalised_world
    q_by_depth = torch.softmax(torch.randn(2, V_LOOP, generator=torch.Generator().manual_seed(5)), -1)
    make = {"sampled-q": lambda: SampledTreeDrafter(TREE, q_by_depth, seed=3),
            "random-deterministic": lambda: RandomDrafter(TREE, V_LOOP, seed=3)}
    n = 1000
    sampling = Sampling(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, repetition_penalty=4.0)
    counts = _loop_counts(target, make[drafter], n, seed=3000, sampling=sampling)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert goodness_of_fit(counts, loop_world[1], n) < ALPHA  # the penalty changed the distribution, visibly


def test_loop_sampling_with_presence_frequency_penalties_and_a_logit_bias_keeps_the_target_distribution(loop_world):
    """OpenAI's penalties on each tree node's own answer and a logit bias: the joint of the first three tokens equals
    plain sampling with them applied position by position, and differs from the joint without."""
    bias = ((2, 1.5), (5, -2.0))
    target, exact = world(tiny_model("llama", vocab=V_LOOP, initializer_range=0.3, seed=1), presence=1.5,
                          frequency=1.0, bias=bias)
    n = 1000
    sampling = Sampling(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, presence_penalty=1.5,
                        frequency_penalty=1.0, logit_bias=bias)
    counts = _loop_counts(target, lambda: RandomDrafter(TREE, V_LOOP, seed=3), n, seed=4000, sampling=sampling)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert goodness_of_fit(counts, loop_world[1], n) < ALPHA  # the penalties changed the distribution, visibly




# ------------------------------------------------------------------------------------------------------- batches
NEIGHBOURS = (torch.tensor([5, 6]), torch.tensor([3, 1, 4, 1, 5, 2, 6, 5, 3]))
"""prompts decoded beside PROMPT's samples in each batch: one shorter, one longer (holes and padding in the rows)."""


def _batch_counts(target: Target, make_drafter: Callable, n: int, seed: int) -> Counter:
    """n samples of PROMPT's first three tokens through selfspec.core.batch, four per batch, decoded between two
    neighbours of other lengths that sample too; each sequence with its own drafter and seeded generator."""
    from selfspec.core.batch import Job, generate_batch

    counts: Counter = Counter()
    for b in range(0, n, 4):
        samples = [Job(PROMPT, make_drafter(), 4, sampling=SAMPLING,
                       generator=torch.Generator().manual_seed(seed + b + i)) for i in range(4)]
        others = [Job(p, make_drafter(), 6, sampling=SAMPLING, generator=torch.Generator().manual_seed(-seed - b - k))
                  for k, p in enumerate(NEIGHBOURS)]
        outs = generate_batch(target, [others[0], *samples[:2], others[1], *samples[2:]])
        for out in (outs[1], outs[2], outs[4], outs[5]):
            counts[tuple(out.tokens[:3])] += 1
    return counts


@pytest.mark.parametrize("drafter", ["sampled-q", "random-deterministic", "draft-model"])
def test_batch_sampling_keeps_each_sequences_distribution(loop_world, drafter):
    """Sampling in a batch (selfspec.core.batch): the joint of PROMPT's first three tokens, decoded four at a time
    beside sequences of other lengths, equals plain sampling from the target."""
    from selfspec.core.drafter import fork

    target, exact = loop_world
    q_by_depth = torch.softmax(torch.randn(2, V_LOOP, generator=torch.Generator().manual_seed(5)), -1)
    draft_model = draft_model_drafter(target, TREE)
    seeds = itertools.count(3)  # each sequence's drafter draws its own drafts (one seed for all would repeat them)
    make = {
        "sampled-q": lambda: SampledTreeDrafter(TREE, q_by_depth, seed=next(seeds)),
        "random-deterministic": lambda: RandomDrafter(TREE, V_LOOP, seed=next(seeds)),
        "draft-model": lambda: fork(draft_model),  # its own q, drawn with the sequence's generator
    }[drafter]
    n = 1000
    counts = _batch_counts(target, make, n, seed=7000)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert len(counts) >= 15


@pytest.mark.parametrize("counts_of, seed", [(_loop_counts, 1000), (_batch_counts, 7000)], ids=["alone", "batch"])
def test_loop_check_catches_a_wrong_rule(loop_world, monkeypatch, counts_of, seed):
    """The loop's checks, alone and in a batch, fail for a rule that always accepts the first child."""
    target, exact = loop_world
    monkeypatch.setattr(LOOP_MODULE, "sample_accept", first_child_always)
    n = 300
    counts = counts_of(target, lambda: RandomDrafter(TREE, V_LOOP, seed=3), n, seed=seed)
    assert goodness_of_fit(counts, exact, n) < ALPHA
