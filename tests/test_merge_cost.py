"""``+skip_unpaid=P``: a merge's costly part sits out where it is measured not to pay for itself (merge_cost), and the
output stays plain decoding's."""

from __future__ import annotations

import pytest

from conftest import VOCAB, random_prompts, reference, tiny_model
from selfspec import Target, Tree, registry, tuned
from selfspec.core.drafter import Draft, Drafter, DraftState
from selfspec.core.generate import generate
from selfspec.drafts import merge_cost
from selfspec.drafts.merge import MergedDrafter
from selfspec.testing import OracleDrafter, RandomDrafter


def test_a_step_is_bucketed_by_the_longest_match_of_the_earlier_parts_that_drafted():
    assert merge_cost.bucket([]) == 0
    assert merge_cost.bucket([0, None]) == 0
    assert merge_cost.bucket([2, 1]) == 2
    assert merge_cost.bucket([None, 7]) == merge_cost.BUCKETS - 1 == 3


def test_observe_keeps_running_means_then_exponential_ones():
    t = merge_cost.Tally()
    for seconds, tokens, without in ((1.0, 4, 1), (3.0, 2, 1)):
        merge_cost.observe(t, True, seconds, tokens, without)
    assert (t.on, t.tokens, t.without, t.on_seconds) == (2, 3.0, 1.0, 2.0)  # plain means while few
    merge_cost.observe(t, False, 0.5)
    assert (t.off, t.off_seconds, t.on) == (1, 0.5, 2)
    for _ in range(8):
        merge_cost.observe(t, True, 2.0, 3, 1)
    merge_cost.observe(t, True, 12.0, 3, 1)  # the 11th: weight ALPHA = 0.1, not 1/11
    assert t.on == 11 and t.on_seconds == pytest.approx(2.0 + 0.1 * 10.0)


def test_pays_compares_tokens_per_second_with_and_without_the_part():
    t = merge_cost.Tally(on=5, tokens=4.0, without=1.0, on_seconds=3.0, off=2, off_seconds=1.0)
    assert merge_cost.pays(t)  # 4 / 3 s >= 1 / 1 s
    t.on_seconds = 5.0
    assert not merge_cost.pays(t)  # 4 / 5 s < 1 / 1 s


def choices(t: merge_cost.Tally, period: int, n: int, on_seconds: float) -> str:
    """The gate's next n choices in one bucket ('D' drafts, '.' sits out), each step then observed: 4 tokens with
    the part in on_seconds, 1 without it in 1 s."""
    out = []
    for _ in range(n):
        drafted = merge_cost.drafts(t, period)
        merge_cost.chose(t, drafted)
        merge_cost.observe(t, drafted, on_seconds if drafted else 1.0, 4, 1)
        out.append("D" if drafted else ".")
    return "".join(out)


def test_the_gate_warms_up_then_follows_the_means_with_a_probe_the_other_way():
    period = 4
    # unpaid (4 tokens in 10 s against 1 in 1 s): after WARM drafts and COLD rests, one draft in every `period` steps
    assert choices(merge_cost.Tally(), period, 17, 10.0) == "DDD.." + "...D" * 3
    # paid (4 tokens in 2 s): after the warm-up, one rest in every REST_EVERY x period steps
    paid = choices(merge_cost.Tally(), period, 5 + 2 * merge_cost.REST_EVERY * period, 2.0)
    assert paid == "DDD.." + ("D" * (merge_cost.REST_EVERY * period - 1) + ".") * 2


class Clocked(Drafter):
    """A drafter that takes ``seconds`` of a fake clock to draft and notes at which step it drafted."""

    def __init__(self, inner: Drafter, clock: list[float], seconds: float, steps: list[int]):
        self.inner, self.clock, self.seconds, self.steps = inner, clock, seconds, steps

    def draft(self, state: DraftState) -> Draft:
        self.clock[0] += self.seconds
        self.steps.append(state.tokens.shape[0])
        return self.inner.draft(state)

    def update(self, draft: Draft, acceptance) -> None:
        self.inner.update(draft, acceptance)


@pytest.mark.parametrize("cost,pattern", [(10.0, "DDD.." + "...D" * 3), (0.5, "DDD.." + "D" * 15 + ".")])
def test_a_merged_part_that_does_not_pay_sits_out_and_the_output_is_plain_decodings(cost, pattern):
    """A costly oracle chain (4 tokens a step against the noise's 1) beside noise that takes 1 s a step: at 10 s a
    draft it is unpaid and drafts one step in four; at 0.5 s it pays and sits out one step in sixteen. Either way the
    tokens are plain greedy decoding's, over two requests (nothing of one is timed into the other)."""
    model = tiny_model("llama")
    target = Target(model)
    clock = [0.0]
    prompts = random_prompts(2, VOCAB, seed=5, min_len=6, max_len=6)
    every, costly = [], []
    refs = [reference(model, p, 100) for p in prompts]
    oracle = OracleDrafter(Tree.chain(3), VOCAB, refs[0], seed=1)
    merged = MergedDrafter([Clocked(RandomDrafter(Tree.full([2, 2]), VOCAB, seed=2), clock, 1.0, every),
                            Clocked(oracle, clock, cost, costly)], skip_unpaid=4, clock=lambda: clock[0])
    for prompt, ref in zip(prompts, refs):
        oracle.continuation = ref
        every.clear()
        costly.clear()
        assert generate(target, merged, prompt, 100).tokens == ref
        if prompt is prompts[0]:
            drafted = set(costly)
            assert "".join("D" if s in drafted else "." for s in every)[:len(pattern)] == pattern
    assert merged.tallies[0] == [merge_cost.Tally()] * merge_cost.BUCKETS  # the first part is never gated
    tally = merged.tallies[1][0]
    assert tally.without == pytest.approx(1.0, abs=0.3) and tally.tokens == pytest.approx(4.0, abs=0.5)
    assert tally.on_seconds == pytest.approx(1.0 + cost) and tally.off_seconds == pytest.approx(1.0)


def test_skip_unpaid_in_the_registry_and_its_tuning_key():
    spec = registry.parse_draft("ngram+ngram:depth=4+skip_unpaid=8+skip_after=3")
    assert spec.config == {"skip_after": 3, "skip_unpaid": 8}
    target = Target(tiny_model("llama"))
    built = registry.build_drafter(spec, target)
    assert (built.skip_after, built.skip_unpaid) == (3, 8)
    without = registry.parse_draft("ngram+ngram:depth=4+skip_after=3")
    assert tuned.merge_stamp(spec, spec.parts[1]) == tuned.merge_stamp(without, without.parts[1])  # not replayed
    with pytest.raises(ValueError, match="skip_unpaid must be >= 1 \\(or None\\), found 0"):
        registry.build_drafter(registry.parse_draft("ngram+ngram+skip_unpaid=0"), target)
