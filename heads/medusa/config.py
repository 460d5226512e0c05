"""What Medusa heads store as config.json (``MedusaConfig``, strict), and reading it from a checkpoint directory.

draft_type "medusa"; the base's name, revision and sizes first (heads/base.py), then the heads' shape, the projection,
the tree built from measured accuracy, the draft vocabulary size and the recipe that trained them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from heads.base import BaseFields
from heads.checkpoints.contents import describe
from heads.checkpoints.files import CONFIG, FILES
from selfspec.core import typed
from selfspec.core.files import read_json_object
from selfspec.core.tree import Tree

PROJECTIONS = ("shared", "own", "lora")


@dataclass
class MedusaConfig(BaseFields):
    """Everything needed to rebuild the heads on top of their base model; stored as config.json. Strict."""

    num_heads: int = 4
    """K: head k predicts token t+1+k."""
    num_layers: int = 1
    """residual blocks per head (distinct modules)."""
    projection: str = "shared"
    """"shared" (frozen LM head of the base, not stored), "own" (a trained copy per head), "lora" (LoRA on the LM head)."""
    lora_rank: int = 16
    """r of the LoRA projection (used when projection == "lora")."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: the delta is scaled by lora_alpha / lora_rank (peft's convention)."""
    lm_head_bias: bool = False
    """the base's LM head has a bias (GPT-J, Phi): an "own" projection starts as a copy of both and trains both."""
    tree: list[list[int]] | None = None
    """Medusa-style choices, built from measured accuracy by heads.tree_search (never by hand)."""
    head_accuracy: list[list[float]] | None = None
    """[K][r]: measured probability that head k's rank-r candidate is the right token."""
    mean_accepted: float | None = None
    """mean accepted tokens per target forward, measured by a benchmark with ``tree`` (None until measured)."""
    draft_vocab_size: int | None = None
    """V': the heads draft only from these most frequent training tokens (heads/training/draft_vocab.py); None: every
    token."""
    draft_type: str = "medusa"
    """written to config.json; selfspec's drafter registry dispatches on it."""
    recipe: dict | None = None
    """the training recipe that produced these heads."""

    @classmethod
    def for_model(cls, model: PreTrainedModel, base_model: str | None = None, **kwargs: Any) -> "MedusaConfig":
        kwargs.setdefault("lm_head_bias", getattr(model.get_output_embeddings(), "bias", None) is not None)
        return super().for_model(model, base_model, **kwargs)

    def __post_init__(self) -> None:
        typed.check(self)
        for name in ("hidden_size", "vocab_size", "num_heads", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaConfig.{name} must be >= 1, found {getattr(self, name)}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"MedusaConfig.draft_vocab_size: expected 1..{self.vocab_size} (the vocabulary) or None, "
                             f"found {self.draft_vocab_size}")
        if self.num_layers < 0:
            raise ValueError(f"MedusaConfig.num_layers must be >= 0, found {self.num_layers}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"MedusaConfig.projection: expected one of {list(PROJECTIONS)}, found {self.projection!r}")
        if self.draft_type != "medusa":
            raise ValueError(f"MedusaConfig.draft_type: expected 'medusa', found {self.draft_type!r}")
        if self.tree is not None:
            tree = Tree.from_choices(self.tree)  # raises on a path without its parent
            if tree.depth > self.num_heads:
                raise ValueError(
                    f"MedusaConfig.tree is {tree.depth} levels deep; {self.num_heads} heads draft at most {self.num_heads}"
                )
        if self.recipe is not None:
            try:
                json.dumps(self.recipe)
            except (TypeError, ValueError) as err:
                raise ValueError(f"MedusaConfig.recipe must be JSON-serialisable (it is stored in config.json): {err}") from err
        if self.head_accuracy is not None:
            if len(self.head_accuracy) != self.num_heads:
                raise ValueError(
                    f"MedusaConfig.head_accuracy has {len(self.head_accuracy)} rows, expected one per head ({self.num_heads})"
                )
            if any(not 0.0 <= a <= 1.0 for row in self.head_accuracy for a in row):
                raise ValueError("MedusaConfig.head_accuracy: expected probabilities in [0, 1]")


def read_config(directory: Path, tool: str = "expected Medusa heads") -> MedusaConfig:
    """The MedusaConfig in ``directory``/config.json. ``tool``: what the caller takes, said when the directory holds
    something else ("heads.export exports Medusa heads")."""
    file = directory / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG}: it holds {describe(directory)}; {tool} (a selfspec "
                                f"checkpoint: {', '.join(FILES)})")
    data = read_json_object(file, "the heads' config")
    if data.get("draft_type") != "medusa":
        what = describe(directory)
        hint = ": convert it first with python -m heads.import_medusa" if "FasterDecoding" in what else ""
        raise ValueError(f"{directory} holds {what}, not Medusa heads (draft_type 'medusa'); {tool}{hint}")
    data.pop("selfspec_version", None)
    try:
        return MedusaConfig.from_dict(data)
    except ValueError as err:  # the config's own message, naming the file it came from
        raise ValueError(f"{file}: {err}") from err
