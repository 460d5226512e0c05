"""The model card (README.md) of Medusa heads: Hub metadata, measured accuracy per head, the tree, a usage snippet."""

from __future__ import annotations

import json

from huggingface_hub import ModelCardData

from heads.checkpoints.cards import card_datasets
from heads.medusa.config import MedusaConfig
from heads.tree_search import expected_accept_length
from selfspec.core.models import BUILTIN


def model_card(config: MedusaConfig, location: str) -> str:
    """README.md: Hub metadata (base_model, library_name, tags, datasets), accuracy, tree and a usage snippet."""
    base = BUILTIN[config.base_model]["hub_id"] if config.base_model in BUILTIN else config.base_model
    meta = ModelCardData(
        base_model=base, library_name="selfspec", tags=["speculative-decoding", "medusa"],
        datasets=card_datasets(config.recipe),
    )
    revision = f" (revision `{config.base_revision}`)" if config.base_revision else ""
    lines = [
        "---", meta.to_yaml(), "---", "",
        f"# Medusa heads for {config.base_model}", "",
        f"{config.num_heads} Medusa heads ({config.num_layers} residual block(s) each, `{config.projection}` projection) "
        f"for `{config.base_model}`{revision}, made with selfspec. Head k predicts the token k steps beyond the base "
        "model's next token; selfspec drafts a tree of their top candidates and verifies it in one forward of the base "
        "model, losslessly: the output is the base model's own.", "",
        "## Measured accuracy", "",
    ]
    if config.head_accuracy:
        ranks = max(len(row) for row in config.head_accuracy)
        top = min(5, ranks)
        lines += ["Probability that head k's rank-r candidate is the right token (held-out data), and its top-r total:", "",
                  "| head | " + " | ".join(f"rank {r}" for r in range(ranks)) + f" | top-1 | top-{top} |",
                  "|---" * (ranks + 3) + "|"]
        for k, row in enumerate(config.head_accuracy):
            cells = [f"{a:.3f}" for a in row] + [""] * (ranks - len(row))
            lines.append(f"| {k + 1} | " + " | ".join(cells) + f" | {sum(row[:1]):.3f} | {sum(row[:top]):.3f} |")
    else:
        lines.append("Not measured yet.")
    lines += ["", "## Tree", ""]
    if config.tree:
        depth = max(len(c) for c in config.tree)
        lines.append(f"{len(config.tree)} draft nodes, depth {depth}, built from the measured accuracy by `heads.tree_search`.")
        if config.head_accuracy:
            lines.append(f"Expected accepted tokens per step (from the measured accuracy): "
                         f"{expected_accept_length(config.head_accuracy, config.tree):.2f}.")
        lines += ["", f"`{json.dumps(config.tree)}`"]
    else:
        lines.append("No tree stored: selfspec drafts a chain of the heads' top-1 candidates.")
    if config.draft_vocab_size is not None:
        lines += ["", f"Drafts come from a draft vocabulary of the {config.draft_vocab_size} tokens most frequent in the "
                      f"training data (of {config.vocab_size}); the base verifies every one."]
    if config.mean_accepted is not None:
        lines += ["", f"Measured mean accepted tokens per step: {config.mean_accepted:.2f}."]
    if config.recipe:
        lines += ["", "## Training recipe", "", "```json", json.dumps(config.recipe, indent=2, default=str), "```"]
    lines += [
        "", "## Usage", "", "```python",
        "from selfspec import Target, generate",
        "from selfspec.core.models import load_model",
        "from heads.medusa.drafter import load_drafter", "",
        f'model, tokenizer = load_model("{config.base_model}")',
        "target = Target(model)",
        f'drafter = load_drafter("{location}", target)',
        'messages = [{"role": "user", "content": "Hello!"}]',
        'ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]',
        "out = generate(target, drafter, ids, max_new_tokens=128, eos_token_id=tokenizer.eos_token_id)",
        "print(tokenizer.decode(out.tokens))", "```", "",
    ]
    return "\n".join(lines)
