"""The GPU run's parts that need torch or ``datasets`` (selfspec/tools/gpu.py runs them in subprocesses; the tool
itself stays on the standard library): the conversations whose user turns the target answers there (``pack``), what
finished of that regeneration there (``finished``), and the tiny model the CPU rehearsal sends in the built-in model's
place (``tiny_model_tar``)."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import datasets

from heads.training.data import DataConfig, load_conversations

USER_CHARS = 3000
"""a user turn sent is cut to this many characters (the target's prompt is cut to its context there anyway)."""
TURNS = 2
"""user turns kept per conversation."""
TINY_TURNS = ["Write a short story about the sea.", "Now make it rhyme.", "What is the capital of France?",
              "And of Italy?", "Explain speculative decoding in one line.", "Give an example."]
"""the rehearsal's conversations (two user turns each), instead of ShareGPT's."""


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


def finished(out: str) -> str:
    """The regeneration at ``out`` (heads.distill's output) as a dataset directory: complete as it is, or, when its cap
    cut it, the shards that finished concatenated into ``out`` (the shard under way is lost) -> a one-line summary,
    also written to ``out``/../regen.json. None finished: SystemExit, in one line."""
    path = Path(out)
    if (path / "state.json").exists():
        rows, complete = len(datasets.load_from_disk(str(path))), True
    else:
        shards = sorted((path / "shards").glob("shard-*")) if (path / "shards").is_dir() else []
        if not shards:
            raise SystemExit(f"{path}: no finished shard of the regeneration: expected at least one (its cap was "
                             "shorter than one batch)")
        full = datasets.concatenate_datasets([datasets.load_from_disk(str(s)) for s in shards])
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".partial-") as tmp:
            full.save_to_disk(Path(tmp) / "data")
            shutil.rmtree(path)
            os.replace(Path(tmp) / "data", path)
        rows, complete = len(full), False
    (path.parent / "regen.json").write_text(json.dumps({"conversations": rows, "complete": complete}))
    return f"{rows} conversations ({'complete' if complete else 'the finished shards; the cap cut the rest'})"


def tiny_model_tar(target: str) -> None:
    """The rehearsal's stand-in for the built-in model: the tests' tiny random Llama chat model (tests/
    tiny_chat_model.py: hidden 64, 2 layers, a real BPE tokenizer and chat template) as a tar of a directory named
    like the built-in model, so that ``--model smollm2-135m-instruct`` finds it in selfspec's cache."""
    from tests.tiny_chat_model import build  # optional: the tests folder, there in a checkout (the rehearsal only)

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "smollm2-135m-instruct")
        with tarfile.open(target, "w") as tar:
            tar.add(model, arcname=model.name)


def tiny_turns(count: int, path: str) -> None:
    """``count`` conversations of two user turns from TINY_TURNS (placeholder replies) -> parquet at ``path``."""
    rows = []
    for k in range(count):
        users = [TINY_TURNS[(2 * k) % len(TINY_TURNS)], TINY_TURNS[(2 * k + 1) % len(TINY_TURNS)]]
        rows.append({"messages": [m for u in users for m in ({"role": "user", "content": u},
                                                            {"role": "assistant", "content": "."})]})
    datasets.Dataset.from_list(rows).to_parquet(path)
