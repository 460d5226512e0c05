"""The conditioned block (heads/block/condition.py, heads/block/chained.py): the Markov bias reads the right token in
training (the true one before each position) and in drafting (each tree node's own parent), the confidence head cuts
branches, decoding stays token-identical to generate (greedy) and keeps the target's distribution (sampling), the
options are strict, checkpoints round-trip, and a conditioned block with its options off is today's block.

Heads here are random (the bias and the confidence given weights that matter) or hand-set oracles on tiny models:
these tests pin the plumbing and losslessness; what conditioning buys is measured on SmolLM2 by the lead's runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import (ARCHS, losses_over_steps, random_prompts, reference, state_after_prefill, tiny_model)
from test_block import random_block, tiny_batch
from test_distribution import ALPHA, PROMPT, V_LOOP, _loop_counts, goodness_of_fit, world

from heads.block.chained import Chain
from heads.block.config import BlockConfig
from heads.block.drafter import BlockDrafter, load_drafter
from heads.block.kind import BlockKind
from heads.block.loss import block_loss
from heads.block.model import BlockHead
from heads.training.base_model import load_base
from heads.training.losses import IGNORE_INDEX
from heads.training.recipe import load_config
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96


def cond_head(model, seed: int = 0, block_size: int = 4, rank: int = 8, confidence: bool = True,
              draft_vocab: int = VOCAB, scale: float = 0.5, **kwargs) -> BlockHead:
    """A random conditioned block head whose bias and confidence matter (both start at zero when trained)."""
    cfg = BlockConfig.for_model(model, block_size=block_size, draft_vocab_size=draft_vocab, condition_rank=rank,
                                confidence=confidence, **kwargs)
    head = random_block(model, cfg, seed)
    with torch.no_grad():
        if head.markov is not None:
            head.markov.up.weight.normal_(std=scale)
        if head.confidence is not None:
            head.confidence.state.weight.normal_(std=0.5)
            head.confidence.state.bias.fill_(1.0)
            if head.confidence.code is not None:
                head.confidence.code.weight.normal_(std=0.5)
    return head


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


# ------------------------------------------------------------------------------------------ drafting: the chain
def oracle_bigram(head: BlockHead, follow: torch.Tensor, strength: float = 60.0) -> None:
    """Make the Markov bias an exact bigram table on a full draft vocabulary: code(t) = one-hot(t) (rank = V), and
    bias(t) puts ``strength`` on follow[t]. A test of which token each position is conditioned on."""
    V = head.config.vocab_size
    assert head.config.condition_rank == V and head.config.draft_vocab_size == V
    head.prev_code = lambda prev: torch.nn.functional.one_hot(prev, V).float()  # [N, V]
    with torch.no_grad():
        head.markov.up.weight.zero_()
        head.markov.up.weight[follow, torch.arange(V)] = strength  # up[follow[t], t]


def test_each_tree_node_is_drafted_after_its_own_parents_token(model):
    """With the bias an oracle bigram (token t -> follow[t]), every node below depth 1 holds follow[its parent's
    token] at rank 0, whichever branch it is on; depth 1 (no bias: its query holds the root) is the block's own."""
    head = cond_head(model, rank=VOCAB, confidence=False)
    follow = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    oracle_bigram(head, follow)
    prompt = random_prompts(1, VOCAB, seed=6, min_len=9, max_len=9)[0]
    with torch.no_grad():
        states = BlockDrafter(head, Tree.chain(1))._block(state_after_prefill(model, prompt))  # [K, D]
        first = torch.log_softmax(head.logits(states[:1]).float(), -1)[0].topk(3).indices.tolist()
    chain = BlockDrafter(head, Tree.chain(4)).draft(state_after_prefill(model, prompt))
    want = [first[0]]
    for _ in range(3):
        want.append(int(follow[want[-1]]))
    assert chain.q is None and chain.tokens.tolist() == [int(prompt[-1])] + want
    static = BlockDrafter(head, Tree.from_choices([[0], [1], [2], [0, 0], [1, 0], [2, 0], [1, 0, 0]]))
    tokens = static.draft(state_after_prefill(model, prompt)).tokens.tolist()
    assert tokens[1:4] == first  # depth 1: the block's ranks
    assert tokens[4:7] == [int(follow[t]) for t in first]  # each branch its own parent's follower
    assert tokens[7] == int(follow[tokens[5]])
    tree = BlockDrafter(head, DynamicTree(12)).draft(state_after_prefill(model, prompt))
    for node in range(1, len(tree.tree)):
        parent = tree.tree.parents[node]
        if parent and tree.tree.ranks[node] == 0:
            assert int(tree.tokens[node]) == int(follow[int(tree.tokens[parent])])


def test_a_zero_bias_and_no_confidence_grow_the_unconditioned_blocks_tree(model):
    """The node-by-node search is Tree.best_first when nothing is chained: same nodes, tokens and scores."""
    plain = cond_head(model, seed=2, rank=0, confidence=False, draft_vocab=64)
    cond = cond_head(model, seed=2, rank=8, confidence=False, draft_vocab=64)
    cond.load_state_dict({**plain.state_dict(), **{k: v for k, v in cond.state_dict().items() if "markov" in k}})
    with torch.no_grad():
        cond.markov.up.weight.zero_()
    assert not plain.chained and cond.chained
    for seed in (1, 2, 3):
        prompt = random_prompts(1, VOCAB, seed=seed, min_len=9, max_len=12)[0]
        for tree in (DynamicTree(10, depth=4), DynamicTree(25, min_prob=0.002), Tree.from_choices([[0], [1], [0, 0]])):
            a = BlockDrafter(plain, tree).draft(state_after_prefill(model, prompt))
            b = BlockDrafter(cond, tree).draft(state_after_prefill(model, prompt))
            assert a.tree == b.tree and a.tokens.tolist() == b.tokens.tolist(), tree
            if a.scores is not None:
                torch.testing.assert_close(a.scores, b.scores.to(a.scores.dtype), atol=1e-5, rtol=0)


def test_the_confidence_cut_drops_every_node_whose_confidence_product_is_below_it(model):
    """Each kept node's product of confidences along its path is >= confidence_min; the children of a kept node that
    the cut dropped are exactly those below it; a cut above every branch drafts the root alone."""
    head = cond_head(model, seed=5, block_size=5)
    prompt = random_prompts(1, VOCAB, seed=8, min_len=10, max_len=10)[0]
    state = state_after_prefill(model, prompt)
    with torch.no_grad():
        states = BlockDrafter(head, Tree.chain(1))._block(state)
    full = BlockDrafter(head, DynamicTree(30, depth=5)).draft(state)
    products = [1.0]  # per node of the full tree
    chain = Chain(head, states, 8)
    for node in range(1, len(full.tree)):
        parent = full.tree.parents[node]
        _, _, log_c = chain.expand(full.tree.depths[node] - 1, int(full.tokens[parent]))
        products.append(products[parent] * math.exp(log_c))
    assert 0.05 < min(products) < max(products[1:]) < 1.0  # the confidences really spread
    for cut in (0.3, 0.5, 0.7):
        head.config.confidence_min = cut
        try:
            kept = BlockDrafter(head, DynamicTree(30, depth=5)).draft(state)
            static = BlockDrafter(head, full.tree).draft(state)
        finally:
            head.config.confidence_min = 0.0
        paths = {tuple(kept.tree.choices[i - 1]) for i in range(1, len(kept.tree))}
        above = {tuple(full.tree.choices[i - 1]) for i in range(1, len(full.tree)) if products[i] >= cut}
        assert above <= paths  # the full tree's nodes above the cut are all kept (the budget refills below)
        assert len(static.tree) == len(above) + 1 and static.tree == Tree.from_choices(sorted(above, key=len))
    head.config.confidence_min = 0.999
    try:
        assert len(BlockDrafter(head, DynamicTree(30)).draft(state).tree) == 1
    finally:
        head.config.confidence_min = 0.0


def test_rank_by_confidence_scores_each_node_by_its_estimated_acceptance(model):
    """rank_by confidence: a node's score is the sum over its path of log c + log q(token) - log q(best sibling); a
    smaller budget keeps the best-scored nodes of a bigger one (what tune-tree assumes)."""
    head = cond_head(model, seed=7, rank_by="confidence")
    prompt = random_prompts(1, VOCAB, seed=9, min_len=8, max_len=8)[0]
    state = state_after_prefill(model, prompt)
    with torch.no_grad():
        chain = Chain(head, BlockDrafter(head, Tree.chain(1))._block(state), 8)
    big = BlockDrafter(head, DynamicTree(20)).draft(state)
    for node in range(1, len(big.tree)):
        parent = big.tree.parents[node]
        values, tokens, log_c = chain.expand(big.tree.depths[node] - 1, int(big.tokens[parent]))
        r = big.tree.ranks[node]
        assert int(big.tokens[node]) == tokens[r]
        want = float(big.scores[parent]) + log_c + values[r] - values[0]
        assert float(big.scores[node]) == pytest.approx(want, abs=1e-5)
    order = sorted(range(1, len(big.tree)), key=lambda i: -float(big.scores[i]))
    small = BlockDrafter(head, DynamicTree(7)).draft(state)
    assert sorted(small.tree.choices) == sorted(big.tree.choices[i - 1] for i in order[:7])


def every_path(chain: Chain, depth: int, min_logp: float) -> list[tuple[float, tuple[int, ...], int, float]]:
    """Brute force, one node at a time: every path at most ``depth`` deep that the cuts leave (min_logp on its
    probability, confidence_min on its product of confidences) as (score, rank path, token, log of that product), best
    first with best-first's tie-break (the smaller rank path)."""
    out = []

    def visit(path: tuple[int, ...], score: float, logp: float, log_conf: float, prev: int) -> None:
        values, tokens, conf = chain.expand(len(path), prev)  # prev unused at depth 0
        for r, (v, token) in enumerate(zip(values, tokens)):
            if log_conf + conf >= chain.min_log_conf and logp + v >= min_logp:
                node = (score + chain.term(values, r, conf), path + (r,), token, log_conf + conf)
                out.append(node)
                if len(node[1]) < depth:
                    visit(node[1], node[0], logp + v, node[3], token)

    visit((), 0.0, 0.0, 0.0, -1)
    return sorted(out, key=lambda node: (-node[0], node[1]))


def test_the_tree_grown_depth_by_depth_is_the_best_nodes_of_every_path(model):
    """``grow`` reads each depth's nodes at once; its tree is still the ``budget`` best of every path the cuts leave
    (brute force, one node at a time), ties to the smaller rank path as a best-first heap pops them: same paths,
    tokens and scores, for both rank_by modes, with and without a Markov bias, several budgets, depths, confidence
    cuts (between the tree's own confidence products: they cut part of it) and min_prob. A static tree keeps exactly
    its nodes above the cut, each its rank after its own parent's token."""
    heads = [cond_head(model, seed=11, block_size=5), cond_head(model, seed=12, block_size=5, rank_by="confidence",
                                                                draft_vocab=64),
             cond_head(model, seed=13, block_size=5, rank=0, rank_by="confidence")]
    static = Tree.full([3, 2, 2, 1])
    sizes: dict[tuple[int, int, float, int], int] = {}  # (head, depth, min_prob, i-th cut) -> paths the cuts leave
    for h, head in enumerate(heads):
        with torch.no_grad():
            if head.markov is not None:
                head.markov.down.weight.mul_(10)  # codes of size ~1: the confidence differs between parents too
        state = state_after_prefill(model, random_prompts(1, VOCAB, seed=h, min_len=9, max_len=9)[0])
        with torch.no_grad():
            states = BlockDrafter(head, Tree.chain(1))._block(state)
        products = sorted({c for *_, c in every_path(Chain(head, states, 3), 5, -math.inf)})
        cuts = [0.0] + [math.exp((products[i] + products[i + 1]) / 2) for i in (len(products) // 3,
                                                                                2 * len(products) // 3)]
        for c, cut in enumerate(cuts):
            head.config.confidence_min = cut
            try:
                for depth, min_prob in ((1, 0.0), (3, 0.0), (5, 0.0), (5, 0.0005)):
                    tree = DynamicTree(60, max_rank=3, depth=depth, min_prob=min_prob)
                    paths = every_path(Chain(head, states[:depth], 3), depth, tree.min_logp)
                    sizes[h, depth, min_prob, c] = len(paths)
                    for budget in (1, 4, 9, 25, 60):
                        want = sorted(paths[:budget], key=lambda node: (len(node[1]), node[1]))
                        got = BlockDrafter(head, DynamicTree.resized(tree, budget, depth)).draft(state)
                        assert got.tree.choices == tuple(node[1] for node in want), (h, cut, depth, budget)
                        assert got.tokens[1:].tolist() == [node[2] for node in want]
                        torch.testing.assert_close(got.scores[1:], torch.tensor([node[0] for node in want]),
                                                   atol=1e-5, rtol=0)
                full = {node[1]: node[2] for node in every_path(Chain(head, states[:4], 3), 4, -math.inf)}
                filled = BlockDrafter(head, static).draft(state)
                assert filled.tree == Tree.from_choices(sorted((p for p in static.choices if p in full), key=len))
                assert dict(zip(filled.tree.choices, filled.tokens[1:].tolist())) == {
                    p: full[p] for p in filled.tree.choices}
            finally:
                head.config.confidence_min = 0.0
    for (h, depth, min_prob, c), n in sizes.items():  # the cuts really act, and leave more than the root
        assert n > 0
        if c and depth == 5 and not min_prob:
            assert n < sizes[h, depth, min_prob, c - 1], (h, depth, min_prob, c)
        if min_prob and not c:
            assert n < sizes[h, depth, 0.0, c], h


# ------------------------------------------------------------------------------------------ lossless decoding
@pytest.mark.parametrize("arch", ARCHS)
def test_conditioned_drafts_through_the_runtime_stay_token_identical_to_generate(arch, tiny_models):
    model = tiny_models[arch]
    target = Target(model)
    heads = [cond_head(model), cond_head(model, seed=1, confidence_min=0.4, rank_by="confidence"),
             cond_head(model, seed=2, rank=0, confidence_min=0.5), cond_head(model, seed=3, confidence=False)]
    trees = (Tree.chain(4), DynamicTree(10), DynamicTree(8, depth=3, min_prob=0.01),
             Tree.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]]))
    sizes = []
    for head in heads:
        for tree in trees:
            drafter = BlockDrafter(head, tree)
            for prompt in random_prompts(3, VOCAB, seed=7):
                out = generate(target, drafter, prompt, max_new_tokens=16)
                assert out.tokens == reference(model, prompt, 16), f"{arch} {tree} {head.config.confidence_min}"
                sizes += [s.tree_size for s in out.steps[1:]]
    assert min(sizes) == 1 and max(sizes) > 4  # some steps cut to the root, some drafted whole trees


def block_cond_drafter(target: Target, tree, cut: float) -> BlockDrafter:
    """A conditioned block (random weights that matter) with a confidence cut on the distribution test's world."""
    model = target.model
    head = cond_head(model, seed=9, block_size=2, rank=4, draft_vocab=V_LOOP, scale=2.0, confidence_min=cut)
    return BlockDrafter(head, tree)


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_conditioned_sampling_keeps_the_target_distribution(tree):
    """The joint of the first three sampled tokens through the loop with a conditioned block drafter (its branches
    conditioned on their parents, its confidence cutting some) is the target's (chi-square, tests/test_distribution.py's
    bound: p > 1e-3)."""
    target, exact = world(tiny_model("llama", vocab=V_LOOP, initializer_range=0.3, seed=1))
    shape = DynamicTree(4) if tree == "dynamic" else Tree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1]])
    cut, uncut = block_cond_drafter(target, shape, cut=0.75), block_cond_drafter(target, shape, cut=0.0)
    changed = 0
    for seed in range(V_LOOP):  # the cut really acts in this world
        state = state_after_prefill(target.model, torch.cat([PROMPT, torch.tensor([seed])]))
        changed += cut.draft(state).tree != uncut.draft(state).tree
    assert changed >= 1, changed
    n = 1000
    counts = _loop_counts(target, lambda: block_cond_drafter(target, shape, cut=0.75), n, seed=7000)
    assert goodness_of_fit(counts, exact, n) > ALPHA
    assert len(counts) >= 15


# ------------------------------------------------------------------------------------------ training
def test_the_loss_conditions_each_offset_on_the_true_token_before_it(model):
    """With the oracle bigram bias on data that follows the bigram (x_t = follow[x_{t-1}]), the cross-entropy is ~0
    at every offset >= 1 (conditioned on the true x_{t-1}) and large at offset 0 (no bias there); conditioned on any
    other token (a shifted input) it is large everywhere."""
    head = cond_head(model, rank=VOCAB, confidence=False)
    follow = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    oracle_bigram(head, follow, strength=200.0)
    T = 14
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, 0] = 5
    for t in range(1, T):
        ids[0, t] = follow[ids[0, t - 1]]
    labels = ids.clone()
    anchors = torch.tensor([[0, 3, 6, -1]])
    with torch.no_grad():
        f = model.model(input_ids=ids).last_hidden_state
        pairs, blocks = head(f, ids, torch.tensor([T]), anchors)
        out = block_loss(pairs, blocks, anchors, f, labels, head, kind="ce", input_ids=ids)
        assert out.per_head[1:].max() < 1e-3 and out.per_head[0] > 1.0, out.per_head
        shifted = torch.roll(ids, 1, dims=1)  # the token two before: the wrong one
        wrong = block_loss(pairs, blocks, anchors, f, labels, head, kind="ce", input_ids=shifted)
        assert wrong.per_head[1:].min() > 10.0
    with pytest.raises(ValueError, match=r"needs the input ids \[B, T\] = \[1, 14\]"):
        block_loss(pairs, blocks, anchors, f, labels, head, kind="ce")


@pytest.mark.parametrize("kind", ["tv_ce", "jsd", "rkl", "tv"])
def test_the_conditioned_loss_falls_on_a_repeated_batch_with_every_new_loss(kind):
    cfg = load_config(REPO / "configs/block_tiny.yaml", ["block.draft_vocab=0", f"loss.kind={kind}",
                                                         "block.condition_rank=8", "block.confidence=true"])
    base, _ = load_base(cfg.model)
    kind_ = BlockKind()
    head, config = kind_.build(cfg, base)
    assert config.condition_rank == 8 and config.confidence and head.markov is not None
    head.train()
    batch, hidden = tiny_batch(base)
    losses = losses_over_steps(lambda: kind_.loss(cfg, head, hidden, None, batch, ranks=5), head.parameters())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0], losses
    assert head.markov.up.weight.abs().max() > 0 and head.confidence.state.weight.abs().max() > 0  # both trained
    rows = kind_.loss(cfg, head, hidden, None, batch, ranks=5, per_row=True)
    assert len(rows) == 2 and all(r.count.shape == (4,) for r in rows)


# ------------------------------------------------------------------------------------------ config, checkpoints
def test_recipe_and_checkpoint_options_are_strict():
    tiny = REPO / "configs/block_tiny.yaml"
    cfg = load_config(tiny)
    assert (cfg.block.condition_rank, cfg.block.confidence, cfg.block.confidence_min, cfg.block.rank_by,
            cfg.loss.ce_mix) == (0, False, 0.0, "probability", 0.1)
    bad = {
        "block.condition_rnk=4": r"condition_rnk",
        "block.condition_rank=-1": r"block.condition_rank: expected 0 \(no Markov bias\) or a rank >= 1, found -1",
        "block.confidence_min=0.5": r"block.confidence_min=0.5, block.rank_by='probability': both read the confidence "
                                    r"head, which is off",
        "block.rank_by=confidence": r"read the confidence head, which is off",
        "block.rank_by=sometimes": r"rank_by",
        "loss.kind=l1": r"loss.kind",
        "loss.ce_mix=1.5": r"loss.ce_mix: expected a share in \[0, 1\], found 1.5",
        "block.confidence_weight=-1": r"block.confidence_weight: expected a finite value >= 0, found -1",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=message) as err:
            load_config(tiny, [override])
        assert "\n" not in str(err.value), override  # one line
    with pytest.raises(ValueError, match=r"block.confidence_min: expected a probability in \[0, 1\), found 1.0"):
        load_config(tiny, ["block.confidence=true", "block.confidence_min=1.0"])
    with pytest.raises(ValueError, match=r"method dflash saves speculators' DFlash format, which has no Markov bias"):
        load_config(tiny, ["method=dflash", "block.condition_rank=4"])
    with pytest.raises(ValueError, match=r"loss.kind 'tv': only the block drafter's loss computes it .*found method "
                                         r"'medusa'"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["loss.kind=tv"])
    cond = load_config(REPO / "configs/block_cond_smollm2.yaml")
    assert cond.method == "block" and cond.block.condition_rank > 0 and cond.block.confidence
    assert cond.loss.kind == "tv_ce"
    lines = (REPO / "configs/block_cond_smollm2.yaml").read_text().splitlines()
    assert lines[1] == "#   python train.py --config configs/block_cond_smollm2.yaml"


def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    head = cond_head(model, seed=4, block_size=5, draft_vocab=64, confidence_min=0.2, rank_by="confidence")
    head.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert (stored["condition_rank"], stored["confidence"], stored["confidence_min"], stored["rank_by"]) == \
        (8, True, 0.2, "confidence")
    loaded = BlockHead.from_pretrained(tmp_path / "ck", model)
    assert loaded.config == head.config and head.state_dict().keys() == loaded.state_dict().keys()
    assert {"markov.down.weight", "markov.up.weight", "confidence.state.weight", "confidence.state.bias",
            "confidence.code.weight"} <= set(loaded.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    prompt = random_prompts(1, VOCAB, seed=9, min_len=8, max_len=8)[0]
    a = BlockDrafter(head, DynamicTree(8)).draft(state_after_prefill(model, prompt))
    b = load_drafter(tmp_path / "ck", Target(model), tree=DynamicTree(8)).draft(state_after_prefill(model, prompt))
    assert a.tree == b.tree and torch.equal(a.tokens, b.tokens) and torch.equal(a.scores, b.scores)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, condition_rank=4)))  # rank 8 stored
    with pytest.raises(ValueError, match=r"disagrees with config.json.*markov"):
        BlockHead.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, confidence=False, confidence_min=0.0,
                                                                 rank_by="probability")))
    with pytest.raises(ValueError, match=r"disagrees with config.json.*confidence"):  # its tensors are there
        BlockHead.from_pretrained(tmp_path / "ck", model)
    fields = {k: v for k, v in stored.items() if k != "selfspec_version"}
    with pytest.raises(ValueError, match=r"BlockConfig.confidence_min=0.2, BlockConfig.rank_by='confidence'"):
        BlockConfig.from_dict(dict(fields, confidence=False))


def test_a_block_with_the_options_off_writes_todays_checkpoint(model, tmp_path):
    """No new keys in config.json, no new tensors: the checkpoint an older selfspec reads, and reads back."""
    head = cond_head(model, rank=0, confidence=False)
    assert head.markov is None and head.confidence is None and not head.chained
    head.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert not {"condition_rank", "confidence", "confidence_min", "rank_by"} & set(stored)
    assert not any(k.startswith(("markov", "confidence")) for k in head.state_dict())
    assert BlockHead.from_pretrained(tmp_path / "ck", model).config == head.config
