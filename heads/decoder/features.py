"""What a drafter over a decoder head reads of a step's ``DraftState`` (the EAGLE drafter, heads/eagle/drafter.py; the
block drafter, heads/block/drafter.py): how many positions were committed since its last draft, and the target's
features of them that the head takes.

Shapes: A newly committed positions, D hidden size, L feature layers.
"""

from __future__ import annotations

import torch

from selfspec.core.drafter import DraftState


def new_positions(state: DraftState, what: str) -> int:
    """A: how many positions were committed since the last draft (their hidden states are ``state.new_hidden``)."""
    if state.new_hidden is None:
        raise ValueError(f"{what} needs DraftState.new_hidden (the target's hidden states of the newly committed "
                         "positions); selfspec.core.generate provides it")
    return state.new_hidden.shape[0]


def head_features(layers: list[int] | None, state: DraftState, what: str) -> torch.Tensor:
    """The target's features of the newly committed positions that a head reading ``layers`` takes: [A, D] final
    hidden states (layers None), or [A, L·D] the states of its feature layers (EAGLE-3)."""
    if not layers:
        return state.new_hidden
    if state.new_states is None:
        raise ValueError(f"this {what} reads the target's hidden states at layers {layers}: expected "
                         "DraftState.new_states (selfspec.core.generate provides it with the target's own verifier), "
                         "found None")
    return state.new_states.take(layers)  # [A, L·D]
