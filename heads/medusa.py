"""Medusa heads: K extra next-next-token predictors on the frozen target's final hidden state.

Head k (k = 1..K) at position t predicts token t+1+k, k steps beyond the LM head's t+1 (the loss in heads/losses.py
draws the index shift). Each head is a stack of ``num_layers`` residual blocks ``x + SiLU(W x + b)`` (distinct modules
per head and per layer; W and b start at zero, so a new head predicts exactly what the LM head predicts) followed by a
projection to the vocabulary:

- ``shared``: the base model's own LM head, frozen. It is never stored in a checkpoint (tiny checkpoints).
- ``own``:    a trainable copy of the LM head per head, initialised from it.
- ``lora``:   the frozen LM head plus a per-head LoRA delta with peft's conventions: ``lora_A`` [r, D] Kaiming-uniform,
              ``lora_B`` [V, r] zero, scaled by ``lora_alpha / r``; only the LoRA weights are stored.

Nothing is applied on top of the projection (no logit soft-capping, no scaling): the LM head module applies none.
The base's LM head is held by reference, never registered as a submodule: ``state_dict()`` holds the heads' own weights
only, and DDP / DeepSpeed wrapping the heads never touch the base.

Shapes: K heads, D hidden size, V vocabulary, "..." any leading dimensions (batch, time).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from selfspec.core.draft_vocab import DraftVocab
from selfspec.core.tree import Tree

PROJECTIONS = ("shared", "own", "lora")


def _type_ok(value: Any, expected: str) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_num = is_int or isinstance(value, float)
    if value is None:
        return "None" in expected
    if expected.startswith("int"):
        return is_int
    if expected.startswith("float"):
        return is_num
    if expected.startswith("str"):
        return isinstance(value, str)
    if expected.startswith("bool"):
        return isinstance(value, bool)
    if expected.startswith("dict"):
        return isinstance(value, dict)
    if expected.startswith("list[int]") or expected.startswith("list[float]"):
        inner = "int" if expected.startswith("list[int]") else "float"
        return isinstance(value, list) and all(_type_ok(x, inner) for x in value)
    if expected.startswith("list[list["):
        inner = "int" if expected.startswith("list[list[int]]") else "float"
        return isinstance(value, list) and all(isinstance(c, list) and all(_type_ok(x, inner) for x in c) for c in value)
    raise TypeError(f"MedusaConfig has a field of unsupported type {expected}")


@dataclass
class HeadsConfigIO:
    """The base a heads config belongs to (its required fields, first in config.json), and from_dict (strict) /
    to_dict / for_model (Medusa heads, Hydra heads)."""

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
        """Strict: unknown keys and missing required keys raise, saying which."""
        return cls(**strict_keys(cls, data, {"base_model", "base_revision", "hidden_size", "vocab_size"}))

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


@dataclass
class MedusaConfig(HeadsConfigIO):
    """Everything needed to rebuild the heads on top of their base model; stored as config.json. Strict."""

    num_heads: int = 4
    """K: head k predicts token t+1+k."""
    num_layers: int = 1
    """residual blocks per head (distinct modules)."""
    projection: str = "shared"
    """"shared" (frozen LM head of the base, not stored), "own" (a trained copy per head), "lora" (LoRA on the LM head)."""
    lora_rank: int = 16
    """r of the LoRA projection (used when projection == "lora")."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: the delta is scaled by lora_alpha / lora_rank (peft's convention)."""
    lm_head_bias: bool = False
    """the base's LM head has a bias (GPT-J, Phi): an "own" projection starts as a copy of both and trains both."""
    tree: list[list[int]] | None = None
    """Medusa-style choices, built from measured accuracy by heads.tree_search (never by hand)."""
    head_accuracy: list[list[float]] | None = None
    """[K][r]: measured probability that head k's rank-r candidate is the right token."""
    mean_accepted: float | None = None
    """mean accepted tokens per target forward, measured by a benchmark with ``tree`` (None until measured)."""
    draft_vocab_size: int | None = None
    """V': the heads draft only from these most frequent training tokens (heads/draft_vocab.py); None: every token."""
    draft_type: str = "medusa"
    """written to config.json; selfspec's drafter registry dispatches on it."""
    recipe: dict | None = None
    """the training recipe that produced these heads."""

    @classmethod
    def for_model(cls, model: PreTrainedModel, base_model: str | None = None, **kwargs: Any) -> "MedusaConfig":
        kwargs.setdefault("lm_head_bias", getattr(model.get_output_embeddings(), "bias", None) is not None)
        return super().for_model(model, base_model, **kwargs)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            expected = str(f.type)  # the annotation as written (postponed annotations are strings)
            if not _type_ok(value, expected):
                raise ValueError(f"MedusaConfig.{f.name}: expected {expected}, found {type(value).__name__} {value!r:.80}")
        for name in ("hidden_size", "vocab_size", "num_heads", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaConfig.{name} must be >= 1, found {getattr(self, name)}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"MedusaConfig.draft_vocab_size: expected 1..{self.vocab_size} (the vocabulary) or None, "
                             f"found {self.draft_vocab_size}")
        if self.num_layers < 0:
            raise ValueError(f"MedusaConfig.num_layers must be >= 0, found {self.num_layers}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"MedusaConfig.projection: expected one of {list(PROJECTIONS)}, found {self.projection!r}")
        if self.draft_type != "medusa":
            raise ValueError(f"MedusaConfig.draft_type: expected 'medusa', found {self.draft_type!r}")
        if self.tree is not None:
            tree = Tree.from_choices(self.tree)  # raises on a path without its parent
            if tree.depth > self.num_heads:
                raise ValueError(
                    f"MedusaConfig.tree is {tree.depth} levels deep; {self.num_heads} heads draft at most {self.num_heads}"
                )
        if self.recipe is not None:
            try:
                json.dumps(self.recipe)
            except (TypeError, ValueError) as err:
                raise ValueError(f"MedusaConfig.recipe must be JSON-serialisable (it is stored in config.json): {err}") from err
        if self.head_accuracy is not None:
            if len(self.head_accuracy) != self.num_heads:
                raise ValueError(
                    f"MedusaConfig.head_accuracy has {len(self.head_accuracy)} rows, expected one per head ({self.num_heads})"
                )
            if any(not 0.0 <= a <= 1.0 for row in self.head_accuracy for a in row):
                raise ValueError("MedusaConfig.head_accuracy: expected probabilities in [0, 1]")


def strict_keys(cls: type, data: dict, required: set[str]) -> dict:
    """``data`` for a config dataclass ``cls``, refused when it has unknown keys or lacks required ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {unknown}; expected a subset of {sorted(known)}")
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{cls.__name__} is missing required keys {missing}")
    return data


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


def check_lm_head(config: MedusaConfig, lm_head: nn.Module, what: str = "this model") -> None:
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


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class LoraProjection(nn.Module):
    """The frozen LM head (held by reference, not stored) plus a LoRA delta, named as peft names it."""

    def __init__(self, lm_head: nn.Module, rank: int, alpha: float):
        super().__init__()
        vocab, hidden = lm_head.weight.shape
        self._lm_head = (lm_head,)  # a tuple: not registered, so not in state_dict
        self.lora_A = nn.ModuleDict({"default": nn.Linear(hidden, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, vocab, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = _frozen_linear(self._lm_head[0], x)  # [..., V]
        delta = self.lora_B["default"](self.lora_A["default"](x))  # [..., V]
        return base + delta.to(base.dtype) * self.scaling


def _frozen_linear(lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The base's LM head applied to x without ever training it (its weights are detached)."""
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
    return F.linear(x.to(lm_head.weight.dtype), lm_head.weight.detach(), bias)


class MedusaHead(nn.Module):
    def __init__(self, config: MedusaConfig, lm_head: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(config.hidden_size) for _ in range(config.num_layers)])
        self.proj: nn.Module | None = None
        if config.projection == "own":
            self.proj = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
            with torch.no_grad():
                self.proj.weight.copy_(lm_head.weight)
                if config.lm_head_bias:
                    self.proj.bias.copy_(lm_head.bias)
        elif config.projection == "lora":
            self.proj = LoraProjection(lm_head, config.lora_rank, config.lora_alpha)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> [..., D] after the residual blocks."""
        x = hidden
        for block in self.blocks:
            x = block(x.to(block.linear.weight.dtype))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, lm_head: nn.Module):
        """lm_head: the base model's (frozen) LM head; held by reference, never stored or trained here."""
        super().__init__()
        check_lm_head(config, lm_head)
        self.config = config
        self._lm_head = (lm_head,)  # a tuple: not a registered submodule (see the module docstring)
        self.heads = nn.ModuleList([MedusaHead(config, lm_head) for _ in range(config.num_heads)])
        self.draft_vocab = DraftVocab(config.draft_vocab_size, config.vocab_size)

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head[0]

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V] of head k (0-based: heads.head_logits(h, 0) is head 1, predicting t+2)."""
        head = self.heads[k]
        x = head.features(hidden)
        if head.proj is None:
            return _frozen_linear(self.lm_head, x)
        if isinstance(head.proj, nn.Linear):
            return head.proj(x.to(head.proj.weight.dtype))
        return head.proj(x)

    def forward(self, hidden: torch.Tensor, on_draft_vocab: bool = False) -> torch.Tensor:
        """hidden [..., D]: the base's final hidden state (after its final norm) -> logits [K, ..., V], or [K, ..., V']
        on the draft vocabulary (``on_draft_vocab``, for heads that have one: what training reads, heads/losses.py)."""
        if on_draft_vocab:
            return self.draft_logits(hidden, len(self.heads))
        return torch.stack([self.head_logits(hidden, k) for k in range(len(self.heads))])

    def draft_logits(self, hidden: torch.Tensor, num: int) -> torch.Tensor:
        """hidden [..., D] -> logits [num, ..., V'] of heads 1..num on the draft vocabulary (``draft_vocab.base_ids``
        maps a column to its token; without one, every token). With the shared LM head, one matmul for all heads over V'
        rows: drafting's main cost."""
        if self.config.projection == "shared":
            features = torch.stack([self.heads[k].features(hidden) for k in range(num)])  # [num, D]
            return self.draft_vocab.linear(self.lm_head, features)
        return self.draft_vocab.restrict(torch.stack([self.head_logits(hidden, k) for k in range(num)]))

    # ------------------------------------------------------------------------------------ checkpoints (checkpoint.py)
    def save_pretrained(self, directory: str | Path, repo_id: str | None = None) -> Path:
        """config.json + model.safetensors (the heads' own weights) + README.md model card, written atomically."""
        from heads.checkpoint import save_heads

        return save_heads(self, directory, repo_id=repo_id)

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None
    ) -> "MedusaHeads":
        """From a local directory or a Hub id (through the Hub cache). Strict; refuses a base of another size."""
        from heads.checkpoint import load_heads

        return load_heads(path_or_repo_id, base_model, revision=revision)

    def push_to_hub(
        self, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
        dry_run: bool = False, commit_message: str = "Upload Medusa heads (selfspec)",
    ) -> Any:
        """Save to a temporary directory and upload it; dry_run returns the files it would upload (nothing is sent)."""
        from heads.checkpoint import push_heads

        return push_heads(self, repo_id, private=private, revision=revision, token=token, dry_run=dry_run,
                          commit_message=commit_message)
