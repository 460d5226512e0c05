"""selfspec: decode faster with a model's own built-in draft, losslessly.

The runtime: a Tree of candidates, a Target that verifies it in one forward, acceptance rules, drafters, and the loop.
It knows nothing about training (``heads`` does that) and never imports ``heads``.
"""

from selfspec.core.accept import Acceptance, greedy_accept, sample_accept, typical_accept
from selfspec.core.drafter import Draft, Drafter, DraftState, NoDrafter, check_tree
from selfspec.core.generate import Output, Step, generate, stream
from selfspec.core.request import GenerationOptions
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.ngram import NGramDrafter
from selfspec.core.sampling import Sampling, next_token, process_logits
from selfspec.core.stopping import stop_strings
from selfspec.core.target import Target, Verified
from selfspec.core.tree import Tree

__all__ = [
    "Acceptance", "Draft", "DraftState", "Drafter", "GenerationOptions", "MergedDrafter", "NoDrafter", "NGramDrafter", "Output", "Sampling", "Step", "Target", "Tree",
    "Verified", "check_tree", "generate", "greedy_accept", "next_token", "process_logits", "sample_accept",
    "stop_strings", "stream", "typical_accept",
]
