"""What the GPU run (selfspec/tools/gpu.py) packs that needs torch and the training data, run in subprocesses of its
``pack``: the draft cast to bf16 for the trip, and the conversations whose user turns the target answers there."""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file, save_file

from heads.training.data import DataConfig, load_conversations

USER_CHARS = 3000
"""a user turn sent is cut to this many characters (the target's prompt is cut to its context there anyway)."""
TURNS = 2
"""user turns kept per conversation."""


def copy_draft_bf16(src: str, dst: str) -> None:
    """A draft checkpoint directory with its floating-point tensors in bf16 (half the bytes; the GPU decodes in bf16
    and fp16), its other files as they are."""
    source, target = Path(src), Path(dst)
    if not (source / "config.json").exists():
        raise SystemExit(f"--draft {source}: expected a draft checkpoint directory with config.json (train one: "
                         "python train.py --config configs/eagle_smollm2.yaml)")
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
            save_file(tensors, str(target / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, target / f.name)


def user_turns(count: int, path: str) -> None:
    """The first ``count`` ShareGPT conversations (selfspec's training source), their first TURNS user turns each cut
    to USER_CHARS, every reply a placeholder (the target writes its own there) -> parquet at ``path``."""
    rows = load_conversations(DataConfig(source="sharegpt", max_conversations=count))
    out = []
    for row in rows:
        users = [m["content"][:USER_CHARS] for m in row["messages"] if m["role"] == "user"][:TURNS]
        out.append({"messages": [m for u in users for m in ({"role": "user", "content": u},
                                                          {"role": "assistant", "content": "."})]})
    datasets.Dataset.from_list(out).to_parquet(path)
