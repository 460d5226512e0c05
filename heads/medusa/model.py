"""Medusa heads: K extra next-next-token predictors on the frozen target's final hidden state.

Head k (k = 1..K) at position t predicts token t+1+k, k steps beyond the LM head's t+1 (the loss in
heads/training/losses.py draws the index shift). Each head is a stack of ``num_layers`` residual blocks
``x + SiLU(W x + b)`` (distinct modules per head and per layer; W and b start at zero, so a new head predicts exactly
what the LM head predicts) followed by a projection to the vocabulary:

- ``shared``: the base model's own LM head, frozen. It is never stored in a checkpoint (tiny checkpoints).
- ``own``:    a trainable copy of the LM head per head, initialised from it.
- ``lora``:   the frozen LM head plus a per-head LoRA delta with peft's conventions: ``lora_A`` [r, D] Kaiming-uniform,
              ``lora_B`` [V, r] zero, scaled by ``lora_alpha / r``; only the LoRA weights are stored.

Nothing is applied on top of the projection (no logit soft-capping, no scaling): the LM head module applies none.
The base's LM head is held by reference, never registered as a submodule: ``state_dict()`` holds the heads' own weights
only, and DDP / DeepSpeed wrapping the heads never touch the base.

A checkpoint is config.json (``MedusaConfig``, heads/medusa/config.py) + model.safetensors (the heads' own
weights) + README.md (heads/medusa/card.py), written and read through heads/checkpoints/files.py; ``load_heads``
refuses a base of another size and weights that disagree with config.json.

Shapes: K heads, D hidden size, V vocabulary, "..." any leading dimensions (batch, time).
"""

from __future__ import annotations

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.base import base_sizes, check_lm_head
from heads.blocks import ResBlock, frozen_linear
from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import WEIGHTS, read_tensors, resolve, write_checkpoint
from heads.medusa.card import model_card
from heads.medusa.config import MedusaConfig, read_config
from selfspec.core.draft_vocab import DraftVocab


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
        base = frozen_linear(self._lm_head[0], x)  # [..., V]
        delta = self.lora_B["default"](self.lora_A["default"](x))  # [..., V]
        return base + delta.to(base.dtype) * self.scaling


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


def read_medusa_checkpoint(directory: Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a Medusa heads checkpoint directory, checked against each other. Strict."""
    config = read_config(directory)
    tensors = read_tensors(directory)
    check_tensors(config, tensors, str(directory / WEIGHTS))
    return config, tensors


class MedusaHeads(nn.Module, DraftCheckpoint):
    WHAT = "Medusa heads"
    DRAFT_TYPE = "medusa"
    ADDS_VOCAB = True

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
            return frozen_linear(self.lm_head, x)
        if isinstance(head.proj, nn.Linear):
            return head.proj(x.to(head.proj.weight.dtype))
        return head.proj(x)

    def forward(self, hidden: torch.Tensor, on_draft_vocab: bool = False) -> torch.Tensor:
        """hidden [..., D]: the base's final hidden state (after its final norm) -> logits [K, ..., V], or [K, ..., V']
        on the draft vocabulary (``on_draft_vocab``, for heads that have one: what training reads,
        heads/training/losses.py)."""
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

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(model_card)
    read_checkpoint = staticmethod(read_medusa_checkpoint)

    @classmethod
    def on_base(cls, config: MedusaConfig, base_model: PreTrainedModel) -> "MedusaHeads":
        return cls(config, base_model.get_output_embeddings())

    def save_pretrained(self, directory: str | Path, repo_id: str | None = None) -> Path:
        """config.json + model.safetensors (the heads' own weights) + README.md model card, written atomically."""
        return save_heads(self, directory, repo_id=repo_id)

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None
    ) -> "MedusaHeads":
        """From a local directory or a Hub id (through the Hub cache). Strict; refuses a base of another size."""
        return load_heads(path_or_repo_id, base_model, revision=revision)


# --------------------------------------------------------------------------------------------------- checkpoints
def expected_shapes(config: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) that heads built from ``config`` hold, computed without allocating them."""
    with torch.device("meta"):
        heads = MedusaHeads(config, nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias))
    return {name: tuple(t.shape) for name, t in heads.state_dict().items()}


def save_heads(heads: MedusaHeads, directory: str | Path, repo_id: str | None = None) -> Path:
    """Write config.json, model.safetensors and README.md to ``directory`` atomically; returns the directory."""
    return write_checkpoint(directory, heads.state_dict(), heads.config.to_dict(),
                            model_card(heads.config, repo_id or str(Path(directory).expanduser())))


def check_tensors(config: MedusaConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights that disagree with config.json: missing, unexpected or wrongly shaped tensors."""
    expected = expected_shapes(config)
    stored_heads = {int(name.split(".")[1]) for name in tensors if name.startswith("heads.") and name.split(".")[1].isdigit()}
    if stored_heads and len(stored_heads) != config.num_heads:
        raise ValueError(f"{where} holds {len(stored_heads)} heads but config.json says num_heads={config.num_heads}")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where} disagrees with config.json (num_heads={config.num_heads}, num_layers={config.num_layers}, "
            f"projection={config.projection!r}): missing tensors {missing[:6]}, unexpected tensors {unexpected[:6]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(tensors[name].shape)}, config.json implies {list(shape)} "
                f"(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, lora_rank={config.lora_rank})"
            )


def load_heads(path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None) -> MedusaHeads:
    """Heads on ``base_model`` (its LM head, device), in the dtype they were stored in. Strict."""
    directory = resolve(path_or_repo_id, revision)
    config = read_config(directory)
    hidden, vocab = base_sizes(base_model)
    for what, want, have in (("hidden size", config.hidden_size, hidden), ("vocab size", config.vocab_size, vocab)):
        if want != have:
            raise ValueError(
                f"heads were trained for {what} {want}, this model has {have}: the heads in {path_or_repo_id} belong "
                f"on {config.base_model}, not on {type(base_model).__name__} ({base_model.config._name_or_path or '?'})"
            )
    tensors = read_tensors(directory)
    check_tensors(config, tensors, f"{directory / WEIGHTS}")
    lm_head = base_model.get_output_embeddings()
    heads = MedusaHeads(config, lm_head)
    heads.load_state_dict(tensors, strict=True)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}  # not the draft vocabulary's token ids
    return heads.to(device=lm_head.weight.device, dtype=dtypes.pop() if len(dtypes) == 1 else None).eval()
