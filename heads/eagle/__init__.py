"""An EAGLE-style head: one light decoder layer of the target's own architecture, drafting autoregressively.

    config.py   EagleConfig (config.json): the base, the decoder's config, drafting defaults, feature layers
    model.py    the head, its training unroll, checkpoint and card
    drafter.py  EagleDrafter, and load_drafter (the selfspec.drafters entry point; both formats below)
    eagle3.py   speculators' EAGLE-3 draft (vLLM's format), read, trained and written as speculators 0.9 does
    speculators_config.py   its config.json (Eagle3Config)
    loss.py     the training loss over the unrolled steps
    kind.py     how the trainer trains them (methods eagle and eagle3)

What the EAGLE head shares with the block drafter (heads/block/: the decoder, its config, the drafter's features,
speculators' format, the trainer's kind) lives in heads/decoder/, which is not a kind.

heads/speculators_export.py (heads.export --format speculators) says what is written in speculators' format, what is refused
and why, for these drafts and the block drafters.
"""
