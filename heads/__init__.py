"""heads: everything trainable in selfspec (Medusa heads, Hydra heads, EAGLE heads, exit heads), their training and
checkpoints."""

from heads.checkpoint import push_folder
from heads.drafter import MedusaDrafter, load_drafter
from heads.eagle import EagleConfig, EagleHead
from heads.eagle_drafter import EagleDrafter
from heads.hydra import HydraConfig, HydraHeads
from heads.hydra_drafter import HydraDrafter
from heads.medusa import MedusaConfig, MedusaHeads
from heads.tree_search import best_choices, best_tree, expected_accept_length, measure_accuracy

__all__ = [
    "EagleConfig", "EagleDrafter", "EagleHead", "HydraConfig", "HydraDrafter", "HydraHeads", "MedusaConfig", "MedusaDrafter",
    "MedusaHeads", "best_choices", "best_tree", "expected_accept_length", "load_drafter", "measure_accuracy", "push_folder",
]
