"""A training run's folder tied to its recipe (heads/training/run_folder.py): run.json records the method, the target
and the values that shape the draft; another recipe is refused in one line before anything loads; a folder holding a
run is not trained over without checkpoint.resume_from or overwrite=true; an output_dir that is a file is one line;
metrics.jsonl is cut back to the resumed step."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from heads.training.recipe import load_config
from heads.training.run_folder import RunFolderError, check_run_folder, identity, trim_metrics
from tiny_run import QUICK, REPO, run, train  # noqa: F401  (run: the shared 4-step run)


def recipe(out: Path, *overrides: str):
    return load_config(REPO / "configs" / "medusa_tiny.yaml", [f"output_dir={out}", *QUICK, *overrides])


def last_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_another_recipe_in_a_run_folder_is_refused_in_one_line_before_anything_loads(run):
    recorded = json.loads((run / "run.json").read_text())
    assert recorded == identity(recipe(run)) and recorded["method"] == "medusa"
    assert recorded["heads.num_heads"] == 3 and recorded["model.name"] == "tiny-random-llama"
    before = (run / "metrics.jsonl").read_text()
    result = train(run, "heads.num_heads=2", "optim.max_steps=6", "checkpoint.resume_from=latest")
    assert result.returncode == 2
    assert last_line(result) == (f"error: {run} holds another run than this recipe's (heads.num_heads: the run has 3, "
                                 "this recipe 2): choose another output_dir, or resume that run with its own recipe "
                                 "(overwrite=true deletes its checkpoints, metrics and draft)")
    assert "process 0/1" not in result.stderr  # nothing was prepared, nothing written
    assert (run / "metrics.jsonl").read_text() == before and json.loads((run / "run.json").read_text()) == recorded
    with pytest.raises(RunFolderError, match=r"\(method: the run has 'medusa', this recipe 'hydra'; heads.num_heads: "):
        check_run_folder(recipe(run, "method=hydra", "heads.num_heads=2", "checkpoint.resume_from=latest"))
    elsewhere = recipe(run.parent / "elsewhere", "model.seed=3",
                       f"checkpoint.resume_from={run / 'checkpoints' / 'step_0000004'}")
    with pytest.raises(RunFolderError, match=f"^{run} holds another run than this recipe's \\(model.seed: the run "
                                             "has 0, this recipe 3\\)"):
        check_run_folder(elsewhere)  # resuming another folder's checkpoint is checked against that run's recipe


def test_a_folder_holding_a_run_is_not_trained_over_unless_asked(run, tmp_path):
    with pytest.raises(RunFolderError) as err:
        check_run_folder(recipe(run))
    assert str(err.value) == (f"output_dir={run} already holds a run (checkpoints up to step_0000004, metrics.jsonl, "
                              "a trained draft in heads/): resume it with checkpoint.resume_from=latest, start it over "
                              "with overwrite=true (its checkpoints, metrics and draft are deleted), or choose another "
                              "output_dir")
    check_run_folder(recipe(run, "checkpoint.resume_from=latest"))
    check_run_folder(recipe(run, "overwrite=true", "heads.num_heads=2"))  # starting over may change the recipe
    with pytest.raises(ValueError, match="overwrite=true starts the run over, checkpoint.resume_from=latest resumes "
                                         "it: set one of them"):
        recipe(run, "overwrite=true", "checkpoint.resume_from=latest")
    out = tmp_path / "again"
    shutil.copytree(run, out)
    result = train(out, "optim.max_steps=2", "heads.num_heads=2", "overwrite=true")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2]  # the old run's steps are gone
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000002"]
    assert json.loads((out / "run.json").read_text())["heads.num_heads"] == 2
    assert json.loads((out / "heads" / "config.json").read_text())["num_heads"] == 2


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("not a run\n")
    result = train(file, "optim.max_steps=1")
    assert result.returncode == 2
    assert last_line(result) == f"error: output_dir={file}: {file} is a file, not a directory: choose another output_dir"
    with pytest.raises(RunFolderError, match=f"^output_dir={file / 'run'}: {file} is a file, not a directory"):
        check_run_folder(recipe(file / "run"))


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
    """Records up to the step stay (its log line, its held-out measure, an epoch's end); later ones, end-of-run ones
    and a line a kill tore are dropped."""
    file = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 2.0}, {"step": 4, "loss": 1.5}, {"step": 4, "eval_top1": [0.1]},
             {"step": 4, "epoch_seconds": 3.0}, {"step": 5, "loss": 1.4}, {"step": 6, "loss": 1.3},
             {"step": 4, "final": True, "eval_top1": [0.2]}]
    file.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "lo')
    assert trim_metrics(file, 4) == 4
    assert [json.loads(line) for line in file.read_text().splitlines()] == lines[:4]
    assert trim_metrics(file, 4) == 0 and trim_metrics(tmp_path / "none.jsonl", 4) == 0
    assert trim_metrics(file, 0) == 4 and file.read_text() == ""


def test_a_block_run_recorded_before_the_conditioning_options_resumes_and_is_told_apart(tmp_path):
    """run.json written before block.condition_rank / block.confidence existed lacks them: that run had neither, so
    today's recipe resumes it, and a conditioned recipe is refused naming the option."""
    def block(*overrides: str):
        return load_config(REPO / "configs" / "block_tiny.yaml", [f"output_dir={tmp_path}", *QUICK, *overrides,
                                                                   "checkpoint.resume_from=latest"])

    old = identity(block())
    del old["block.condition_rank"], old["block.confidence"]
    (tmp_path / "run.json").write_text(json.dumps(old))
    check_run_folder(block())
    with pytest.raises(RunFolderError, match=r"\(block.condition_rank: the run has 0, this recipe 8\)"):
        check_run_folder(block("block.condition_rank=8"))
