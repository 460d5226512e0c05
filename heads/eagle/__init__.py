"""An EAGLE-style head: one light decoder layer of the target's own architecture, drafting autoregressively.

    config.py   EagleConfig (config.json), the decoder's config, feature layers
    model.py    the head, its training unroll, checkpoint and card
    drafter.py  EagleDrafter, and load_drafter (the selfspec.drafters entry point)
    loss.py     the training loss over the unrolled steps
    kind.py     how the trainer trains it
"""
