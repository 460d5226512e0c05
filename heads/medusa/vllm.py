"""Medusa heads in vLLM's Medusa format: the export (``export_vllm``, checked by loading it back) and its importer
(``heads_from_vllm``); ``python -m heads.export`` is the command.

vLLM's Medusa draft model (vllm/model_executor/models/medusa.py and transformers_utils/configs/medusa.py) reads:

    config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size,
                       truncated_vocab_size (= vocab_size: no token map), num_heads, num_hidden_layers,
                       medusa_fc_bias (true: selfspec's blocks have biases; with false vLLM builds bias-free layers and
                       silently skips the bias tensors), original_lm_head
    model.safetensors  blocks.{i}.layers.{j}.weight [D, D], .bias [D]   head i, block j:  x = x + SiLU(W x + b)
                       lm_heads.{i}.weight [V, D]                       head i's projection (no bias)

Projections: "own" is written as it is; "shared" writes the base model's LM head into every lm_heads.{i} (or once, as
lm_heads.0 with original_lm_head=true, which vLLM versions with that option share across heads); "lora" is merged,
W + (alpha / r) B A. vLLM's config class renames any key holding "num" and "heads" / "layers", so no other such key
is written. The heads read the base's final hidden state after its final norm, as vLLM feeds them.

Every export is written to a temporary directory, loaded back with ``heads_from_vllm`` (the importer for the format)
and compared (tensors exactly, logits on random hidden states) before it is moved into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from heads.base import check_lm_head
from heads.medusa.config import MedusaConfig
from heads.medusa.model import LoraProjection, MedusaHeads, check_tensors

CONFIG, WEIGHTS = "config.json", "model.safetensors"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""relative and absolute tolerance of the logits check, per dtype (a merged LoRA rounds differently)."""


# ------------------------------------------------------------------------------------------------------- export
def projection_weight(heads: MedusaHeads, k: int) -> torch.Tensor:
    """[V, D]: the matrix head k projects with (the base LM head, its own copy, or the LoRA-merged LM head)."""
    proj, lm_head = heads.heads[k].proj, heads.lm_head
    if isinstance(proj, nn.Linear):
        if proj.bias is not None:
            raise ValueError(
                "vLLM's Medusa lm_heads have no bias, but these heads' projections have one: cannot export"
            )
        return proj.weight.detach()
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("vLLM's Medusa lm_heads have no bias, but the base model's LM head has one: cannot export")
    weight = lm_head.weight.detach()
    if proj is None:
        return weight
    if isinstance(proj, LoraProjection):
        delta = proj.lora_B["default"].weight.float() @ proj.lora_A["default"].weight.float()  # [V, r] @ [r, D]
        return (weight.float() + proj.scaling * delta).to(weight.dtype)
    raise TypeError(f"unknown projection module {type(proj).__name__}")


def vllm_config(heads: MedusaHeads, original_lm_head: bool = False) -> dict:
    c = heads.config
    dtypes = {p.dtype for p in heads.parameters()} or {heads.lm_head.weight.dtype}
    return {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "truncated_vocab_size": c.vocab_size, "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers, "medusa_fc_bias": True, "original_lm_head": original_lm_head,
        "torch_dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32",
        "base_model_name_or_path": c.base_model,
    }


def vllm_tensors(heads: MedusaHeads, original_lm_head: bool = False) -> dict[str, torch.Tensor]:
    if original_lm_head and heads.config.projection != "shared":
        raise ValueError(f"original_lm_head shares the base LM head across heads; these heads have a "
                         f"{heads.config.projection!r} projection of their own: export them without it")
    out = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            out[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach()
            out[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach()
        if i == 0 or not original_lm_head:
            out[f"lm_heads.{i}.weight"] = projection_weight(heads, i)
    return {k: t.cpu().contiguous().clone() for k, t in out.items()}  # clones: safetensors refuses shared storage


def export_vllm(heads: MedusaHeads, out_dir: str | Path, original_lm_head: bool = False) -> Path:
    """Write vLLM's Medusa format to ``out_dir`` after checking it loads back to the same heads; returns out_dir."""
    target = Path(out_dir).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"expected a directory to export into, found a file at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        save_file(vllm_tensors(heads, original_lm_head), str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(vllm_config(heads, original_lm_head), indent=2) + "\n")
        check_vllm_export(heads, tmp)
        target.mkdir(exist_ok=True)
        for name in (WEIGHTS, CONFIG):
            os.replace(tmp / name, target / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------------------- import
def read_vllm(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a vLLM Medusa checkpoint; strict: the names and shapes the config implies, nothing else."""
    directory = Path(directory)
    try:
        config = json.loads((directory / CONFIG).read_text())
        tensors = load_file(str(directory / WEIGHTS))
    except (OSError, json.JSONDecodeError, SafetensorError) as err:
        raise ValueError(f"{directory} is not a readable vLLM Medusa checkpoint ({CONFIG} + {WEIGHTS}): {err}") from err
    required = ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers")
    if config.get("model_type") != "medusa" or any(not isinstance(config.get(k), int) for k in required):
        raise ValueError(f"{directory / CONFIG}: expected model_type 'medusa' and integers {list(required)}, found "
                         f"{ {k: config.get(k) for k in ('model_type', *required)} }")
    if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"] or "token_map" in tensors:
        raise ValueError(f"{directory}: a truncated vocabulary (token_map) is not supported")
    d, v, k, n = (config[key] for key in required)
    bias, shared = bool(config.get("medusa_fc_bias", False)), bool(config.get("original_lm_head", False))
    shapes = {f"lm_heads.{i}.weight": (v, d) for i in range(1 if shared else k)}
    for i in range(k):
        for j in range(n):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (d, d)
            if bias:
                shapes[f"blocks.{i}.layers.{j}.bias"] = (d,)
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{directory / WEIGHTS} disagrees with its config (num_heads={k}, num_hidden_layers={n}, "
                         f"medusa_fc_bias={bias}, original_lm_head={shared}): missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]} (vLLM would ignore the unexpected ones)")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{directory / WEIGHTS}: {name} has shape {list(tensors[name].shape)}, expected {list(shape)}"
            )
    return config, tensors


def heads_from_vllm(directory: str | Path, lm_head: nn.Module, base_model: str | None = None) -> MedusaHeads:
    """MedusaHeads (projection "own") computing what vLLM computes from the checkpoint in ``directory``."""
    config, tensors = read_vllm(directory)
    k, n = config["num_heads"], config["num_hidden_layers"]
    medusa = MedusaConfig(
        base_model=base_model or config.get("base_model_name_or_path") or "unknown", base_revision=None,
        hidden_size=config["hidden_size"], vocab_size=config["vocab_size"], num_heads=k, num_layers=n, projection="own",
    )
    check_lm_head(medusa, lm_head, "the base model's LM head")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the base model's LM head has a bias; vLLM's Medusa lm_heads have none")
    ours = {}
    for i in range(k):
        for j in range(n):
            weight = tensors[f"blocks.{i}.layers.{j}.weight"]
            zero = torch.zeros_like(weight[0])  # medusa_fc_bias false: vLLM's layers have no bias
            ours[f"heads.{i}.blocks.{j}.linear.weight"] = weight
            ours[f"heads.{i}.blocks.{j}.linear.bias"] = tensors.get(f"blocks.{i}.layers.{j}.bias", zero)
        lm = 0 if config.get("original_lm_head") else i
        ours[f"heads.{i}.proj.weight"] = tensors[f"lm_heads.{lm}.weight"].clone()
    check_tensors(medusa, ours, str(Path(directory) / WEIGHTS))
    heads = MedusaHeads(medusa, lm_head)
    heads.load_state_dict(ours, strict=True)
    return heads.to(device=lm_head.weight.device, dtype=next(iter(tensors.values())).dtype).eval()


def check_vllm_export(heads: MedusaHeads, directory: Path, samples: int = 16) -> None:
    """Load the export back and compare: tensors exactly, logits of every head on random hidden states."""
    config, tensors = read_vllm(directory)
    expected = vllm_tensors(heads, bool(config.get("original_lm_head")))
    differ = sorted(k for k in expected if not torch.equal(tensors[k], expected[k]))
    if differ:
        raise ValueError(f"export check failed: {directory / WEIGHTS} holds other values for {differ[:6]}")
    back = heads_from_vllm(directory, heads.lm_head, heads.config.base_model)
    hidden = torch.randn(samples, heads.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(heads.lm_head.weight.device)
    with torch.no_grad():
        want, got = heads(hidden).float(), back(hidden).float()  # [K, S, V]
    tol = TOLERANCE.get(heads.lm_head.weight.dtype, 3e-2)
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        worst = float((got - want).abs().max())
        raise ValueError(
            f"export check failed: logits of the exported heads differ from the original by up to {worst:.3g}"
        )
