"""Export for vLLM's ``speculators`` format (0.9): what can be written exactly, and why the rest is refused.

    python -m heads.export DIR OUT --format speculators [--verifier HUB_ID]

speculators' EAGLE-3 draft (heads/eagle/eagle3.py: ``Eagle3Head``) is written as speculators writes it: config.json
(speculators_model_type "eagle3", transformer_layer_config, draft_vocab_size, eagle_aux_hidden_state_layer_ids, the
norm flags, speculators_config with the verifier) and model.safetensors under speculators' tensor names (fc, layers.*,
norm, lm_head, d2t as offsets, t2d). ``--verifier`` renames the target it names (a Hub id in place of the local path
the draft was made on, before publishing). Every export is read back and compared with what was exported (tensors
exactly, draft logits on random features) before it is reported written.

selfspec's own EAGLE head (heads/eagle/model.py, draft_type "eagle") is refused: the format cannot express it, and a
checkpoint that loads but drafts differently is worse than none. ``differences`` says which parts differ.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from heads.eagle.config import EagleConfig
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.speculators_config import Eagle3Config, is_speculators

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


def differences(config: dict) -> list[str]:
    """Why a checkpoint's config.json (a selfspec draft) cannot be written in speculators' format; [] when it can
    (a speculators EAGLE-3 draft)."""
    if is_speculators(config):
        return []
    kind = config.get("draft_type")
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
        raise ValueError(f"{source} cannot be exported in the speculators format: the format cannot express it, and a "
                         f"checkpoint that loads but drafts differently is not written. What differs:\n{parts}")


def export_speculators(source: str | Path, out_dir: Path, model: PreTrainedModel, verifier: str | None = None,
                       revision: str | None = None) -> Path:
    """A speculators EAGLE-3 draft (``source``: a directory or Hub id) on ``model``, written to ``out_dir`` in
    speculators' format (its verifier renamed to ``verifier`` where given), read back and compared."""
    head = Eagle3Head.from_pretrained(source, model, revision=revision)
    if verifier is not None:
        head.config = replace(head.config, verifier=verifier)
    head.save_pretrained(out_dir)
    check_export(head, out_dir, model)
    return out_dir


def check_export(head: Eagle3Head, out_dir: Path, model: PreTrainedModel) -> None:
    """The export read back strictly: the same tensors, exactly, and the same draft logits on random features."""
    back = Eagle3Head.from_pretrained(out_dir, model)
    ours, theirs = head.state_dict(), back.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        raise RuntimeError(f"the export in {out_dir} reads back with other tensors than were written")
    g = torch.Generator().manual_seed(0)
    D, A = head.config.hidden_size, head.config.num_features
    weight = head.fc.weight
    features = torch.randn(1, 4, A * D, generator=g).to(weight)
    tokens = torch.randint(0, head.config.vocab_size, (1, 4), generator=g).to(weight.device)
    positions = torch.arange(4, device=weight.device)[None]
    with torch.inference_mode():
        a, b = (h.logits(h.step(h.true_features(features), tokens, positions, None, None)) for h in (head, back))
    if not torch.equal(a, b):
        raise RuntimeError(f"the export in {out_dir} drafts differently after reading back "
                           f"(max logit difference {float((a - b).abs().max()):.3g})")
