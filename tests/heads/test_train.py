"""train.py end to end on the tiny recipe, in subprocesses as a user runs it: a loadable checkpoint, an exact resume
after SIGKILL (after a checkpoint, and in the middle of writing one), SIGTERM saving a checkpoint, a NaN loss message,
two real CPU processes, DeepSpeed ZeRO-2."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heads.medusa.model import MedusaHeads
from heads.training.base_model import load_base
from heads.training.config import ModelConfig
from heads.training.state import checkpoints

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/medusa_tiny.yaml"]
# a schedule that does not depend on max_steps, so a run with more steps follows the same path step by step
LONG = ["optim.scheduler=constant_with_warmup", "optim.epochs=100", "checkpoint.every=4", "logging.every=1",
        "eval.every=0", "logging.log_with=[]"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "train.py", *TINY, f"output_dir={out}", *overrides]


def run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def step_losses(out: Path) -> dict[int, float]:
    """step -> training loss, from <output_dir>/metrics.jsonl (a resumed run's lines override earlier ones)."""
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def logged_steps(out: Path) -> list[int]:
    """The steps of metrics.jsonl's training-loss records, in the order logged."""
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def start_and_wait_for(cmd: list[str], path: Path, timeout: float = 900) -> subprocess.Popen:
    """Start cmd; return it once path exists. timeout only catches a hung run, not a slow one: the files awaited
    here appear in 10-25 s on an idle 2-core EPYC, and a loaded CI machine may take several times that."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            tail = proc.stdout.read()[-3000:]
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {path} appeared:\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 12-step run: checkpoints at 4, 8, 12; epochs of 10 steps, so it crosses into epoch 2."""
    out = tmp_path_factory.mktemp("reference")
    result = run(train_cmd(out, *LONG, "optim.max_steps=12", "logging.log_with=[tensorboard]", "eval.every=6"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_run_writes_loadable_heads_checkpoints_and_logs(reference):
    heads_dir = reference / "heads"
    model, _ = load_base(ModelConfig(name="tiny-random-llama"))
    heads = MedusaHeads.from_pretrained(heads_dir, model)
    config = json.loads((heads_dir / "config.json").read_text())
    assert config["num_heads"] == 3 and config["base_model"] == "tiny-random-llama"
    assert len(config["head_accuracy"]) == 3 and len(config["head_accuracy"][0]) == 10  # acc[k][r], eval.ranks = 10
    assert config["tree"] and len(config["tree"]) <= 8  # built from the measured accuracy, tree.budget = 8
    assert config["recipe"]["optim"]["max_steps"] == 12
    assert any(p.abs().sum() > 0 for p in heads.parameters())  # trained: the zero-initialised blocks moved
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step_0000008", "step_0000012"]  # keep=2
    assert sorted(step_losses(reference)) == list(range(1, 13))
    assert list((reference / "medusa").rglob("events.out.tfevents*")), "no TensorBoard event file"
    evals = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines() if "eval_top1" in line]
    assert [(e["step"], e.get("final", False)) for e in evals] == [(6, False), (12, True)]  # every 6 steps; the end


def test_run_killed_after_a_checkpoint_resumes_with_the_same_losses(reference, tmp_path):
    out = tmp_path / "killed"
    proc = start_and_wait_for(train_cmd(out, *LONG, "optim.max_steps=1000"), out / "checkpoints" / "step_0000004")
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait()
    resumed_from = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")][-1]
    result = run(train_cmd(out, *LONG, "optim.max_steps=12", "checkpoint.resume_from=latest"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / resumed_from}" in result.stderr
    expected, got = step_losses(reference), step_losses(out)
    n = int(resumed_from.split("_")[1])
    assert n < 12
    for step in range(n + 1, 13):  # the steps after the checkpoint, across the epoch boundary at step 10
        assert got[step] == pytest.approx(expected[step], abs=1e-6), f"step {step}"
    assert logged_steps(out) == list(range(1, 13))  # metrics.jsonl cut back to the checkpoint: each step once


# train.py with torch.save wrapped: the optimizer file of the step-8 checkpoint is left half-written on disk, the test
# is told through a marker file, and the process waits there for the test's SIGKILL
HALF_WRITE = """
import os, runpy, sys, time, torch
marker, real_save = sys.argv[1], torch.save
def save(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    if os.path.basename(f) == "optimizer.bin" and os.path.basename(os.path.dirname(f)).endswith("step_0000008"):
        os.truncate(f, os.path.getsize(f) // 2)
        open(marker, "w").close()
        time.sleep(600)
torch.save = save
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_run_killed_while_writing_a_checkpoint_resumes_from_the_last_good_one(reference, tmp_path):
    out, marker = tmp_path / "killed", tmp_path / "half-written"
    cmd = [sys.executable, "-c", HALF_WRITE, str(marker), *train_cmd(out, *LONG, "optim.max_steps=1000")[2:]]
    proc = start_and_wait_for(cmd, marker)
    proc.send_signal(signal.SIGKILL)  # in the middle of the step-8 checkpoint
    proc.wait()
    partial = out / "checkpoints" / ".tmp-step_0000008"
    assert (partial / "optimizer.bin").exists() and not (partial / "scheduler.bin").exists()
    assert [p.name for p in checkpoints(out / "checkpoints")] == ["step_0000004"]  # the partial one is not a checkpoint

    result = run(train_cmd(out, *LONG, "optim.max_steps=12", "checkpoint.resume_from=latest"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_0000004'} at step 4" in result.stderr
    expected, got = step_losses(reference), step_losses(out)
    for step in range(5, 13):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), f"step {step}"
    assert logged_steps(out) == list(range(1, 13))  # steps 5-8 of the killed run are not logged twice
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000008", "step_0000012"]  # swept


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
    """SIGTERM (a scheduler's stop) and SIGINT (Ctrl-C) alike: a checkpoint at the step reached, a clean exit."""
    out = tmp_path / "term"
    cmd = train_cmd(out, *LONG, "optim.max_steps=1000", "checkpoint.every=0")
    proc = start_and_wait_for(cmd, out / "metrics.jsonl")
    proc.send_signal(signum)
    output = proc.communicate(timeout=900)[0]  # a hang guard: the checkpoint and exit take ~2 s
    assert proc.returncode == 128 + signum, output[-3000:]
    saved = sorted((out / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].name.startswith("step_")
    assert f"stopped by signal {int(signum)} at step {int(saved[0].name[5:])}" in output
    assert "Traceback" not in output


def test_max_minutes_ends_the_run_as_at_its_last_step(tmp_path):
    """optim.max_minutes: the run stops at the first optimizer step past the clock, long before max_steps, and ends as
    a finished run does: the last step logged, the held-out measure, the draft saved."""
    out = tmp_path / "clock"
    result = run(train_cmd(out, *LONG, "optim.max_steps=100000", "optim.max_minutes=0.05", "eval.every=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in records if "loss" in r)
    assert 1 <= last < 1000 and any(r.get("final") and r["step"] == last for r in records)
    assert (out / "heads" / "config.json").exists()
    assert run(train_cmd(tmp_path / "bad", "optim.max_minutes=0")).returncode == 2


def test_nan_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "nan"
    # lr 1e30 makes two stacked residual blocks overflow float32 at the second step
    result = run(train_cmd(out, "optim.lr=1e30", "heads.num_layers=2", "optim.warmup_steps=0",
                           "optim.max_grad_norm=null", "checkpoint.every=1", "logging.log_with=[]", "eval.every=0"))
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: the loss became (nan|inf|-inf) at step 2 ", message), message
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_0000001'}" in message


def test_unusable_data_is_one_error_line_not_a_traceback(tmp_path):
    """Data that cannot be used (here: no messages / conversations / text column; a missing file) stops train.py
    before any training with what was expected and what was found, on one line, exit status 2."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi", "answer": "hello"}\n' * 4)
    for source, expected in ((bad, "error: expected a 'messages' or 'conversations' column, found ['answer', "
                                   "'question']"),
                             (tmp_path / "missing.jsonl", f"error: data file {tmp_path / 'missing.jsonl'} does not exist")):
        result = run(train_cmd(tmp_path / "out", f"data.source={source}", "logging.log_with=[]"))
        assert result.returncode == 2
        assert result.stderr.strip().splitlines()[-1].startswith(expected), result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_two_cpu_processes_both_train(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
           "train.py", *TINY, f"output_dir={out}", "optim.max_steps=3", "checkpoint.every=0", "eval.every=0",
           "logging.log_with=[]"]
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process 0/2 on cpu" in result.stderr and "process 1/2 on cpu" in result.stderr
    assert (out / "heads" / "model.safetensors").exists()


def test_two_cpu_processes_train_an_eagle_head_whose_decoder_names_its_embeddings_otherwise(tmp_path):
    """DDP refuses parameters that get no gradient: the EAGLE head's decoder reads the embeddings it is given, and
    GPT-Neo's own input embedding (``wte``, not ``embed_tokens``) must not be trained (the run failed with "parameters
    that were not used in producing loss")."""
    import json

    from heads.eagle.model import EagleHead
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig
    from selfspec import Target, registry

    config = dict(model_type="gpt_neo", vocab_size=300, hidden_size=64, num_layers=2, num_heads=4,
                  attention_types=[[["global", "local"], 1]], window_size=256, max_position_embeddings=256,
                  intermediate_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    out = tmp_path / "ddp-eagle"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
           "train.py", *TINY, "method=eagle", f"model.config={json.dumps(config)}", "data.max_length=64",
           f"output_dir={out}", "optim.max_steps=2", "checkpoint.every=0", "eval.every=0", "logging.log_with=[]"]
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process 0/2 on cpu" in result.stderr and "process 1/2 on cpu" in result.stderr
    model, _ = load_base(ModelConfig(config=config))
    head = registry.build_drafter(registry.parse_draft(str(out / "eagle_head")), Target(model)).head
    assert isinstance(head, EagleHead) and not head.decoder.get_input_embeddings().weight.requires_grad


def test_deepspeed_zero2_one_process(tmp_path):
    out = tmp_path / "ds2"
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", "configs/accelerate/deepspeed_zero2.yaml",
           "train.py", *TINY, f"output_dir={out}", "optim.max_steps=3", "checkpoint.every=3", "eval.every=0",
           "logging.log_with=[]"]
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(DeepSpeed: heads only in the engine)" in result.stderr
    assert (out / "checkpoints" / "step_0000003").is_dir()
    model, _ = load_base(ModelConfig(name="tiny-random-llama"))
    MedusaHeads.from_pretrained(out / "heads", model)


def test_deepspeed_zero3_one_process_saves_a_whole_eagle_head(tmp_path):
    """Under ZeRO-3 transformers builds every new model partitioned (zero.Init): the final EAGLE head was loaded into
    such an empty fresh head and the run failed at its last step ("size mismatch ... torch.Size([0])"). The gathered
    weights are written as they are; the head loads strictly and decodes token-identically."""
    from conftest import decode_with_tiny_draft

    out = tmp_path / "ds3"
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", "configs/accelerate/deepspeed_zero3.yaml",
           "train.py", *TINY, "method=eagle", f"output_dir={out}", "optim.max_steps=2", "checkpoint.every=0",
           "eval.every=2", "logging.log_with=[]"]
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(DeepSpeed: heads only in the engine)" in result.stderr
    decode_with_tiny_draft(out / "eagle_head")


def test_deepspeed_zero3_refuses_an_eagle_head_whose_layer_is_a_mixture_of_experts(tmp_path):
    """ZeRO-3's gradient reduction fails inside DeepSpeed on an MoE layer's experts (an assertion, at the first step):
    refused before any step, naming what to use instead."""
    import json

    config = dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", "configs/accelerate/deepspeed_zero3.yaml", "train.py", *TINY, "method=eagle",
           f"model.config={json.dumps(config)}", f"output_dir={tmp_path / 'ds3-moe'}", "optim.max_steps=2",
           "checkpoint.every=0", "eval.every=0", "logging.log_with=[]"]
    result = run(cmd)
    assert result.returncode != 0
    assert ("error: DeepSpeed ZeRO-3 cannot train this head: its layer is a mixture of experts (MixtralSparseMoeBlock)"
            in result.stderr), result.stderr[-3000:]
    assert "use configs/accelerate/deepspeed_zero2.yaml" in result.stderr and "AssertionError" not in result.stderr


def test_random_target_from_a_config_dict_is_frozen():
    model, tokenizer = load_base(ModelConfig(config={"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                                     "num_hidden_layers": 1, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2}))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == len(tokenizer) == 259
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(ValueError, match="expected a transformers config dict with a 'model_type' key"):
        load_base(ModelConfig(config={"hidden_size": 32}))


def test_the_loss_runs_under_the_recipes_autocast(tmp_path):
    """mixed_precision=bf16: a kind's loss, which runs the draft's LM head (and the target's) outside the heads'
    forward, is computed under the same autocast as that forward, so its matrix products run in bf16 too (a block
    recipe's step 1.25x shorter on a bf16 CPU, docs/benchmarks/log.md §53). In a process of its own, as a user runs
    train.py, with the trainer's loss call recorded."""
    script = f"""
import json, sys, torch
import train
from heads.training import trainer
seen, real = [], trainer.heads_loss
def recording(*args, **kwargs):
    seen.append([args[4], torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))])
    return real(*args, **kwargs)
trainer.heads_loss = recording
code = train.main({[*TINY, f"output_dir={tmp_path / 'out'}", "mixed_precision=bf16", "optim.max_steps=2",
                    "eval.every=0", "logging.log_with=[]", "checkpoint.every=100"]!r})
print("SEEN " + json.dumps(seen))
sys.exit(code)
"""
    result = run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.split("SEEN ", 1)[1])
    steps = [(on, dtype) for split, on, dtype in seen if split == "train"]
    assert steps and all(on and dtype == "torch.bfloat16" for on, dtype in steps), seen  # every micro-batch's loss
