"""A small separate draft model distilled from the frozen target: the target's own architecture with a few of its
layers, trained on KL(target || draft) and saved as an ordinary transformers model directory (``--draft model:DIR``).

    student.py   the student built from chosen target layers (``build_student``), and the module the trainer trains
    save.py      the model directory it is saved as: weights, config naming the target, tokenizer, card
    kind.py      how the trainer trains it (``method: draft_model``)
"""
