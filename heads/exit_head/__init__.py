"""An exit head: a small map that makes layer E's input readable by the target's final norm and LM head.

    model.py    ExitHeadConfig, the exit head, its checkpoint and card
    drafter.py  load_drafter (the selfspec.drafters entry point): selfspec's EarlyExitDrafter with the exit head
    kind.py     how the trainer trains it
"""
