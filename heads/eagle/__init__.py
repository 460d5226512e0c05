"""An EAGLE-style head: one light decoder layer of the target's own architecture, drafting autoregressively.

    config.py   EagleConfig (config.json), the decoder's config, feature layers
    model.py    the head, its training unroll, checkpoint and card     drafter.py   EagleDrafter, load_drafter
    loss.py     the training loss over the unrolled steps
"""
