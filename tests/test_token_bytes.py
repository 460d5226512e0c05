"""token_bytes: a token's own bytes, where its decoded text alone is U+FFFD (a piece of a split character)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.tools.token_bytes import byte_level_table, token_bytes, token_text
from tests.tiny_chat_model import build_tokenizer

TEXTS = ["café naïve → 😊", "😊😊 ok", "→→ résumé", "plain ascii"]


def test_byte_level_table_is_gpt2s_alphabet():
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table["!"] == ord("!") and table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["Ā"] == 0


def test_byte_level_tokens_join_into_the_text():
    """The tiny model's byte-level BPE splits "é", "→" and "😊" over several tokens; their bytes join into the text."""
    tok = build_tokenizer()
    split = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split += sum(tok.decode([i]) == "\ufffd" for i in ids)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    assert split >= 6  # the case this is for really occurs


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE with byte fallback: a few letters, "▁" for spaces, <0x00>..<0xFF>."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "c", "é", "▁a", "▁b"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_byte_fallback_tokens_are_their_bytes():
    tok = byte_fallback_tokenizer()
    ids = tok.encode("a😊 b é", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[1:5] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x8A>"]
    assert [token_bytes(tok, i) for i in ids[1:5]] == [b"\xf0", b"\x9f", b"\x98", b"\x8a"]
    assert tok.decode([ids[5]]) == "b"  # decoded alone, SentencePiece's "▁b" loses its space; what it adds keeps it
    assert token_text(tok, ids[5]) == " b" and token_bytes(tok, ids[5]) == b" b"
    assert token_text(tok, ids[-1]) == "é" and token_bytes(tok, ids[-1]) == "é".encode()
    # joined, the bytes are the text with the one leading space SentencePiece's decoder strips from a whole text
    assert b"".join(token_bytes(tok, i) for i in ids) == " a😊 b é".encode()


def test_whole_tokens_and_special_tokens_are_their_text():
    tok = build_tokenizer()
    for i in tok.encode("the quick brown fox", add_special_tokens=False):
        assert token_bytes(tok, i) == tok.decode([i]).encode()
    assert token_bytes(tok, tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
