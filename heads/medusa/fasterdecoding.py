"""Medusa heads saved by FasterDecoding/Medusa (Medusa-1: heads on a frozen base), converted into a selfspec checkpoint
(``import_medusa``; ``python -m heads.import_medusa`` is the command).

FasterDecoding's format, from a local directory or a Hub id:

    config.json                    medusa_num_heads, medusa_num_layers, base_model_name_or_path (any may be missing)
    medusa_lm_head.safetensors     or medusa_lm_head.pt (loaded with torch.load(weights_only=True): no pickled code)
        {head}.{layer}.linear.weight [D, D], {head}.{layer}.linear.bias [D]    layer = 0..L-1, ResBlock x + SiLU(Wx + b)
        {head}.{L}.weight            [V, D]                                    the head's own copy of the LM head

Head numbering and the index shift are Medusa's and selfspec's alike (head 0 predicts token t+2). FasterDecoding builds
each head as ``[ResBlock] * L`` (one module applied L times); its state dict stores the block once per layer, and the
import gives each layer its own module with those weights, which computes the same function. The projection becomes
"own". Published configs often disagree with the stored tensors (a config saying 2 heads where 5 are stored): the
tensors are trusted, and a warning says so.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from heads.checkpoints.contents import check_output, describe, is_draft_checkpoint
from heads.checkpoints.files import resolve
from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads, check_tensors, save_heads
from selfspec.core.files import read_json_object

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
KEY = re.compile(r"(?P<head>\d+)\.(?P<layer>\d+)\.(?P<what>linear\.weight|linear\.bias|weight)")


def read_config(directory: Path) -> dict:
    """config.json as a dict ({} when there is none: the weights alone say how many heads and layers there are)."""
    file = directory / CONFIG
    if not file.is_file():
        log.warning("%s has no %s: counting heads and layers from the weights", directory, CONFIG)
        return {}
    return read_json_object(file, "the Medusa checkpoint's config")


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, file name) from medusa_lm_head.safetensors, else medusa_lm_head.pt."""
    for name in WEIGHT_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                tensors = load_file(str(file))
            else:
                tensors = torch.load(file, map_location="cpu", weights_only=True)
        except (SafetensorError, OSError, RuntimeError, pickle.UnpicklingError) as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
            detail = next((line for line in lines if "Unsupported global" in line), lines[0])  # torch's long message
            raise ValueError(f"{file} could not be read safely ({type(err).__name__}: {detail}); a .pt file is loaded "
                             "with weights_only=True and may hold tensors only") from err
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{file}: expected a state dict of tensors, found {type(tensors).__name__}")
        prefix = "medusa_head."
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: t for k, t in tensors.items()}
        return tensors, name
    what = describe(directory)
    hint = ": it is selfspec's own format already, use it as it is" if what == "a selfspec medusa checkpoint" else ""
    raise FileNotFoundError(f"{directory} holds {what}, not a FasterDecoding Medusa checkpoint (it has neither "
                            f"{' nor '.join(WEIGHT_FILES)}); heads.import_medusa converts FasterDecoding's format{hint}")


def parse_heads(tensors: dict[str, torch.Tensor], where: str) -> tuple[int, int, int, int]:
    """(num_heads K, num_layers L, hidden D, vocab V) counted from the keys; refuses a state dict that is not whole."""
    unknown = sorted(k for k in tensors if not KEY.fullmatch(k))
    if unknown:
        raise ValueError(f"{where}: unexpected keys {unknown[:6]}; expected {{head}}.{{layer}}.linear.weight|bias and "
                         "{head}.{num_layers}.weight (FasterDecoding Medusa-1 heads)")
    layers: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for key in tensors:
        m = KEY.fullmatch(key)
        layers[int(m["head"])][int(m["layer"])].add(m["what"])
    num_heads = len(layers)
    if sorted(layers) != list(range(num_heads)) or num_heads == 0:
        raise ValueError(f"{where}: heads are numbered {sorted(layers)}, expected 0..K-1")
    depths = set()
    for head, by_layer in layers.items():
        depth = max(by_layer)
        want = {i: {"linear.weight", "linear.bias"} for i in range(depth)} | {depth: {"weight"}}
        if dict(by_layer) != want:
            held = {i: sorted(w) for i, w in sorted(by_layer.items())}
            raise ValueError(f"{where}: head {head} holds {held}; expected residual blocks 0..{depth - 1} "
                             f"(linear.weight + linear.bias) then {depth}.weight")
        depths.add(depth)
    if len(depths) != 1:
        raise ValueError(f"{where}: heads have different numbers of layers {sorted(depths)}; expected one for all")
    num_layers = depths.pop()
    vocab, hidden = tensors[f"0.{num_layers}.weight"].shape
    for key, t in tensors.items():
        m = KEY.fullmatch(key)
        shape = {"linear.weight": (hidden, hidden), "linear.bias": (hidden,), "weight": (vocab, hidden)}[m["what"]]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{where}: {key} has shape {list(t.shape)}, expected {list(shape)} (D={hidden}, V={vocab})"
            )
    return num_heads, num_layers, hidden, vocab


def _config_count(config: dict, key: str, found: int, what: str, where: str) -> None:
    said = config.get(key)
    if said is None:
        log.warning("%s has no %s: using the %d %s stored in the weights", where, key, found, what)
    elif said != found:
        log.warning("%s says %s=%s but the weights store %d %s: trusting the weights (%d %s)",
                    where, key, said, found, what, found, what)


def convert(
    tensors: dict[str, torch.Tensor], medusa_config: dict, base_model: str | None, source: str, where: str,
) -> MedusaHeads:
    """FasterDecoding's state dict + config.json -> MedusaHeads (projection "own"), without allocating a base model."""
    num_heads, num_layers, hidden, vocab = parse_heads(tensors, where)
    _config_count(medusa_config, "medusa_num_heads", num_heads, "heads", f"{source}/{CONFIG}")
    _config_count(medusa_config, "medusa_num_layers", num_layers, "layers per head", f"{source}/{CONFIG}")
    base = base_model or medusa_config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{source}/{CONFIG} names no base_model_name_or_path: pass the base model (--base-model ID)")
    config = MedusaConfig(
        base_model=base, base_revision=None, hidden_size=hidden, vocab_size=vocab, num_heads=num_heads,
        num_layers=num_layers, projection="own", recipe={"imported_from": source, "format": "FasterDecoding Medusa-1"},
    )
    ours = {}
    for h in range(num_heads):
        for i in range(num_layers):
            ours[f"heads.{h}.blocks.{i}.linear.weight"] = tensors[f"{h}.{i}.linear.weight"]
            ours[f"heads.{h}.blocks.{i}.linear.bias"] = tensors[f"{h}.{i}.linear.bias"]
        ours[f"heads.{h}.proj.weight"] = tensors[f"{h}.{num_layers}.weight"]
    ours = {k: t.detach().clone().contiguous() for k, t in ours.items()}  # [ResBlock] * L stores one tensor per layer
    check_tensors(config, ours, where)
    with torch.device("meta"):
        heads = MedusaHeads(config, nn.Linear(hidden, vocab, bias=False))
    heads.load_state_dict(ours, strict=True, assign=True)  # the meta parameters become the imported tensors
    return heads


def import_medusa(
    path_or_repo_id: str | Path, out_dir: str | Path, base_model: str | None = None, revision: str | None = None,
) -> Path:
    """Convert a FasterDecoding Medusa checkpoint (local directory or Hub id) into a selfspec checkpoint directory.
    ``out_dir`` must be new, empty or a selfspec Medusa checkpoint (which is replaced)."""
    check_output(Path(out_dir), lambda d: is_draft_checkpoint(d, "medusa"), "a selfspec medusa checkpoint")
    directory = resolve(path_or_repo_id, revision, files=(CONFIG, *WEIGHT_FILES))
    medusa_config = read_config(directory)
    tensors, weights = read_weights(directory)
    heads = convert(tensors, medusa_config, base_model, str(path_or_repo_id), str(directory / weights))
    return save_heads(heads, out_dir)
