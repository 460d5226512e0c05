"""A block drafter: one forward drafts a block of K future tokens. Two architectures, one drafter and one loss.

    config.py         BlockConfig (config.json): the base, the decoder's config, the block size, drafting defaults
    model.py          selfspec's block head (the EAGLE head's pairs, then K - 1 learned mask queries), its training
                      pass and mask, checkpoint and card
    dflash.py         speculators' DFlash draft (vLLM's format: the target's states as keys and values, [root, mask x
                      K] as the block), read, trained and written as speculators 0.9 does
    dflash_config.py  its config.json (DFlashConfig)
    drafter.py        BlockDrafter (either head), and load_drafter (the selfspec.drafters entry point; both formats)
    loss.py           the anchors a row trains and the loss per block offset
    kind.py           how the trainer trains them (methods block and dflash)

What the block drafter shares with the EAGLE head (heads/eagle/: the decoder and its pairs, its config, the drafter's
features, speculators' format, the trainer's kind) lives in heads/decoder/, which is not a kind.
"""
