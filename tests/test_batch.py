"""Batches: every sequence of a batch decodes exactly as it would alone (selfspec/core/batch.py).

Greedy decoding of a batch is token-identical (fp32) to ``model.generate`` of each prompt alone, on the five tiny
architectures: prompts of mixed lengths, plain decoding, prompt lookup, an oracle tree whose whole branch is accepted
(so rows accept different lengths every step and their caches get holes), a merge; EOS and stop strings inside a batch;
sequences of different max_new_tokens; sequences joining a running batch and leaving it early; a wait line when the
batch is full (``max_batch``). The API takes a list of prompts. Sampling in a batch keeps each sequence's distribution:
tests/test_distribution.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import ARCHS, REPEATING, VOCAB, random_prompts, reference
from selfspec import NGramDrafter, NoDrafter, Target, Tree
from selfspec.core import hf
from selfspec.core.batch import Batch, Job, generate_batch, stream_batch
from selfspec.core.drafter import fork
from selfspec.drafts.layerskip import LayerSkipDrafter
from selfspec.drafts.merge import MergedDrafter
from selfspec.tools.serve.batcher import Batcher
from selfspec.testing import OracleDrafter, RandomDrafter

NEW = 20
N_PROMPTS = 12
TREE = Tree.full([2, 2, 2])  # 15 nodes; the oracle's answer on rank 1 at every level


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_models):
    """(arch, Target, prompts of mixed lengths, their greedy references of NEW tokens)."""
    arch = request.param
    model = tiny_models[arch]
    prompts = random_prompts(N_PROMPTS, VOCAB, seed=300 + ARCHS.index(arch), min_len=2, max_len=30)
    return arch, Target(model), prompts, [reference(model, p, NEW) for p in prompts]


DRAFTERS = {
    "plain": lambda i, ref: NoDrafter(),
    "ngram": lambda i, ref: NGramDrafter(),
    # two prompts in three get the oracle, the others a random tree: rows accept very different lengths
    "oracle-or-random": lambda i, ref: OracleDrafter(TREE, VOCAB, ref, branch_rank=1, seed=7) if i % 3 else
    RandomDrafter(TREE, VOCAB, seed=3),
    "merged": lambda i, ref: MergedDrafter([NGramDrafter(), OracleDrafter(Tree.chain(3), VOCAB, ref, seed=7) if i % 2
                                            else RandomDrafter(Tree.chain(3), VOCAB, seed=3)]),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_batch_is_generate_of_each_prompt(case, drafter):
    arch, target, prompts, refs = case
    jobs = [Job(p, DRAFTERS[drafter](i, ref), NEW) for i, (p, ref) in enumerate(zip(prompts, refs))]
    outs = generate_batch(target, jobs)
    bad = [(i, out.tokens, ref) for i, (out, ref) in enumerate(zip(outs, refs)) if out.tokens != ref]
    assert not bad, f"{arch}/{drafter}: {len(bad)} of {len(refs)} sequences differ from generate, first {bad[0]}"
    accepted = [out.mean_accepted for out in outs]
    if drafter == "plain":
        assert all(a == 1.0 for a in accepted)
    else:  # the drafts were really taken, and rows took different lengths
        assert max(accepted) > 1.3 and len(set(round(a, 3) for a in accepted)) > 1, accepted


def test_eos_and_lengths_inside_a_batch(case):
    """Each sequence has its own end: an EOS token its continuation reaches (at different steps), or its own
    max_new_tokens; each leaves the batch there and the others go on, identical to generate."""
    arch, target, prompts, refs = case
    jobs, expected = [], []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        if i % 3 == 0:  # stop at the first occurrence of a token of the continuation
            eos = ref[2 + i % 7]
            jobs.append(Job(p, NGramDrafter(), NEW, eos_token_id=eos))
            expected.append(reference(target.model, p, NEW, eos_token_id=eos))
        else:
            n = 1 + (i * 5) % NEW
            jobs.append(Job(p, OracleDrafter(Tree.chain(4), VOCAB, ref, seed=7), n))
            expected.append(ref[:n])
    outs = generate_batch(target, jobs)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.tokens == exp, f"{arch}: sequence {i}"
    assert len({len(out.tokens) for out in outs}) > 3  # they really ended at different steps


def test_sequences_join_and_leave_a_running_batch(case):
    arch, target, prompts, refs = case
    batch = Batch(target)
    got: dict[int, list[int]] = {}

    def add(i: int) -> None:
        step, done = batch.add(i, Job(prompts[i], NGramDrafter(), NEW))
        assert not done
        got[i] = list(step.tokens)

    def step() -> None:
        for key, s, _ in batch.step():
            got[key].extend(s.tokens)

    add(0), add(1)
    step(), step()
    add(2)  # joins two steps late, with a prompt of its own length
    step()
    batch.remove(1)  # its client went away
    assert batch.keys == [0, 2] and hf.rows(batch.cache) == 2
    for _ in range(3):
        step()
    add(3)
    while len(batch):
        step()
    assert got[0] == refs[0] and got[2] == refs[2] and got[3] == refs[3], arch
    assert 0 < len(got[1]) < NEW and got[1] == refs[1][: len(got[1])]  # what it had before it left
    assert hf.rows(batch.cache) == 0


def test_a_full_batch_queues_the_rest(case):
    """max_batch 3 for 7 prompts: at most 3 decode at once, the others join as sequences finish, all identical."""
    arch, target, prompts, refs = case
    jobs = [Job(p, NGramDrafter(), 4 + 2 * i) for i, p in enumerate(prompts[:7])]
    live, most, finished = set(), 0, []
    for i, step, done in stream_batch(target, jobs, max_batch=3):
        live.add(i)
        most = max(most, len(live))
        if done:
            live.discard(i)
            finished.append(i)
    assert most == 3 and sorted(finished) == list(range(7))
    outs = generate_batch(target, jobs, max_batch=3)
    assert [o.tokens for o in outs] == [ref[: 4 + 2 * i] for i, ref in enumerate(refs[:7])]


def test_one_sequence_is_the_batch_size_one_loop(case):
    """A batch of one verifies like the batch-size-1 loop: the same tokens, steps and tree sizes."""
    from selfspec.core.generate import generate

    arch, target, prompts, refs = case
    for p, ref in list(zip(prompts, refs))[:4]:
        alone = generate(target, OracleDrafter(TREE, VOCAB, ref, branch_rank=1, seed=7), p, NEW)
        [batched] = generate_batch(target, [Job(p, OracleDrafter(TREE, VOCAB, ref, branch_rank=1, seed=7), NEW)])
        assert batched.tokens == alone.tokens == ref
        assert [(s.tokens, s.tree_size) for s in batched.steps] == [(s.tokens, s.tree_size) for s in alone.steps]


def test_fork_shares_weights_and_not_state(tiny_models):
    """A forked drafter shares its modules with the original, and its cache and counters are its own."""
    from selfspec.drafts.draft_model import ModelDrafter
    from conftest import tiny_model

    target = Target(tiny_models["llama"])
    drafter = ModelDrafter(tiny_model("llama", initializer_range=REPEATING, seed=11, num_hidden_layers=1), target,
                           Tree.chain(3))
    twin = fork(drafter)
    assert twin.model is drafter.model and twin.target is drafter.target
    assert twin.cache is not drafter.cache
    merged = MergedDrafter([NGramDrafter(), drafter])
    twin_merged = fork(merged)
    assert twin_merged.drafters[1].model is drafter.model and twin_merged.drafters[0] is not merged.drafters[0]
    # decoding a batch with forked draft models: each sequence as generate decodes it
    prompts = random_prompts(5, VOCAB, seed=9, min_len=3, max_len=20)
    refs = [reference(target.model, p, NEW) for p in prompts]
    outs = generate_batch(target, [Job(p, fork(drafter), NEW) for p in prompts])
    assert [o.tokens for o in outs] == refs


def test_a_drafter_on_the_targets_cache_cannot_batch(tiny_models):
    target = Target(tiny_models["llama"])
    skip = LayerSkipDrafter(target, (1,), depth=2)
    assert not skip.batchable and not MergedDrafter([NGramDrafter(), skip]).batchable
    with pytest.raises(ValueError, match="LayerSkipDrafter cannot draft for a batch"):
        fork(skip)
    with pytest.raises(ValueError, match="LayerSkipDrafter cannot draft for a batch"):
        Batch(target).add(0, Job(torch.tensor([1, 2, 3]), skip, 4))
    # a merge names the part that cannot batch, and the server's batcher says to serve one request at a time
    with pytest.raises(ValueError, match=r"MergedDrafter \(its part LayerSkipDrafter\) cannot draft for a batch"):
        fork(MergedDrafter([NGramDrafter(), skip]))
    with pytest.raises(ValueError, match=r"LayerSkipDrafter cannot draft for a batch: .*--max-batch 1"):
        Batcher(SimpleNamespace(drafter=skip), max_batch=4)


def test_bad_jobs_are_refused_before_they_join(tiny_models):
    target = Target(tiny_models["llama"])
    batch = Batch(target)
    with pytest.raises(ValueError, match="the prompt is empty"):
        batch.add(0, Job(torch.tensor([], dtype=torch.long), NoDrafter(), 4))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        batch.add(0, Job(torch.tensor([1, 2]), NoDrafter(), 0))
    batch.add("a", Job(torch.tensor([1, 2]), NoDrafter(), 4))
    with pytest.raises(ValueError, match="a sequence with key 'a' is already in the batch"):
        batch.add("a", Job(torch.tensor([3, 4]), NoDrafter(), 4))
    assert len(batch) == 1 and hf.rows(batch.cache) == 1
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        list(stream_batch(target, [Job(torch.tensor([1, 2]), NoDrafter(), 4)], max_batch=0))


# ------------------------------------------------------------------------------------------------ the Python API
@pytest.fixture(scope="module")
def api_model(model_dir):
    import selfspec.api as ss

    return ss.load(str(model_dir), draft="ngram")


def test_api_generates_a_list_of_prompts(api_model):
    """A list of prompts (texts, chats, token ids) -> one Result each, identical to decoding each alone, with stop
    strings and the tokenizer's EOS inside the batch; a [B, T] tensor is B prompts."""
    m = api_model
    prompts = ["hello there", [{"role": "user", "content": "count to five"}], "a", "what is the time",
               m.encode("tell me a story").tolist()]
    for stop in (None, ["e"], ["th", "o"]):
        alone = [m.generate(p, max_new_tokens=24, stop=stop) for p in prompts]
        together = m.generate(prompts, max_new_tokens=24, stop=stop)
        assert [r.tokens for r in together] == [r.tokens for r in alone], stop
        assert [r.text for r in together] == [r.text for r in alone]
        plain = [m.generate_plain(p, max_new_tokens=24, stop=stop).tokens for p in prompts]
        assert [r.tokens for r in together] == plain
        assert all(r.stats.new_tokens == len(r.tokens) and sum(r.stats.accept_lengths) == len(r.tokens)
                   for r in together)
    assert len({len(r.tokens) for r in m.generate(prompts, max_new_tokens=24, stop=["th", "o"])}) > 1
    rows = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert [r.tokens for r in m.generate(rows, max_new_tokens=6)] == \
        [m.generate(row, max_new_tokens=6).tokens for row in rows]


def test_generate_plain_pads_a_list_of_prompts_into_one_batch(api_model):
    """transformers' generate on a left-padded batch, the peer of a selfspec batch: each row's answer is its answer
    alone (fp32 greedy), ending at its own stop string or EOS with the padding after it cut; one time for all rows;
    logprobs per row as alone."""
    m = api_model
    prompts = ["hello there", [{"role": "user", "content": "count to five"}], "a", "what is the time"]
    assert len({m.encode(p).shape[0] for p in prompts}) == len(prompts)  # every row padded differently
    for stop in (None, ["e"], ["th", "o"]):
        alone = [m.generate_plain(p, max_new_tokens=24, stop=stop) for p in prompts]
        padded = m.generate_plain(prompts, max_new_tokens=24, stop=stop)
        assert [r.tokens for r in padded] == [r.tokens for r in alone], stop
        assert [r.text for r in padded] == [r.text for r in alone]
        assert all(r.stats.new_tokens == len(r.tokens) == sum(r.stats.accept_lengths) for r in padded)
        assert len({r.stats.seconds for r in padded}) == 1
    assert len({len(r.tokens) for r in m.generate_plain(prompts, max_new_tokens=24, stop=["th", "o"])}) > 1
    padded = m.generate_plain(prompts[:2], max_new_tokens=6, logprobs=2)
    alone = [m.generate_plain(p, max_new_tokens=6, logprobs=2) for p in prompts[:2]]
    for x, y in zip(padded, alone):
        assert [t.token for t in x.logprobs] == [t.token for t in y.logprobs]
        assert [t.logprob for t in x.logprobs] == pytest.approx([t.logprob for t in y.logprobs], abs=1e-4)


def test_api_streams_a_list_of_prompts(api_model):
    m = api_model
    prompts = ["hello there", "count to five", "a"]
    stream = m.stream(prompts, max_new_tokens=16)
    pieces: dict[int, str] = {0: "", 1: "", 2: ""}
    for i, piece in stream:
        pieces[i] += piece
    alone = [m.generate(p, max_new_tokens=16) for p in prompts]
    assert [pieces[i] for i in range(3)] == [s.text for s in stream.streams] == [r.text for r in alone]
    assert [s.tokens for s in stream.streams] == [r.tokens for r in alone]
    assert all(s.done for s in stream.streams)


def test_api_queues_beyond_max_batch_and_falls_back_for_unbatchable_drafts(model_dir):
    import selfspec.api as ss

    m = ss.load(str(model_dir), draft="ngram")
    m.max_batch = 2
    prompts = ["one", "two", "three", "four", "five"]
    assert [r.tokens for r in m.generate(prompts, max_new_tokens=8)] == \
        [m.generate(p, max_new_tokens=8).tokens for p in prompts]
    skip = ss.load(str(model_dir), draft="early-exit:layer=1")  # runs the target's own layers: one at a time
    assert not skip.drafter.batchable
    assert [r.tokens for r in skip.generate(prompts[:3], max_new_tokens=8)] == \
        [m.generate_plain(p, max_new_tokens=8).tokens for p in prompts[:3]]


# ------------------------------------------------------------------------------------------------- node budget
def _chain_draft(n: int):
    from selfspec.core.drafter import Draft

    return Draft(tree=Tree.chain(n - 1), tokens=torch.arange(n))


def test_within_budget_keeps_every_root_and_shares_the_rest_among_drafts():
    from selfspec.core.batch import within_budget

    drafts = [_chain_draft(n) for n in (9, 1, 5, 1)]
    assert [len(d.tree) for d in within_budget(drafts, 4)] == [1, 1, 1, 1]  # roots only: plain decoding
    assert [len(d.tree) for d in within_budget(drafts, 8)] == [3, 1, 3, 1]  # 4 left, 2 each for the two that drafted
    assert [len(d.tree) for d in within_budget(drafts, 12)] == [5, 1, 5, 1]
    assert [len(d.tree) for d in within_budget(drafts, 14)] == [7, 1, 5, 1]  # the second's unfilled share passes on
    assert [len(d.tree) for d in within_budget(drafts, 100)] == [9, 1, 5, 1]
    cut = within_budget([_chain_draft(9), _chain_draft(9)], 5)[0]
    assert cut.tokens.tolist() == [0, 1, 2] and cut.tree.is_chain  # its first nodes, still a tree


def test_a_node_budget_stays_lossless(case):
    """Trees cut to a budget decode the same tokens: twelve sequences under a budget of twelve nodes verify their roots
    alone (plain decoding, one token a step); under 36 they share 24 draft nodes a step."""
    arch, target, prompts, refs = case
    for budget in (N_PROMPTS, 3 * N_PROMPTS):
        jobs = [Job(p, OracleDrafter(TREE, VOCAB, ref, branch_rank=1, seed=7), NEW) for p, ref in zip(prompts, refs)]
        got: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
        sizes = []
        for i, step, _ in stream_batch(target, jobs, node_budget=budget):
            got[i].extend(step.tokens)
            sizes.append(step.tree_size)
        assert [got[i] for i in range(len(jobs))] == refs, (arch, budget)
        if budget == N_PROMPTS:
            assert max(sizes) == 1 and len(sizes) == N_PROMPTS * NEW  # one token a step each
        else:
            assert 1 < max(sizes) < len(TREE) and len(sizes) < N_PROMPTS * NEW


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_batch_beyond_a_sliding_window(arch):
    """Sliding-window layers in a batch: the window (4) is applied by position in each row's mask, far beyond it."""
    from conftest import tiny_model

    model = tiny_model(arch, initializer_range=REPEATING, sliding_window=4)
    target = Target(model)
    prompts = random_prompts(6, VOCAB, seed=21, min_len=2, max_len=12)
    refs = [reference(model, p, NEW) for p in prompts]
    jobs = [Job(p, OracleDrafter(TREE, VOCAB, ref, branch_rank=1, seed=7) if i % 2 else NGramDrafter(), NEW)
            for i, (p, ref) in enumerate(zip(prompts, refs))]
    assert [o.tokens for o in generate_batch(target, jobs)] == refs
