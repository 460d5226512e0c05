"""--draft / --tree parsing, entry-point drafters, and refusing a draft for another base model before any model loads."""

from __future__ import annotations

import functools
import json
import re

import pytest

from selfspec import api, base_check, registry
from selfspec.core.drafter import NoDrafter
from selfspec.drafts.ngram import NGramDrafter
from selfspec.core.tree import DynamicTree, Tree


class FakeEntryPoint:
    """Stands in for an importlib EntryPoint of group selfspec.drafters."""

    def __init__(self, fn, value="fake.module:load"):
        self.fn, self.value = fn, value

    def load(self):
        return self.fn


def checkpoint(tmp_path, **config):
    d = tmp_path / "heads-ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_builtin_specs():
    assert registry.parse_draft("none").kind == "none"
    spec = registry.parse_draft("ngram:depth=4,max_nodes=9")
    assert (spec.kind, spec.config, spec.label) == ("ngram", {"depth": 4, "max_nodes": 9}, "ngram:depth=4,max_nodes=9")
    assert registry.parse_draft("ngram").label == "ngram"
    assert registry.parse_draft("early-exit:layer=15,depth=4").label == "early-exit:layer=15,depth=4"
    merged = registry.parse_draft("ngram:depth=6+early-exit:layer=3+skip_after=2")
    assert merged.label == "ngram:depth=6+early-exit:layer=3+skip_after=2"  # a part keeps its options in the name
    with pytest.raises(ValueError, match="bad n-gram option 'width=3'.*depth, max_nodes"):
        registry.parse_draft("ngram:width=3")
    with pytest.raises(ValueError, match="must be an integer, found 'x'"):
        registry.parse_draft("ngram:depth=x")
    with pytest.raises(ValueError, match="depth, max_nodes and max_matches must be >= 1"):
        registry.parse_draft("ngram:depth=0")
    with pytest.raises(ValueError, match="unknown --draft 'medusa'.*'none', 'ngram'"):
        registry.parse_draft("medusa")


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="draft checkpoint directory .*missing does not exist"):
        registry.parse_draft(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        registry.parse_draft(str(empty))
    no_type = checkpoint(tmp_path, base_model="x")
    with pytest.raises(ValueError, match='no "draft_type"'):
        registry.parse_draft(str(no_type))
    (no_type / "config.json").write_text(json.dumps({"draft_type": "warp"}))
    with pytest.raises(ValueError, match="a 'warp' draft, but no loader is registered.*registered: block, eagle, exit-head, hydra, layerskip, medusa"):
        registry.parse_draft(str(no_type))


def test_medusa_is_registered_in_pyproject():
    assert registry.drafter_loaders()["medusa"].value == "heads.medusa.drafter:KIND"


def test_check_base():
    spec = registry.DraftSpec(kind="medusa", location="/x/heads",
                              config={"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "hidden_size": 576,
                                      "vocab_size": 49152})
    base_check.check_base(spec, "smollm2-135m-instruct", (576,), 49152)  # the built-in's name matches the Hub id's
    with pytest.raises(ValueError, match="trained for HuggingFaceTB/SmolLM2-135M-Instruct with hidden_size 576, but the "
                                         "target /m/tiny has hidden_size 64"):
        base_check.check_base(spec, "/m/tiny", (64,), 49152)
    with pytest.raises(ValueError, match="trained for HuggingFaceTB/SmolLM2-135M-Instruct, but the target is /m/copy"):
        base_check.check_base(spec, "/m/copy", (576,), 49152)
    base_check.check_base(spec, "/m/copy", (576,), 49152, allow_other_base=True)
    # a target whose LM head reads another width than its layers (OPT-350m): heads of either width pass
    base_check.check_base(spec, "smollm2-135m-instruct", (1024, 576), 49152)


@pytest.mark.parametrize("trained_at, target_at, same", [
    (None, "v2", True),  # trained on whatever main was: nothing to compare
    ("main", None, True), ("v2", "v2", True), ("0123abcd" * 5, "0123abc", True), ("0123ABCD" * 5, "0123abcd", True),
    ("v2", None, False), ("v2", "main", False), ("0123abcd" * 5, "0123abce", False), ("v2", "v3", False),
])
def test_check_base_compares_hub_revisions(trained_at, target_at, same):
    """Heads trained for one revision of a Hub model are refused on another (its weights may differ), unless told."""
    spec = registry.DraftSpec(kind="medusa", location="/x/heads",
                              config={"base_model": "me/model", "base_revision": trained_at, "hidden_size": 64})
    check = functools.partial(base_check.check_base, spec, "me/model", (64,), 100, revision=target_at)
    if same:
        check()
        return
    with pytest.raises(ValueError, match=f"trained for me/model at revision {trained_at}, but the target is at "
                                         f"revision {target_at or 'main'}: pass --revision {trained_at}"):
        check()
    check(allow_other_base=True)


def test_parse_tree(tmp_path):
    assert registry.parse_tree(None) is None
    assert registry.parse_tree("chain:3") == Tree.chain(3)
    assert registry.parse_tree("full:2,1") == Tree.full([2, 1])
    assert registry.parse_tree("[[0], [0, 0], [1]]") == Tree.from_choices([(0,), (0, 0), (1,)])
    f = tmp_path / "tree.json"
    f.write_text("[[0], [1]]")
    assert registry.parse_tree(str(f)) == Tree.from_choices([(0,), (1,)])
    assert registry.parse_tree("dynamic:24") == DynamicTree(24)
    for rule in (DynamicTree(24), DynamicTree(8, depth=2)):  # what bench records for DRAFT@auto parses back
        assert registry.parse_tree(rule.spec) == rule
    assert DynamicTree(8, depth=2).spec == "dynamic:8,depth=2"
    with pytest.raises(ValueError, match="max_rank=4 has no --tree form"):
        DynamicTree(8, max_rank=4).spec
    assert len(registry.parse_tree("full:32,31")) == 1 + registry.MAX_TREE_NODES  # 32 + 32 x 31 draft nodes: the most
    assert registry.parse_tree(f"dynamic:{registry.MAX_TREE_NODES}").budget == registry.MAX_TREE_NODES
    # the adaptive length: a probability under which no node is drafted, in any order with depth, spelled back
    assert registry.parse_tree("dynamic:16,min_prob=0.05,depth=4") == DynamicTree(16, depth=4, min_prob=0.05)
    assert DynamicTree(16, depth=4, min_prob=0.05).spec == "dynamic:16,depth=4,min_prob=0.05"
    assert registry.parse_tree(DynamicTree(16, min_prob=0.2).spec) == DynamicTree(16, min_prob=0.2)


@pytest.mark.parametrize("spec, message", [
    ("dynamic:0", "bad --tree 'dynamic:0': N: expected a whole number >= 1, found '0'"),
    ("chain:0", "bad --tree 'chain:0': K: expected a whole number >= 1, found '0'"),  # drafts nothing
    ("chain:x", "bad --tree 'chain:x': K: expected a whole number >= 1, found 'x'"),
    ("full:3,-1", "bad --tree 'full:3,-1': each width: expected a whole number >= 1, found '-1'"),
    ("dynamic:8,depth=", "bad --tree 'dynamic:8,depth=': D: expected a whole number >= 1, found ''"),
    ("full:100,100", "bad --tree 'full:100,100': 10,100 draft nodes, more than the 1024 a step may verify"),
    ("full:10000,10000,10000", "1,000,100,010,000 draft nodes, more than the 1024"),  # refused before it is built
    ("dynamic:5000", "bad --tree 'dynamic:5000': 5,000 draft nodes, more than the 1024"),
    ("dynamic:8,min_prob=1", "bad --tree 'dynamic:8,min_prob=1': a dynamic tree's min_prob is a probability below 1: "
                             "expected 0 <= min_prob < 1, found 1.0"),
    ("dynamic:8,min_prob=x", "min_prob: expected a probability such as 0.05, found 'x'"),
    ("dynamic:8,width=2", "dynamic tree option 'width=2': expected depth=D or min_prob=P, each at most once"),
    ("dynamic:8,depth=2,depth=3", "dynamic tree option 'depth=3': expected depth=D or min_prob=P, each at most once"),
])
def test_bad_tree_sizes_say_which_number_is_wrong(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        registry.parse_tree(spec)


def test_parse_tree_refuses_what_is_not_a_tree(tmp_path):
    with pytest.raises(ValueError, match="unknown --tree 'medusa63'.*'chain:K'"):
        registry.parse_tree("medusa63")
    with pytest.raises(ValueError, match="bad --tree .*has no parent"):
        registry.parse_tree("[[0, 0]]")
    with pytest.raises(FileNotFoundError, match="tree file .*nope.json does not exist"):
        registry.parse_tree(str(tmp_path / "nope.json"))


def test_load_with_a_registered_checkpoint(model_dir, tmp_path, monkeypatch):
    calls = []

    def fake_load(path, target, revision=None, tree=None):
        calls.append((path, target.hidden_size, revision, tree))
        return NGramDrafter(depth=2)

    monkeypatch.setattr(registry, "drafter_loaders", lambda: {"fake": FakeEntryPoint(fake_load)})
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ckpt = checkpoint(tmp_path, draft_type="fake", base_model=str(model_dir), hidden_size=64, vocab_size=vocab)
    m = api.load(str(model_dir), draft=str(ckpt), tree="chain:2")
    assert calls == [(str(ckpt), 64, None, Tree.chain(2))]
    assert isinstance(m.drafter, NGramDrafter) and m.drafter.depth == 2


def test_draft_for_another_model_fails_before_loading(model_dir, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the draft was checked")

    monkeypatch.setattr(api, "load_model", no_loading)
    monkeypatch.setattr(registry, "drafter_loaders", lambda: {"medusa": FakeEntryPoint(None)})
    ckpt = checkpoint(tmp_path, draft_type="medusa", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                      hidden_size=576, vocab_size=49152)
    with pytest.raises(ValueError, match="these heads were trained for HuggingFaceTB/SmolLM2-135M-Instruct with "
                                         "hidden_size 576, but the target .* has hidden_size 64"):
        api.load(str(model_dir), draft=str(ckpt))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        api.load(str(model_dir), draft=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown --tree"):
        api.load(str(model_dir), draft="ngram", tree="medusa63")


def test_tree_with_ngram_or_none_is_refused(model_dir):
    with pytest.raises(ValueError, match="--tree does not apply to --draft ngram.*ngram:depth=8"):
        api.load(str(model_dir), draft="ngram", tree="chain:3")
    assert isinstance(api.load(str(model_dir), draft="none").drafter, NoDrafter)
    sized = api.load(str(model_dir), draft="ngram:max_matches=2", tree="dynamic:8,depth=3").drafter  # trie size
    assert (sized.max_nodes, sized.depth, sized.max_matches) == (8, 3, 2)
    with pytest.raises(ValueError, match="--tree dynamic:8 sizes prompt lookup's trie, and --draft ngram:max_nodes=4 "
                                         "sets max_nodes too: give the size once"):
        api.load(str(model_dir), draft="ngram:max_nodes=4", tree="dynamic:8")
    with pytest.raises(ValueError, match="prompt lookup's drafts have no probabilities for min_prob to cut by"):
        api.load(str(model_dir), draft="ngram", tree="dynamic:8,min_prob=0.1")
    grown = api.load(str(model_dir), draft="early-exit:layer=1", tree="dynamic:8").drafter  # depth: the drafter's 4
    assert (grown.dynamic, grown.tree) == (DynamicTree(8, depth=4), None)


def test_loader_that_returns_no_drafter_is_refused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "drafter_loaders", lambda: {"bad": FakeEntryPoint(lambda *a, **k: object())})
    ckpt = checkpoint(tmp_path, draft_type="bad")
    with pytest.raises(TypeError, match="fake.module:load returned object, expected a selfspec Drafter"):
        api.load(str(model_dir), draft=str(ckpt))


def test_early_exit_spec_builds_a_lossless_drafter(model_dir):
    spec = registry.parse_draft("early-exit:layer=1,depth=3,stop_below=0.1")
    assert spec.kind == "early-exit" and spec.config == {"layer": 1, "depth": 3, "stop_below": 0.1}
    m = api.load(str(model_dir), draft="early-exit:layer=1,depth=3")
    ids = m.tokenizer("the quick brown fox", return_tensors="pt")["input_ids"]
    plain = m.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert m.generate(ids, max_new_tokens=24).tokens == plain


@pytest.mark.parametrize("bad, message", [
    ("early-exit", "needs the exit layer"),
    ("early-exit:layer=x", "must be an integer, found 'x'"),
    ("early-exit:layer=1,foo=2", "key one of layer, depth, stop_below"),
])
def test_early_exit_spec_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        registry.parse_draft(bad)


def test_early_exit_layer_out_of_range_names_the_range(model_dir):
    with pytest.raises(ValueError, match=r"exit layer must be in 1\.\.1"):
        api.load(str(model_dir), draft="early-exit:layer=2")


def test_corrupt_checkpoint_config_says_what_and_what_to_do(tmp_path):
    d = tmp_path / "heads-ckpt"
    d.mkdir()
    (d / "config.json").write_text('{"draft_type": "medusa", ')  # cut off mid-write
    with pytest.raises(ValueError, match=r"the draft checkpoint's config \(.*config.json\) is not valid JSON: .*corrupt"):
        registry.parse_draft(str(d))
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="should hold a JSON object, found list"):
        registry.parse_draft(str(d))
