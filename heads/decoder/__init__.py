"""A light decoder of the target's own architecture over the target's features: what the EAGLE and block kinds share;
not a kind itself (no entry point, no method of heads/kinds.py).

    config.py               DecoderHeadConfig (what EagleConfig and BlockConfig share), the decoder's config
                            (decoder_config), the feature layers' checks
    model.py                DecoderHead (what EagleHead and BlockHead share: fusion, fc, decoder, draft vocabulary, the
                            frozen embeddings and LM head), building and running the decoder, reading and carding their
                            checkpoints
    features.py             what a drafter over such a head reads of a step's DraftState (head_features, new_positions)
    speculators_config.py   SpeculatorsConfig: what the config.json of speculators' drafts share (Eagle3Config,
                            DFlashConfig), is_speculators, their auxiliary layers, layers_for
    speculators.py          SpeculatorsDraft: what speculators' draft modules share (Eagle3Head, DFlashHead): features
                            through fc, d2t / t2d, reading and loading their checkpoints
    kind.py                 DecoderKind (what EagleKind and BlockKind share), SpeculatorsKind, draft_size, new_draft

heads/eagle/ and heads/block/ import from here; nothing here imports a kind's package.
"""
