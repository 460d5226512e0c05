"""A trained exit head as a selfspec Drafter: selfspec's own early-exit drafter (``selfspec.drafts.early_exit``), which
drafts with the target's first E layers, then the exit head and the target's final norm and LM head."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from heads.exit_head.model import ExitHead
from selfspec.core.drafter import DraftKind
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree
from selfspec.drafts.early_exit import EarlyExitDrafter


def load_drafter(path_or_repo_id: str | Path, target: Target, revision: str | None = None,
                 tree: Tree | DynamicTree | Sequence[Sequence[int]] | None = None) -> EarlyExitDrafter:
    """The ``exit-head`` entry point of ``selfspec.drafters``: the exit head on ``target``, as an EarlyExitDrafter
    (a chain of the stored depth unless ``tree`` is given)."""
    head = ExitHead.from_pretrained(path_or_repo_id, target.model, revision=revision)
    if tree is not None and not isinstance(tree, (Tree, DynamicTree)):
        tree = Tree.from_choices(tree)
    c = head.config
    return EarlyExitDrafter(target, c.exit_layer, depth=c.draft_depth, tree=tree, stop_below=c.stop_below,
                            exit_head=head)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""an exit head (entry point ``exit-head`` of ``selfspec.drafters``): fixed and dynamic trees, tuned by
``infer.py tune-tree``."""
