"""The other side of heads/speculators_check.py (and tests/heads/test_speculators.py): runs in a venv of its own with
speculators==0.9.0 (whose pins conflict with selfspec's), never imports selfspec.

    python speculators_side.py JOB.json

JOB.json is a list of cases {"checkpoint": DIR, "inputs": FILE, "ttt_steps": K, "out": FILE} (EAGLE-3) or {"kind":
"dflash", "checkpoint": DIR, "inputs": FILE, "out": FILE}. For an EAGLE-3 case, speculators' own loader reads the
checkpoint (``Eagle3DraftModel.from_pretrained``: its config, its weights, the verifier's
embeddings from the directory the config names), and its own forward runs K steps (its training-time test: step 0 on
the target's aux states, step u on its own step u-1 output with the tokens shifted u to the left) on FILE's
``hidden_states`` [1, L, A·D] and ``input_ids`` [1, L]. The logits of every step, captured at its lm_head, go to
``out`` as ``logits`` [K, L, V'], with the d2t it loaded (offsets; [0] when it has no draft vocabulary) as ``d2t``.
For a DFlash case, ``DFlashDraftModel.from_pretrained`` reads the checkpoint (the verifier's embeddings replace any in
it, as its loader does) and its anchored-block pass (``_backbone_forward``, what its training and its metrics run)
runs with every position but the last block_size an anchor, on FILE's ``hidden_states`` [1, L, A·D] and ``input_ids``
[1, L]: ``logits`` [L - block_size, block_size, V'] (anchor a's block: slot i drafts x_{a+i}) and ``d2t``.
Eager attention (speculators' float-mask path): its default, flex attention, needs a compiler on CPU.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def run_dflash(case: dict) -> None:
    config = DFlashSpeculatorConfig.from_pretrained(case["checkpoint"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(case["checkpoint"], config=config).eval()
    model.load_verifier_weights()
    inputs = load_file(case["inputs"])
    ids = inputs["input_ids"]
    L, K = ids.shape[1], config.block_size
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(  # noqa: SLF001
            inputs["hidden_states"], ids, torch.ones_like(ids),
            torch.zeros(1, L, config.transformer_layer_config.hidden_size), torch.zeros_like(ids), max_anchors=L - K)
    d2t = model.d2t if model.d2t is not None else torch.zeros(1, dtype=torch.long)
    save_file({"logits": logits[0].unflatten(0, (L - K, K)).contiguous(), "d2t": d2t.contiguous()}, case["out"])


def run(case: dict) -> None:
    if case.get("kind") == "dflash":
        return run_dflash(case)
    config = Eagle3SpeculatorConfig.from_pretrained(case["checkpoint"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(case["checkpoint"], config=config).eval()
    inputs = load_file(case["inputs"])
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
              document_ids=torch.zeros_like(inputs["input_ids"]), ttt_steps=case["ttt_steps"])
    d2t = model.d2t if model.d2t is not None else torch.zeros(1, dtype=torch.long)
    save_file({"logits": torch.cat(captured).contiguous(), "d2t": d2t.contiguous()}, case["out"])


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in json.loads(open(sys.argv[1]).read()):
        run(case)
    print("ok")
