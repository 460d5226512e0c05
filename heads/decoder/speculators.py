"""What the modules of every draft in the format of vLLM's ``speculators`` library (0.9) share, whatever its
speculators_model_type (EAGLE-3, heads/eagle/eagle3.py ``Eagle3Head``; DFlash, heads/block/dflash.py ``DFlashHead``):
``SpeculatorsDraft``, their features through ``fc`` and their draft vocabulary as speculators stores it, and reading
(``read_speculators``) and loading (``load_speculators_state``) a checkpoint as speculators' own loader does.

The draft vocabulary: d2t [V'] offsets (draft index k -> target id k + d2t[k], in increasing target-id order) and t2d
[V] a mask of the target ids it holds; absent where the draft drafts the whole vocabulary. Their config.json's shared
part is heads/decoder/speculators_config.py.

Shapes: N positions, D hidden size, A aux layers, V target vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.checkpoints.files import CONFIG, WEIGHTS, read_tensors
from selfspec.core.draft_vocab import check_draft_tokens
from selfspec.core.files import read_json_object

H = TypeVar("H", bound=nn.Module)


class SpeculatorsDraft:
    """What speculators' EAGLE-3 and DFlash drafts share (a module with a ``config``, a ``WHAT``, ``fc`` and the
    ``d2t`` / ``t2d`` buffers): they read A layers' states of the target, concatenated [..., A·D], through ``fc``, and
    keep a draft vocabulary as speculators stores it."""

    @property
    def feature_width(self) -> int:
        return self.config.hidden_size * self.config.num_features

    def checked_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's aux states [..., A·D], refused at another width, in ``fc``'s dtype."""
        if features.shape[-1] != self.feature_width:
            raise ValueError(f"{self.WHAT}: expected target features of width {self.feature_width} "
                             f"({self.config.num_features} layers x {self.config.hidden_size}), found {features.shape[-1]}")
        return features.to(self.fc.weight.dtype)

    def set_draft_vocab(self, tokens) -> None:
        """The draft vocabulary: V' distinct target ids, stored sorted as d2t offsets and the t2d mask."""
        tokens = check_draft_tokens(tokens, self.config.draft_vocab_size, self.config.vocab_size).sort().values
        if self.d2t is None:
            return
        self.d2t.copy_(tokens - torch.arange(len(tokens)))
        self.t2d.copy_(vocab_mask(tokens, self.config.vocab_size))


def read_speculators(directory: Path, what: str, from_json, ignored: tuple[str, ...], optional: tuple[str, ...],
                     stub) -> tuple:
    """config.json and model.safetensors of a speculators checkpoint (``what``: EAGLE-3, DFlash), checked against each
    other: the config read by ``from_json``, every tensor the module ``stub(config, tensors)`` has present with its
    shape (``optional`` ones may be absent), no others (``ignored`` ones are dropped), d2t / t2d a consistent draft
    vocabulary. Strict."""
    data = read_json_object(directory / CONFIG, f"the speculators {what} config")
    data.pop("selfspec_version", None)
    try:
        config = from_json(data)
    except ValueError as err:
        raise ValueError(f"{directory / CONFIG}: {err}") from err
    if not (directory / WEIGHTS).is_file() and (directory / f"{WEIGHTS}.index.json").is_file():
        raise ValueError(f"{directory} holds a sharded checkpoint ({WEIGHTS}.index.json); selfspec reads one "
                         f"{WEIGHTS}")
    tensors = {k: v for k, v in read_tensors(directory).items() if k not in ignored}
    with torch.device("meta"):
        expected = stub(config, tensors).state_dict()
    expected = {name: tuple(t.shape) for name, t in expected.items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    missing = sorted(set(expected) - set(found) - set(optional))
    wrong = {k: (expected[k], found[k]) for k in sorted(set(expected) & set(found)) if expected[k] != found[k]}
    if missing or set(found) - set(expected) or wrong:
        raise ValueError(f"{directory / WEIGHTS} disagrees with config.json: missing tensors {missing[:4]}, unexpected "
                         f"{sorted(set(found) - set(expected))[:4]}, wrong shapes (expected, found) "
                         f"{dict(list(wrong.items())[:4])}")
    if "d2t" in tensors:
        check_vocab_maps(tensors, config, directory / WEIGHTS)
    return config, tensors


def check_vocab_maps(tensors: dict[str, torch.Tensor], config, file: Path) -> None:
    """d2t (offsets: target id = k + d2t[k]) must name distinct, increasing target ids (speculators' t2d order), and
    t2d, where stored, exactly those."""
    tokens = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
    try:
        check_draft_tokens(tokens, config.draft_vocab_size, config.vocab_size)
    except ValueError as err:
        raise ValueError(f"{file}: d2t (draft index -> target id offsets): {err}") from None
    if not bool((tokens[1:] > tokens[:-1]).all()):
        raise ValueError(f"{file}: d2t names target ids out of increasing order; speculators pairs lm_head rows with t2d "
                         "in increasing order")
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), vocab_mask(tokens, config.vocab_size)):
        raise ValueError(f"{file}: t2d and d2t name different draft vocabularies")


def vocab_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d: [V] bool, True at the draft vocabulary's target ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[tokens.cpu()] = True
    return mask


def load_speculators_state(head: H, tensors: dict[str, torch.Tensor], base_model: PreTrainedModel) -> H:
    """A speculators checkpoint's tensors into ``head`` (strictly), completed as speculators' loader completes them:
    t2d from d2t where only d2t is stored, lm_head as the target's LM head rows of the draft vocabulary (in t2d order)
    where none is stored -> the head on the target's device and dtype, in eval mode."""
    config = head.config
    if head.d2t is not None:
        tokens = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
        tensors.setdefault("t2d", vocab_mask(tokens, config.vocab_size))
    else:
        tokens = torch.arange(config.vocab_size)
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = base_model.get_output_embeddings().weight.detach()[tokens].float().cpu()
    head.load_state_dict(tensors, strict=True)
    weight = base_model.get_output_embeddings().weight
    return head.to(device=weight.device, dtype=weight.dtype).eval()
