"""The per-request draft policy: the regression and its leave-one-out shortcut, the checkpoint, the drafter (picks an
arm per request from the prefill, stays token-identical to plain decoding), and infer.py fit-policy on a real bench run
of the tiny chat model, whose saved policy then runs as a bench method."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import Recording, random_prompts, reference, tiny_model

from selfspec.tools import cli, policy_fit
from selfspec.core.generate import generate
from selfspec.drafts.ngram import NGramDrafter
from selfspec.drafts.policy import (Policy, PolicyDrafter, Ridge, fit_ridge, loo_predictions, prompt_features,
                             realised_gain, select_lambda)
from selfspec.core.target import Target


def test_prompt_features_are_mean_last_and_log_length():
    h = torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, 1.0]])  # [P=3, D=2]
    assert prompt_features(h).tolist() == [3.0, 3.0, 5.0, 1.0, math.log(3)]
    assert prompt_features(h).dtype == torch.float64
    with pytest.raises(ValueError, match=r"expected the prompt's hidden states \[P, D\] with P >= 1, found \(0, 2\)"):
        prompt_features(torch.zeros(0, 2))


def test_leave_one_out_shortcut_equals_refitting_without_each_request():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(12, 3, generator=g, dtype=torch.float64)
    lam = 3.0
    z = (x - x.mean(0)) / x.std(0, unbiased=False)  # the shortcut standardises with every row
    yc = y - y.mean(1, keepdim=True)
    fast = loo_predictions(x, y, lam)
    for i in range(12):
        keep = [j for j in range(12) if j != i]
        zi, yi = z[keep], yc[keep]
        zm, ym = zi.mean(0), yi.mean(0)
        w = torch.linalg.solve((zi - zm).T @ (zi - zm) + lam * torch.eye(5, dtype=torch.float64), (zi - zm).T @ (yi - ym))
        assert torch.allclose(fast[i], ym + (z[i] - zm) @ w, atol=1e-10)


def test_fit_predicts_the_training_data_in_the_limit_and_the_mean_under_a_large_penalty():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 20, generator=g, dtype=torch.float64)  # more features than rows: an exact fit exists
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    yc = y - y.mean(1, keepdim=True)
    assert torch.allclose(fit_ridge(x, y, 1e-9).predict(x), yc, atol=1e-6)
    assert torch.allclose(fit_ridge(x, y, 1e12).predict(x), yc.mean(0).expand(6, 2), atol=1e-9)
    with pytest.raises(ValueError, match="the ridge penalty must be > 0, found 0"):
        fit_ridge(x, y, 0)


def test_a_planted_rule_is_learned_and_a_useless_feature_falls_back_to_the_best_fixed_arm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(80, 6, generator=g, dtype=torch.float64)
    # arm 1 is 20% faster where feature 0 is positive, 20% slower elsewhere; arm 0 is the better fixed arm on average
    y = torch.stack([torch.zeros(80, dtype=torch.float64), 0.2 * torch.sign(x[:, 0]) - 0.05], 1)
    sel = select_lambda(x, y, [0.1, 1.0, 10.0, 1e9])
    assert sel.fixed == 0
    assert sel.oracle_gain == pytest.approx(float(torch.clamp(y[:, 1], min=0).mean()))
    assert sel.loo_gain[sel.lam] > 0.6 * sel.oracle_gain  # learned on requests it did not see (a linear rule on a step)
    assert sel.loo_gain[1e9] == 0.0  # a huge penalty predicts the mean: always the best fixed arm
    noise = torch.randn(80, 6, generator=g, dtype=torch.float64)
    y0 = torch.stack([torch.zeros(80, dtype=torch.float64), torch.full((80,), -0.1, dtype=torch.float64)], 1)
    assert select_lambda(noise, y0, [1.0, 1e9]).loo_gain == {1.0: 0.0, 1e9: 0.0}
    assert realised_gain(y, y, 0) == sel.oracle_gain


def _length_policy(hidden_size: int, threshold: float) -> Policy:
    """Arm 1 for prompts longer than ``threshold`` tokens, arm 0 otherwise (a rule on the log-length feature)."""
    f = 2 * hidden_size + 1
    weights = torch.zeros(f, 2, dtype=torch.float64)
    weights[-1] = torch.tensor([-1.0, 1.0])
    ridge = Ridge(mean=torch.zeros(f, dtype=torch.float64), scale=torch.ones(f, dtype=torch.float64), weights=weights,
                  bias=torch.tensor([math.log(threshold), -math.log(threshold)], dtype=torch.float64))
    return Policy(arms=("ngram:depth=1", "ngram:depth=6"), ridge=ridge, base_model="tiny", hidden_size=hidden_size,
                  vocab_size=96, dtype="float32", measured={"fixed": 0})


def test_the_drafter_picks_an_arm_per_request_and_stays_token_identical_to_plain_greedy():
    model = tiny_model("llama")
    target = Target(model)
    policy = _length_policy(target.hidden_size, threshold=10.5)
    arms = [Recording(NGramDrafter(depth=1)), Recording(NGramDrafter(depth=6))]
    drafter = PolicyDrafter(policy, arms)
    prompts = random_prompts(8, 96, seed=3, min_len=4, max_len=16)
    for prompt in prompts:
        before = [len(a.states) for a in arms]
        out = generate(target, drafter, prompt, 24)
        assert out.tokens == reference(model, prompt, 24)
        want = int(prompt.shape[0] > 10.5)
        assert drafter.arm == want
        assert len(arms[want].states) > before[want] and len(arms[1 - want].states) == before[1 - want]  # it drafted alone
    assert drafter.chosen == [sum(p.shape[0] <= 10 for p in prompts), sum(p.shape[0] > 10 for p in prompts)]
    assert 0 < drafter.chosen[0] < len(prompts)  # both arms were used


def test_checkpoint_round_trip_is_exact_and_loading_is_strict(tmp_path):
    policy = _length_policy(4, threshold=3.0)
    d = policy.save_pretrained(tmp_path / "p")
    back = Policy.from_pretrained(d)
    assert back.arms == policy.arms and back.measured == policy.measured and back.dtype == "float32"
    for name in ("mean", "scale", "weights", "bias"):
        assert torch.equal(getattr(back.ridge, name), getattr(policy.ridge, name))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "budget": 3}))
    with pytest.raises(ValueError, match=r"expected keys \[.*\], found \[.*'budget'"):
        Policy.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**config, "hidden_size": 5}))
    with pytest.raises(ValueError, match=r"policy tensor 'mean' should have shape \(11,\).*found \(9,\)"):
        Policy.from_pretrained(d)
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:40])
    with pytest.raises(ValueError, match="cannot be read .* missing or corrupt"):
        Policy.from_pretrained(d)
    with pytest.raises(ValueError, match="at least two arms, found 1"):
        Policy(arms=("ngram",), ridge=policy.ridge, base_model="tiny", hidden_size=4, vocab_size=96, dtype="float32")


def test_a_saved_policy_loads_as_a_draft_with_each_arm_built_by_the_registry(model_dir, tmp_path):
    """--draft POLICY_DIR goes through the registry's entry point (selfspec.registry.load_policy): each arm is built as
    --draft builds it, 'DRAFT@TREE' with its own tree; a --tree for the policy itself is refused."""
    from selfspec import api

    plain = api.load(str(model_dir), draft="none")
    policy = _length_policy(plain.target.hidden_size, threshold=10.5)
    Policy(arms=("ngram:depth=1", "ngram@dynamic:6,depth=2"), ridge=policy.ridge, base_model=str(model_dir),
           hidden_size=policy.hidden_size, vocab_size=plain.target.vocab_size, dtype="float32",
           measured=policy.measured).save_pretrained(tmp_path / "policy")
    loaded = api.load(str(model_dir), draft=str(tmp_path / "policy"))
    assert isinstance(loaded.drafter, PolicyDrafter)
    assert [(d.depth, d.max_nodes) for d in loaded.drafter.drafters] == [(1, NGramDrafter().max_nodes), (2, 6)]
    assert loaded.generate("hello there", max_new_tokens=8).tokens == plain.generate("hello there", max_new_tokens=8).tokens
    with pytest.raises(ValueError, match="--tree does not apply to a policy"):
        api.load(str(model_dir), draft=str(tmp_path / "policy"), tree="chain:2")


def test_fit_policy_learns_from_a_bench_run_and_runs_as_a_bench_method(model_dir, tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    prompts = ["Write about the sea.", "the quick brown fox", "Hello, how are you today?", "abc abc abc abc",
               "Tell me a story.", "1 2 3 4 5 6", "Why is the sky blue?", "red green red green"]
    questions.write_text("".join(json.dumps({"question_id": i, "category": "writing" if i < 4 else "coding",
                                             "turns": [p, "Again."]}) + "\n" for i, p in enumerate(prompts)))
    arms = "ngram:depth=1,ngram:depth=6"
    run = tmp_path / "run"
    common = ["--model", str(model_dir), "--dtype", "fp32", "--max-new-tokens", "10", "--warmup-tokens", "2",
              "--no-progress"]
    assert cli.main(["bench", "--questions", str(questions), "--out-dir", str(run), "--methods", f"plain,{arms}",
                     *common]) == 0
    policy_dir = tmp_path / "policy"
    assert cli.main(["fit-policy", "--bench-dir", str(run), "--arms", arms, "--dtype", "fp32", "--out", str(policy_dir),
                     "--model", str(model_dir), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "8 training requests (4 questions x turns), 4 questions held out" in printed
    assert "an oracle picking each request's fastest arm" in printed
    policy = Policy.from_pretrained(policy_dir)
    assert policy.arms == ("ngram:depth=1", "ngram:depth=6")
    assert policy.measured["train_question_ids"] == [0, 2, 4, 6]
    assert policy.measured["held_out_question_ids"] == [1, 3, 5, 7]
    held = [json.loads(line)["question_id"] for line in (policy_dir / "heldout_questions.jsonl").read_text().splitlines()]
    assert held == [1, 3, 5, 7]
    # the policy as a method of a bench on the held-out questions: fp32 answers identical to plain decoding's
    out = tmp_path / "eval"
    assert cli.main(["bench", "--questions", str(policy_dir / "heldout_questions.jsonl"), "--out-dir", str(out),
                     "--methods", f"plain,{policy_dir}", *common]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [d["identical"] for d in summary["differences"]["policy/float32"]] == [True] * 4
    answers = [json.loads(line) for line in (out / "model-policy-float32.jsonl").read_text().splitlines()]
    assert [a["question_id"] for a in answers] == held


def test_fit_policy_refuses_arms_the_run_did_not_measure(model_dir, tmp_path):
    run = tmp_path / "run"
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi."]}) + "\n")
    assert cli.main(["bench", "--questions", str(questions), "--out-dir", str(run), "--methods", "plain,ngram",
                     "--model", str(model_dir), "--dtype", "fp32", "--max-new-tokens", "4", "--warmup-tokens", "0",
                     "--no-progress"]) == 0
    with pytest.raises(ValueError, match=r"the run has no answers labelled \['ngram:depth=3'\]; it measured "
                                         r"\['plain', 'ngram'\]"):
        policy_fit.run_cli(["--bench-dir", str(run), "--arms", "ngram,ngram:depth=3", "--out", str(tmp_path / "p"),
                            "--dtype", "fp32", "--model", str(model_dir)], out=None)
    with pytest.raises(ValueError, match="measured \\['float32'\\], not bfloat16"):
        policy_fit.run_cli(["--bench-dir", str(run), "--arms", "ngram,none", "--out", str(tmp_path / "p"),
                            "--dtype", "bf16", "--model", str(model_dir)], out=None)
    # a run that read its Hub drafts at a revision: the policy's arms (plain --draft strings) would load others
    manifest = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**manifest, "draft_revision": "exp"}))
    with pytest.raises(ValueError, match="read its Hub drafts at revision exp; a policy names its arms"):
        policy_fit.run_cli(["--bench-dir", str(run), "--arms", "ngram,none", "--out", str(tmp_path / "p"),
                            "--dtype", "fp32", "--model", str(model_dir)], out=None)
