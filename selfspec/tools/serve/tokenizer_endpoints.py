"""vLLM's tokenizer endpoints (``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``): what a client
such as lm-evaluation-harness (``tokenizer_backend=remote``) needs to tokenize as the server does."""

from __future__ import annotations

from typing import Any

from selfspec.tools.serve.protocol import RequestError, chat_messages, check_text
from selfspec.tools.serve.session import Session


def tokenize(session: Session, body: Any) -> dict:
    """vLLM's ``POST /tokenize``: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
    "add_generation_prompt": true} -> the token ids the model would read."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise RequestError("expected a JSON object with 'prompt' (text) or 'messages' (chat messages)")
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    session.check_model(body)
    flags = {k: body.get(k) for k in ("add_special_tokens", "add_generation_prompt")}
    for key, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"'{key}': expected true or false, found {value!r:.80}", key)
    tokenizer = session.model.tokenizer
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise RequestError(f"'prompt': expected a string, found {body['prompt']!r:.80}", "prompt")
        session.check_prompt_chars(check_text(body["prompt"], "prompt"), "prompt")
        special = flags["add_special_tokens"] is not False
        ids = tokenizer(body["prompt"], add_special_tokens=special).input_ids
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(f"the tokenizer of {session.name} has no chat template: send 'prompt'", "messages")
        messages = chat_messages(body)
        session.check_prompt_chars(messages, "messages")
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=flags["add_generation_prompt"] is not False)
        ids = tokenizer(text, add_special_tokens=bool(flags["add_special_tokens"])).input_ids
    return {"count": len(ids), "max_model_len": session.model.target.max_length, "tokens": ids, "token_strs": None}


def detokenize(session: Session, body: Any) -> dict:
    """vLLM's ``POST /detokenize``: {"tokens": [...]} -> {"prompt": their text} (special tokens kept)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    session.check_model(body)
    vocab = session.model.target.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise RequestError(f"'tokens': expected a list of token ids, found {tokens!r:.80}", "tokens")
    bad = [i for i in tokens if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"'tokens': token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": session.model.tokenizer.decode(tokens, clean_up_tokenization_spaces=False)}


def tokenizer_info(session: Session) -> dict:
    """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does (lm-evaluation-harness's
    ``tokenizer_backend=remote`` reads it)."""
    tokenizer = session.model.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": session.model.target.max_length}
