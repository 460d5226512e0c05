"""The other side of tests/heads/test_speculators.py: runs in a venv of its own with speculators==0.9.0 (whose pins
conflict with selfspec's), never imports selfspec.

    python speculators_side.py JOB.json

JOB.json is a list of cases {"checkpoint": DIR, "inputs": FILE, "ttt_steps": K, "out": FILE}. For each, speculators'
own loader reads the checkpoint (``Eagle3DraftModel.from_pretrained``: its config, its weights, the verifier's
embeddings from the directory the config names), and its own forward runs K steps (its training-time test: step 0 on
the target's aux states, step u on its own step u-1 output with the tokens shifted u to the left) on FILE's
``hidden_states`` [1, L, A·D] and ``input_ids`` [1, L]. The logits of every step, captured at its lm_head, go to
``out`` as ``logits`` [K, L, V'], with the d2t it loaded (offsets; [0] when it has no draft vocabulary) as ``d2t``.
Eager attention (speculators' float-mask path): its default, flex attention, needs a compiler on CPU.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def run(case: dict) -> None:
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
