"""What every kind of head records and checks about the frozen base model it was trained on.

A head's config starts with ``BaseFields`` (the base's name and revision, and the sizes the head was built for), so a
checkpoint names the base it belongs on and a base of another size is refused before any weight is read.
``base_sizes`` reads those sizes off a model, ``base_name`` the name a checkpoint records for it, and
``check_lm_head`` refuses an LM head of another shape than a head was built for.

Shapes: D hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from selfspec.core import typed


@dataclass
class BaseFields:
    """The base a head's config belongs to (its required fields, first in config.json), and from_dict (strict) /
    to_dict / for_model, for the configs of Medusa heads, Hydra heads, EAGLE heads and exit heads."""

    base_model: str
    """the base model's name or path the heads were trained for (e.g. "smollm2-135m-instruct")."""
    base_revision: str | None
    """the base model's revision (commit or branch) on the Hub, when known."""
    hidden_size: int
    """D of the base model."""
    vocab_size: int
    """V of the base model's LM head."""

    @classmethod
    def from_dict(cls, data: dict):
        """Strict: unknown keys, missing required keys and values of the wrong type raise, saying which."""
        return typed.from_dict(cls, data)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_model(cls, model: PreTrainedModel, base_model: str | None = None, **kwargs: Any):
        """A config for heads on ``model``: hidden and vocab size read from it; other fields from kwargs.

        base_model defaults to the model's Hub id, or the name of its local directory (never a machine's full path):
        the built-in default loads from ``.../smollm2-135m-instruct`` and is named ``smollm2-135m-instruct``.
        """
        hidden, vocab = base_sizes(model)
        kwargs.setdefault("base_revision", None)
        return cls(base_model=base_name(model, base_model), hidden_size=hidden, vocab_size=vocab, **kwargs)


def base_name(model: PreTrainedModel, base_model: str | None = None) -> str:
    """The name a checkpoint records for its base: ``base_model``, else the model's Hub id, or the name of its local
    directory (never a machine's full path)."""
    name = base_model or getattr(model.config, "_name_or_path", None) or model.config.model_type
    if base_model is None and Path(name).expanduser().is_dir():
        name = Path(name).expanduser().resolve().name
    return str(name)


def base_sizes(model: PreTrainedModel, at: str = "lm_head") -> tuple[int, int]:
    """(width D, vocab size V of the LM head) of a causal LM. D is the width of the states the LM head reads
    (at="lm_head": what Medusa, Hydra and EAGLE heads read) or of the decoder's layers (at="layers": what an exit head
    reads). The two differ where the decoder projects its final state before the LM head (OPT-350m's project_out:
    1,024 -> 512)."""
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise TypeError(f"expected a causal LM with an LM head, found {type(model).__name__} without one")
    if at not in ("lm_head", "layers"):
        raise ValueError(f"base_sizes: expected at='lm_head' or 'layers', found {at!r}")
    width = lm_head.weight.shape[1] if at == "lm_head" else model.config.get_text_config().hidden_size
    return int(width), int(lm_head.weight.shape[0])


def check_lm_head(config: BaseFields, lm_head: nn.Module, what: str = "this model") -> None:
    """Refuse an LM head of another shape than the heads were built for."""
    weight = getattr(lm_head, "weight", None)
    if weight is None or weight.dim() != 2:
        raise TypeError(f"expected the base model's LM head (a Linear with a [V, D] weight), found {type(lm_head).__name__}")
    vocab, hidden = weight.shape
    if hidden != config.hidden_size:
        raise ValueError(
            f"heads were trained for hidden size {config.hidden_size}, {what} has {hidden}: "
            f"load them onto the base they were trained for ({config.base_model})"
        )
    if vocab != config.vocab_size:
        raise ValueError(
            f"heads were trained for vocab size {config.vocab_size}, {what} has {vocab}: "
            f"load them onto the base they were trained for ({config.base_model})"
        )


def card_usage(base_model: str, location: str) -> str:
    """The model card's few lines that decode with a draft checkpoint through the selfspec API."""
    return (f'```python\nfrom selfspec.api import load\nmodel = load("{base_model}", draft="{location}")\n'
            'print(model.generate("Hello!", max_new_tokens=64).text)\n```')
