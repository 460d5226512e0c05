"""The hardware-aware tree budget: accepted lengths at smaller budgets read exactly off a larger draft, the verify-cost
curve measured once and cached, the choice maximising predicted tokens/s, and --tree auto using the cached choice.

The budget-N prediction is checked against really decoding with budget N: on a greedy run the accepted length of each
step is a property of (state, tree), so the recorded big-budget run predicts the small-budget run's mean exactly when
the two runs visit the same states; here they are compared on the first step of many prompts, where they do."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import random_prompts, tiny_model
from fake_clock import FakeClock

from heads.eagle.config import EagleConfig
from heads.eagle.drafter import EagleDrafter
from heads.eagle.model import EagleHead
from selfspec import registry, tuned
from selfspec.tools import budget, merge_budget
import selfspec.core.generate as generate_module
from selfspec.core.generate import generate
from selfspec.drafts.layerskip import LayerSkipDrafter
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree

VOCAB = 96


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", initializer_range=0.1)
    cfg = EagleConfig.for_model(model, draft_vocab_size=VOCAB)
    torch.manual_seed(0)
    head = EagleHead(cfg, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    with torch.no_grad():  # a head that tends to agree with the target: start from its own features
        head.fc.weight.zero_()
        head.fc.weight[:, cfg.hidden_size:] = torch.eye(cfg.hidden_size) * 3
    return model, head


def test_accepted_at_counts_the_accepted_path_inside_the_best_nodes():
    scores = torch.tensor([0.0, -0.1, -2.0, -0.3, -0.5])  # root, a (depth 1), b (1), a->c (2), c->d (3)
    depths, path = (0, 1, 1, 2, 3), (0, 1, 3, 4)  # the target accepted a, c, d
    assert budget.accepted_at(scores, depths, path, budget=4, depth=3) == 4  # all three + the bonus
    assert budget.accepted_at(scores, depths, path, budget=2, depth=3) == 3  # a, c (b is worse than both)
    assert budget.accepted_at(scores, depths, path, budget=1, depth=3) == 2
    assert budget.accepted_at(scores, depths, path, budget=4, depth=1) == 2  # depth 1 keeps a only
    # the adaptive length: nodes below the cut are left out, whatever the budget
    assert budget.kept_nodes(scores, depths, budget=4, depth=3, min_logp=-0.4) == [1, 3]
    assert budget.accepted_at(scores, depths, path, budget=4, depth=3, min_logp=-0.4) == 3  # a, c
    assert budget.accepted_at(scores, depths, path, budget=4, depth=3, min_logp=-0.05) == 1  # nothing: the bonus


def test_interpolate_between_and_beyond_measured_sizes():
    curve = {1: 10.0, 4: 13.0, 8: 21.0}
    assert budget.interpolate(curve, 4) == 13.0
    assert budget.interpolate(curve, 6) == 17.0
    assert budget.interpolate(curve, 10) == 25.0


@pytest.mark.parametrize("kind", ["eagle", "layerskip"])
def test_recorded_big_budget_predicts_what_a_small_budget_accepts(setup, kind):
    model, head = setup
    target = Target(model)
    if kind == "eagle":
        def make(n: int):
            return EagleDrafter(head, 4, 3, n)
    else:  # the target minus its second layer, growing its own tree
        def make(n: int):
            return LayerSkipDrafter(target, (1,), tree=DynamicTree(n, max_rank=3, depth=4))
    prompts = random_prompts(12, VOCAB, seed=4)
    for small in (1, 3, 6):
        recorder = budget._Recorder(make(16))
        predicted, real = [], []
        for p in prompts:
            recorder.steps.clear()
            generate(target, recorder, p, max_new_tokens=8)
            scores, depths, path = recorder.steps[0]  # the first drafted step: the same state in both runs
            predicted.append(budget.accepted_at(scores, depths, path, small, 4))
            out = generate(target, make(small), p, max_new_tokens=8)
            real.append(len(out.steps[1].tokens))
        assert predicted == real, small
    assert max(real) > 1  # the drafts do get accepted: the check is not about rejections only


def test_recorded_big_budget_predicts_what_an_adaptive_length_accepts_and_verifies(setup):
    """dynamic:N,min_prob=P replayed off the recorded big-budget draft: the tokens a step gains and the size of the
    tree it verifies, exactly as a real decode with that cut (EAGLE's rerank leaves out the nodes below it)."""
    model, head = setup
    target = Target(model)
    prompts = random_prompts(12, VOCAB, seed=4)
    sizes = set()
    for small, p in ((16, 0.05), (6, 0.2), (3, 0.01)):
        predicted, real = [], []
        for prompt in prompts:
            recorder = budget._Recorder(EagleDrafter(head, 4, 3, 16))
            generate(target, recorder, prompt, max_new_tokens=8)
            scores, depths, path = recorder.steps[0]
            kept = budget.kept_nodes(scores, depths, small, 4, math.log(p))
            predicted.append((budget.accepted_at(scores, depths, path, small, 4, math.log(p)), len(kept) + 1))
            out = generate(target, EagleDrafter(head, 4, 3, small, min_prob=p), prompt, max_new_tokens=8)
            real.append((len(out.steps[1].tokens), out.steps[1].tree_size))
        assert predicted == real, (small, p)
        sizes |= {n for _, n in real}
    assert len(sizes) >= 3  # the cut gives trees of several sizes: the check is not about full budgets only
    choice = budget._choice([recorder.steps[0]], 6, 4, 0.2, {1: 10.0, 64: 73.0}, 1.0, 2.0)
    n = len(budget.kept_nodes(*recorder.steps[0][:2], 6, 4, math.log(0.2))) + 1
    assert (choice.nodes, choice.step_ms, choice.tree) == (n, 10.0 + (n - 1) + 2.0, DynamicTree(6, depth=4, min_prob=0.2))


def test_recorded_lookup_predicts_what_prompt_lookup_of_another_size_accepts(setup):
    """One recording at the largest size predicts every other (depth, max_nodes) at the states it visited (here the
    first drafted step): exactly, up to the target's next tokens the recording knows (its accepted drafts and bonus)."""
    from selfspec.drafts.ngram import NGramDrafter

    from selfspec.core.drafter import NoDrafter

    target = Target(setup[0])
    prompts = [torch.cat([p, torch.tensor(generate(target, NoDrafter(), p, 24).tokens)])  # the target's own loops
               for p in random_prompts(24, VOCAB, seed=5, min_len=8, max_len=20)]
    recorder = budget._LookupRecorder(NGramDrafter(depth=6, max_nodes=16))
    recorded = []
    for p in prompts:
        recorder.steps.clear()
        generate(target, recorder, p, max_new_tokens=12)
        recorded.append(recorder.steps[0])
    beyond = 0
    for depth, nodes in ((1, 1), (2, 3), (6, 4), (3, 16)):
        lookup = NGramDrafter(depth=depth, max_nodes=nodes)
        predicted = [budget.lookup_at(tokens, accepted, lookup) for tokens, accepted in recorded]
        real = [generate(target, NGramDrafter(depth=depth, max_nodes=nodes), p, max_new_tokens=12).steps[1]
                for p in prompts]
        assert [n for _, n in predicted] == [s.tree_size for s in real], (depth, nodes)
        for (gained, _), (_, accepted), step in zip(predicted, recorded, real):
            if gained <= len(accepted):  # inside what the recording knows of the target's next tokens: exact
                assert gained == len(step.tokens), (depth, nodes)
            else:  # the trie holds the recorded bonus too: at least that
                assert len(accepted) + 1 == gained <= len(step.tokens), (depth, nodes)
                beyond += 1
    assert max(g for g, _ in predicted) > 2  # drafts do get accepted, deeper than one token
    assert beyond > 0  # a smaller trie that reaches past the recorded one: (3, 16) holds more, shorter continuations


def test_verify_costs_time_the_sizes_in_rounds(setup, tmp_path, monkeypatch):
    """Every size once per round (warm-up rounds first), so that a machine whose speed drifts slows every size alike;
    each verification as greedy decoding runs it (no LM head in the forward, ``head_rows`` after it; every logit with
    greedy=False); a cached curve timed another way (size by size, or with every logit: "rounds") is measured again."""
    from selfspec.tools import costs

    model, _ = setup
    target = Target(model)
    order, heads = [], []
    real = target.verify
    monkeypatch.setattr(target, "verify", lambda tree, tokens, cache, logits=True:
                        order.append((len(tokens), logits)) or real(tree, tokens, cache, logits))
    monkeypatch.setattr(costs, "greedy_from_hidden", lambda tree, *a: heads.append(len(tree)))
    rows = costs.verify_costs(target, sizes=(1, 2, 4), context=8, repeats=3, warmup=2)
    assert order == [(1, False), (2, False), (4, False)] * 5 and heads == [1, 2, 4] * 5
    assert [r.nodes for r in rows] == [1, 2, 4] and rows[0].relative == 1.0
    order.clear()
    heads.clear()
    costs.verify_costs(target, sizes=(1, 4), context=8, repeats=1, warmup=0, greedy=False)
    assert order == [(1, True), (4, True)] and heads == []  # as sampling verifies: every node's logits

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    curve = budget.cached_verify_costs(target, "tiny", repeats=1)
    path = next((tmp_path / "cache" / "tuning").glob("verify-*.json"))
    data = json.loads(path.read_text())
    assert data["timing"] == budget.TIMING == "rounds, greedy head rows"
    for before in ({"timing": "rounds"}, {}):  # with every logit; size by size (no "timing" in its file): not trusted
        path.write_text(json.dumps({**{k: v for k, v in data.items() if k != "timing"}, **before,
                                    "median_ms": {"1": 99.0}}))
        order.clear()
        assert sorted(budget.cached_verify_costs(target, "tiny", repeats=1)) == sorted(curve) and order


def test_a_cost_curve_out_of_order_is_timed_again_when_measured_or_read(setup, tmp_path, monkeypatch, caplog):
    """From 8 nodes up a bigger tree cannot verify much cheaper than a smaller one: such a curve was disturbed while it
    was timed, so it is timed again (up to budget.TRIES times) whether it was just measured or read from the cache;
    below 8 nodes a real kernel effect may order sizes otherwise (fp32: 2 nodes above 4) and is kept."""
    from selfspec.tools.costs import VerifyCost

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    good = {n: 10.0 + n for n in budget.SIZES}
    disturbed = {**good, 32: 66.0, 48: 46.0}
    assert budget.cost_anomalies(disturbed) == [(32, 48)]
    assert budget.cost_anomalies({**good, 2: 30.0, 4: 20.0}) == []  # below MONOTONE_FROM
    assert budget.cost_anomalies({**good, 32: 1.1 * good[48]}) == []  # within SLACK
    timings = [disturbed, disturbed, good]
    monkeypatch.setattr(budget, "verify_costs", lambda *a, **k: [VerifyCost(n, ms, ms / 11) for n, ms in timings.pop(0).items()])
    target = Target(setup[0])
    assert budget.cached_verify_costs(target, "tiny") == good and not timings  # timed three times
    path = next((tmp_path / "cache" / "tuning").glob("verify-*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "median_ms": disturbed}))  # a disturbed cached curve
    timings = [good]
    assert budget.cached_verify_costs(target, "tiny") == good and not timings  # timed again, not used
    assert budget.cached_verify_costs(target, "tiny") == good  # now read
    timings = [disturbed] * budget.TRIES
    with caplog.at_level("WARNING"):
        assert budget.cached_verify_costs(target, "tiny", refresh=True) == disturbed  # kept after TRIES, with a warning
    assert "stayed out of order after 3 timings (32 nodes 66.0 ms, 48 nodes 46.0 ms)" in caplog.text


def test_verify_costs_on_a_model_with_fewer_positions_than_the_context():
    """GPT-2 with 32 learned positions: the cost curve's default context (256) is cut to what the model holds (a
    tree's nodes sit one position past the context) instead of indexing past its position embeddings."""
    from selfspec.tools import costs

    target = Target(tiny_model("gpt2", max_positions=32))
    rows = costs.verify_costs(target, sizes=(1, 4), repeats=1, warmup=0)
    assert [r.nodes for r in rows] == [1, 4]


def test_tune_caches_costs_and_the_best_tree_for_tree_auto(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model, head = setup
    target = Target(model)
    calls = []
    real = budget.verify_costs
    monkeypatch.setattr(budget, "verify_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    # the tiny model's ~0.5 ms verifies can time out of order beside other work, and such a curve is timed again when
    # read (tested on its own below); here a curve is taken as it comes
    monkeypatch.setattr(budget, "cost_anomalies", lambda curve: [])
    curve = budget.cached_verify_costs(target, "tiny", repeats=2)
    assert budget.cached_verify_costs(target, "tiny") == curve and len(calls) == 1  # measured once, then read
    assert sorted(curve) == list(budget.SIZES)

    head.save_pretrained(tmp_path / "eagle")
    tuning = budget.tune(target, lambda d, n: EagleDrafter(head, d, 3, n), random_prompts(3, VOCAB, seed=5), curve,
                         depths=(2, 4), budgets=(2, 8), max_new_tokens=12)
    assert len(tuning.table) == 4 and tuning.best == max(tuning.table, key=lambda c: c.tokens_per_s)
    path = tuned.save_tuned(str(tmp_path / "eagle"), target, "tiny", tuning)
    assert json.loads(path.read_text())["best"]["budget"] == tuning.best.budget
    spec = registry.parse_draft(str(tmp_path / "eagle"))
    tree = registry.resolve_tree("auto", spec, target, "tiny")
    assert tree == DynamicTree(budget=tuning.best.budget, depth=tuning.best.depth)
    drafter = registry.build_drafter(spec, target, tree)
    assert (drafter.budget, drafter.depth) == (tuning.best.budget, tuning.best.depth)

    with pytest.raises(FileNotFoundError, match="run `python infer.py tune-tree --draft"):
        registry.resolve_tree("auto", spec, target, "another-name")
    with pytest.raises(ValueError, match="--tree auto is for drafts whose tree budget"):
        registry.resolve_tree("auto", registry.parse_draft("early-exit:layer=1"), target, "tiny")


def test_tune_predicts_at_this_runs_level_whatever_level_the_cached_curve_was_measured_at(setup, monkeypatch):
    """A cost curve measured when the machine was 10x slower (busier, another load) predicts the same tokens/s as one
    measured now: its shape is kept, its level scaled to this run's own verifications, so the verify cost and the
    drafting cost (measured now) of a prediction come from the same run. Unscaled, the stale curve's predictions are
    ~10x off and it favours deeper trees than are fastest now. The loop's clock moves only in the target's verify (by
    what ``curve`` says a tree of that size costs) and in drafting (1 ms per level of depth), so every figure is exact."""
    model, head = setup
    target = Target(model)
    prompts = random_prompts(3, VOCAB, seed=7)
    curve = {n: 1.0 + 0.5 * n for n in budget.SIZES}  # ms: what this run's verifications cost
    stale = {n: 10 * ms for n, ms in curve.items()}
    clock = FakeClock()
    monkeypatch.setattr(generate_module, "time", clock)
    verify = target.verify
    monkeypatch.setattr(target, "verify", lambda tree, tokens, cache, *rest: clock.advance(
        budget.interpolate(curve, len(tokens)) / 1000) or verify(tree, tokens, cache, *rest))

    def timed_drafter(depth: int, n: int) -> EagleDrafter:
        drafter = EagleDrafter(head, depth, 3, n)
        draft = drafter.draft
        drafter.draft = lambda state: clock.advance(depth / 1000) or draft(state)
        return drafter

    def run(c):
        return budget.tune(target, timed_drafter, prompts, c, depths=(1, 3), budgets=(2, 8), max_new_tokens=24)

    now, then = run(curve), run(stale)
    assert now.verify_ratio == pytest.approx(1.0)  # this run's verifications cost what the curve says
    assert then.verify_ratio == pytest.approx(0.1)  # the stale curve is seen as 10x this run's level
    assert now.plain_ms == pytest.approx(curve[1]) and then.plain_ms == pytest.approx(curve[1])  # scaled to this run
    assert len(now.table) == len(then.table) == 4
    for a, b in zip(sorted(now.table, key=lambda c: (c.depth, c.budget)),
                    sorted(then.table, key=lambda c: (c.depth, c.budget))):
        assert (a.depth, a.budget, a.accepted) == (b.depth, b.budget, b.accepted)
        # predicted step: the verify of the nodes kept (budget + 1, or fewer: one level of top-3 drafts has 3
        # candidates, and the last step of a decode drafts no deeper than the tokens still wanted) at this run's
        # level, plus this run's drafting at that depth
        nodes = a.nodes if a.nodes is not None else a.budget + 1
        assert 1 < nodes <= min(a.budget + 1, 4 if a.depth == 1 else 99), a
        assert a.step_ms == pytest.approx(1.0 + 0.5 * nodes + a.depth), a
        assert b.step_ms == pytest.approx(a.step_ms) and b.tokens_per_s == pytest.approx(a.tokens_per_s), (a, b)


def test_dynamic_tree_depth_option_parses_and_limits_the_drafts(setup):
    assert registry.parse_tree("dynamic:24,depth=3") == DynamicTree(24, depth=3)
    with pytest.raises(ValueError, match="bad --tree"):
        registry.parse_tree("dynamic:24,depth=0")
    model, head = setup
    drafter = EagleDrafter.with_tree(head, DynamicTree(10, depth=2))
    out = generate(Target(model), drafter, random_prompts(1, VOCAB, seed=6)[0], max_new_tokens=10)
    assert all(s.tree_size <= 11 for s in out.steps) and drafter.depth == 2


def test_medusa_dynamic_trees_report_scores_that_predict_smaller_budgets():
    """Medusa heads with a dynamic tree are tunable too: a budget-N tree is the N best paths of the same candidates."""
    from heads.medusa.config import MedusaConfig
    from heads.medusa.drafter import MedusaDrafter
    from heads.medusa.model import MedusaHeads

    model = tiny_model("llama", initializer_range=0.1)
    heads = MedusaHeads(MedusaConfig.for_model(model, num_heads=3), model.get_output_embeddings()).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    target = Target(model)
    gained = []
    for small in (1, 4):
        recorder = budget._Recorder(MedusaDrafter(heads, DynamicTree(12)))
        for p in random_prompts(8, VOCAB, seed=11):
            recorder.steps.clear()
            generate(target, recorder, p, max_new_tokens=8)
            scores, depths, path = recorder.steps[0]
            assert scores[0] == 0 and (scores[1:] <= 0).all()
            real = generate(target, MedusaDrafter(heads, DynamicTree(small)), p, max_new_tokens=8)
            assert budget.accepted_at(scores, depths, path, small, 3) == len(real.steps[1].tokens)
            gained.append(len(real.steps[1].tokens))
    assert max(gained) > 1  # some drafts are accepted: not a check on rejections only


def test_the_tuning_table_warns_when_no_tree_beats_one_token_decoding():
    def tuning(accepted):
        best = budget.Choice(depth=3, budget=8, accepted=accepted, step_ms=100.0)
        return budget.Tuning(best=best, plain_ms=50.0, table=[best])

    slow = budget.format_tuning(tuning(1.8))  # 18 tokens/s predicted against 20 for one-token steps
    assert "warning: no tree is predicted to beat one-token decoding here (best 18.0 against 20.0 tokens/s)" in slow
    assert "0.90×" in slow
    assert "warning" not in budget.format_tuning(tuning(2.2))


def test_tune_tree_caches_nothing_when_the_machine_is_busier_than_its_cost_curve(model_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """A cost curve 20x cheaper than what the calibration's own verifications take stands for a machine busy during
    tune-tree (or a stale curve): the choice would fit that load, so nothing is cached for --tree auto and the message
    says what to do. The loop's clock moves only in the target's verify, by 20x what the cached curve says."""
    from selfspec.tools import cli
    from selfspec.drafts.layerskip import LayerSkipConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    curve = {n: (1.0 + 0.5 * n) / 20 for n in budget.SIZES}  # ms
    monkeypatch.setattr(budget, "cached_verify_costs", lambda *a, **k: curve)
    clock = FakeClock()
    monkeypatch.setattr(generate_module, "time", clock)
    verify = Target.verify
    monkeypatch.setattr(Target, "verify", lambda self, tree, tokens, cache, *rest: clock.advance(
        20 * budget.interpolate(curve, len(tokens)) / 1000) or verify(self, tree, tokens, cache, *rest))
    ckpt = tmp_path / "skip"
    LayerSkipConfig(base_model="model", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(ckpt)
    assert cli.main(["tune-tree", "--model", str(model_dir), "--draft", str(ckpt), "--dtype", "fp32", "--depths", "2",
                     "--budgets", "2,6", "--prompts", "2", "--max-new-tokens", "8"]) == 1
    printed = capsys.readouterr().out
    assert ("error: nothing cached for --tree auto. This run's verifications took 20.0x the time the cached verify "
            "costs say (one-token step 1.5 ms)") in printed
    assert "Run tune-tree again with nothing else running" in printed
    assert not list((tmp_path / "cache").rglob("tree-*.json"))


def test_tune_tree_and_sweep_exit_refuse_a_draft_for_another_model_before_loading_it(model_dir, tmp_path, monkeypatch,
                                                                                    capsys):
    """As infer.py does: a checkpoint whose base_model names another model is refused from its config.json alone,
    unless --allow-other-base says the target is a copy of it."""
    from selfspec.tools import calibrate, cli
    from selfspec.drafts.layerskip import LayerSkipConfig

    ckpt = tmp_path / "skip"
    LayerSkipConfig(base_model="someone/other-model", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(ckpt)
    loaded = []
    monkeypatch.setattr(calibrate, "load_model", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(
        FileNotFoundError("stop after the check")))
    common = ["--model", str(model_dir), "--dtype", "fp32"]
    for argv in (["tune-tree", *common, "--draft", str(ckpt)], ["sweep-exit", *common, "--exit-heads", str(ckpt)]):
        assert cli.main(argv) == 2
        assert "trained for someone/other-model, but the target is" in capsys.readouterr().err and not loaded
        assert cli.main([*argv, "--allow-other-base"]) == 2
        assert "stop after the check" in capsys.readouterr().err and loaded
        loaded.clear()


def test_tune_tree_tunes_a_layer_skip_draft_for_tree_auto(model_dir, tmp_path, monkeypatch, capsys):
    """infer.py tune-tree on a layer-skip checkpoint of the tiny chat model: the target's own layers grow the tree, the
    best (budget, depth) is cached, and --tree auto then builds that dynamic tree."""
    from selfspec import api
    from selfspec.tools import cli
    from selfspec.drafts.layerskip import LayerSkipConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # the tiny model's ~1 ms verifications time noisily
    ckpt = tmp_path / "skip"
    LayerSkipConfig(base_model="model", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(ckpt)
    assert cli.main(["tune-tree", "--model", str(model_dir), "--draft", str(ckpt), "--dtype", "fp32", "--depths", "2,3",
                     "--budgets", "2,6", "--prompts", "2", "--max-new-tokens", "8"]) == 0
    printed, err = capsys.readouterr()
    # progress bars: the verify-cost curve, then 2 depths x 2 prompts (totals: tqdm redraws at most every 0.1 s)
    assert "verify costs" in err and "calibrating" in err and "/4 [" in err
    best = json.loads(next((tmp_path / "cache").rglob("tree-*.json")).read_text())["best"]
    tree = DynamicTree(best["budget"], depth=best["depth"], min_prob=best["min_prob"])
    assert f"best: --tree {tree.spec} " in printed and "| min_prob |" in printed
    drafter = api.load(str(model_dir), draft=str(ckpt), tree="auto").drafter
    assert drafter.dynamic == tree
    # decoding in another dtype than the one tuned: the error says which one is tuned (tune-tree defaults to bf16)
    with pytest.raises(FileNotFoundError, match=r"\(it is tuned for float32, \d+ threads: decode in that dtype, or "
                                                r"tune this one\); run `python infer.py tune-tree .* --dtype bfloat16`"):
        api.load(str(model_dir), draft=str(ckpt), tree="auto", dtype="bfloat16")


def test_tune_tree_tunes_prompt_lookups_depth_and_max_nodes_for_tree_auto(model_dir, tmp_path, monkeypatch, capsys):
    """infer.py tune-tree --draft ngram: the best (depth, max_nodes) is cached for this target, dtype and machine, and
    --draft ngram --tree auto (bench: ngram@auto) decodes with it; options it tunes cannot also be given."""
    from selfspec import api
    from selfspec.tools import cli
    from selfspec.drafts.ngram import NGramDrafter

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # the tiny model's ~1 ms verifications time noisily
    common = ["--model", str(model_dir), "--dtype", "fp32", "--depths", "2,5", "--budgets", "3,9", "--prompts", "2",
              "--max-new-tokens", "8", "--no-progress"]
    assert cli.main(["tune-tree", "--draft", "ngram:max_matches=4", *common]) == 0
    printed = capsys.readouterr().out
    [cached] = (tmp_path / "cache").rglob("tree-*.json")
    best, table = json.loads(cached.read_text())["best"], json.loads(cached.read_text())["table"]
    assert {(c["depth"], c["budget"]) for c in table} == {(2, 3), (2, 9), (5, 3), (5, 9)}
    assert f"best: --draft ngram:depth={best['depth']},max_matches=4,max_nodes={best['budget']}" in printed
    assert "tune it on prompts like your workload's (--prompts-file)" in printed  # the built-in prompts copy little
    drafter = api.load(str(model_dir), draft="ngram:max_matches=4", tree="auto").drafter
    assert isinstance(drafter, NGramDrafter)
    assert (drafter.depth, drafter.max_nodes, drafter.max_matches) == (best["depth"], best["budget"], 4)
    assert cli.main(["--model", str(model_dir), "--draft", "ngram:max_matches=4", "--tree", "auto", "--prompt", "hi",
                     "--max-new-tokens", "3"]) == 0  # the statistics name what auto stands for here
    assert f"[selfspec ngram:max_matches=4 --tree auto: dynamic:{best['budget']},depth={best['depth']}] " \
        in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match=r"no tuned tree for ngram on .*tune-tree --draft ngram "):
        api.load(str(model_dir), draft="ngram", tree="auto")  # other options: another draft, tuned on its own
    with pytest.raises(ValueError, match="--tree auto tunes prompt lookup's depth and max_nodes, and --draft "
                                         "ngram:depth=3,max_matches=4 sets depth: drop it from --draft"):
        api.load(str(model_dir), draft="ngram:depth=3,max_matches=4", tree="auto")
    assert cli.main(["tune-tree", "--draft", "ngram:max_nodes=4", *common]) == 2
    assert "tune-tree tunes prompt lookup's depth and max_nodes, and --draft ngram:max_nodes=4 sets max_nodes: drop " \
           "it from --draft" in capsys.readouterr().err


def test_tune_tree_tunes_every_dtype_of_a_list_as_bench_decodes_them(model_dir, tmp_path, monkeypatch, capsys):
    """--dtype fp32,bf16 tunes and caches each dtype in turn (what `infer.py bench --dtype fp32,bf16` with DRAFT@auto
    needs); a list naming an unknown dtype is refused before any model loads."""
    from selfspec import api
    from selfspec.tools import cli
    from selfspec.drafts.layerskip import LayerSkipConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # cache the tuning even beside other work on the cores
    ckpt = tmp_path / "skip"
    LayerSkipConfig(base_model="model", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(ckpt)
    common = ["--model", str(model_dir), "--draft", str(ckpt), "--depths", "2", "--budgets", "2,6", "--prompts", "2",
              "--max-new-tokens", "8", "--no-progress"]
    assert cli.main(["tune-tree", *common, "--dtype", "fp32,fp8"]) == 2
    assert "unknown dtype 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "tuning").exists()  # refused before the fp32 tuning ran
    assert cli.main(["tune-tree", *common, "--dtype", "fp32,bf16"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("best: --tree dynamic:") == 2 and " fp32, " in printed and " bf16, " in printed
    dtypes = {json.loads(f.read_text())["key"]["dtype"] for f in (tmp_path / "cache").rglob("tree-*.json")}
    assert dtypes == {"torch.float32", "torch.bfloat16"}
    for dtype in ("float32", "bfloat16"):
        assert isinstance(api.load(str(model_dir), draft=str(ckpt), tree="auto", dtype=dtype).drafter.dynamic,
                          DynamicTree)


# ------------------------------------------------------------------------------------------ the budget inside a merge
def test_merged_at_cuts_the_tuned_part_and_keeps_the_other_parts_whole():
    scores = torch.tensor([0.0, -0.1, -2.0, -0.3])  # the head's root, a=1 (depth 1), b=2 (1), a->c=3 (2)
    own = (scores, (0, 1, 1, 2), [(), (1,), (2,), (1, 3)])
    lookup = (frozenset({(5,), (5, 6)}),)  # prompt lookup (the merge's first part) drafted 5 -> 6; the head is second

    def at(step, budget_, depth, resting=frozenset()):
        cut = merge_budget.merged_at(step, budget_, depth, resting)
        return cut.gained, cut.nodes

    # it was right: 5, 6, bonus 9
    copying = merge_budget.MergedStep(own=own, others=lookup, accepted=(5, 6, 9), tuned=1)
    assert merge_budget.merged_at(copying, 1, 2) == (3, 4, (2, 0), frozenset())  # both + the bonus; root + 5, 6 + a
    # the head was: a, c, bonus 7
    head_right = merge_budget.MergedStep(own=own, others=lookup, accepted=(1, 3, 7), tuned=1)
    assert merge_budget.merged_at(head_right, 1, 2) == (2, 4, (0, 1), frozenset())  # a only
    assert at(head_right, 3, 2) == (3, 6)  # a, c (b too, not accepted)
    assert at(head_right, 3, 1) == (2, 5)  # depth 1: a, b
    shared = merge_budget.MergedStep(own=own, others=(frozenset({(1,), (1, 3)}),), accepted=(1, 3, 7), tuned=1)
    assert merge_budget.merged_at(shared, 3, 2).own == (2, 2)  # both drafted the accepted path...
    assert at(shared, 3, 2) == (3, 4)  # ...verified once
    odd = merge_budget.MergedStep(own=(torch.tensor([0.0, -0.1, -2.0, -0.05]), *own[1:]), others=lookup,
                                  accepted=(1, 3, 7), tuned=1)
    assert at(odd, 1, 2) == (3, 5)  # a child scored above its parent brings the parent into the trie
    assert merge_budget.merged_at(copying, 64, 2, frozenset({1})) == (3, 3, (2, 0), frozenset({1}))  # the head sat out
    assert at(head_right, 3, 2, frozenset({0})) == (3, 4)  # prompt lookup sat out: the head's nodes only


def test_merged_run_rests_a_part_after_an_earlier_part_had_skip_after_tokens_accepted():
    """MergedDrafter's rule replayed: a part sits out the step after an earlier part had >= skip_after of its own
    tokens accepted (in the replayed verdict, not the recorded one), never at a request's first step; its nodes leave
    that step's trie and its drafting time is what tuning takes off."""
    own = (torch.tensor([0.0, -0.1]), (0, 1), [(), (1,)])  # the head always drafts the token 1
    lookup = (frozenset({(5,), (5, 6)}),)

    def step(accepted, starts=False):
        return merge_budget.MergedStep(own=own, others=lookup, accepted=accepted, tuned=1, starts=starts,
                                       part_ms=(0.5, 4.0))

    steps = [step((5, 6, 9), starts=True), step((1, 2)), step((5, 6, 9)), step((5, 9), starts=True), step((5, 6, 9))]
    rests = [c.resting for c in merge_budget.merged_run(steps, 4, 2, skip_after=2)]
    # lookup had 2 accepted at step 0 -> the head rests at step 1 (and the 1 it would have drafted is not accepted);
    # lookup had 0 at step 1 -> the head drafts at 2; 2 again at step 2, but step 3 starts a request; 1 at 3
    assert rests == [frozenset(), frozenset({1}), frozenset(), frozenset(), frozenset()]
    assert [c.gained for c in merge_budget.merged_run(steps, 4, 2, skip_after=2)] == [3, 1, 3, 2, 3]
    assert [c.gained for c in merge_budget.merged_run(steps, 4, 2, skip_after=None)] == [3, 2, 3, 2, 3]
    assert [c.resting for c in merge_budget.merged_run(steps, 4, 2, skip_after=1)][4] == frozenset({1})
    # the prediction: verify of each replayed tree at its size, plus the rest of a step less the resting part's time
    curve = {1: 10.0, 2: 12.0, 4: 14.0}
    choice = merge_budget.merged_choice(steps, 4, 2, (2, None), curve, ratio=0.5, other_ms=6.0)
    sizes = [c.nodes for c in merge_budget.merged_run(steps, 4, 2, 2)]
    assert sizes == [4, 3, 4, 4, 4]  # root + 5, 6 + the head's 1 (resting at step 1: root + 5, 6)
    assert choice.step_ms == pytest.approx(0.5 * (4 * 14.0 + 13.0) / 5 + 6.0 - 4.0 / 5)
    assert (choice.accepted, choice.nodes, choice.resting) == (12 / 5, 19 / 5, 1 / 5)
    # the head listed first: prompt lookup (now second) rests after the head had tokens accepted
    first = [merge_budget.MergedStep(own=own, others=lookup, accepted=a, tuned=0, starts=i == 0)
             for i, a in enumerate([(1, 2), (5, 6, 9)])]
    assert [c.gained for c in merge_budget.merged_run(first, 4, 2, skip_after=1)] == [2, 1]


def test_merged_run_rests_a_part_where_an_earlier_part_continues_a_match_of_skip_match_tokens_this_step():
    """skip_match replayed: a part sits out the very step where an earlier part that drafted continues a match of at
    least skip_match tokens (the recorded ``copying``), the first step of a request included; a part that sat out
    rests nobody; with skip_after too, either rule rests it."""
    own = (torch.tensor([0.0, -0.1]), (0, 1), [(), (1,)])
    lookup = (frozenset({(5,), (5, 6)}),)

    def step(accepted, copying, starts=False):
        return merge_budget.MergedStep(own=own, others=lookup, accepted=accepted, tuned=1, starts=starts,
                                       part_ms=(0.5, 4.0), copying=(copying, 0))

    steps = [step((5, 6, 9), 3, starts=True), step((1, 2), 1), step((5, 6, 9), 2), step((5, 9), 0)]
    rests = [c.resting for c in merge_budget.merged_run(steps, 4, 2, None, skip_match=2)]
    assert rests == [frozenset({1}), frozenset(), frozenset({1}), frozenset()]
    assert [c.gained for c in merge_budget.merged_run(steps, 4, 2, None, skip_match=2)] == [3, 2, 3, 2]
    assert [c.resting for c in merge_budget.merged_run(steps, 4, 2, None, skip_match=3)][2] == frozenset()
    both = [c.resting for c in merge_budget.merged_run(steps, 4, 2, 2, skip_match=3)]
    assert both == [frozenset({1}), frozenset({1}), frozenset(), frozenset({1})]  # match, after, neither, after
    # the head listed first and copying nothing: prompt lookup (second) never rests for a match
    first = [merge_budget.MergedStep(own=own, others=lookup, accepted=(5, 6, 9), tuned=0, copying=(0, 3))]
    assert merge_budget.merged_run(first, 4, 2, None, skip_match=1)[0].resting == frozenset()
    choice = merge_budget.merged_choice(steps, 4, 2, (None, 2), {1: 10.0, 2: 12.0, 4: 14.0}, ratio=1.0, other_ms=6.0)
    assert choice.step_ms == pytest.approx((13.0 + 14.0 + 13.0 + 14.0) / 4 + 6.0 - 2 * 4.0 / 4)


def test_recorded_merge_predicts_what_the_merge_with_a_smaller_head_budget_and_a_skip_after_accepts(setup):
    """Prompt lookup and an EAGLE head merged, recorded with both drafting every step at a big budget: replayed with a
    smaller head budget and skip_after (``merged_run``), it predicts exactly, step for step, the tokens a real merge
    with them gains, the size of the tree it verifies (the trie of both drafts: shared paths once) and the steps where
    the head sits out, for as long as the real run stands where the recording stood (until a step accepts less)."""
    from selfspec.core.generate import stream
    from selfspec.drafts.merge import MergedDrafter
    from selfspec.drafts.ngram import NGramDrafter

    model, head = setup
    target = Target(model)

    def parts(n: int, min_prob: float = 0.0):
        return [NGramDrafter(depth=4, max_nodes=6), EagleDrafter(head, 4, 3, n, min_prob=min_prob)]

    prompts = random_prompts(12, VOCAB, seed=4)
    compared = rested = 0
    for small, skip, cut_at, match in ((16, 1, 0, None), (16, 2, 0, None), (6, 2, 0, None), (3, None, 0, None),
                                       (1, 1, 0, None), (16, 2, 0.05, None), (16, None, 0, 1), (6, 3, 0, 2)):
        for p in prompts:
            recorder = merge_budget._MergedRecorder(parts(16), tuned=1)
            recorded = generate(target, recorder, p, max_new_tokens=32)
            cuts = merge_budget.merged_run(recorder.steps, small, 4, skip, math.log(cut_at) if cut_at else -math.inf,
                                           skip_match=match)
            real_drafter = MergedDrafter(parts(small, cut_at), skip_after=skip, skip_match=match)
            real, real_rested = [], []
            for n, s in enumerate(stream(target, real_drafter, p, max_new_tokens=32)):
                if n:  # after the prefill, each step as it is yielded: this step's part drafts are still held
                    real.append((len(s.tokens), s.tree_size))
                    real_rested.append(real_drafter.part_drafts[1] is None)
            recorded_gains = [len(s.tokens) for s in recorded.steps[1:]]
            for i, (cut, (gained, nodes), resting) in enumerate(zip(cuts, real, real_rested)):
                if sum(g for g, _ in real[:i]) != sum(recorded_gains[:i]):
                    break  # the real run stands elsewhere from here on
                if 1 + sum(g for g, _ in real[:i]) + 4 >= 32:
                    break  # near max_new_tokens the loop cuts the tree to the tokens still wanted
                assert (cut.gained, cut.nodes, 1 in cut.resting) == (gained, nodes, resting), (small, skip, i)
                compared += 1
                rested += resting
    assert compared > 100 and rested > 5  # many steps compared, some of them with the head sitting out


def test_tune_tree_tunes_a_draft_inside_a_merge_and_tree_auto_prefers_that_tuning(model_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    """infer.py tune-tree on 'ngram+CKPT+skip_after=2' tunes CKPT's budget with prompt lookup drafting beside it and
    caches it for that merge alone: --tree auto on the same merge uses it, CKPT alone keeps its own tuning, a merge
    with other options falls back to CKPT's own, and with neither tuned the error names both commands."""
    from selfspec import api
    from selfspec.tools import cli
    from selfspec.drafts.layerskip import LayerSkipConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # the tiny model's ~1 ms verifications time noisily
    ckpt = tmp_path / "skip"
    LayerSkipConfig(base_model="model", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(ckpt)
    merge, other_merge = f"ngram:depth=4,max_nodes=6+{ckpt}+skip_after=2", f"ngram+{ckpt}"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--depths", "2", "--prompts", "2", "--max-new-tokens", "8"]

    def load(draft: str):
        return api.load(str(model_dir), draft=draft, tree="auto").drafter

    with pytest.raises(FileNotFoundError, match=rf"run `python infer.py tune-tree --draft {ckpt} .*, or tune it inside "
                                                rf"this merge: `python infer.py tune-tree --draft ngram:depth=4,"):
        load(merge)
    assert cli.main(["tune-tree", *common, "--draft", str(ckpt), "--budgets", "3"]) == 0
    capsys.readouterr()
    assert cli.main(["tune-tree", *common, "--draft", merge, "--budgets", "2,6"]) == 0
    printed = capsys.readouterr().out
    assert "| mean tree nodes |" in printed and f"inside {merge}" in printed
    assert "| skip_after | skip_match | best tree |" in printed and "| 2 | never (this merge) | dynamic:" in printed
    assert "| never | never | dynamic:" in printed and "| 3 | 2 | dynamic:" in printed
    files = [json.loads(f.read_text()) for f in (tmp_path / "cache").rglob("tree-*.json")]
    merges = {f["key"].get("merged"): f["best"] for f in files}
    gates = [("" if a is None else f"+skip_after={a}") + ("" if m is None else f"+skip_match={m}")
             for a in (1, 2, 3, 4, 6, None) for m in (2, 3, None)]
    assert len(files) == 1 + 18 and set(merges) == {None, *(f"ngram:depth=4,max_nodes=6+*{g}" for g in gates)}
    inside = merges["ngram:depth=4,max_nodes=6+*+skip_after=2"]
    assert inside["budget"] in (2, 6) and inside["nodes"] > 1
    assert load(merge).drafters[1].dynamic == DynamicTree(inside["budget"], depth=2, min_prob=inside["min_prob"])
    four = merges["ngram:depth=4,max_nodes=6+*+skip_after=4"]  # every skip_after was tuned from the same recording
    assert (load(merge.replace("skip_after=2", "skip_after=4")).drafters[1].dynamic
            == DynamicTree(four["budget"], depth=2, min_prob=four["min_prob"]))
    alone = DynamicTree(3, depth=2, min_prob=merges[None]["min_prob"])  # the adaptive length's cut tuned too
    assert merges[None]["min_prob"] in budget.MIN_PROBS
    assert load(str(ckpt)).dynamic == alone
    assert load(other_merge).drafters[1].dynamic == alone  # not tuned in: the part's own
    assert cli.main(["tune-tree", *common, "--draft", "ngram:depth=4+ngram"]) == 2  # no part to tune
    assert ("ngram:depth=4 (the part of ngram:depth=4+ngram that --tree applies to) is a 'ngram' draft"
            in capsys.readouterr().err)


def test_the_machine_key_tells_apart_cpus_of_one_name_by_their_instructions(monkeypatch):
    # 'AMD EPYC' named both a Zen 3 (AVX2, bf16 emulated) and a Zen 4 (AVX-512 with bf16) here, where a tree's cost
    # differs several times: a tree tuned on one must not be read on the other
    target = Target(tiny_model("llama"))
    key = tuned.machine_key(target, "tiny")
    assert key["isa"] == torch.backends.cpu.get_cpu_capability()
    assert key["bf16_instructions"] == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if key["isa"] == "AVX2" else "AVX2")
    other = tuned.machine_key(target, "tiny")
    assert other != key and tuned.cache_file("tree", other) != tuned.cache_file("tree", key)
    monkeypatch.undo()
    monkeypatch.setattr(tuned, "bf16_emulated", lambda device: key["bf16_instructions"])
    assert tuned.machine_key(target, "tiny")["bf16_instructions"] != key["bf16_instructions"]
