"""Publishing over real HTTP: heads go up to a local Hub-compatible server (tests/hub_server.py) through
huggingface_hub and come back through the Hub cache, bit for bit; every failure is reported as one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from huggingface_hub import constants
from hub_server import TOKEN, HubServer, use_hub
from safetensors.torch import load_file
from tiny_chat_model import build
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from heads import publish as publish_cli
from heads.checkpoints.hub import PublishError
from heads.draft_types import push_folder
from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter
from heads.medusa.model import MedusaHeads
from selfspec import Target, registry
from selfspec.core.generate import generate
from selfspec.core.tree import DynamicTree
from selfspec.registry import build_drafter, parse_draft

REPO = "tester/tiny-heads"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = build(tmp_path_factory.mktemp("chat") / "model")
    return LlamaForCausalLM.from_pretrained(path).eval(), PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubServer() as server:
        use_hub(monkeypatch, server, tmp_path / "hf-home")
        yield server


def heads_for(model, seed: int = 0, **kwargs) -> MedusaHeads:
    """Heads with small random weights everywhere (as if trained): drafts differ from the LM head's."""
    config = MedusaConfig.for_model(model, base_model="tiny-chat", num_heads=3, num_layers=1,
                                    tree=[[0], [1], [0, 0], [0, 0, 0]], head_accuracy=[[0.5, 0.2]] * 3, **kwargs)
    heads = MedusaHeads(config, model.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return heads


def same_tensors(a: MedusaHeads, b: MedusaHeads) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def decode(model, tokenizer, drafter) -> tuple[list[int], str]:
    messages = [{"role": "user", "content": "write a short story about the sea"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = generate(Target(model), drafter, ids, max_new_tokens=24)
    return out.tokens, tokenizer.decode(out.tokens)


def test_publish_download_load_decode_then_offline(chat, hub, tmp_path):
    model, tokenizer = chat
    heads = heads_for(model)
    local = heads.save_pretrained(tmp_path / "local")
    published = heads.push_to_hub(REPO)
    assert published.repo_id == REPO and published.revision == "main" and published.changed
    assert published.files == ("config.json", "model.safetensors", "README.md")
    stored = hub.files(REPO)
    assert published.commit == hub.repos[REPO].branches["main"]
    assert stored["config.json"] == (local / "config.json").read_bytes()
    uploaded, saved = safetensors.torch.load(stored["model.safetensors"]), load_file(local / "model.safetensors")
    assert uploaded.keys() == saved.keys() and all(torch.equal(uploaded[k], saved[k]) for k in saved)
    assert f'load_drafter("{REPO}", target)' in stored["README.md"].decode()  # the card names the repo

    loaded = MedusaHeads.from_pretrained(REPO, model)
    assert loaded.config == heads.config and same_tensors(loaded, heads)
    cached = Path(constants.HF_HUB_CACHE) / "models--tester--tiny-heads"
    assert cached.is_dir()  # through the (test's own) Hub cache

    expected = decode(model, tokenizer, MedusaDrafter(heads, heads.config.tree))
    assert decode(model, tokenizer, MedusaDrafter(loaded, loaded.config.tree)) == expected
    assert expected[1] == tokenizer.decode(expected[0]) and len(expected[0]) == 24
    via_registry = build_drafter(parse_draft(REPO), Target(model))  # what `--draft tester/tiny-heads` does
    assert decode(model, tokenizer, via_registry) == expected

    # a second load needs no network: HF_HUB_OFFLINE=1 refuses every request, and the server sees none
    seen = len(hub.requests)
    with pytest.MonkeyPatch.context() as offline:
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        again = MedusaHeads.from_pretrained(REPO, model)
        assert decode(model, tokenizer, build_drafter(parse_draft(REPO), Target(model))) == expected
    assert same_tensors(again, heads) and len(hub.requests) == seen

    # publishing the same files again makes no new commit (the same directory: safetensors 0.8 writes its header
    # metadata in a random order, so two saves of the same heads may differ in bytes)
    first = push_folder(local, REPO)
    commits = len(hub.repos[REPO].commits)
    same = push_folder(local, REPO)
    assert not same.changed and same.commit == first.commit and len(hub.repos[REPO].commits) == commits


def test_private_repo_on_a_branch(chat, hub, monkeypatch):
    model, _ = chat
    heads = heads_for(model, projection="own")
    published = heads.push_to_hub(REPO, private=True, revision="exp")
    assert published.revision == "exp" and hub.repos[REPO].private
    assert set(hub.files(REPO, "exp")) == {".gitattributes", "config.json", "model.safetensors", "README.md"}
    assert set(hub.files(REPO, "main")) == {".gitattributes"}  # main is untouched

    monkeypatch.delenv("HF_TOKEN")  # anonymous: the private repo does not exist for us
    not_found = f"'{REPO}' is not a local directory and could not be fetched.*revision exp"
    with pytest.raises(FileNotFoundError, match=not_found):
        MedusaHeads.from_pretrained(REPO, model, revision="exp")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert same_tensors(MedusaHeads.from_pretrained(REPO, model, revision="exp"), heads)

    heads.push_to_hub("tester/public-heads")
    with pytest.raises(PublishError, match="tester/public-heads already exists and is public.*nothing was published"):
        heads.push_to_hub("tester/public-heads", private=True)


def test_no_token_is_refused_before_any_request(chat, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    no_token = f"cannot publish to {REPO}: no token found; pass --token / token=, set HF_TOKEN"
    with pytest.raises(PublishError, match=no_token):
        heads_for(chat[0]).push_to_hub(REPO)
    assert hub.requests == []


def test_a_wrong_token_is_reported_and_nothing_is_published(chat, hub):
    refused = r"while creating the repo: the Hub refused the token \(401: Invalid credentials"
    with pytest.raises(PublishError, match=refused):
        heads_for(chat[0]).push_to_hub(REPO, token="hf_not_the_right_one")
    assert hub.repos == {}


def test_wrong_repo_ids(chat, hub):
    model, _ = chat
    heads = heads_for(model)
    for bad in ("not a repo id", "tiny-heads", "a/b/c"):
        with pytest.raises(ValueError, match=f"{bad!r} is not a Hub repo id: expected 'owner/name'"):
            heads.push_to_hub(bad)
    assert hub.requests == []
    with pytest.raises(PublishError, match=r"no write access to someone-else/heads \(403: .*namespace 'someone-else'"):
        heads.push_to_hub("someone-else/heads")
    missing = "'tester/no-such-heads' is not a local directory and could not be fetched"
    with pytest.raises(FileNotFoundError, match=missing):
        MedusaHeads.from_pretrained("tester/no-such-heads", model)


@pytest.mark.parametrize("fault", ["500", "drop"])
def test_a_failed_upload_is_reported_as_failed(chat, hub, fault):
    heads = heads_for(chat[0])
    hub.fail_next("commit", fault)
    why = r"the Hub answered 500" if fault == "500" else r"network error \(RemoteProtocolError"
    with pytest.raises(PublishError, match=rf"publishing 3 files to {REPO} \(branch main\) failed while uploading and "
                                           rf"committing: {why}.*Nothing was published: branch main is unchanged"):
        heads.push_to_hub(REPO)
    assert set(hub.files(REPO)) == {".gitattributes"}
    assert heads.push_to_hub(REPO).changed  # the retry publishes


def test_dry_run_lists_the_files_and_sends_nothing(chat, hub, tmp_path, capsys):
    heads = heads_for(chat[0])
    assert heads.push_to_hub(REPO, dry_run=True) == ["config.json", "model.safetensors", "README.md"]
    directory = heads.save_pretrained(tmp_path / "ck")
    assert publish_cli.main([str(directory), REPO, "--dry-run", "--private", "--revision", "exp"]) == 0
    out = capsys.readouterr().out
    assert f"dry run: would publish to {REPO} (branch exp, private) in one commit:" in out
    size = (directory / "model.safetensors").stat().st_size
    assert f"  model.safetensors  ({size:,} bytes)" in out and "README.md" in out
    assert "token: HF_TOKEN; nothing was sent" in out
    assert hub.requests == []


def test_cli_publishes_and_reports_failures(chat, hub, tmp_path, capsys):
    model, _ = chat
    heads = heads_for(model)
    directory = heads.save_pretrained(tmp_path / "ck")
    hub.fail_next("commit", "500")
    assert publish_cli.main([str(directory), REPO]) == 1
    out, err = capsys.readouterr()
    assert "published" not in out
    assert err.startswith("publish failed: publishing 3 files") and "Nothing was published" in err

    # the real command, configured only through the environment (HF_ENDPOINT, HF_HOME, HF_TOKEN)
    run = subprocess.run([sys.executable, "-m", "heads.publish", str(directory), REPO, "--revision", "v1"],
                         cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    commit = hub.repos[REPO].branches["v1"]
    assert {name: hub.files(REPO, "v1")[name] for name in ("config.json", "model.safetensors")} == {
        name: (directory / name).read_bytes() for name in ("config.json", "model.safetensors")}  # the files as saved
    assert run.stdout.startswith(f"published 3 files: {REPO} branch v1 at commit {commit[:8]}")
    assert same_tensors(MedusaHeads.from_pretrained(REPO, model, revision="v1"), heads)

    config = directory / "config.json"
    config.write_text(config.read_text().replace('"num_layers": 1', '"num_layers": 2'))
    assert publish_cli.main([str(directory), REPO]) == 2
    err = capsys.readouterr().err
    assert "cannot publish" in err and "disagrees with config.json" in err
    assert "missing tensors ['heads.0.blocks.1" in err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        publish_cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m heads.publish" in out and "--dry-run" in out and "--revision BRANCH" in out


def test_train_py_publishes_when_the_recipe_names_a_repo(hub, tmp_path):
    """publish.repo_id: the final heads (and an exit head) go to the Hub when training ends, as saved; a recipe that
    publishes without a token, or to a malformed repo id, is refused before any training."""
    def train(*overrides: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", "logging.log_with=[]",
               "optim.max_steps=2", "checkpoint.every=0", "eval.every=0", *overrides]
        return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=180)

    run = train(f"output_dir={tmp_path / 'm'}", f"publish.repo_id={REPO}", "publish.revision=r1")
    assert run.returncode == 0, run.stderr[-3000:]
    saved = tmp_path / "m" / "heads"
    assert hub.files(REPO, "r1")["model.safetensors"] == (saved / "model.safetensors").read_bytes()
    assert hub.files(REPO, "r1")["config.json"] == (saved / "config.json").read_bytes()
    assert f"published {saved} to" in run.stderr

    run = train(f"output_dir={tmp_path / 'e'}", "method=exit_head", "exit.layer=1", "loss.kind=kl",
                "publish.repo_id=tester/tiny-exit")
    assert run.returncode == 0, run.stderr[-3000:]
    files = hub.files("tester/tiny-exit", "main")
    assert files["model.safetensors"] == (tmp_path / "e" / "exit_head" / "model.safetensors").read_bytes()
    assert b"Early-exit head" in files["README.md"] and b'draft="tester/tiny-exit"' in files["README.md"]

    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    no_token = subprocess.run([sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml",
                               f"output_dir={tmp_path / 'x'}", f"publish.repo_id={REPO}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert no_token.returncode == 2 and "no Hub token was found: set HF_TOKEN" in no_token.stderr
    assert not (tmp_path / "x").exists()  # refused before anything ran
    bad_id = train(f"output_dir={tmp_path / 'y'}", "publish.repo_id=not a repo")
    assert bad_id.returncode == 2 and bad_id.stderr.startswith("error in the recipe:")


def test_exit_head_push_to_hub_round_trip(chat, hub):
    from heads.exit_head.model import ExitHead, ExitHeadConfig

    model, _ = chat
    head = ExitHead(ExitHeadConfig.for_model(model, 1, base_model="tiny-chat"))
    with torch.no_grad():
        head.blocks[0].linear.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    assert head.push_to_hub("tester/exit", dry_run=True) == ["config.json", "model.safetensors", "README.md"]
    published = head.push_to_hub("tester/exit")
    assert published.changed and sorted(published.files) == ["README.md", "config.json", "model.safetensors"]
    loaded = ExitHead.from_pretrained("tester/exit", model)
    assert loaded.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


def test_eagle_head_push_to_hub_round_trip(chat, hub):
    """An EAGLE head published over the Hub API and loaded back by id: the same weights, draft vocabulary and drafts."""
    from heads.eagle.config import EagleConfig
    from heads.eagle.drafter import load_drafter
    from heads.eagle.model import EagleHead
    from selfspec.core.target import Target

    model, tokenizer = chat
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_model(model, base_model="tiny-chat", draft_vocab_size=200),
                     model.get_input_embeddings(), model.get_output_embeddings())
    head.draft_vocab.set(torch.arange(200) + 50)
    assert head.push_to_hub("tester/eagle", dry_run=True) == ["config.json", "model.safetensors", "README.md"]
    published = head.push_to_hub("tester/eagle")
    assert published.changed and sorted(published.files) == ["README.md", "config.json", "model.safetensors"]
    loaded = EagleHead.from_pretrained("tester/eagle", model)
    assert loaded.config == head.config and torch.equal(loaded.draft_vocab.tokens, torch.arange(200) + 50)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    assert b'draft="tester/eagle"' in hub.files("tester/eagle", "main")["README.md"]
    drafter = load_drafter("tester/eagle", Target(model))
    assert drafter.budget == head.config.budget


def test_a_block_drafter_is_published_and_drafts_by_repo_id_alone_and_merged(chat, hub, tmp_path, capsys):
    """heads.publish sends a block drafter's three files; `--draft owner/name` (and `ngram+owner/name` with a tree
    for the block) loads it by repo id, the same weights and draft vocabulary, and decodes token-identically to plain
    greedy decoding."""
    from heads.block.config import BlockConfig
    from heads.block.drafter import BlockDrafter
    from heads.block.model import BlockHead
    from selfspec.drafts.merge import MergedDrafter

    model, tokenizer = chat
    torch.manual_seed(0)
    head = BlockHead(BlockConfig.for_model(model, base_model="tiny-chat", block_size=4, draft_vocab_size=200),
                     model.get_input_embeddings(), model.get_output_embeddings())
    head.draft_vocab.set(torch.arange(200) + 50)
    head.save_pretrained(tmp_path / "block")
    assert publish_cli.main([str(tmp_path / "block"), "tester/block"]) == 0
    assert set(hub.files("tester/block")) == {".gitattributes", "config.json", "model.safetensors", "README.md"}
    assert b'draft="tester/block"' in hub.files("tester/block")["README.md"]
    loaded = BlockHead.from_pretrained("tester/block", model)
    assert loaded.config == head.config and torch.equal(loaded.draft_vocab.tokens, torch.arange(200) + 50)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "write a short story about the sea"}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    alone = registry.build("tester/block", Target(model), "tiny-chat", tree="dynamic:6,min_prob=0.01")
    merged = registry.build("ngram+tester/block+skip_after=3", Target(model), "tiny-chat", tree="dynamic:6,depth=3")
    assert isinstance(alone, BlockDrafter) and alone.dynamic == DynamicTree(6, min_prob=0.01)
    assert isinstance(merged, MergedDrafter) and merged.drafters[1].dynamic == DynamicTree(6, depth=3)
    for drafter in (alone, merged):
        tokens, _ = decode(model, tokenizer, drafter)
        assert tokens == plain[:len(tokens)] and len(tokens) == 24


def test_hydra_heads_push_to_hub_round_trip(chat, hub, tmp_path):
    """Hydra heads published over the Hub API (the same commit path as every draft) and loaded back by id, tree and
    all; a saved directory is checked and carded as Hydra heads by push_folder (python -m heads.publish)."""
    from heads.draft_types import push_folder
    from heads.hydra.drafter import load_drafter
    from heads.hydra.model import HydraConfig, HydraHeads
    from selfspec.core.target import Target

    model, tokenizer = chat
    torch.manual_seed(0)
    heads = HydraHeads(HydraConfig.for_model(model, base_model="tiny-chat", num_heads=2, tree=[[0], [1], [0, 0]]),
                       model.get_input_embeddings(), model.get_output_embeddings())
    published = heads.push_to_hub("tester/hydra")
    assert published.changed and sorted(published.files) == ["README.md", "config.json", "model.safetensors"]
    loaded = HydraHeads.from_pretrained("tester/hydra", model)
    assert loaded.config == heads.config
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
    assert b'draft="tester/hydra"' in hub.files("tester/hydra", "main")["README.md"]
    assert len(load_drafter("tester/hydra", Target(model)).tree) == 4
    saved = heads.save_pretrained(tmp_path / "hydra-local")
    assert push_folder(saved, "tester/hydra-2", dry_run=True) == ["config.json", "model.safetensors", "README.md"]


def test_tuned_trees_belong_to_one_revision_of_a_hub_draft(chat, hub, monkeypatch, tmp_path):
    """`infer.py tune-tree --draft REPO --draft-revision R` caches the tree for R's weights: `--tree auto` finds it
    for R (also offline, from the Hub cache) and not for main, whose heads differ (a tuning once keyed by the repo id
    alone served any revision)."""
    from selfspec import tuned
    from selfspec.tools import budget
    from selfspec.registry import resolve_tree

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "selfspec-cache"))
    model, _ = chat
    target = Target(model)
    heads_for(model, seed=0).push_to_hub(REPO)
    heads_for(model, seed=1).push_to_hub(REPO, revision="exp")
    choice = budget.Choice(depth=2, budget=4, accepted=1.5, step_ms=2.0)
    tuned.save_tuned(REPO, target, "tiny-chat", budget.Tuning(best=choice, plain_ms=1.0, table=[choice]), "exp")

    assert resolve_tree("auto", parse_draft(REPO, revision="exp"), target, "tiny-chat") == DynamicTree(4, depth=2)
    with pytest.raises(FileNotFoundError, match=f"run `python infer.py tune-tree --draft {REPO} --model tiny-chat"):
        resolve_tree("auto", parse_draft(REPO), target, "tiny-chat")
    seen = len(hub.requests)
    with pytest.MonkeyPatch.context() as offline:
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        assert tuned.load_tuned(REPO, target, "tiny-chat", "exp") == DynamicTree(4, depth=2)
    assert len(hub.requests) == seen


def test_bench_reads_the_model_and_drafts_at_their_hub_revisions(chat, hub, tmp_path, capsys):
    """`infer.py bench --revision R --draft-revision S`: the model and the Hub drafts come from those branches (main
    holds neither here); the revisions are part of the run's manifest."""
    import json

    from huggingface_hub import HfApi

    from selfspec.tools import cli

    model, tokenizer = chat
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    api = HfApi()
    api.create_repo("tester/tiny-chat")
    api.create_branch("tester/tiny-chat", branch="v2")
    api.upload_folder(repo_id="tester/tiny-chat", folder_path=model_dir, revision="v2")
    heads_for(model).push_to_hub(REPO, revision="exp")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["say hello"]}) + "\n")
    out = tmp_path / "bench"
    argv = ["bench", "--model", "tester/tiny-chat", "--questions", str(questions), "--out-dir", str(out), "--methods",
            f"plain,{REPO}", "--dtype", "fp32", "--max-new-tokens", "8", "--warmup-tokens", "0", "--no-progress",
            "--allow-other-base"]
    assert cli.main(argv + ["--revision", "v2", "--draft-revision", "exp"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["revision"] == "v2" and summary["meta"]["draft_revision"] == "exp"
    assert {row["method"] for row in summary["rows"]} >= {"plain", "tiny-heads"}
    assert cli.main(argv + ["--resume"]) == 2  # main has no model: the revision was not ignored


def test_a_layer_skip_config_is_published_and_drafts_by_repo_id(chat, hub, tmp_path, capsys):
    """A searched skip set has no weights: config.json and its card go up, and `--draft owner/name` decodes with it,
    token-identical to plain greedy decoding. A policy (arms named by local paths) is refused, saying why."""
    from selfspec.drafts.layerskip import LayerSkipConfig

    model, tokenizer = chat
    config = LayerSkipConfig(base_model="tiny-chat", num_hidden_layers=2, skip_layers=(1,), draft_depth=3,
                             measured={"mean_accepted": 1.5, "tokens_per_s": 30.0, "plain_tokens_per_s": 20.0})
    config.save(tmp_path / "skip")
    assert publish_cli.main([str(tmp_path / "skip"), "tester/skip", "--dry-run"]) == 0
    assert "config.json" in capsys.readouterr().out
    assert publish_cli.main([str(tmp_path / "skip"), "tester/skip"]) == 0
    stored = hub.files("tester/skip")
    assert set(stored) == {".gitattributes", "config.json", "README.md"}
    card = stored["README.md"].decode()
    assert "skipping layers\n[1] of 2" in card and "1.50x" in card and 'draft="tester/skip"' in card
    assert LayerSkipConfig.load("tester/skip") == config

    drafter = build_drafter(parse_draft("tester/skip"), Target(model))
    tokens, _ = decode(model, tokenizer, drafter)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "write a short story about the sea"}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert tokens == plain[:len(tokens)] and len(tokens) == 24

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text('{"draft_type": "policy", "arms": ["ngram", "none"]}')
    assert publish_cli.main([str(tmp_path / "policy"), "tester/policy"]) == 2
    assert "holds a selfspec policy checkpoint; heads.publish publishes selfspec checkpoints of" in capsys.readouterr().err


def test_publish_says_what_a_directory_that_is_no_checkpoint_holds(tmp_path, capsys):
    from tiny_chat_model import build

    model_dir = build(tmp_path / "model")
    capsys.readouterr()
    assert publish_cli.main([str(model_dir), "tester/x", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"cannot publish {model_dir}: {model_dir} holds a transformers model directory; heads.publish publishes selfspec "
        "checkpoints of Medusa, Hydra, EAGLE and exit heads, block drafters and layer-skip configs (config.json with "
        "draft_type medusa, exit-head, eagle, hydra, block, layerskip) and draft models (a transformers directory "
        "whose config.json names selfspec_target)\n")


def test_a_draft_model_is_published_whole_and_drafts_by_repo_id(chat, hub, tmp_path, capsys):
    """heads.publish sends a distilled draft model as saved (weights, configs, tokenizer) with its card naming the
    repo; `--draft model:owner/name` loads it from the Hub and decodes token-identically to plain greedy decoding."""
    from heads.draft_model.save import Distilled, save_draft_model
    from heads.draft_model.student import build_student
    from selfspec.core.drafter import NoDrafter

    model, tokenizer = chat
    student = build_student(model, [0], train_embeddings=False)
    facts = Distilled(base_model="tiny-chat", base_revision=None, layers=[0], target_layers=2, train_embeddings=False,
                      tokenizer=tokenizer, draft_vocab=list(range(0, len(tokenizer), 2)))
    saved = save_draft_model(tmp_path / "dm", student, student.state_dict(), facts, 0.5)
    assert publish_cli.main([str(saved), "tester/draft-model"]) == 0
    files = hub.files("tester/draft-model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= set(files)
    assert files["model.safetensors"] == (saved / "model.safetensors").read_bytes()
    assert b"--draft model:tester/draft-model" in files["README.md"] and str(saved).encode() not in files["README.md"]
    target = Target(model)
    drafter = registry.build("model:tester/draft-model", target, "tiny-chat", tree="dynamic:6,depth=3")
    assert drafter.draft_vocab.tolist() == facts.draft_vocab
    tokens, _ = decode(model, tokenizer, drafter)
    reference, _ = decode(model, tokenizer, NoDrafter())
    assert tokens == reference
