"""A distilled draft model on disk: an ordinary transformers model directory, written atomically
(heads/checkpoints/files.py ``atomic_directory``) on the main process only.

    config.json              the student's transformers config, plus what it was distilled from (``TARGET_KEYS``)
    generation_config.json   the target's
    model.safetensors        the student's weights, float32 (tied embeddings stored once)
    tokenizer.json, ...      the target's tokenizer: the draft's tokens are the target's ids
    README.md                the model card: the target and its revision, the layers copied, the measured agreement

``AutoModelForCausalLM.from_pretrained(directory)`` loads it with no selfspec code; ``python infer.py --draft
model:<directory>`` drafts with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from heads.base import card_usage
from heads.checkpoints.files import CARD, atomic_directory
from selfspec.drafts.draft_model_load import DRAFT_VOCAB_KEY

TARGET_KEYS = ("selfspec_target", "selfspec_target_revision", "selfspec_layers", "selfspec_top1_agreement")
"""config.json's record of the target (a transformers config keeps extra keys): its name, its Hub revision (null when
unknown), the target layers the student's were copied from, and the held-out top-1 agreement with it (null: not
measured). A loader compares selfspec_target with the target it is given."""


@dataclass(frozen=True)
class Distilled:
    """What the kind's build hands its save (the trainer's "config" of this kind): the target and the copied layers."""

    base_model: str
    """the target's name (``heads.base.base_name``)."""
    base_revision: str | None
    """the target's Hub revision, when the recipe gives one."""
    layers: list[int]
    """the target layers the student's layers were copied from."""
    target_layers: int
    """the target's number of decoder layers."""
    train_embeddings: bool
    """whether the embeddings and LM head were trained (else frozen copies of the target's)."""
    tokenizer: PreTrainedTokenizerBase | None
    """the target's tokenizer, saved beside the weights (None: none is saved)."""
    draft_vocab: list[int] | None = None
    """the token ids it drafts from (config.json's ``selfspec_draft_vocab``); None: every token."""


def save_draft_model(directory: str | Path, student: PreTrainedModel, state: dict[str, torch.Tensor],
                     facts: Distilled, agreement: float | None) -> Path:
    """Write ``student``'s config (with ``TARGET_KEYS``), ``state`` (its weights, e.g. gathered by accelerate) as
    safetensors, the tokenizer and the card to ``directory``, atomically."""
    values = (facts.base_model, facts.base_revision, list(facts.layers), agreement)
    for key, value in zip(TARGET_KEYS, values):
        setattr(student.config, key, value)
    if facts.draft_vocab is not None:
        setattr(student.config, DRAFT_VOCAB_KEY, list(facts.draft_vocab))
    with atomic_directory(directory) as tmp:
        student.save_pretrained(tmp, state_dict=state)
        if facts.tokenizer is not None:
            facts.tokenizer.save_pretrained(tmp)
        (tmp / CARD).write_text(draft_model_card(student, facts, agreement, str(Path(directory).expanduser())))
    return Path(directory).expanduser()


def draft_model_files(directory: Path, repo_id: str) -> dict[str, Path | bytes]:
    """What publishing the draft model in ``directory`` to ``repo_id`` uploads: every file as saved (weights, configs,
    tokenizer), after loading its config and weights' names (a directory missing its weights is refused), and its
    card with the usage naming ``repo_id`` (``--draft model:<repo_id>``)."""
    files: dict[str, Path | bytes] = {p.name: p for p in sorted(directory.iterdir())
                                      if p.is_file() and not p.name.startswith(".") and p.name != CARD}
    if "model.safetensors" not in files and "model.safetensors.index.json" not in files:
        raise ValueError(f"{directory} is a draft model without its weights (model.safetensors); save it again "
                         "(train.py method draft_model)")
    card = (directory / CARD).read_text() if (directory / CARD).is_file() else f"# Draft model\n\n--draft model:{repo_id}\n"
    files[CARD] = re.sub(r"model:[^\s\"'`)]+", f"model:{repo_id}", card).encode()
    return files


def draft_model_card(student: PreTrainedModel, facts: Distilled, agreement: float | None, location: str) -> str:
    config = student.config
    revision = facts.base_revision or "not recorded"
    measured = "not measured" if agreement is None else f"{agreement:.3f}"
    vocab = ("It drafts from every token." if facts.draft_vocab is None else
             f"selfspec drafts with it from the {len(facts.draft_vocab):,} tokens most frequent in its training data "
             "(config.json: selfspec_draft_vocab), reading only their rows of the LM head.")
    embeddings = ("trained with the layers" if facts.train_embeddings
                  else "kept frozen, so its vocabulary stays aligned with the target's")
    return f"""---
library_name: transformers
base_model: {facts.base_model}
tags: [speculative-decoding, draft-model, distillation, selfspec]
---
# Draft model for {facts.base_model}

A {len(facts.layers)}-layer {config.model_type} distilled from its target, {facts.base_model} (revision {revision}).
Its layers were initialised from the target's decoder layers {list(facts.layers)} (of {facts.target_layers}).
Its embeddings, final norm and LM head are copies of the target's ({embeddings}).
{vocab}
It was trained on KL(target || draft) to the target's next-token distributions.
It uses the target's tokenizer (saved here).

Top-1 agreement with {facts.base_model} on held-out data: {measured}.

It loads as any transformers causal LM (`AutoModelForCausalLM.from_pretrained`). Speculative decoding with it, the
target verifying every draft (greedy output is the target's own):

```bash
python infer.py --model {facts.base_model} --draft model:{location}
```

{card_usage(facts.base_model, f"model:{location}")}
"""
