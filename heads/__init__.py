"""heads: everything trainable in selfspec (draft heads, exit heads), their training and checkpoints."""

from heads.checkpoint import push_folder
from heads.drafter import MedusaDrafter, load_drafter
from heads.medusa import MedusaConfig, MedusaHeads
from heads.tree_search import best_choices, best_tree, expected_accept_length, measure_accuracy

__all__ = [
    "MedusaConfig", "MedusaDrafter", "MedusaHeads", "best_choices", "best_tree", "expected_accept_length",
    "load_drafter", "measure_accuracy", "push_folder",
]
