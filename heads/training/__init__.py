"""Training a draft on a frozen target, whatever its kind (train.py is the command).

    trainer.py      the loop, as numbered steps, asking the kind it trains (kind.py: HeadKind; heads/kinds.py)
    engine.py loaders.py evaluate.py   accelerate's side, the loaders, a batch's loss and held-out accuracy
    config.py recipe.py             the recipe (typed sections) and loading it (YAML + overrides)
    data.py sharegpt.py distill.py  training rows, the default data, self-distilled replies
    base_model.py hidden_cache.py   the frozen target and its cached hidden states
    losses.py draft_vocab.py        the Medusa loss; draft vocabularies counted on the data
    state.py metrics.py             checkpoints, resuming, signals; logged metrics
"""
