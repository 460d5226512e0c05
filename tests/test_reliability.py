"""Reliability and safety cases of docs/RELIABILITY.md not covered next to the code they test: checkpoints that die
while being replaced or deleted, memory over a long run, model code that must not run unasked, loaders that cannot run
pickled code, and Hub tokens that never reach the output."""

from __future__ import annotations

import ast
import gc
import io
import json
import logging
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from accelerate import Accelerator

import tiny_chat_model
from conftest import VOCAB, random_prompts, tiny_model
from heads import publish as publish_cli
from heads.checkpoints.hub import PublishError, publish
from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter
from heads.medusa.model import MedusaHeads
from heads.training import state as train_state
from hub_server import TOKEN, HubServer, use_hub
from selfspec import NGramDrafter, Sampling, Target, Tree, stream
from selfspec.tools import cli
from selfspec.core import hf
from selfspec.core.models import load_model

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ checkpoints: a kill while cleaning up
class Killed(BaseException):
    """The process died here (raised where a SIGKILL would have stopped it)."""


def dying_rmtree(path) -> None:
    """Deletes the directory's files, then the process dies before the directory itself is gone."""
    for file in Path(path).iterdir():
        file.unlink()
    raise Killed


def complete(root: Path) -> list[str]:
    """The checkpoints resume_from=latest may pick, each checked to hold its files."""
    found = train_state.checkpoints(root)
    assert all((p / "random_states_0.pkl").is_file() and (p / "progress.json").is_file() for p in found), [
        sorted(os.listdir(p)) for p in found]
    return [p.name for p in found]


def test_a_kill_while_deleting_or_replacing_a_checkpoint_leaves_only_complete_ones(tmp_path, monkeypatch):
    accelerator, root, progress = Accelerator(cpu=True), tmp_path / "checkpoints", train_state.Progress()
    for step in (4, 8):
        train_state.save_checkpoint(accelerator, root, step, keep=2, progress=progress)
    monkeypatch.setattr(train_state, "shutil", SimpleNamespace(rmtree=dying_rmtree))
    with pytest.raises(Killed):  # step 12 is in place; deleting step 4 (beyond keep=2) dies half-way
        train_state.save_checkpoint(accelerator, root, 12, keep=2, progress=progress)
    assert complete(root) == ["step_0000008", "step_0000012"]
    with pytest.raises(Killed):  # resumed from step 8, re-saving step 12 over the old one dies half-way
        train_state.save_checkpoint(accelerator, root, 12, keep=2, progress=progress)
    assert complete(root) == ["step_0000008", "step_0000012"]
    monkeypatch.undo()
    train_state.save_checkpoint(accelerator, root, 16, keep=2, progress=progress)  # the next save sweeps what the kills left
    assert sorted(os.listdir(root)) == ["step_0000012", "step_0000016"]


def test_training_checkpoints_hold_no_pickled_progress(tmp_path):
    """Where training stands is plain JSON (accelerate would pickle registered custom state and load it with
    weights_only=False); resuming reads it back."""
    accelerator, root, progress = Accelerator(cpu=True), tmp_path / "checkpoints", train_state.Progress()
    progress.step, progress.epoch, progress.batch_in_epoch = 7, 1, 3
    saved = train_state.save_checkpoint(accelerator, root, 7, keep=2, progress=progress)
    assert not list(saved.glob("custom_checkpoint_*"))
    assert train_state.load_progress(saved).state_dict() == {"step": 7, "epoch": 1, "batch_in_epoch": 3}
    (saved / "progress.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no progress.json: it is not a complete selfspec training"):
        train_state.load_progress(saved)


# --------------------------------------------------------------------------------------- long runs: memory flat
class CacheChecking:
    """Wraps a drafter; before every step, checks that each cache layer holds exactly the committed tokens (all but
    the newest root, which the step feeds)."""

    def __init__(self, inner):
        self.inner, self.steps = inner, 0

    def draft(self, state):
        lengths = hf.layer_lengths(state.cache)
        assert lengths == [state.tokens.shape[0] - 1] * len(lengths), f"step {self.steps}: cache layers {lengths}, " \
            f"committed {state.tokens.shape[0] - 1}"
        self.steps += 1
        return self.inner.draft(state)

    def update(self, draft, acceptance) -> None:
        self.inner.update(draft, acceptance)


def live_tensors() -> tuple[int, int]:
    """(number of live tensor objects, bytes of their distinct storages), after a full garbage collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)]
    # fake tensors hold no data: torch.compile keeps some alive after a compiled model ran (tests/test_compiled.py)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(tensors), sum(storages.values())


def test_hundreds_of_prompts_and_thousands_of_steps_keep_memory_flat():
    """One target, one n-gram drafter and one Medusa drafter (a branching tree: cache entries are moved and cropped)
    serve 200 prompts, greedy and sampled in turn. The cache holds exactly the committed tokens before every step, and
    after a warm-up the live tensors do not grow: a leak of one tensor per prompt (200) or per step (thousands) fails,
    where lazily built buffers (a handful) would not. Tensor counts are exact, unlike RSS on a busy machine."""
    model = tiny_model("llama", initializer_range=0.1)
    target = Target(model)
    heads = MedusaHeads(MedusaConfig.for_model(model, num_heads=2, num_layers=1), model.get_output_embeddings())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():  # random heads: drafts on every branch, some accepted
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    drafters = [CacheChecking(NGramDrafter(depth=4, max_nodes=12)),
                CacheChecking(MedusaDrafter(heads, Tree.from_choices([(0,), (1,), (0, 0), (1, 0)])))]

    def serve(prompts) -> int:
        tokens = 0
        for i, prompt in enumerate(prompts):
            sampling = Sampling() if i % 4 < 2 else Sampling(temperature=1.0)
            for step in stream(target, drafters[i % 2], prompt, 16, sampling=sampling,
                               generator=torch.Generator().manual_seed(i)):
                tokens += len(step.tokens)
        return tokens

    serve(random_prompts(16, VOCAB, seed=1))  # warm-up: every path once
    before = live_tensors()
    assert serve(random_prompts(200, VOCAB, seed=2)) == 200 * 16
    after = live_tensors()
    assert sum(d.steps for d in drafters) > 2000
    assert after[0] - before[0] <= 8, f"live tensors grew from {before[0]} to {after[0]} over 200 prompts"
    assert after[1] - before[1] <= 64 * 1024, f"live tensor bytes grew from {before[1]} to {after[1]}"


# -------------------------------------------------------------------------------- model code runs only if asked
@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory) -> Path:
    """A tiny chat model whose config names its own modeling file (auto_map), which writes $MARKER when imported."""
    path = tiny_chat_model.build(tmp_path_factory.mktemp("remote-code") / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="marker_llama", auto_map={"AutoConfig": "modeling_marker.MarkerConfig",
                                                       "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "modeling_marker.py").write_text(
        "import os\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "open(os.environ['MARKER'], 'w').close()  # the model's own code ran\n\n\n"
        "class MarkerConfig(LlamaConfig):\n    model_type = 'marker_llama'\n\n\n"
        "class MarkerForCausalLM(LlamaForCausalLM):\n    config_class = MarkerConfig\n")
    return path


def test_model_code_is_refused_unless_the_user_opts_in(remote_code_model, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("MARKER", str(marker))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 4))  # were transformers to ask on the terminal: "yes"
    refused = rf"{remote_code_model} needs Python code of its own to load .* pass trust_remote_code=True"
    with pytest.raises(ValueError, match=refused):
        load_model(str(remote_code_model))
    assert cli.main(["--model", str(remote_code_model), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {remote_code_model} needs Python code") and "infer.py --trust-remote-code" in err
    assert not marker.exists()  # refused without running it, and without asking

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "infer.py", "--model", str(remote_code_model), "--trust-remote-code",
                             "--prompt", "hi", "--max-new-tokens", "4"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.exists() and "4 new tokens in" in result.stderr


# ---------------------------------------------------------------------------------------- loaders are safe
def unsafe_loads(source: str) -> list[str]:
    """Calls in ``source`` that could run code from a file: torch.load without weights_only=True, pickle.load(s),
    numpy.load with allow_pickle=True, and trust_remote_code=True written as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name.endswith("torch.load") and kw.get("weights_only") != "True":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if name in ("pickle.load", "pickle.loads") or (name.endswith("np.load") and kw.get("allow_pickle") == "True"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if kw.get("trust_remote_code") == "True":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_loader_can_run_code_from_a_file():
    assert unsafe_loads("torch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\n"
                        "np.load(f, allow_pickle=True)\nAutoModel.from_pretrained(p, trust_remote_code=True)") != []
    assert len(unsafe_loads("torch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\n"
                            "np.load(f, allow_pickle=True)\nM.from_pretrained(p, trust_remote_code=True)")) == 5
    assert unsafe_loads("torch.load(f, map_location='cpu', weights_only=True)\nnp.load(f)") == []
    files = [*ROOT.glob("selfspec/*.py"), *ROOT.glob("heads/*.py"), ROOT / "train.py", ROOT / "infer.py"]
    found = {str(f.relative_to(ROOT)): unsafe_loads(f.read_text()) for f in files}
    assert {f: calls for f, calls in found.items() if calls} == {}


# ------------------------------------------------------------------------------------- tokens stay secret
WRONG = "hf_wrong_token_never_shown"


def test_hub_tokens_never_reach_output_logs_or_errors(tmp_path, monkeypatch, capsys, caplog):
    """Publishing with a token (right and wrong, argument and HF_TOKEN, success and every failure) never writes it to
    stdout, stderr, a log record, an error message or its traceback."""
    model = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_model(model, base_model="tiny-llama", num_heads=2, num_layers=1),
                        model.get_output_embeddings())
    directory = heads.save_pretrained(tmp_path / "heads")
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    with HubServer() as hub:
        use_hub(monkeypatch, hub, tmp_path / "hf-home", token=None)
        assert publish_cli.main([str(directory), "tester/heads", "--token", TOKEN, "--dry-run"]) == 0
        assert publish_cli.main([str(directory), "tester/heads", "--token", TOKEN]) == 0
        assert publish_cli.main([str(directory), "tester/heads", "--token", WRONG]) == 1
        hub.fail_next("commit", "500")
        assert publish_cli.main([str(directory), "tester/other", "--token", TOKEN]) == 1
        hub.fail_next("commit", "drop")
        assert publish_cli.main([str(directory), "tester/other", "--token", TOKEN]) == 1
        for token, fault in ((WRONG, None), (TOKEN, "500"), (TOKEN, "drop")):
            if fault:
                hub.fail_next("commit", fault)
            with pytest.raises(PublishError) as failed:
                publish({"a.txt": b"a"}, "tester/third", token=token)
            seen.append("".join(traceback.format_exception(failed.value)))
        monkeypatch.setenv("HF_TOKEN", TOKEN)  # the token from the environment, through the real command
        run = subprocess.run([sys.executable, "-m", "heads.publish", str(directory), "tester/env"], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        seen += [run.stdout, run.stderr]
    out, err = capsys.readouterr()
    assert "published 3 files" in out and "the Hub refused the token (401" in err and "Nothing was published" in err
    seen += [out, err, *(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)]
    for token in (TOKEN, WRONG):
        assert not [text for text in seen if token in text], f"{token} was shown"


# ------------------------------------------------------------------------------------------------ the table
def test_every_test_named_in_docs_reliability_exists():
    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(named) > 40
    missing = [f"{file}::{name}" for file, name in named
               if not re.search(rf"^def {name}\(", (ROOT / file).read_text(), flags=re.M)]
    assert missing == []
