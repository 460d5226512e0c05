"""The student: a small causal LM of the target's own architecture whose layers start as copies of some of the
target's, and the module the trainer trains it as.

``build_student(target, layers)`` builds a transformers ``AutoModelForCausalLM`` from a copy of the target's config
with ``num_hidden_layers = len(layers)`` and loads the target's weights into it: student layer i is target layer
``layers[i]``; the embeddings, final norm and LM head are copies, tied as the target's config ties them. The layers are
built fresh, not moved over, so each knows its new index (``layer_idx``: its slot in a KV cache) and attention type.
The config entries that say something per layer follow the copied layers: lists with an entry per layer
(``PER_LAYER``: full or sliding attention, RoPE or not) are subset, lists of layer indices (``LAYER_INDICES``)
renumbered; anything else that makes a layer's weights depend on its index fails the strict load, naming the tensors.
With every layer chosen the student is the target (tests/heads/test_draft_model.py checks its logits). Under DeepSpeed
ZeRO-3, which builds it partitioned, the weights are loaded into its gathered parameters (``whole``).

``Distillation`` is what the trainer trains: the student, and the frozen target held by reference (never trained,
saved or wrapped by DDP / DeepSpeed), whose LM head turns the target's final hidden states into its next-token
distribution.

Shapes: B batch, T time, N scored positions, D hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
from typing import ContextManager

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled

from heads.training.base_model import lm_logits
from selfspec.core import hf

PER_LAYER = ("layer_types", "no_rope_layers")
"""config lists with one entry per decoder layer (Gemma / Qwen / Mistral full or sliding attention, Llama-4 /
SmolLM3 RoPE or not): the student keeps its layers' entries."""
LAYER_INDICES = ("mlp_only_layers",)
"""config lists of decoder layer indices (Qwen-MoE's dense layers): renumbered to the student's layers."""


def chosen_layers(layers: list[int] | None, num_layers: int | None, total: int) -> list[int]:
    """The target layers the student copies, from the recipe's section draft_model: ``layers`` as given, or
    ``num_layers`` evenly spaced over the target's ``total`` layers, the first and the last included (1: the first);
    checked against the target (``check_layers``). The recipe refuses both set (heads/training/config.py)."""
    if layers is None and num_layers is None:
        raise ValueError("draft_model: expected layers (target layer indices) or num_layers, found neither")
    if layers is None:
        if not 1 <= num_layers <= total:
            raise ValueError(f"draft_model.num_layers: expected 1..{total} (the target has {total} layers), found "
                             f"{num_layers}")
        # round(i * (total - 1) / (num_layers - 1)), halves rounded up
        layers = [0] if num_layers == 1 else [(2 * i * (total - 1) + num_layers - 1) // (2 * (num_layers - 1))
                                              for i in range(num_layers)]
    check_layers(layers, total)
    return list(layers)


def check_layers(layers: list[int], total: int) -> None:
    """Refuse a layer list that is empty, not strictly increasing or out of the target's ``total`` layers."""
    if not layers:
        raise ValueError("draft_model.layers: expected at least one target layer index, found none")
    missing = [i for i in layers if not 0 <= i < total]
    if missing:
        raise ValueError(f"draft_model.layers: layer {missing[0]} does not exist; the target has {total} layers "
                         f"(0..{total - 1})")
    if any(a >= b for a, b in zip(layers, layers[1:])):
        raise ValueError(f"draft_model.layers: expected strictly increasing layer indices, found {list(layers)}")


def student_config(config: PretrainedConfig, layers: list[int]) -> PretrainedConfig:
    """A copy of the target's ``config`` for a model of the target ``layers`` only (see PER_LAYER, LAYER_INDICES)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = len(layers)
    for name in PER_LAYER:
        value = getattr(out, name, None)
        if isinstance(value, (list, tuple)):
            setattr(out, name, [value[i] for i in layers])
    for name in LAYER_INDICES:
        value = getattr(out, name, None)
        if isinstance(value, (list, tuple)):
            setattr(out, name, [new for new, old in enumerate(layers) if old in value])
    out._name_or_path = ""  # not the target's: the student is saved and named by its own directory
    return out


def copied_state(target: PreTrainedModel, layers: list[int]) -> dict[str, torch.Tensor]:
    """The target's state dict renamed for the student: decoder layer ``layers[i]``'s tensors as layer i's, the other
    chosen layers' dropped, everything outside the layers (embeddings, final norm, LM head) as it is."""
    stack = hf.decoder_layers(target)
    prefix = next(name for name, module in target.named_modules() if module is stack) + "."  # "model.layers."
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    for name, tensor in target.state_dict().items():
        if not name.startswith(prefix):
            state[name] = tensor
            continue
        index, _, rest = name[len(prefix):].partition(".")
        if int(index) in new_index:
            state[f"{prefix}{new_index[int(index)]}.{rest}"] = tensor
    return state


def build_student(target: PreTrainedModel, layers: list[int], train_embeddings: bool = False) -> PreTrainedModel:
    """A float32 causal LM of the target's architecture with the target's ``layers`` (indices, increasing), embeddings,
    final norm and LM head copied in; its generation config is the target's. The embeddings and LM head are frozen
    unless ``train_embeddings``."""
    check_layers(layers, len(hf.decoder_layers(target)))
    config = student_config(target.config, layers)
    student = hf.sdpa_or_eager(lambda attn: AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                                             dtype=torch.float32))
    try:
        with whole(student):
            student.load_state_dict(copied_state(target, layers), strict=True)
    except RuntimeError as err:  # a per-layer structure the config copy does not express
        raise ValueError(f"the target's layers {list(layers)} do not fit a {len(layers)}-layer "
                         f"{config.model_type} built from its config (a layer whose weights depend on its index?): "
                         f"{err}") from None
    student.generation_config = copy.deepcopy(target.generation_config)
    for module in (student.get_input_embeddings(), student.get_output_embeddings()):
        module.requires_grad_(train_embeddings)
    return student.train()


def whole(model: PreTrainedModel) -> ContextManager:
    """Within the block ``model``'s parameters are whole, and what rank 0 writes to them is kept: under DeepSpeed ZeRO-3
    transformers builds every new model partitioned (zero.Init), its parameters empty until gathered."""
    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed  # optional heavy dependency: only under DeepSpeed ZeRO-3, whose import costs seconds

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)


class Distillation(nn.Module):
    """The student (registered: trained, checkpointed, saved) beside the frozen target (a reference: never part of
    its state dict, the optimizer or a DDP wrapper)."""

    def __init__(self, student: PreTrainedModel, target: PreTrainedModel):
        super().__init__()
        self.student = student
        self._target = (target,)  # a tuple: not registered as a submodule

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, T], scored [B, T] bool -> the student's logits at the scored positions
        [1, N, V] (its LM head runs there only)."""
        out = hf.decoder(self.student)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                       return_dict=True)
        return lm_logits(self.student, out.last_hidden_state[scored])[None]  # [1, N, V]

    @torch.no_grad()
    def target_logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states [N, D] -> its logits [N, V], as its own forward computes them."""
        return lm_logits(self._target[0], final)
