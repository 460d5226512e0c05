"""``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for every trained draft (PEFT's and huggingface_hub's
mixin surface), over the files of heads/checkpoints/files.py.

A draft module subclasses ``DraftCheckpoint`` next to ``nn.Module`` and says what is its own:

- ``WHAT``: its name in messages and commit messages ("Hydra heads"); ``DRAFT_TYPE``: the draft_type of its config;
- what it can be turned into: ``SPECULATORS_TYPE`` (it is a draft of vLLM's speculators format, which
  ``python -m heads.export --format speculators`` and ``--format gguf`` write), ``SPECULATORS_INSTEAD`` (why not, and
  what to train instead), ``ADDS_VOCAB`` (``python -m heads.add_vocab`` adds a draft vocabulary after training);
- ``card_for(config, location)``: its README.md;
- ``read_checkpoint(directory)``: (config, tensors), checked against each other;
- ``on_base(config, base_model)``: a new module on the base (its embeddings, LM head) before the weights load;
- ``base_checks(config, base_model)``: (name, trained for, found) sizes beyond hidden and vocabulary size;
- where its files differ from its module's state (speculators' drafts): ``saved_state()``, what ``save_pretrained``
  writes, and ``loaded(config, tensors, base_model)``, the module ``from_pretrained`` makes of what it read.

``push_to_hub`` saves into a temporary directory, reads it back strictly, and uploads config.json, model.safetensors
and the card written for the repo in one Hub commit (heads/checkpoints/hub.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.checkpoints.files import CARD, CONFIG, WEIGHTS, check_base_sizes, resolve, write_checkpoint
from heads.checkpoints.hub import Published, check_repo_id, publish


class DraftCheckpoint:
    """The checkpoint surface of a draft module that has a ``config`` (with ``to_dict``); see the module docstring."""

    WHAT = "draft"
    DRAFT_TYPE = ""
    SPECULATORS_TYPE = ""
    """the speculators_model_type of its config.json when it is a draft of vLLM's speculators format ("": it is not)."""
    SPECULATORS_INSTEAD = ""
    """for a selfspec draft the speculators format cannot express: what to train instead, which exports as it is."""
    ADDS_VOCAB = False
    """whether ``python -m heads.add_vocab`` can count and add a draft vocabulary to it after training."""
    READS = "lm_head"
    """the width its config's hidden_size names: of the states the LM head reads, or of the decoder's "layers"
    (``heads.base.base_sizes``)."""

    @classmethod
    def card_for(cls, config: Any, location: str) -> str:
        raise NotImplementedError

    @classmethod
    def read_checkpoint(cls, directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def on_base(cls, config: Any, base_model: PreTrainedModel) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def base_checks(cls, config: Any, base_model: PreTrainedModel) -> tuple[tuple[str, int, int], ...]:
        return ()

    def card(self, location: str) -> str:
        """README.md for this draft stored at ``location`` (a directory or a Hub repo id)."""
        return self.card_for(self.config, location)

    def saved_state(self) -> dict[str, torch.Tensor]:
        """The tensors ``save_pretrained`` writes: the module's state."""
        return self.state_dict()

    def save_pretrained(self, directory: str | Path, repo_id: str | None = None) -> Path:
        """config.json + model.safetensors (``saved_state``) + README.md, written atomically."""
        return write_checkpoint(directory, self.saved_state(), self.config.to_dict(),
                                self.card(repo_id or str(directory)))

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
                    dry_run: bool = False, commit_message: str | None = None) -> list[str] | Published:
        """Save to a temporary directory and upload it in one commit; dry_run returns the files it would upload
        (nothing is sent). Any failure raises ``heads.checkpoints.hub.PublishError`` saying what the repo holds now."""
        check_repo_id(repo_id)
        with tempfile.TemporaryDirectory(prefix="selfspec-push-") as tmp:
            directory = self.save_pretrained(Path(tmp) / "heads", repo_id=repo_id)
            self.read_checkpoint(directory)  # what is uploaded is checked as strictly as any published folder
            files = {name: directory / name for name in (CONFIG, WEIGHTS, CARD)}
            if dry_run:
                return list(files)
            return publish(files, repo_id, private=private, revision=revision, token=token,
                           commit_message=commit_message or f"Upload {self.WHAT} (selfspec)")

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None):
        """From a local directory or a Hub id, onto ``base_model`` (its device and dtype). Strict; refuses a base of
        another hidden or vocabulary size (or whatever ``base_checks`` names)."""
        directory = resolve(path_or_repo_id, revision)
        config, tensors = cls.read_checkpoint(directory)
        check_base_sizes(config, base_model, path_or_repo_id, cls.WHAT, extra=cls.base_checks(config, base_model),
                         at=cls.READS)
        return cls.loaded(config, tensors, base_model)

    @classmethod
    def loaded(cls, config: Any, tensors: dict[str, torch.Tensor], base_model: PreTrainedModel) -> nn.Module:
        """The module on ``base_model`` with ``tensors`` loaded strictly, on the base's device and dtype, in eval
        mode."""
        module = cls.on_base(config, base_model)
        module.load_state_dict(tensors, strict=True)
        weight = base_model.get_output_embeddings().weight
        return module.to(device=weight.device, dtype=weight.dtype).eval()
