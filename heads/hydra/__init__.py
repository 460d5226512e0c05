"""Hydra heads: Medusa heads that also read the tokens drafted before them.

    model.py    HydraConfig, the heads, their checkpoint and card     drafter.py   HydraDrafter, load_drafter
"""
