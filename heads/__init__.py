"""heads: everything trainable in selfspec (Medusa heads, Hydra heads, EAGLE heads, exit heads, block drafters, draft
models), their training and checkpoints.

    medusa/ hydra/ eagle/ exit_head/ block/ draft_model/   what each kind is: config and module, checkpoint,
                                                           drafter, how it trains
    decoder/                           what the EAGLE and block kinds share (a light decoder of the target's own
                                       architecture, speculators' format); not a kind
    base.py blocks.py tree_search.py   what the kinds share: the base they are built on, their blocks, trees
    checkpoints/                       checkpoint files, the Hub, model cards, the DraftCheckpoint mixin
    training/                          the trainer and its parts (recipe, data, losses, hidden-state cache, state)
    kinds.py draft_types.py            the lookups: recipe method -> kind, checkpoint draft_type -> module class
    export.py publish.py distill.py retree.py add_vocab.py import_medusa.py   the commands (python -m heads.X)

Importing ``heads`` imports no kind: each name of ``__all__`` is imported from its module when first asked for
(``from heads import EagleHead`` imports the EAGLE head's modules and nothing of the other kinds).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EagleConfig": "heads.eagle.config", "EagleDrafter": "heads.eagle.drafter", "EagleHead": "heads.eagle.model",
    "HydraConfig": "heads.hydra.model", "HydraDrafter": "heads.hydra.drafter", "HydraHeads": "heads.hydra.model",
    "MedusaConfig": "heads.medusa.config", "MedusaDrafter": "heads.medusa.drafter", "MedusaHeads": "heads.medusa.model",
    "load_drafter": "heads.medusa.drafter", "push_folder": "heads.draft_types", "best_choices": "heads.tree_search",
    "best_tree": "heads.tree_search", "expected_accept_length": "heads.tree_search",
    "measure_accuracy": "heads.tree_search",
}
"""name -> the module that defines it."""

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """``heads.X`` for X in ``__all__``: imported from its module on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module 'heads' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
