"""Self-distillation: regenerate the assistant turns of a conversation dataset with the target itself.

Heads trained on what the target would say (rather than on what ChatGPT said in ShareGPT) predict the target's
continuations better, which is what speculative decoding accepts. For each conversation the user turns (and a leading
system message) are kept; turn by turn, the target answers the conversation so far — its own earlier answers
included — in batches with left padding, greedy or sampled.

Output (``out``): a ``datasets`` dataset saved with ``save_to_disk``, column ``messages`` ([{role, content}], like
every source in ``heads/training/data.py``) and ``source_index`` (the row it came from), usable as
``DataConfig(source=out)``.
Work is written as it goes to ``out/shards/shard-NNNNN`` (``shard_size`` conversations each, written atomically);
a restart with the same settings skips finished shards, and each shard seeds its own sampling, so an interrupted and
resumed run writes exactly what an uninterrupted one would. ``out/distill.json`` records the settings.

``python -m heads.distill`` is the command (heads/distill.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from heads.training.data import MESSAGES_FEATURES, DataConfig, load_conversations
from selfspec.core import typed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = 256
    batch_size: int = 8
    shard_size: int = 64
    """conversations per shard (the unit of resumption); a shard's prompts are batched by length, turn by turn."""
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    max_prompt_length: int = 1024
    """a conversation stops (keeping its earlier turns) once the prompt for its next reply is longer than this."""
    seed: int = 0

    def __post_init__(self):
        typed.check(self)
        for name in ("max_new_tokens", "batch_size", "shard_size", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillConfig.{name}: expected >= 1, found {getattr(self, name)}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"DistillConfig.temperature: expected > 0 when sampling, found {self.temperature}")


def _generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
              gen: GenerationConfig) -> list[str]:
    """Token-id prompts -> decoded replies (up to, not including, the first end-of-turn token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), gen.pad_token_id, dtype=torch.long)  # [B, T], left padded
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen)
    stop = set(gen.eos_token_id)
    replies = []
    for row in out[:, width:].tolist():  # [B, new]
        cut = next((j for j, tok in enumerate(row) if tok in stop), len(row))
        replies.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return replies


def regenerate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]],
               cfg: DistillConfig, progress: Callable[[int], None] | None = None) -> list[list[dict]]:
    """Replace every assistant turn by the model's own reply to the conversation so far (user turns kept).

    Turn by turn, the prompts of all ``conversations`` are answered in batches of ``cfg.batch_size`` by length, so
    each batch pads little (a short prompt batched with a long one waits through the long one's prefill and attends
    over its padding). ``progress(n)``: n more user turns are answered (or dropped with their conversation, when a
    prompt grows past ``cfg.max_prompt_length``).
    """
    stop = [tokenizer.eos_token_id] + list(_as_list(model.generation_config.eos_token_id))
    stop = sorted({t for t in stop if t is not None})
    if not stop:
        raise ValueError("neither the tokenizer nor the model's generation config names an EOS token: "
                         "replies would never end; expected a chat model's tokenizer")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample, eos_token_id=stop,
                           pad_token_id=pad, bos_token_id=None,
                           **({"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}  # top_k=0: off
                              if cfg.do_sample else {}))
    progress = progress or (lambda n: None)
    users = [[m["content"] for m in conv if m["role"] == "user"] for conv in conversations]
    new = [[m] if m["role"] == "system" else [] for m in (conv[0] for conv in conversations)]
    active = [True] * len(conversations)
    for turn in range(max((len(u) for u in users), default=0)):
        pending = []  # (conversation index, prompt ids)
        for i, conv_users in enumerate(users):
            if not active[i] or turn >= len(conv_users):
                continue
            text = tokenizer.apply_chat_template(new[i] + [{"role": "user", "content": conv_users[turn]}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > cfg.max_prompt_length:
                active[i] = False
                progress(len(conv_users) - turn)  # this turn and the later ones are never answered
                continue
            pending.append((i, ids))
        pending.sort(key=lambda item: len(item[1]))  # stable: equal lengths keep the conversations' order
        for start in range(0, len(pending), cfg.batch_size):
            chunk = pending[start : start + cfg.batch_size]
            for (i, _), reply in zip(chunk, _generate(model, tokenizer, [ids for _, ids in chunk], gen)):
                new[i] += [{"role": "user", "content": users[i][turn]}, {"role": "assistant", "content": reply}]
            progress(len(chunk))
    return new


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _shard_dir(out: Path, index: int) -> Path:
    return out / "shards" / f"shard-{index:05d}"


def _check_manifest(out: Path, manifest: dict) -> None:
    path = out / "distill.json"
    if path.exists():
        found = json.loads(path.read_text())
        if found != manifest:
            changed = sorted(k for k in manifest.keys() | found.keys() if manifest.get(k) != found.get(k))
            raise ValueError(f"{out} holds a distillation run with other settings ({changed} differ): "
                             f"expected {manifest}, found {found}; use a new --out or the same settings to resume")
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)


def distill(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: DataConfig, out: str | Path,
    cfg: DistillConfig = DistillConfig(), max_shards: int | None = None, model_name: str | None = None,
    revision: str | None = None,
) -> Path | None:
    """Regenerate the conversations of ``data`` (source, split, max_conversations, MT-bench exclusion) into ``out``.

    Returns ``out`` once the dataset is complete, or None when it stopped after ``max_shards`` new shards (run again
    with the same arguments to resume). A finished ``out`` is returned as is.
    """
    out = Path(out)
    if (out / "state.json").exists():
        return out
    conversations = load_conversations(data)
    if "messages" not in conversations.column_names:
        raise ValueError(f"{data.source!r} has a plain 'text' column: distillation needs conversations "
                         "(a 'messages' or 'conversations' column)")
    n_shards = -(-len(conversations) // cfg.shard_size)
    source = {k: getattr(data, k) for k in ("source", "split", "max_conversations", "exclude_questions")}
    manifest = {"model": model_name or model.config.name_or_path, "source": source,
                "conversations": len(conversations), "config": dataclasses.asdict(cfg)}
    dtype = next(model.parameters()).dtype
    # recorded where they differ from what every earlier run used (the Hub's main, fp32): those runs stay resumable
    manifest.update({k: v for k, v in (("revision", revision),
                                       ("dtype", None if dtype == torch.float32 else str(dtype))) if v})
    _check_manifest(out, manifest)
    done = [s for s in range(n_shards) if _shard_dir(out, s).exists()]
    written = 0
    turns = [sum(m["role"] == "user" for m in conv) for conv in conversations["messages"]]  # replies to write
    bar = tqdm(total=sum(turns), initial=sum(sum(turns[k * cfg.shard_size : (k + 1) * cfg.shard_size]) for k in done),
               desc="distilling", unit="reply")  # over replies, not conversations: one-turn conversations finish first
    for s in range(n_shards):
        if _shard_dir(out, s).exists():
            continue
        if max_shards is not None and written >= max_shards:
            bar.close()
            log.info("stopped after %d new shards; %d of %d done", written, len(done) + written, n_shards)
            return None
        lo, hi = s * cfg.shard_size, min((s + 1) * cfg.shard_size, len(conversations))
        torch.manual_seed(cfg.seed + s)  # per shard: a resumed run samples what an uninterrupted one would
        messages = regenerate(model, tokenizer, conversations[lo:hi]["messages"], cfg, progress=bar.update)
        shard = datasets.Dataset.from_dict({"messages": messages, "source_index": list(range(lo, hi))},
                                           features=_OUT_FEATURES)
        _shard_dir(out, s).parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=_shard_dir(out, s).parent, prefix=".tmp-") as tmp:
            shard.save_to_disk(Path(tmp) / "shard")
            os.replace(Path(tmp) / "shard", _shard_dir(out, s))  # atomic: a half-written shard is never skipped
        written += 1
    bar.close()
    return _finalise(out, n_shards)


_OUT_FEATURES = datasets.Features({**MESSAGES_FEATURES, "source_index": datasets.Value("int64")})


def _finalise(out: Path, n_shards: int) -> Path:
    """Concatenate the shards into ``out`` itself; state.json, moved in last, marks the dataset complete."""
    full = datasets.concatenate_datasets([datasets.load_from_disk(str(_shard_dir(out, s))) for s in range(n_shards)])
    with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-") as tmp:
        full.save_to_disk(Path(tmp) / "final")
        files = sorted(Path(tmp, "final").iterdir(), key=lambda p: p.name == "state.json")
        for f in files:
            os.replace(f, out / f.name)
    shutil.rmtree(out / "shards")
    return out
