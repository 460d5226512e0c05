"""A tiny random Llama chat model with a real byte-level BPE tokenizer and a ChatML template, saved to a directory.

Built offline in about a second: the tokenizer is trained on a few sentences (bytes + ~60 merges), so multi-byte
characters ("é", "→") take several tokens, which is what incremental text decoding has to handle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "café naïve résumé → arrows and more words",
    "write a short story about the sea and the moon",
    "Hello, how are you today? I am fine, thank you.",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=256 + len(specials) + 60, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(path: Path, seed: int = 0) -> Path:
    """Save a tiny random Llama (hidden 64, 2 layers) and its tokenizer to ``path``; returns ``path``."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
        initializer_range=0.2,  # larger than the default so the random model says varied things
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_heads(model_dir: Path, path: Path, num_heads: int = 2) -> Path:
    """Untrained (zero-initialised) Medusa heads for the model in ``model_dir``, saved as a checkpoint at ``path``."""
    from heads.medusa.config import MedusaConfig
    from heads.medusa.model import MedusaHeads, save_heads

    model = LlamaForCausalLM.from_pretrained(model_dir)
    config = MedusaConfig.for_model(model, num_heads=num_heads, num_layers=1)
    return save_heads(MedusaHeads(config, model.get_output_embeddings()), path)


def one_thread():
    """Generator for a module-scoped fixture: torch on one thread while the module runs, then as before.

    Tiny models gain nothing from a second thread, and on a shared 2-core machine two spinning threads per process
    made these tests ~15x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def spanning_stop(tokenizer, tokens: list[int], start: int) -> str:
    """Two letters of one token and two of the next (from token ``start`` on), seen nowhere before them in the text."""
    pieces = [tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in tokens]
    for k in range(start, len(tokens) - 1):
        a, b = pieces[k], pieces[k + 1]
        stop = a[-2:] + b[:2]
        seen = "".join(pieces[: k + 1]) + b[0]  # the text before the stop's last character
        if len(a) >= 2 and len(b) >= 2 and stop.isalpha() and stop.isascii() and stop not in seen:
            return stop
    raise AssertionError("no stop string spanning two tokens in this answer")


def build_draft_model(model_dir: Path, path: Path, num_layers: int = 1) -> Path:
    """A separate draft model for the model in ``model_dir``: its first ``num_layers`` layers (same tokenizer), saved as
    an ordinary model directory at ``path`` (what ``--draft model:DIR`` loads)."""
    from transformers import AutoTokenizer

    model = LlamaForCausalLM.from_pretrained(model_dir)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path
