"""A training run's state on disk and its interruptions: progress, atomic checkpoints, ``resume_from``, signals.

Checkpoints live in ``<output_dir>/checkpoints/step_NNNNNNN``: ``accelerator.save_state`` (heads, optimizer, scheduler,
RNG states, samplers) and ``progress.json`` (``Progress``: plain JSON, never a pickle) go to a hidden temporary
directory, which is renamed into
place whole, so a killed run leaves either a complete checkpoint or none; older ones beyond ``keep`` are renamed out
of sight, then deleted.
SIGINT / SIGTERM only set a flag (``StopFlag``); the loop saves a checkpoint at the next optimizer step and returns.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import signal
import zipfile
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open

from heads.cli import one_line

log = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "step_"


PROGRESS_FILE = "progress.json"


class Progress:
    """Where training stands; saved in every checkpoint as ``progress.json`` (``save_checkpoint`` / ``load_progress``)."""

    def __init__(self) -> None:
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (temporary directories of interrupted saves are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def resolve_resume(resume_from: str | None, root: Path) -> Path | None:
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = checkpoints(root)
        if not found:
            log.info("resume_from=latest: no checkpoint in %s yet, starting from scratch", root)
        return found[-1] if found else None
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        found = [p.name for p in checkpoints(root)]
        raise FileNotFoundError(f"checkpoint.resume_from={resume_from!r}: expected 'latest' or a checkpoint directory, "
                                f"found no directory there (checkpoints in {root}: {found})")
    return path


class CorruptCheckpoint(ValueError):
    """A checkpoint to resume from has a file that cannot be read; the message names it and an intact one."""


def check_random_states(file: Path) -> None:
    """Load an RNG-state file as accelerate's load_state does (``weights_only=True``: tensors, numpy arrays and plain
    containers, no code runs) and set each state on a throwaway generator; raises what accelerate would swallow."""
    states = accelerate_load(file, map_location="cpu", weights_only=True)
    if not isinstance(states, dict):
        raise TypeError(f"expected a dict of RNG states, found {type(states).__name__}")
    random.Random().setstate(states["random_state"])
    np.random.RandomState().set_state(states["numpy_random_seed"])
    torch.Generator().set_state(states["torch_manual_seed"])


def unreadable(checkpoint: Path, process_index: int = 0) -> str | None:
    """None if every file of ``checkpoint`` reads back (tensors, torch.save archives, progress.json, this process's
    RNG states), else "<file> cannot be read (<error>) ..." for the first that does not. accelerate's load_state raises
    a bare SafetensorError or RuntimeError that names no file, and skips an unreadable RNG-state file with a log line,
    so a resumed run would silently not reproduce the uninterrupted one; this reads each file first (archives by
    their checksums, this process's RNG states whole, ``check_random_states``)."""
    rng = f"random_states_{process_index}.pkl"
    if not (checkpoint / rng).is_file():
        return f"{rng} (this process's RNG states) is missing"
    for file in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        f.get_tensor(name)
            elif file.suffix in (".bin", ".pkl", ".pt"):  # torch.save archives (accelerate's save_state): every
                with zipfile.ZipFile(file) as archive:  # member's CRC checked; the RNG states loaded weights-only
                    if (bad := archive.testzip()) is not None:
                        raise ValueError(f"its member {bad} fails its checksum")
                if file.name == rng:
                    check_random_states(file)
            elif file.name == PROGRESS_FILE:
                Progress().load_state_dict(json.loads(file.read_text()))
        except (SafetensorError, OSError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError,
                TypeError, IndexError, pickle.UnpicklingError) as err:
            detail = one_line(err) or "no message"
            return f"{file.name} cannot be read ({type(err).__name__}: {detail}): it is truncated or corrupt"
    return None


def check_intact(checkpoint: Path, root: Path, resume_from: str, process_index: int = 0) -> None:
    """Refuse to resume from a checkpoint with an unreadable file, naming the file and the newest earlier checkpoint
    in ``root`` that is intact (if any)."""
    problem = unreadable(checkpoint, process_index)
    if problem is None:
        return
    step = int(checkpoint.name[len(CHECKPOINT_PREFIX):]) if checkpoint.name[len(CHECKPOINT_PREFIX):].isdigit() else None
    earlier = [p for p in reversed(checkpoints(root))
               if p.resolve() != checkpoint.resolve() and (step is None or int(p.name[len(CHECKPOINT_PREFIX):]) < step)]
    intact = next((p for p in earlier if unreadable(p, process_index) is None), None)
    todo = (f"resume from the newest intact one with checkpoint.resume_from={intact}" if intact is not None else
            f"no earlier checkpoint in {root} is intact: delete {checkpoint} and set checkpoint.resume_from=null to "
            "start afresh")
    raise CorruptCheckpoint(f"checkpoint.resume_from={resume_from}: {checkpoint} cannot be resumed from: {problem}; "
                            f"{todo}")


def load_progress(checkpoint: Path) -> Progress:
    """The Progress stored in a checkpoint directory."""
    file = checkpoint / PROGRESS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{checkpoint} has no {PROGRESS_FILE}: it is not a complete selfspec training checkpoint "
                                "(or one from before progress.json; start that run afresh)")
    progress = Progress()
    progress.load_state_dict(json.loads(file.read_text()))
    return progress


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, keep: int, progress: Progress) -> Path:
    """accelerator.save_state + progress.json into a temporary directory, renamed into place; keeps the newest
    ``keep``."""
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        for stale in root.glob(".tmp-*"):  # left by a run killed while saving
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / PROGRESS_FILE).write_text(json.dumps(progress.state_dict()) + "\n")
        # a checkpoint is replaced or deleted by first renaming it out of sight (.tmp-old-*), so a kill during the
        # deletion never leaves a half-deleted directory under a step_ name for resume_from=latest to pick
        if final.exists():  # re-saving a step after resuming from an older checkpoint
            final.rename(root / f".tmp-old-{final.name}")
        tmp.rename(final)
        for old in checkpoints(root)[:-keep]:
            old.rename(root / f".tmp-old-{old.name}")
        for doomed in root.glob(".tmp-old-*"):
            shutil.rmtree(doomed)
    accelerator.wait_for_everyone()
    return final


class StopFlag:
    """SIGINT / SIGTERM set a flag; the loop saves a checkpoint at the next optimizer step and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now, without saving
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
