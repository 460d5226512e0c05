"""How every draft checkpoint is stored: a directory (or Hub repo) like PEFT's and huggingface_hub's mixin.

    config.json         the draft's config (its "draft_type" names the kind), plus "selfspec_version"
    model.safetensors   the draft's own weights only (never the base model's), with a sha256 of the tensor bytes
    README.md           the model card

Saving is atomic: files are written to a temporary directory next to the target; a new directory is renamed into
place whole, an existing one gets each file replaced atomically (weights first, config.json last) so other files
there (a git clone of the repo, say) are left alone. Loading is strict: unknown config keys, missing or unexpected
tensors, shapes that disagree with config.json, a corrupt or truncated file, or a base of another size all raise.
A directory is found locally or fetched from the Hub through its cache (``resolve``). What each kind stores is its
own (heads/medusa/model.py, heads/hydra/model.py, heads/eagle/model.py, heads/exit_head/model.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tomllib
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from heads.base import base_sizes
from selfspec.core.files import read_json_object
from selfspec.core.models import looks_local

CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"
FILES = (CONFIG, WEIGHTS, CARD)


def selfspec_version() -> str:
    """The installed selfspec's version; from a source checkout that was not installed (code on PYTHONPATH), the
    version in its pyproject.toml marked "+source"."""
    try:
        return importlib.metadata.version("selfspec")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if not pyproject.is_file():
            return "unknown"
        return tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes of the tensors, in name order (detects bytes changed inside the file)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], config: dict, card: str) -> Path:
    """Any draft checkpoint: config.json (+ selfspec_version), model.safetensors (with the tensors' sha256) and
    README.md, written to a temporary directory and renamed into place, so a checkpoint is whole or absent."""
    with atomic_directory(directory) as tmp:
        tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "sha256": tensors_sha256(tensors)})
        (tmp / CONFIG).write_text(json.dumps({**config, "selfspec_version": selfspec_version()}, indent=2) + "\n")
        (tmp / CARD).write_text(card)
    return Path(directory).expanduser()


@contextmanager
def atomic_directory(directory: str | Path) -> Iterator[Path]:
    """A temporary directory next to ``directory`` to write a checkpoint's files into; when the block ends without an
    error they are moved into place: a new directory is renamed into place whole, an existing one gets each file
    replaced atomically (weights first, config.json last). On an error nothing in ``directory`` changes."""
    target = Path(directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"expected a directory to save the checkpoint into, found a file at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()  # the default mode (not mkdtemp's 0700): the renamed checkpoint is as readable as any new directory
    try:
        yield tmp
        if not target.exists():
            os.rename(tmp, target)  # the whole checkpoint appears at once
            return
        for path in sorted(tmp.iterdir(), key=lambda p: (p.name == CONFIG, p.suffix != ".safetensors", p.name)):
            os.replace(path, target / path.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------- load
def resolve(path_or_repo_id: str | Path, revision: str | None = None, files: tuple[str, ...] = FILES) -> Path:
    """A local checkpoint directory, or a Hub repo fetched through the Hub cache (a second load needs no network).

    files: the file names fetched from a Hub repo (a selfspec heads checkpoint's by default).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given but {path} is a local directory: revisions are for Hub ids")
        return path
    if path.exists():
        raise NotADirectoryError(f"expected a checkpoint directory or a Hub repo id, found the file {path}")
    if looks_local(str(path_or_repo_id)):  # a path, not 'owner/name': never looked up on the Hub
        raise FileNotFoundError(f"the directory {path} does not exist: expected a local checkpoint directory "
                                "(or a Hub repo id 'owner/name'); check the path")
    try:
        return Path(snapshot_download(str(path_or_repo_id), revision=revision, allow_patterns=list(files)))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise FileNotFoundError(
            f"{path_or_repo_id!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"(revision {revision or 'main'}): {type(err).__name__}: {err}"
        ) from err


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has {CONFIG} but no {WEIGHTS}: the checkpoint is incomplete")
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is corrupt or truncated ({err}): save or download the checkpoint again") from err
    stored = metadata.get("sha256")
    if stored is not None and stored != tensors_sha256(tensors):
        raise ValueError(f"{file} is corrupt: its tensors do not match the sha256 stored with them; save or download it again")
    return tensors


def read_typed_checkpoint(directory: Path, draft_type: str, what: str, from_dict: Callable[[dict], Any],
                          build: Callable[[Any], nn.Module],
                          upgrade: Callable[[dict], dict] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """config.json (its draft_type must be ``draft_type``; parsed strictly by ``from_dict``) and model.safetensors,
    whose tensor names and shapes must be those of ``build(config).state_dict()`` (built on the meta device), after
    ``upgrade`` (if given) renamed an older checkpoint's tensors. ``what`` names the draft in messages ("exit head",
    "EAGLE head")."""
    data = read_json_object(directory / CONFIG, f"the {what}'s config")
    if data.get("draft_type") != draft_type:
        raise ValueError(f"{directory / CONFIG} says draft_type {data.get('draft_type')!r}; expected {draft_type!r} "
                         f"(an {what} checkpoint)")
    data.pop("selfspec_version", None)
    try:
        config = from_dict(data)
    except ValueError as err:  # the config's own message, naming the file it came from
        raise ValueError(f"{directory / CONFIG}: {err}") from err
    tensors = read_tensors(directory)
    if upgrade is not None:
        tensors = upgrade(tensors)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build(config).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        wrong = {k: (expected[k], found[k]) for k in sorted(set(expected) & set(found)) if expected[k] != found[k]}
        raise ValueError(f"{directory / WEIGHTS} disagrees with config.json: missing tensors "
                         f"{sorted(set(expected) - set(found))[:4]}, unexpected {sorted(set(found) - set(expected))[:4]}, "
                         f"wrong shapes (expected, found) {dict(list(wrong.items())[:4])}")
    return config, tensors


def check_base_sizes(config: Any, base_model: PreTrainedModel, location: str | Path, what: str,
                     extra: tuple[tuple[str, int, int], ...] = (), at: str = "lm_head") -> None:
    """Refuse a base whose hidden or vocabulary size (or any (name, trained for, found) in ``extra``) differs from what
    the draft ``config`` was trained for, naming the base it belongs on. ``at``: which width (``base_sizes``)."""
    hidden, vocab = base_sizes(base_model, at=at)
    for name, want, have in (("hidden size", config.hidden_size, hidden), ("vocab size", config.vocab_size, vocab),
                             *extra):
        if want != have:
            raise ValueError(f"the {what} in {location} was trained for {name} {want}, this model has {have}: it "
                             f"belongs on {config.base_model}")
