"""The block drafter: one forward drafts a whole block, the training pass computes exactly what drafting computes (its
mask, its anchors, its loss's index shift), trees from a block (chain, dynamic, static) and the trees it refuses,
losslessness through the runtime on the tiny architectures (alone, with accepted blocks, merged with prompt lookup),
strict save / load and base checks, and train.py's block method end to end with an exact resume.

The heads here are random or trained for a few steps on a tiny random target: these tests pin the plumbing and
losslessness; what training buys is measured on SmolLM2 in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import (ARCHS, Recording, decode_with_tiny_draft, losses_over_steps, random_prompts, reference,
                      state_after_prefill, tiny_model, train_and_check_resume)
from test_architectures import SUPPORTED, build

from heads.block.config import BlockConfig
from heads.block.drafter import BlockDrafter, load_drafter
from heads.block.kind import BlockKind
from heads.block.loss import block_loss, sample_anchors
from heads.block.model import BlockHead, block_mask
from heads.training.base_model import load_base
from heads.training.config import ModelConfig
from heads.training.losses import IGNORE_INDEX
from heads.training.recipe import load_config
from selfspec import api, registry
from selfspec.core import hf
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.ngram import NGramDrafter

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
FEATURES = [0, 1, 2]  # EAGLE-3 features on a 2-layer tiny model: the embeddings, layer 1's output, the final state


def random_block(model, cfg: BlockConfig, seed: int) -> BlockHead:
    """A block head on ``model`` built under ``torch.manual_seed(seed)``, its masks random (a trained one is not near
    zero), and below the full vocabulary a random draft vocabulary (from its own generator: the global one's draws
    after this are the same either way)."""
    torch.manual_seed(seed)
    head = BlockHead(cfg, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    with torch.no_grad():
        head.mask.normal_(std=0.5)
    if cfg.draft_vocab_size < model.config.vocab_size:
        head.draft_vocab.set(torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))
                             [:cfg.draft_vocab_size])
    return head


def make_head(model, seed: int = 0, block_size: int = 4, draft_vocab: int = VOCAB, num_layers: int = 1,
              feature_layers=None, **kwargs) -> BlockHead:
    cfg = BlockConfig.for_model(model, num_layers=num_layers, block_size=block_size, draft_vocab_size=draft_vocab,
                                feature_layers=feature_layers, **kwargs)
    head = random_block(model, cfg, seed)
    if head.fuse is not None:
        with torch.no_grad():
            torch.nn.init.normal_(head.fuse.weight, std=0.3)
    return head


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


# ------------------------------------------------------------------------------------------ training = drafting
def test_training_mask_says_which_query_sees_which_key():
    n, M = 5, 2
    anchors = torch.tensor([[1, 3, -1]])  # two blocks and an absent one
    allowed = block_mask(n, anchors, torch.tensor([6]), M, torch.float32)[0, 0] == 0  # [5 + 6, 5 + 6]
    seen = lambda q: allowed[q].nonzero().flatten().tolist()  # noqa: E731
    assert seen(2) == [0, 1, 2]  # pair 2: pairs 0..2, causal, no mask query
    assert seen(n + 0) == seen(n + 1) == [0, 1, n + 0, n + 1]  # anchor 1's masks: pairs <= 1 and their block
    assert seen(n + 2) == seen(n + 3) == [0, 1, 2, 3, n + 2, n + 3]  # anchor 3's: pairs <= 3, their own block only
    assert seen(n + 4) == [n + 4, n + 5]  # an absent anchor's masks see their own block only (never scored)
    padded = block_mask(n, torch.tensor([[2, -1, -1]]), torch.tensor([4]), M, torch.float32)[0, 0] == 0
    for q in range(n + 6):  # pairs 3 and 4 are padding (length 4: pairs 0..2): no other query sees them
        assert set(padded[q].nonzero().flatten().tolist()) & {3, 4} <= {q}
    assert padded[4].nonzero().flatten().tolist() == [0, 1, 2, 4]  # a padding query: the true pairs and itself


@pytest.mark.parametrize("arch,layers", [("llama", None), ("qwen2", None), ("gpt2", None), ("llama", FEATURES)])
def test_training_pass_at_an_anchor_is_what_drafting_computes(arch, layers):
    """The training pass's outputs at pair j and at anchor j's masks = the block the drafter computes after the prefix
    x_0 .. x_{j+1} (root x_{j+1}), for every anchor, also in a right-padded row and with multi-layer features."""
    model = tiny_model(arch, initializer_range=0.1)
    check_training_pass(model, make_head(model, num_layers=2, feature_layers=layers), layers)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "falcon", "gpt_neo", "deepseek_v3", "opt"])
def test_training_pass_is_what_drafting_computes_on_more_architectures(model_type):
    """The same on the decoders whose layers differ most (test_eagle.py's unroll test says how)."""
    model = build(model_type, SUPPORTED[model_type])
    check_training_pass(model, make_head(model, num_layers=2, draft_vocab=64), None)


def check_training_pass(model, head: BlockHead, layers) -> None:
    T = 12
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([T, 9])
    anchors = torch.tensor([[0, 4, 10, -1], [2, 5, 7, -1]])  # row 1: pairs 0..7 are true ones
    with torch.no_grad():
        states = hf.decoder(model)(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in layers or [-1]], dim=-1)  # [2, T, F]
        pairs, blocks = head(features, ids, lengths, anchors)  # [2, n, D], [2, A, M, D]
    for row in range(2):
        for a, j in enumerate(anchors[row].tolist()):
            if j < 0:
                continue
            drafter = BlockDrafter(head, Tree.chain(1))
            block = drafter._block(state_after_prefill(model, ids[row, :j + 2]))  # [K, D]
            torch.testing.assert_close(pairs[row, j], block[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(blocks[row, a], block[1:], rtol=1e-4, atol=1e-4)


def test_one_forward_of_the_head_per_drafting_step(model):
    """Each draft is exactly one call of the head's decoder, whatever the tree (the block's K positions at once)."""
    head = make_head(model, block_size=5)
    calls = []
    hook = head.decoder.register_forward_hook(lambda *args: calls.append(1))
    try:
        for tree in (Tree.chain(5), DynamicTree(12), Tree.from_choices([[0], [1], [0, 0], [0, 0, 0]])):
            calls.clear()
            drafter = Recording(BlockDrafter(head, tree))
            for prompt in random_prompts(3, VOCAB, seed=3):
                generate(Target(model), drafter, prompt, max_new_tokens=12)
            assert len(calls) == len(drafter.states) > 0
    finally:
        hook.remove()


# ------------------------------------------------------------------------------------------ the objective
def test_anchors_are_deterministic_one_per_stratum_and_only_where_a_block_has_training_tokens():
    T, K = 40, 4
    labels = torch.arange(T).repeat(3, 1)
    labels[:, :10] = IGNORE_INDEX  # a prompt: x_0 .. x_9 are not trained
    labels[2, 14:] = IGNORE_INDEX  # row 2 trains x_10 .. x_13 only
    index = torch.tensor([5, 6, 7])
    anchors = sample_anchors(labels, K, 6, seed=0, index=index)
    assert torch.equal(anchors, sample_anchors(labels, K, 6, seed=0, index=index))  # deterministic
    assert not torch.equal(anchors[0], sample_anchors(labels, K, 6, seed=1, index=index)[0])  # the seed matters
    candidates = list(range(5, 37))  # blocks x_{j+3} .. x_{j+5} reaching x_10 .. x_39: j = 5 .. 36 (pairs <= 38)
    for row in (0, 1):
        picked = anchors[row].tolist()
        assert picked == sorted(picked) and set(picked) <= set(candidates)
        for a in range(6):  # one per stratum of the 32 candidates
            assert candidates[a * 32 // 6] <= picked[a] < candidates[(a + 1) * 32 // 6 - 1] + 1
    assert anchors[0].tolist() != anchors[1].tolist()  # rows draw their own
    assert anchors[2].tolist() == [5, 6, 7, 8, 9, 10]  # x_10 .. x_13 reached from j = 5 .. 10: all of them
    few = sample_anchors(labels, K, 8, seed=0, index=index)[2].tolist()
    assert few == [5, 6, 7, 8, 9, 10, -1, -1]


def test_loss_index_shift_a_head_predicting_the_next_features_scores_zero(model):
    """If pair j's output were f_{j+1} and anchor j's mask i's were f_{j+2+i}, the KL loss is 0 at every offset and
    top-1 agreement 1 (the whole vocabulary drafted), scored where the predicted token is a training token."""
    model = tiny_model("llama")  # spread-out logits: a feature one position off is far from right
    head = make_head(model)
    T = 12
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # pairs 0, 1 predict x_2, x_3: not scored
    anchors = torch.tensor([[1, 6, 8, -1]])
    with torch.no_grad():
        f = model.model(input_ids=ids).last_hidden_state  # [1, T, D]
    pairs = f[:, 1:]  # [1, n, D]: f_{j+1} at pair j
    at = (anchors.clamp(min=0)[:, :, None] + 2 + torch.arange(3)).clamp(max=T - 1)  # [1, A, M] f_{j+2+i}
    blocks = f[0][at]  # [1, A, M, D]
    out = block_loss(pairs, blocks, anchors, f, labels, head, kind="kl")
    assert out.per_head.abs().max() < 1e-5 and out.top1.tolist() == [1.0] * 4
    # offset 0: pairs 2..9 (x_4 .. x_11); offset 1 + i: anchors whose x_{j+3+i} exists (t <= 11) and is trained
    assert out.count.tolist() == [8, 3, 2, 2]
    wrong = block_loss(f[:, :-1], blocks, anchors, f, labels, head, kind="kl")  # f_j at pair j: one position off
    assert wrong.per_head[0] > 0.1 and wrong.per_head[1:].abs().max() < 1e-5
    ce = block_loss(pairs, blocks, anchors, f, labels, head, kind="ce", ranks=0)
    assert ce.hits.shape == (4, 0) and torch.isfinite(ce.total)


def tiny_batch(base) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A training batch of two random rows of 24 tokens (the second 20 long, the rest ignored) and the base's final
    states on it [2, 24, D]."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "lengths": torch.tensor([24, 20]), "index": torch.tensor([0, 1])}
    batch["labels"][1, 20:] = IGNORE_INDEX
    with torch.no_grad():
        hidden = base.model(input_ids=ids).last_hidden_state
    return batch, hidden


def test_the_loss_falls_on_a_repeated_batch():
    """The block kind's loss (one forward of the head per batch), 20 AdamW steps on one tiny batch: finite, and falls."""
    cfg = load_config(REPO / "configs/block_tiny.yaml", ["block.draft_vocab=0"])
    base, _ = load_base(cfg.model)
    kind = BlockKind()
    head, _ = kind.build(cfg, base)
    head.train()
    batch, hidden = tiny_batch(base)
    losses = losses_over_steps(lambda: kind.loss(cfg, head, hidden, None, batch, ranks=5), head.parameters())
    assert all(torch.isfinite(torch.tensor(losses))) and kind.loss(cfg, head, hidden, None, batch, 5).count.shape == (4,)
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------------------------------ drafting
def test_chain_and_tree_drafts_are_the_blocks_ranked_candidates(model):
    head = make_head(model, seed=3, block_size=5, draft_vocab=64)
    prompt = random_prompts(1, VOCAB, seed=6, min_len=9, max_len=9)[0]
    with torch.no_grad():
        block = BlockDrafter(head, Tree.chain(1))._block(state_after_prefill(model, prompt))  # [K, D]
        logp = torch.log_softmax(head.logits(block).float(), dim=-1)  # [K, V']
    ranked = head.draft_vocab.base_ids(logp.topk(8).indices).tolist()  # [K][8] base ids, best first
    chain = BlockDrafter(head, Tree.chain(4)).draft(state_after_prefill(model, prompt))
    assert chain.tree == Tree.chain(4) and chain.q is None
    assert chain.tokens.tolist() == [int(prompt[-1])] + [ranked[d][0] for d in range(4)]
    tree = BlockDrafter(head, DynamicTree(10, depth=4)).draft(state_after_prefill(model, prompt))
    assert len(tree.tree) == 11 and tree.tree.depth <= 4
    top = logp.topk(8).values
    for node in range(1, len(tree.tree)):  # node (r1, ..., rd): position d's rank-rd candidate, scored by its path
        path = tree.tree.choices[node - 1]
        assert int(tree.tokens[node]) == ranked[len(path) - 1][path[-1]]
        assert float(tree.scores[node]) == pytest.approx(sum(float(top[d, r]) for d, r in enumerate(path)), abs=1e-5)
    static = BlockDrafter(head, Tree.from_choices([[0], [1], [0, 0], [0, 1]])).draft(state_after_prefill(model, prompt))
    assert static.tokens.tolist() == [int(prompt[-1]), ranked[0][0], ranked[0][1], ranked[1][0], ranked[1][1]]


def test_the_adaptive_length_drafts_the_nodes_above_its_probability_and_nothing_when_none_is(model, tiny_models):
    """min_prob: the budget's best nodes, none whose path probability is below it; an unsure block drafts the root
    alone, and decoding stays token-identical to generate through steps that draft nothing."""
    head = make_head(model, seed=3, block_size=5, draft_vocab=64)
    prompt = random_prompts(1, VOCAB, seed=6, min_len=9, max_len=9)[0]
    full = BlockDrafter(head, DynamicTree(40, depth=5)).draft(state_after_prefill(model, prompt))
    for p in (0.002, 0.01, 0.05):
        cut = BlockDrafter(head, DynamicTree(40, depth=5, min_prob=p)).draft(state_after_prefill(model, prompt))
        above = [i for i in range(1, len(full.tree)) if float(full.scores[i]) >= math.log(p)]
        assert 0 < len(above) < len(full.tree) - 1, p  # the cut really falls inside this tree
        assert cut.tree == Tree.from_choices([full.tree.choices[i - 1] for i in above])
        assert cut.tokens.tolist() == [full.tokens.tolist()[0]] + [full.tokens.tolist()[i] for i in above]
    best = float(full.scores[1:].max())
    none = BlockDrafter(head, DynamicTree(40, min_prob=min(0.99, math.exp(best) * 1.01)))
    assert len(none.draft(state_after_prefill(model, prompt)).tree) == 1
    assert none.resized(3, 8).dynamic == DynamicTree(8, depth=3, min_prob=none.dynamic.min_prob)  # tuning keeps it
    llama = tiny_models["llama"]
    target, drafter = Target(llama), BlockDrafter(make_head(llama, block_size=4), DynamicTree(10, min_prob=0.02))
    sizes = []
    for prompt in random_prompts(4, VOCAB, seed=7):
        out = generate(target, drafter, prompt, max_new_tokens=20)
        assert out.tokens == reference(llama, prompt, 20)
        sizes += [s.tree_size for s in out.steps[1:]]
    assert min(sizes) == 1 and max(sizes) > 1, sizes  # some steps drafted nothing (the root alone), some drafted


class OracleBlock(BlockDrafter):
    """The block drafter with its per-position logits replaced by the reference continuation (rank 0), except at
    block offset 2 where the reference token is rank 1 on every other step: blocks get accepted whole and in part, so
    the drafter's cache must follow several committed tokens a step."""

    def __init__(self, head, tree, ref: list[int], prompt_length: int):
        super().__init__(head, tree)
        self.ref, self.prompt_length, self.steps = ref, prompt_length, 0

    def draft(self, state):
        want = self.ref[state.tokens.shape[0] - self.prompt_length:]  # x_T, x_{T+1}, ...
        self.steps += 1

        def logits(out):  # [depth, D] -> [depth, V'] (the whole vocabulary is drafted: V' = V)
            g = torch.randn(out.shape[0], VOCAB, generator=torch.Generator().manual_seed(self.steps))
            for d in range(min(out.shape[0], len(want))):
                g[d, want[d]] = 5.0 if d == 2 and self.steps % 2 else 10.0
                g[d, (want[d] + 1) % VOCAB] = 7.0  # rank 1 (rank 0 at offset 2 on odd steps)
            return g

        self.head.logits = logits
        try:
            return super().draft(state)
        finally:
            del self.head.logits


@pytest.mark.parametrize("arch", ARCHS)
def test_block_drafts_through_the_runtime_stay_token_identical_to_generate(arch, tiny_models):
    model = tiny_models[arch]
    head = make_head(model, block_size=4)
    target = Target(model)
    prompts = random_prompts(4, VOCAB, seed=7)
    for tree in (Tree.chain(4), DynamicTree(10)):
        drafter = BlockDrafter(head, tree)  # one drafter across prompts: its cache restarts
        for prompt in prompts:
            out = generate(target, drafter, prompt, max_new_tokens=20)
            assert out.tokens == reference(model, prompt, 20), f"{arch} {tree}"
            assert drafter.committed == prompt.shape[0] + sum(len(s.tokens) for s in out.steps[:-1]) - 1
    accepted = []
    for prompt in prompts:  # blocks accepted whole and in part
        ref = reference(model, prompt, 24)
        for tree in (Tree.chain(4), DynamicTree(8)):
            out = generate(target, OracleBlock(head, tree, ref, prompt.shape[0]), prompt, max_new_tokens=24)
            assert out.tokens == ref, f"{arch} oracle {tree}"
            accepted += [len(s.tokens) for s in out.steps[:-1]]
    assert max(accepted) == 5 and min(accepted) <= 3  # a whole block of 4 + the bonus token; and blocks cut short
    merged = MergedDrafter([NGramDrafter(depth=4, max_nodes=6), BlockDrafter(head, DynamicTree(6, depth=3))])
    for prompt in random_prompts(4, VOCAB, seed=8):  # prompt lookup and the block drafter verified as one tree
        assert generate(target, merged, prompt, max_new_tokens=24).tokens == reference(model, prompt, 24)


def test_a_block_drafter_that_sits_out_steps_of_a_merged_draft_stays_in_step():
    """ngram+block with skip_after=1: the drafter rests whenever prompt lookup had a token accepted, and is handed every
    hidden state committed meanwhile (every layer's, for feature layers), else it would refuse to go on, out of step."""
    model = tiny_model("llama", initializer_range=0.5)  # repetitive greedy continuations: prompt lookup gets accepted
    block = BlockDrafter(make_head(model, feature_layers=FEATURES), DynamicTree(6))
    merged = MergedDrafter([NGramDrafter(depth=4, max_nodes=6), block], skip_after=1)
    for prompt in random_prompts(6, VOCAB, seed=9):
        assert generate(Target(model), merged, prompt, max_new_tokens=32).tokens == reference(model, prompt, 32)
    assert merged.skipped[0] == 0 and merged.skipped[1] >= 5, merged.skipped  # the drafter really sat out steps
    assert block.committed > 0


def test_a_block_drafter_rests_at_the_very_steps_prompt_lookup_continues_a_match_of_skip_match_tokens():
    """ngram+block with skip_match=2: the drafter sits out exactly the steps whose prompt-lookup draft continues a
    2-token match (``Draft.copying``), drafts at every other, stays in step, and the output is the target's own."""
    model = tiny_model("llama", initializer_range=0.5)
    block = BlockDrafter(make_head(model, feature_layers=FEATURES), DynamicTree(6))
    merged = MergedDrafter([NGramDrafter(depth=4, max_nodes=6), block], skip_match=2)
    steps = []
    draft = merged.draft

    def watched(state):
        out = draft(state)
        steps.append((merged.part_drafts[0].copying, merged.part_drafts[1] is None))
        return out

    merged.draft = watched
    for prompt in random_prompts(6, VOCAB, seed=9):
        assert generate(Target(model), merged, prompt, max_new_tokens=32).tokens == reference(model, prompt, 32)
    assert all(rested == (copying >= 2) for copying, rested in steps), steps
    assert sum(r for _, r in steps) >= 3 and sum(not r for _, r in steps) >= 5, steps  # both kinds of step happened


def test_a_block_drafter_reading_feature_layers_stays_token_identical(tiny_models):
    model = tiny_models["gemma3"]
    drafter = BlockDrafter(make_head(model, feature_layers=FEATURES), DynamicTree(8))
    for prompt in random_prompts(4, VOCAB, seed=17):
        assert generate(Target(model), drafter, prompt, max_new_tokens=20).tokens == reference(model, prompt, 20)


def test_block_drafts_report_scores_that_predict_what_smaller_budgets_accept(model):
    """What ``tune-tree`` reads (selfspec/tools/budget.py): a budget-N tree is the N best-scored nodes of a bigger
    budget's tree, so the scores of one recorded draft predict the accepted length at every smaller budget."""
    from selfspec.tools import budget

    head = make_head(model, block_size=4)
    with torch.no_grad():  # a head that tends to agree with the target: start from its own features
        head.fc.weight.zero_()
        head.fc.weight[:, 32:] = torch.eye(32) * 3
    target = Target(model)
    gained = []
    for small in (1, 3, 6):
        recorder = budget._Recorder(BlockDrafter(head, DynamicTree(16)))
        for p in random_prompts(8, VOCAB, seed=12):
            recorder.steps.clear()
            generate(target, recorder, p, max_new_tokens=8)
            scores, depths, path = recorder.steps[0]  # the first drafted step: the same state in both runs
            assert scores[0] == 0 and (scores[1:] <= 0).all()
            real = generate(target, BlockDrafter(head, DynamicTree(small)), p, max_new_tokens=8)
            assert budget.accepted_at(scores, depths, path, small, 4) == len(real.steps[1].tokens)
            gained.append(len(real.steps[1].tokens))
    assert max(gained) > 1  # some drafts are accepted: not a check on rejections only


# ------------------------------------------------------------------------------------------ checkpoints, trees
def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    head = make_head(model, seed=4, block_size=5, draft_vocab=64, feature_layers=FEATURES)
    head.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["draft_type"] == "block" and stored["block_size"] == 5 and stored["feature_layers"] == FEATURES
    loaded = BlockHead.from_pretrained(tmp_path / "ck", model)
    assert loaded.config == head.config and head.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    assert loaded.mask.shape == (4, 32)
    prompt = random_prompts(1, VOCAB, seed=9, min_len=8, max_len=8)[0]
    a = BlockDrafter(head, DynamicTree(8)).draft(state_after_prefill(model, prompt))
    b = BlockDrafter(loaded, DynamicTree(8)).draft(state_after_prefill(model, prompt))
    assert a.tree == b.tree and torch.equal(a.tokens, b.tokens) and torch.equal(a.scores, b.scores)

    with pytest.raises(ValueError, match="trained for vocab size 96, this model has 128"):
        BlockHead.from_pretrained(tmp_path / "ck", tiny_model("llama", vocab=128))
    with pytest.raises(ValueError, match="trained for hidden size 32, this model has 48"):
        BlockHead.from_pretrained(tmp_path / "ck", tiny_model("llama", hidden_size=48))
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, block_size=6)))  # 4 masks stored, not 5
    with pytest.raises(ValueError, match=r"disagrees with config.json.*'mask': \(\(5, 32\), \(4, 32\)\)"):
        BlockHead.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, surprise=1)))
    with pytest.raises(ValueError, match=r"unknown BlockConfig keys \['surprise'\]"):
        BlockHead.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, draft_type="eagle")))
    with pytest.raises(ValueError, match="says draft_type 'eagle'; expected 'block'"):
        BlockHead.from_pretrained(tmp_path / "ck", model)
    fields = {k: v for k, v in stored.items() if k != "selfspec_version"}
    with pytest.raises(ValueError, match=r"BlockConfig.depth: expected null or 1..5 \(the block size\), found 6"):
        BlockConfig.from_dict(dict(fields, depth=6))
    with pytest.raises(ValueError, match=r"BlockConfig.block_size: expected >= 2"):
        BlockConfig.from_dict(dict(fields, block_size=1))


def test_a_checkpoint_for_another_base_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """Through the API, from config.json alone: nothing is loaded, the message names what each side has."""
    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded: the draft should have been refused first")

    monkeypatch.setattr(api, "load_model", no_loading)
    make_head(tiny_model("llama"), base_model="tiny-llama").save_pretrained(tmp_path / "narrow")  # hidden 32, V 96
    with pytest.raises(ValueError, match=r"trained for tiny-llama with hidden_size 32, but the target .* has "
                                         r"hidden_size 64"):
        api.load(str(model_dir), draft=str(tmp_path / "narrow"))
    base, _ = load_base(ModelConfig(name=str(model_dir)))
    make_head(base, draft_vocab=128, base_model="someone/other-model").save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="trained for someone/other-model, but the target is"):
        api.load(str(model_dir), draft=str(tmp_path / "other"))


def test_tree_options_and_the_trees_a_block_drafter_refuses(model, tmp_path):
    make_head(model, block_size=4, draft_vocab=6, budget=12).save_pretrained(tmp_path / "ck")
    target = Target(model)
    default = load_drafter(tmp_path / "ck", target)  # the checkpoint's: its budget, the whole block
    assert (default.dynamic.budget, default.depth, default.ranks, default.max_depth) == (12, 4, 6, 4)
    chained = load_drafter(tmp_path / "ck", target, tree=Tree.chain(3))
    assert (chained.depth, chained.ranks) == (3, 1)
    resized = default.resized(2, 5)
    assert (resized.dynamic.budget, resized.depth) == (5, 2) and resized.head is default.head
    with pytest.raises(ValueError, match=r"the tree is 5 levels deep, but 4 is the most the block drafter \(blocks of 4 "
                                         r"tokens"):
        load_drafter(tmp_path / "ck", target, tree=Tree.chain(5))
    with pytest.raises(ValueError, match=r"asks for the top-7 candidate, but top-6 is the most the block drafter .*6-token "
                                         r"draft vocabulary"):
        load_drafter(tmp_path / "ck", target, tree=Tree.full([7]))
    with pytest.raises(ValueError, match=r"drafts blocks of 4 tokens \(block_size 4\), so expected depth <= 4, found 5"):
        load_drafter(tmp_path / "ck", target, tree=DynamicTree(8, depth=5))
    spec = registry.parse_draft(str(tmp_path / "ck"), tree="dynamic:8,depth=3")  # a dynamic tree passes the registry
    assert spec.kind == "block" and spec.capabilities.tunable
    built = registry.build(spec, target, "tiny")
    assert isinstance(built, BlockDrafter) and (built.dynamic.budget, built.depth) == (8, 3)
    merged = registry.build(f"ngram+{tmp_path / 'ck'}@chain:2", target, "tiny")  # ngram+DIR: --tree goes to the block
    assert isinstance(merged, MergedDrafter) and merged.drafters[1].depth == 2
    prompt = random_prompts(1, VOCAB, seed=11, min_len=10, max_len=10)[0]
    assert generate(target, merged, prompt, max_new_tokens=16).tokens == reference(model, prompt, 16)


# ------------------------------------------------------------------------------------------ train.py
def test_recipe_checks_the_block_section():
    with pytest.raises(ValueError, match="block.block_size: expected >= 2"):
        load_config(REPO / "configs/block_tiny.yaml", ["block.block_size=1"])
    with pytest.raises(ValueError, match=r"block.depth: expected null or 1..4 \(block.block_size\), found 5"):
        load_config(REPO / "configs/block_tiny.yaml", ["block.depth=5"])
    with pytest.raises(ValueError, match="block.anchors: expected a value >= 1, found 0"):
        load_config(REPO / "configs/block_tiny.yaml", ["block.anchors=0"])
    cfg = load_config(REPO / "configs/block_smollm2.yaml")
    assert cfg.method == "block" and cfg.loss.kind == "kl" and cfg.block.block_size == 6
    assert cfg.final_dir == Path("runs/block-smollm2/block_head")
    lines = (REPO / "configs/block_smollm2.yaml").read_text().splitlines()
    assert lines[1] == "#   python train.py --config configs/block_smollm2.yaml"


def test_train_py_trains_a_block_drafter_that_resumes_exactly_and_decodes_losslessly(tmp_path):
    common = ["--config", "configs/block_tiny.yaml", "optim.scheduler=constant_with_warmup", "optim.epochs=100",
              "logging.every=1", "eval.every=0", "logging.log_with=[tensorboard]", "checkpoint.every=3"]
    train_and_check_resume(tmp_path, common)
    out = tmp_path / "full" / "block_head"
    config = json.loads((out / "config.json").read_text())
    assert config["recipe"]["method"] == "block" and config["block_size"] == 4 and config["draft_vocab_size"] == 128
    assert len(config["top1_agreement"]) == 4 and all(0.0 <= a <= 1.0 for a in config["top1_agreement"])
    metrics = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["top1"]) == 4 and torch.isfinite(torch.tensor(r["loss"])) for r in metrics if "top1" in r)
    assert list((tmp_path / "full" / "block").rglob("events.out.tfevents*"))  # TensorBoard, beside the drafter
    decode_with_tiny_draft(out)
