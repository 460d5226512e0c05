"""A block drafter: the EAGLE head's pairs of the committed text, then K - 1 learned mask queries, drafting a block of
K future tokens in one forward.

    config.py   BlockConfig (config.json): the base, the decoder's config, the block size, drafting defaults
    model.py    the head, its training pass and mask, checkpoint and card
    drafter.py  BlockDrafter, and load_drafter (the selfspec.drafters entry point)
    loss.py     the anchors a row trains and the loss per block offset
    kind.py     how the trainer trains it
"""
