"""Hydra heads: Medusa heads that also read the tokens drafted before them.

    model.py    HydraConfig, the heads, their checkpoint and card
    drafter.py  HydraDrafter, and load_drafter (the selfspec.drafters entry point)
    kind.py     how the trainer trains them (Medusa's loss and saving, plus the tokens on the path)
"""
