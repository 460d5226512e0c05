"""Medusa heads: K predictors of tokens t+2..t+1+K on the frozen target's final hidden state.

    config.py           MedusaConfig (config.json) and reading it
    model.py            the heads, and their checkpoint (save / load)
    card.py             the model card
    drafter.py          MedusaDrafter, and load_drafter (the selfspec.drafters entry point)
    kind.py             how the trainer trains them
    vllm.py             vLLM's Medusa format (python -m heads.export)
    fasterdecoding.py   FasterDecoding's Medusa-1 checkpoints (python -m heads.import_medusa)
"""
