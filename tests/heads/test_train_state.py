"""Resuming from a training checkpoint with an unreadable file: one line naming the checkpoint, the file, the error
and the newest earlier checkpoint that is intact, never a traceback or a silently different run."""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.utils import load as accelerate_load

from heads.training.state import CorruptCheckpoint, check_intact, unreadable
from tiny_run import run, train  # noqa: F401  (run: the shared 4-step run)

FILES = ("model.safetensors", "optimizer.bin", "scheduler.bin", "progress.json", "random_states_0.pkl")


def truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


@pytest.mark.parametrize("name", FILES)
def test_a_truncated_file_is_named_with_the_newest_intact_checkpoint(run, tmp_path, name):
    root = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", root)
    latest, earlier = root / "step_0000004", root / "step_0000002"
    assert unreadable(latest) is None and unreadable(earlier) is None
    truncate(latest / name)
    with pytest.raises(CorruptCheckpoint) as err:
        check_intact(latest, root, "latest")
    message = str(err.value)
    assert message.startswith(f"checkpoint.resume_from=latest: {latest} cannot be resumed from: {name} cannot be read (")
    assert message.endswith(f"): it is truncated or corrupt; resume from the newest intact one with "
                            f"checkpoint.resume_from={earlier}")
    assert "\n" not in message

    truncate(earlier / name)  # no intact one left
    with pytest.raises(CorruptCheckpoint, match=f"; no earlier checkpoint in {root} is intact: delete {latest} and set "
                                                "checkpoint.resume_from=null to start afresh$"):
        check_intact(latest, root, "latest")


def test_missing_rng_states_are_refused(run, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", root)
    (root / "step_0000004" / "random_states_0.pkl").unlink()
    assert unreadable(root / "step_0000004") == "random_states_0.pkl (this process's RNG states) is missing"


def test_train_py_refuses_a_corrupt_checkpoint_in_one_line(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    rng = out / "checkpoints" / "step_0000004" / "random_states_0.pkl"  # accelerate alone only logs this one
    truncate(rng)
    result = train(out, "optim.max_steps=6", "checkpoint.resume_from=latest")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint.resume_from=latest: {rng.parent} cannot be resumed from: "
                           "random_states_0.pkl cannot be read (")
    assert last.endswith(f"resume from the newest intact one with checkpoint.resume_from={rng.parent.parent / 'step_0000002'}")
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints" / "step_0000006").exists()  # nothing trained on


def test_rng_states_that_pass_their_checksums_but_do_not_load_are_refused(run, tmp_path):
    """An RNG-state archive whose members all pass their checksums but that accelerate cannot apply (a state of the
    wrong form; an object weights-only loading refuses) was resumed from with only an INFO log line: the pre-check
    loads it weights-only and applies each state to a throwaway generator."""
    root = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", root)
    rng = root / "step_0000004" / "random_states_0.pkl"
    good = accelerate_load(rng, weights_only=True)
    for bad, error in [({**good, "random_state": "nonsense"}, "ValueError: state with version n passed to "),
                       ({**good, "torch_manual_seed": torch.zeros(3, dtype=torch.uint8)}, "RuntimeError: "),
                       ({k: v for k, v in good.items() if k != "numpy_random_seed"}, "KeyError: "),
                       ({**good, "when": datetime.date(2026, 1, 1)}, "UnpicklingError: Weights only load failed")]:
        torch.save(bad, rng)
        problem = unreadable(root / "step_0000004")
        assert problem is not None and problem.startswith(f"random_states_0.pkl cannot be read ({error}"), problem
        assert problem.endswith("): it is truncated or corrupt")
    torch.save(good, rng)
    assert unreadable(root / "step_0000004") is None
