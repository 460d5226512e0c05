r"""The bytes a token stands for, even where they are not whole UTF-8 characters.

A byte-level BPE tokenizer (GPT-2's, SmolLM2's, Llama-3's, Qwen's) splits a character such as "😊" (4 bytes) over
several tokens, and a SentencePiece tokenizer with byte fallback spells a rare character as ``<0xF0>`` tokens. Decoded
alone, such a token is U+FFFD ("\ufffd"), whose UTF-8 bytes [239, 191, 189] say nothing about it; OpenAI's
log-probabilities carry a ``bytes`` field exactly so that a client can join the tokens of a split character again. This
module recovers the real bytes from the token's vocabulary entry:

    byte-level BPE       "ðŁ" -> b"\xf0\x9f"    (GPT-2's table maps each byte to a printable character)
    byte fallback        "<0xF0>" -> b"\xf0"
    anything else        its text, UTF-8 encoded

A token's text is what it adds to a text, read after a plain word: SentencePiece's "▁b" adds " b", though decoded
alone it is "b" (its decoder strips a text's leading space).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte. Printable
    Latin-1 bytes stand for themselves; the other 68 are moved to U+0100 onwards, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def _decoder_types(node: Any) -> set[str]:
    """Every decoder type named in a tokenizer.json "decoder" entry (Sequence decoders nest others)."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        return found.union(*(_decoder_types(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_decoder_types(v) for v in node))
    return set()


@functools.lru_cache(maxsize=8)
def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return "ByteLevel" in _decoder_types(json.loads(backend.to_str()).get("decoder"))


@functools.lru_cache(maxsize=8)
def _anchor(tokenizer: Any) -> tuple[int, str]:
    """A plain word's last token and its text: what a token is decoded after, so that SentencePiece's decoder does not
    strip the token's leading space as it strips a text's first."""
    token = tokenizer.encode("a", add_special_tokens=False)[-1]
    return token, tokenizer.decode([token], clean_up_tokenization_spaces=False)


def token_text(tokenizer: Any, token: int) -> str:
    """The text token id ``token`` adds to a text (U+FFFD for a piece of a split character; a special token: its
    name)."""
    anchor, before = _anchor(tokenizer)
    text = tokenizer.decode([anchor, token], clean_up_tokenization_spaces=False)
    if text.startswith(before):
        return text[len(before):]
    return tokenizer.decode([token], clean_up_tokenization_spaces=False)


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token id ``token`` adds to a text."""
    text = token_text(tokenizer, token)
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        table = byte_level_table()
        if _is_byte_level(tokenizer) and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return text.encode()
