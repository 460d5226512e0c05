"""A training run's folder (``output_dir``) tied to the recipe that trains in it, so that two runs cannot be mixed up.

``run.json`` records the recipe's kind (``method``), its target and the values that shape the draft's weights
(each kind's ``shape``). Before anything loads (``check_run_folder``, on every process):

  - a recipe that disagrees with the folder's ``run.json`` (or with that of the run a ``resume_from`` path belongs to)
    is refused in one line naming each value that differs;
  - a folder that holds a run (checkpoints, ``metrics.jsonl``, a trained draft) is not trained over from scratch: the
    recipe resumes it (``checkpoint.resume_from``) or says to start over (``overwrite=true``, which deletes them);
  - an ``output_dir`` that is a file (or inside one) is refused.

Once the accelerator exists, ``claim_run_folder`` (main process) deletes what ``overwrite`` replaces and writes
``run.json``. On resume ``trim_metrics`` cuts ``metrics.jsonl`` back to the resumed step: a killed run's steps after its
last checkpoint are trained again, and would otherwise be logged twice.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from heads.kinds import every_kind, kind_for
from heads.training.config import TrainConfig
from heads.training.state import checkpoints

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
TARGET = ("model.name", "model.revision", "model.config", "model.seed")
"""what names the frozen target (its seed: the weights of a random one)."""


class RunFolderError(ValueError):
    """An output_dir that holds another run, or a run the recipe would train over, or that is not a directory."""


def identity(cfg: TrainConfig) -> dict[str, Any]:
    """What ``run.json`` records of a recipe: its method, its target and the values that shape its draft."""
    def value(key: str) -> Any:
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    return {"method": cfg.method, **{key: value(key) for key in (*TARGET, *kind_for(cfg.method).shape)}}


def held(out: Path) -> list[str]:
    """What of a run ``out`` holds: its checkpoints, its metrics, trained drafts (empty: nothing to train over)."""
    found = []
    steps = checkpoints(out / "checkpoints")
    if steps:
        found.append(f"checkpoints up to {steps[-1].name}")
    if (out / METRICS_FILE).is_file() and (out / METRICS_FILE).stat().st_size:
        found.append(METRICS_FILE)
    found += [f"a trained draft in {name}/" for name in final_dirs() if (out / name).is_dir()]
    return found


def final_dirs() -> list[str]:
    """The folders of an output_dir where some kind saves its trained draft (each kind's ``final_dir``)."""
    return sorted({kind.final_dir for kind in every_kind().values()})


def _recorded(folder: Path) -> dict | None:
    file = folder / RUN_FILE
    if not file.is_file():
        return None
    try:
        recorded = json.loads(file.read_text())
    except (ValueError, OSError) as err:
        raise RunFolderError(f"{file} cannot be read ({type(err).__name__}: {err}): it records which run the folder "
                             "holds; restore it, or choose another output_dir") from None
    if not isinstance(recorded, dict):
        raise RunFolderError(f"{file}: expected a JSON object, found {type(recorded).__name__}; restore it, or choose "
                             "another output_dir")
    return recorded


def _differences(recorded: dict, ours: dict) -> list[str]:
    keys = [*ours, *(k for k in recorded if k not in ours)]
    return [f"{k}: the run has {recorded.get(k)!r}, this recipe {ours.get(k)!r}" for k in keys
            if recorded.get(k) != ours.get(k)]


def check_run_folder(cfg: TrainConfig) -> None:
    """Refuse, in one line and before anything loads, an output_dir that is not a directory, that holds another run
    than the recipe's, or that holds a run the recipe neither resumes nor says to start over."""
    out = Path(cfg.output_dir)
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise RunFolderError(f"output_dir={cfg.output_dir}: {blocking} is a file, not a directory: choose another "
                             "output_dir")
    ours = identity(cfg)
    folders = [out]
    if cfg.checkpoint.resume_from not in (None, "latest"):  # a checkpoint of another folder: its run too
        folders.append(Path(cfg.checkpoint.resume_from).expanduser().parent.parent)
    for folder in folders:
        recorded = _recorded(folder)
        if recorded is not None and recorded.get("method") == cfg.method:
            recorded = {**kind_for(cfg.method).shape_defaults, **recorded}
        diffs = _differences(recorded, ours) if recorded is not None else []
        if diffs and not (cfg.overwrite and folder == out):
            raise RunFolderError(f"{folder} holds another run than this recipe's ({'; '.join(diffs)}): choose another "
                                 "output_dir, or resume that run with its own recipe (overwrite=true deletes its "
                                 "checkpoints, metrics and draft)")
    found = held(out)
    if found and cfg.checkpoint.resume_from is None and not cfg.overwrite:
        raise RunFolderError(f"output_dir={cfg.output_dir} already holds a run ({', '.join(found)}): resume it with "
                             "checkpoint.resume_from=latest, start it over with overwrite=true (its checkpoints, "
                             "metrics and draft are deleted), or choose another output_dir")


def claim_run_folder(cfg: TrainConfig, is_main_process: bool) -> None:
    """On the main process: with ``overwrite``, delete the run the folder held (checkpoints, metrics.jsonl, trained
    drafts; the hidden-state cache and tracker logs stay); then record this recipe in ``run.json``."""
    if not is_main_process:
        return
    out = Path(cfg.output_dir)
    if cfg.overwrite:
        for name in ("checkpoints", *final_dirs()):
            if (out / name).is_dir():
                shutil.rmtree(out / name)
        (out / METRICS_FILE).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(identity(cfg), indent=1) + "\n")
    os.replace(tmp, out / RUN_FILE)


def trim_metrics(metrics_file: Path, step: int) -> int:
    """Keep the records of ``metrics_file`` up to optimizer step ``step`` (a resumed run logs what follows again),
    without the end-of-run ones ("final") and a line a kill cut short; -> how many were dropped."""
    if not metrics_file.is_file():
        return 0
    kept, dropped = [], 0
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and record.get("step", 0) <= step and not record.get("final")
        except ValueError:
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = metrics_file.with_name(f".{metrics_file.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, metrics_file)
    return dropped

