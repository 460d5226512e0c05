"""What a directory holds, in words and by the draft_type its config.json names: read before a tool reads it as some
kind of checkpoint ("it holds a transformers model directory, not Medusa heads") or refuses to write over it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from selfspec.core.files import read_json_object


def _config(directory: Path) -> dict:
    try:
        data = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe(directory: Path) -> str:
    """What a directory holds, in words ("a selfspec medusa checkpoint", "a transformers model directory", ...)."""
    directory = Path(directory)
    if not directory.exists():
        return "nothing (it does not exist)"
    if not directory.is_dir():
        return "a file, not a directory"
    entries = sorted(p.name for p in directory.iterdir())
    if not entries:
        return "nothing (an empty directory)"
    config = _config(directory)
    if isinstance(config.get("draft_type"), str):
        return f"a selfspec {config['draft_type']} checkpoint"
    if isinstance(config.get("speculators_model_type"), str):
        return f"a speculators {config['speculators_model_type']} checkpoint"
    if config.get("model_type") == "medusa" and "MedusaModel" in (config.get("architectures") or []):
        return "a vLLM Medusa export"
    if "medusa_num_heads" in config or any(n.startswith("medusa_lm_head.") for n in entries):
        return "a FasterDecoding Medusa checkpoint"
    if ("model_type" in config or "architectures" in config) and isinstance(config.get("selfspec_target"), str):
        return "a selfspec draft model"  # heads/draft_model: a transformers directory distilled for a target
    if "model_type" in config or "architectures" in config:
        return "a transformers model directory"
    if "progress.json" in entries and any(n.startswith("random_states_") for n in entries):
        return "a selfspec training checkpoint"
    if "checkpoints" in entries or "metrics.jsonl" in entries:
        return "a selfspec training run"
    if "state.json" in entries and "dataset_info.json" in entries:
        return "a datasets directory"
    if "distill.json" in entries:
        return "a heads.distill run"
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    return f"{len(entries)} other file(s) ({shown})"


def is_draft_checkpoint(directory: Path, draft_type: str) -> bool:
    """A selfspec checkpoint of this draft_type (config.json says so)."""
    return _config(Path(directory)).get("draft_type") == draft_type


def stored_draft_type(directory: Path, what: str = "the checkpoint's config") -> str | None:
    """The draft_type that ``directory``/config.json names (None without a config.json or a draft_type); a config.json
    that is not a JSON object raises, naming it as ``what``."""
    config_file = Path(directory) / "config.json"
    return read_json_object(config_file, what).get("draft_type") if config_file.is_file() else None


def check_output(out: Path, ours: Callable[[Path], bool], wanted: str, option: str = "the output directory") -> None:
    """Refuse an ``out`` that exists and is not empty unless ``ours(out)`` (it already is this tool's kind of
    output, ``wanted`` in words), so a tool never overwrites files that are not its own."""
    out = Path(out).expanduser()
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"{option} {out} is a file; expected a directory to write {wanted} into: choose "
                                 "another path or delete it")
    if not any(out.iterdir()) or ours(out):
        return
    raise ValueError(f"{option} {out} already holds {describe(out)}, not {wanted}; writing there would overwrite its "
                     "files: choose another path or delete it")
