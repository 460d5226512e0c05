"""Loading a separate draft model for a target: ``--draft model:<dir or Hub id>``, checked against the target before
it drafts a token.

A draft model must tokenize exactly as the target does: its tokens are verified by id. A draft model whose config.json
holds ``selfspec_draft_vocab`` (the ids of its draft vocabulary: what ``train.py`` counts on its training data, or
``python -m heads.add_vocab DIR`` adds) drafts from those tokens alone, reading only their rows of its LM head. The two tokenizers are compared
(the whole vocabulary and the special tokens); where the target's tokenizer cannot be found from its model (a model
built in memory), the sizes and special token ids of the two configs are compared instead, with a warning. The draft
loads on the target's device, in the target's dtype.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from selfspec.core.drafter import DraftKind
from selfspec.core.models import load_model
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree
from selfspec.drafts.draft_model import ModelDrafter

DRAFT_VOCAB_KEY = "selfspec_draft_vocab"
"""config.json's list of the token ids a draft model drafts from (absent: every token)."""
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def load_model_drafter(location: str | Path, target: Target, revision: str | None = None,
                       tree: Tree | DynamicTree | None = None) -> ModelDrafter:
    """The draft model at ``location`` (a transformers model directory or Hub id) drafting for ``target``."""
    dtype = next(target.model.parameters()).dtype
    model, tokenizer = load_model(str(location), dtype=dtype, revision=revision, device=str(target.device))
    if reason := tokenizer_mismatch(tokenizer, target_tokenizer(target), model.config, target.model.config):
        raise ValueError(f"the draft model {location} does not share the target's tokenizer: {reason}. Expected a "
                         "draft model with the target's tokenizer (its vocabulary and special tokens)")
    vocab = getattr(model.config, DRAFT_VOCAB_KEY, None)
    return ModelDrafter(model, target, tree, None if vocab is None else torch.tensor(vocab, dtype=torch.long))


def target_tokenizer(target: Target) -> PreTrainedTokenizerBase | None:
    """The target's tokenizer, from where its model was loaded (None when that is not known or has none)."""
    name = getattr(target.model, "name_or_path", "") or ""
    if not name:
        return None
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        return None


def tokenizer_mismatch(draft: PreTrainedTokenizerBase | None, target: PreTrainedTokenizerBase | None,
                       draft_config: Any, target_config: Any) -> str | None:
    """Why a draft model's tokens are not the target's (None: they are): the tokenizers' vocabularies and special
    tokens, or, where either tokenizer is unknown, the configs' vocabulary sizes and special token ids."""
    if draft is not None and target is not None:
        mine, theirs = draft.get_vocab(), target.get_vocab()
        if mine != theirs:
            if len(mine) != len(theirs):
                return f"its tokenizer has {len(mine):,} tokens, the target's {len(theirs):,}"
            token = next(t for t in sorted(mine) if mine.get(t) != theirs.get(t))
            return (f"token {token!r} is id {mine[token]} in its tokenizer, "
                    f"{theirs.get(token, 'absent')} in the target's")
        for key in SPECIAL:
            if getattr(draft, key) != getattr(target, key):
                return f"its {key} is {getattr(draft, key)}, the target's {getattr(target, key)}"
        return None
    warnings.warn("the target's tokenizer is not known from its model: comparing the draft's and the target's "
                  "vocabulary sizes and special token ids, not their tokenizers", stacklevel=3)
    draft_text, target_text = draft_config.get_text_config(), target_config.get_text_config()
    for key in ("vocab_size", *SPECIAL):
        mine, theirs = getattr(draft_text, key, None), getattr(target_text, key, None)
        if mine != theirs:
            return f"its config's {key} is {mine}, the target's {theirs}"
    return None


KIND = DraftKind(load=load_model_drafter, dynamic_trees=True, tunable=True, checks_base=False)
"""a separate draft model (``--draft model:DIR``, or a transformers causal LM directory; entry point ``model`` of
``selfspec.drafters``): fixed and dynamic trees, tuned by ``infer.py tune-tree``; its config.json names no base model,
so its tokenizer is checked against the target's as it loads instead."""
