"""Medusa heads: K predictors of tokens t+2..t+1+K on the frozen target's final hidden state.

    config.py   MedusaConfig (config.json) and reading it        card.py      the model card
    model.py    the heads, and their checkpoint (save / load)     drafter.py   MedusaDrafter, the entry point's load_drafter
    vllm.py     vLLM's Medusa format (heads.export)               fasterdecoding.py   FasterDecoding's (heads.import_medusa)
"""
