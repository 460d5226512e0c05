"""heads: everything trainable in selfspec (Medusa heads, Hydra heads, EAGLE heads, exit heads), their training and
checkpoints.

    medusa/ hydra/ eagle/ exit_head/   what each kind is: config and module, checkpoint, drafter, how it trains
    base.py blocks.py tree_search.py   what the kinds share: the base they are built on, their blocks, trees
    checkpoints/                       checkpoint files, the Hub, model cards, the DraftCheckpoint mixin
    training/                          the trainer and its parts (recipe, data, losses, hidden-state cache, state)
    kinds.py draft_types.py            the lookups: recipe method -> kind, checkpoint draft_type -> kind
    export.py publish.py distill.py retree.py add_vocab.py import_medusa.py   the commands (python -m heads.X)
"""

from heads.draft_types import push_folder
from heads.eagle.config import EagleConfig
from heads.eagle.drafter import EagleDrafter
from heads.eagle.model import EagleHead
from heads.hydra.drafter import HydraDrafter
from heads.hydra.model import HydraConfig, HydraHeads
from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter, load_drafter
from heads.medusa.model import MedusaHeads
from heads.tree_search import best_choices, best_tree, expected_accept_length, measure_accuracy

__all__ = [
    "EagleConfig", "EagleDrafter", "EagleHead", "HydraConfig", "HydraDrafter", "HydraHeads", "MedusaConfig", "MedusaDrafter",
    "MedusaHeads", "best_choices", "best_tree", "expected_accept_length", "load_drafter", "measure_accuracy", "push_folder",
]
