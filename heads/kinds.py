"""The kinds of draft the trainer trains, by the name a recipe gives them (``method``): the one registry of kinds on
the training side (``selfspec.registry`` is the decoding side's: entry points of ``selfspec.drafters``).

A new kind provides its package (config and module, checkpoint, drafter, and a ``HeadKind``, heads/training/kind.py,
which declares what the kind can do: its final directory, how it checks its recipe section, the losses it computes)
and one line here. A kind's module is imported when its method is first asked for, so training one kind, or importing
one kind's drafter, loads no other kind.
"""

from __future__ import annotations

import functools
import importlib

KINDS: dict[str, str] = {"medusa": "heads.medusa.kind:MedusaKind", "hydra": "heads.hydra.kind:HydraKind",
                         "exit_head": "heads.exit_head.kind:ExitHeadKind", "eagle": "heads.eagle.kind:EagleKind",
                         "eagle3": "heads.eagle.kind:Eagle3Kind", "block": "heads.block.kind:BlockKind",
                         "dflash": "heads.block.kind:DFlashKind", "draft_model": "heads.draft_model.kind:DraftModelKind"}
"""method -> where its HeadKind is ('module:class'), imported on first use (``kind_for``)."""
METHODS = tuple(KINDS)
"""the recipe's ``method`` values (heads/training/config.py types it ``Literal[METHODS]``)."""


@functools.cache
def kind_for(method: str) -> "heads.training.kind.HeadKind":  # noqa: F821 (a string: importing it would be a cycle)
    """The kind a recipe's ``method`` trains (its module imported now, once)."""
    if method not in KINDS:
        raise ValueError(f"method: expected one of {list(KINDS)}, found {method!r}")
    module, _, name = KINDS[method].partition(":")
    return getattr(importlib.import_module(module), name)()


def every_kind() -> dict[str, "heads.training.kind.HeadKind"]:  # noqa: F821
    """method -> its kind, for every method (imports them all: for what must know each kind's answer, such as which
    folders of an output_dir hold a trained draft)."""
    return {method: kind_for(method) for method in KINDS}
