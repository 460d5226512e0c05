"""Give Medusa heads, Hydra heads, an exit head, a layer-skip draft or a separate draft model without one a draft
vocabulary (heads/training/draft_vocab.py), counted on their data.

    python -m heads.add_vocab runs/medusa-smollm2/heads --size 8192 [--out DIR]

The V' tokens most frequent among the training tokens of the data the checkpoint's recipe names (``recipe.data``:
the same conversations, chat template and assistant-only labels; ``--source`` for other data; a layer-skip
checkpoint or a draft model has no recipe: ShareGPT's default conversations), end-of-turn always included. A draft
model (a transformers model directory, ``--draft model:DIR``) gets it in its config.json (``selfspec_draft_vocab``). Only the vocabulary is
added: the heads' weights, tree and measured accuracy are unchanged, and the
checkpoint is rewritten atomically (in place or to --out). Heads trained now store one themselves (heads.draft_vocab).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from heads.checkpoints.contents import check_output, describe, is_draft_checkpoint, stored_draft_type
from heads.checkpoints.files import resolve
from heads.cli import check_source, positive_int, report_errors
from heads.draft_types import DRAFT_TYPES
from heads.training.base_model import load_base
from heads.training.config import ModelConfig
from heads.training.data import DataConfig, build_datasets
from heads.training.draft_vocab import draft_vocabulary, end_of_turn, token_counts, with_draft_vocab
from selfspec.core.files import atomic_write, read_json_object
from selfspec.drafts.draft_model_load import DRAFT_VOCAB_KEY
from selfspec.drafts.layerskip import LayerSkipConfig

LAYER_SKIP_CONVERSATIONS = 2000
"""conversations counted for a layer-skip checkpoint (it has no recipe naming its data)."""


@report_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m heads.add_vocab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a Medusa heads, Hydra heads, exit-head or layer-skip checkpoint directory, or a "
                                      "draft model directory (--draft model:DIR)")
    p.add_argument("--size", type=int, default=8192, help="V': tokens in the draft vocabulary (default 8192)")
    p.add_argument("--model", default=None, help="the base model (default: the checkpoint recipe's model, else its "
                                                 "base_model)")
    p.add_argument("--source", default=None, help="data to count tokens on (default: the checkpoint recipe's "
                                                  "data.source, else sharegpt)")
    p.add_argument("--max-conversations", type=positive_int, default=None,
                   help="conversations to count (default: the recipe's data.max_conversations; for a layer-skip "
                        f"checkpoint {LAYER_SKIP_CONVERSATIONS})")
    p.add_argument("--out", default=None, help="save here instead of over the checkpoint: a new or empty directory, "
                                               "or a checkpoint of the same kind to replace")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    check_source(a.source)
    directory = resolve(a.checkpoint)
    kind = stored_draft_type(directory, "the heads' config")
    if kind is None and describe(directory) == "a selfspec draft model":
        return _draft_model(a, directory)
    cls = DRAFT_TYPES.get(kind)
    if kind != "layerskip" and not (cls is not None and cls.ADDS_VOCAB):
        why = " (an EAGLE head stores its draft vocabulary when it is trained: eagle.draft_vocab)" if kind == "eagle" else ""
        raise ValueError(f"{a.checkpoint} holds {describe(directory)}; heads.add_vocab takes a selfspec checkpoint of "
                         f"Medusa heads, Hydra heads, an exit head or a layer-skip draft, or a draft model (train.py "
                         f"method draft_model){why}")
    if a.out is not None:
        check_output(Path(a.out), lambda d: is_draft_checkpoint(d, kind), f"a selfspec {kind} checkpoint", "--out")
    if kind == "layerskip":
        return _layer_skip(a, directory)
    config = cls.read_checkpoint(directory)[0]
    if not 1 <= a.size <= config.vocab_size:
        print(f"error: --size: expected 1..{config.vocab_size} (the base's vocabulary), found {a.size}", file=sys.stderr)
        return 2
    recipe = config.recipe or {}
    base = dict(recipe.get("model") or {"name": config.base_model, "revision": config.base_revision})
    if a.model is not None:
        base = {"name": a.model}
    model, tokenizer = load_base(ModelConfig(**base))  # the base the heads were trained on, as train.py loads it
    heads = cls.from_pretrained(directory, model)
    data = dict(recipe.get("data") or {})
    if a.source is not None:
        data["source"] = a.source
    if a.max_conversations is not None:
        data["max_conversations"] = a.max_conversations
    train_rows, tokens, counts = _count(DataConfig(**data), tokenizer, a.size, config.vocab_size)
    new = with_draft_vocab(heads, tokens, lambda c: cls.on_base(c, model))
    out = new.save_pretrained(a.out or directory)
    _report(out, kind, tokens, counts, train_rows, data.get("source", "sharegpt"))
    return 0


def _count(data, tokenizer, size: int, vocab_size: int):
    """(the training rows of ``data``, the ``size`` most frequent training tokens with end-of-turn, every token's
    count [V])."""
    train_rows, _ = build_datasets(data, tokenizer)
    counts = token_counts(train_rows, vocab_size)
    tokens = draft_vocabulary(train_rows, size, vocab_size, end_of_turn(tokenizer), counts=counts)
    return train_rows, tokens, counts


def _report(out, kind: str, tokens, counts, rows, source: str) -> None:
    share = counts[tokens.numpy()].sum() / max(counts.sum(), 1)
    print(f"{out}: the {kind} checkpoint now drafts from the {len(tokens)} tokens (of {len(counts)}) most frequent in "
          f"{len(rows)} training rows of {source}: {100 * share:.2f}% of their {counts.sum()} training tokens")


def _draft_model(a, directory: Path) -> int:
    """A separate draft model (a transformers model directory): the vocabulary goes into its config.json as
    ``selfspec_draft_vocab``, rewritten atomically (the weights and everything else unchanged)."""
    if a.out is not None:
        raise ValueError("--out: a draft model's vocabulary is written into its own config.json; copy the directory "
                         "first to keep the original")
    config = read_json_object(directory / "config.json", "the draft model's config")
    counted = _count_without_recipe(a, config.get("selfspec_target") or str(directory))
    if counted is None:
        return 2
    rows, tokens, counts, source = counted
    atomic_write(directory / "config.json", json.dumps({**config, DRAFT_VOCAB_KEY: tokens.tolist()}, indent=2) + "\n")
    _report(directory, "draft model", tokens, counts, rows, source)
    return 0


def _layer_skip(a, directory) -> int:
    """A layer-skip checkpoint (config.json only): the vocabulary goes into its config as ``draft_vocab``."""
    config = LayerSkipConfig.load(directory)
    counted = _count_without_recipe(a, config.base_model)
    if counted is None:
        return 2
    rows, tokens, counts, source = counted
    out = dataclasses.replace(config, draft_vocab=tuple(tokens.tolist())).save(a.out or directory).parent
    _report(out, "layerskip", tokens, counts, rows, source)
    return 0


def _count_without_recipe(a, base: str):
    """For a draft with no recipe naming its data (a layer-skip config, a draft model): (rows, the vocabulary, every
    token's count, the data source) counted on --source (ShareGPT by default) with ``base``'s tokenizer (--model
    overrides it), or None after saying that --size does not fit the vocabulary."""
    model, tokenizer = load_base(ModelConfig(name=a.model or base))
    V = model.get_output_embeddings().weight.shape[0]
    if not 1 <= a.size <= V:
        print(f"error: --size: expected 1..{V} (the base's vocabulary), found {a.size}", file=sys.stderr)
        return None
    data = {"source": a.source or "sharegpt", "max_conversations": a.max_conversations or LAYER_SKIP_CONVERSATIONS}
    rows, tokens, counts = _count(DataConfig(**data), tokenizer, a.size, V)
    return rows, tokens, counts, data["source"]


if __name__ == "__main__":
    sys.exit(main())
