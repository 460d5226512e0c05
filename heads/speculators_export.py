"""Export for vLLM's ``speculators`` format (0.9): what can be written exactly, and why the rest is refused.

    python -m heads.export DIR OUT --format speculators [--verifier HUB_ID]

Two of speculators' drafts are written as speculators writes them: EAGLE-3 (heads/eagle/eagle3.py ``Eagle3Head``:
speculators_model_type "eagle3") and DFlash (heads/block/dflash.py ``DFlashHead``: "dflash"), each config.json with
its speculators_config naming the verifier, and model.safetensors under speculators' tensor names. ``--verifier``
renames the target it names (a Hub id in place of the local path the draft was made on, before publishing). Every
export is read back and compared with what was exported (tensors exactly, draft logits on random features) before it
is reported written. train.py trains both (``method: eagle3``, ``method: dflash``).

selfspec's own EAGLE head (heads/eagle/model.py, draft_type "eagle") and block head (heads/block/model.py, "block")
are refused: the format cannot express them, and a checkpoint that loads but drafts differently is worse than none.
``differences`` says which parts differ.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from heads.block.dflash import DFlashHead
from heads.checkpoints.files import CONFIG, resolve
from heads.decoder.speculators_config import is_speculators
from heads.draft_types import DRAFT_TYPES, SPECULATORS_TYPES
from heads.eagle.config import EagleConfig
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.speculators_config import Eagle3Config
from selfspec.core.files import read_json_object

FORMATS = {kind: (cls.CONFIG, cls) for kind, cls in SPECULATORS_TYPES.items()}
"""speculators_model_type -> the config and module selfspec reads and writes it with (every module class that declares
a ``SPECULATORS_TYPE``, heads/draft_types.py)."""
DIFFERENCES = (
    "input fusion: selfspec maps [embedding, features] through fc [2D -> D, with bias] and then an ordinary decoder "
    "layer; speculators' first layer has no such fc: it normalises the embedding (input_layernorm) and the features "
    "(hidden_norm) separately and reads both, 2D wide, in its q/k/v projections",
    "residual: selfspec's first layer adds the fused fc output back; speculators' adds the features alone (or their "
    "hidden_norm)",
    "fed-back state: selfspec feeds its final-norm output to the next step; speculators and vLLM feed the pre-norm "
    "state (speculators' norm_output=true feeds the normed one, but vLLM ignores that flag)",
)
"""How selfspec's EAGLE head (heads/eagle/model.py) differs from speculators' EAGLE-3 draft, part by part; none of them
is a setting of speculators' config."""
BLOCK_DIFFERENCES = (
    "context: selfspec's block head reads the committed text as pairs [embedding, features] through fc [2D -> D, with "
    "bias] and causal decoder layers; DFlash projects the target's states alone (fc without bias, then hidden_norm) "
    "into every layer's keys and values, with no queries of their own",
    "mask slots: selfspec's block head feeds K - 1 learned mask vectors and drafts the first token from the last "
    "true pair; DFlash feeds the root's embedding and then one mask token's embedding (mask_token_id) in every slot, "
    "and drafts every token from a mask slot",
    "layers: selfspec's block head runs the target's own layer kind and reads the LM head without a norm of its own; "
    "DFlash runs Qwen3-style layers (per-head q / k norms) and a final norm before its LM head",
)
"""How selfspec's block head (heads/block/model.py) differs from speculators' DFlash draft, part by part."""


def differences(config: dict) -> list[str]:
    """Why a checkpoint's config.json cannot be written in speculators' format; [] when it can (a speculators EAGLE-3
    or DFlash draft)."""
    if is_speculators(config):
        kind = config["speculators_model_type"]
        return [] if kind in FORMATS else [f"a speculators {kind!r} draft: selfspec reads and writes speculators' "
                                           f"{' and '.join(FORMATS)} drafts"]
    kind = config.get("draft_type")
    if kind == "block":
        return list(BLOCK_DIFFERENCES)
    if kind != "eagle":
        hint = "; Medusa heads export to vLLM's Medusa format (--format vllm)" if kind == "medusa" else ""
        return [f"speculators 0.9 has no model of a selfspec {kind!r} draft (its models: eagle3, dflash, dflash2, "
                f"dspark, mtp, peagle, xpress){hint}"]
    eagle = EagleConfig.from_dict({k: v for k, v in config.items() if k != "selfspec_version"})
    found = list(DIFFERENCES)
    if not eagle.feature_layers:
        found.insert(0, "features: an EAGLE-1 head (feature_layers null) reads the final hidden state alone; "
                        "speculators 0.9 has no EAGLE-1 model (its eagle3 always fuses auxiliary layers)")
    return found


def vllm_caveats(config: Eagle3Config) -> list[str]:
    """What vLLM's EAGLE-3 draft (``Eagle3LlamaForCausalLM``, read at vLLM's main branch) does not do of what
    speculators 0.9 loads: where a draft uses it, vLLM would load the export but draft differently."""
    notes = []
    if config.transformer_layer_config["model_type"] != "llama":
        notes.append(f"vLLM builds Llama layers for every EAGLE-3 draft; these are "
                     f"{config.transformer_layer_config['model_type']} layers")
    if config.num_features != 3:
        notes.append(f"vLLM's fc reads 3 target states; this draft fuses {config.num_features}")
    for flag in ("norm_output", "norm_before_fc", "fc_norm"):
        if getattr(config, flag):
            notes.append(f"vLLM ignores {flag}=true")
    return notes


def refuse(config: dict, source: str) -> None:
    """Raise, naming each part that differs, unless ``config`` can be written in speculators' format."""
    if found := differences(config):
        parts = "\n".join(f"  - {line}" for line in found)
        instead = instead_of(config)
        raise ValueError(f"{source} cannot be exported in the speculators format: the format cannot express it, and a "
                         f"checkpoint that loads but drafts differently is not written. What differs:\n{parts}"
                         + (f"\nInstead: {instead}" if instead else ""))


def instead_of(config: dict) -> str:
    """What to train instead of the selfspec draft ``config`` describes, which exports as it is ("" where there is
    nothing to say): its module class's ``SPECULATORS_INSTEAD``."""
    cls = DRAFT_TYPES.get(config.get("draft_type"))
    return cls.SPECULATORS_INSTEAD if cls is not None else ""


def export_speculators(source: str | Path, out_dir: Path, model: PreTrainedModel, verifier: str | None = None,
                       revision: str | None = None) -> Path:
    """A speculators EAGLE-3 or DFlash draft (``source``: a directory or Hub id) on ``model``, written to ``out_dir``
    in speculators' format (its verifier renamed to ``verifier`` where given), read back and compared."""
    head = module_for(source, revision).from_pretrained(source, model, revision=revision)
    if verifier is not None:
        head.config = replace(head.config, verifier=verifier)
    head.save_pretrained(out_dir)
    check_export(head, out_dir, model)
    return out_dir


def module_for(source: str | Path, revision: str | None = None) -> type[Eagle3Head] | type[DFlashHead]:
    """The module that reads the speculators checkpoint ``source``."""
    config = read_json_object(resolve(source, revision) / CONFIG, "the speculators draft's config")
    refuse(config, str(source))
    return FORMATS[config["speculators_model_type"]][1]


def check_export(head: Eagle3Head | DFlashHead, out_dir: Path, model: PreTrainedModel) -> None:
    """The export read back strictly: the same tensors, exactly, and the same draft logits on random features."""
    back = type(head).from_pretrained(out_dir, model)
    ours, theirs = head.state_dict(), back.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        raise RuntimeError(f"the export in {out_dir} reads back with other tensors than were written")
    a, b = (_probe(h) for h in (head, back))
    if not torch.equal(a, b):
        raise RuntimeError(f"the export in {out_dir} drafts differently after reading back "
                           f"(max logit difference {float((a - b).abs().max()):.3g})")


def _probe(head: Eagle3Head | DFlashHead) -> torch.Tensor:
    """Draft logits of ``head`` on 4 positions of random features and tokens (seeded: the same for any head)."""
    g = torch.Generator().manual_seed(0)
    D, A = head.config.hidden_size, head.config.num_features
    weight = head.fc.weight
    features = torch.randn(4, A * D, generator=g).to(weight)
    tokens = torch.randint(0, head.config.vocab_size, (5,), generator=g).to(weight.device)
    with torch.inference_mode():
        if isinstance(head, DFlashHead):
            return head.logits(head.block(head.new_cache(), features, tokens))
        positions = torch.arange(4, device=weight.device)[None]
        return head.logits(head.step(head.true_features(features[None]), tokens[None, 1:], positions, None, None))
