"""The kinds of draft the trainer trains, by the name a recipe gives them (``method``): the one lookup.

A new kind provides its package (config and module, checkpoint, drafter, and a ``HeadKind``, heads/training/kind.py)
and one line here; the recipe's ``method`` lists the names it accepts (heads/training/config.py).
"""

from __future__ import annotations

from heads.block.kind import BlockKind, DFlashKind
from heads.draft_model.kind import DraftModelKind
from heads.eagle.kind import Eagle3Kind, EagleKind
from heads.exit_head.kind import ExitHeadKind
from heads.hydra.kind import HydraKind
from heads.medusa.kind import MedusaKind
from heads.training.kind import HeadKind

KINDS: dict[str, HeadKind] = {"medusa": MedusaKind(), "hydra": HydraKind(), "exit_head": ExitHeadKind(),
                              "eagle": EagleKind(), "eagle3": Eagle3Kind(), "block": BlockKind(),
                              "dflash": DFlashKind(), "draft_model": DraftModelKind()}
"""method -> what the trainer asks of that kind."""


def kind_for(method: str) -> HeadKind:
    """The kind a recipe's ``method`` trains."""
    if method not in KINDS:
        raise ValueError(f"method: expected one of {list(KINDS)}, found {method!r}")
    return KINDS[method]
