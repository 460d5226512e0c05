"""An EAGLE-style head: one light decoder layer of the target's own architecture, drafting autoregressively.

    config.py   EagleConfig (config.json), the decoder's config, feature layers
    model.py    the head, its training unroll, checkpoint and card
    drafter.py  EagleDrafter, and load_drafter (the selfspec.drafters entry point; both formats below)
    eagle3.py   speculators' EAGLE-3 draft (vLLM's format), read and written as speculators 0.9 does
    speculators_config.py   its config.json (Eagle3Config)
    speculators.py          heads.export --format speculators: what is written, what is refused and why
    loss.py     the training loss over the unrolled steps
    kind.py     how the trainer trains it
"""
