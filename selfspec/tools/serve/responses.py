"""OpenAI's response objects for one request: the whole answer (``complete``) or its stream chunks (``chunks``),
with their ids, usage (``usage.selfspec``: how the answer was decoded) and log-probabilities in OpenAI's two formats
(chat's ``content`` list, the completions API's parallel lists)."""

from __future__ import annotations

import itertools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from selfspec.tools.serve.protocol import Request
from selfspec.tools.serve.session import Gone, Scored, Session, never


def _envelope(session: Session, chat: bool) -> dict:
    """The fields every response object of one answer shares (a new id per answer)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": session.name}


def _logprobs(session: Session, r: Request, tokens: tuple[Scored, ...] | list[Scored]) -> dict | None:
    """OpenAI's logprobs object for these tokens: chat's ``content`` list, or the completions API's parallel lists
    (whose ``top_logprobs`` hold the k likeliest tokens and the chosen one, as OpenAI's do)."""
    if r.logprobs is None:
        return None
    text = session.token_text
    if r.chat:
        def entry(token: int, logprob: float) -> dict:
            return {"token": text(token), "logprob": logprob, "bytes": session.token_bytes(token)}

        return {"content": [{**entry(s.token, s.logprob.logprob),
                             "top_logprobs": [entry(i, v) for i, v in s.logprob.top]}
                            for s in tokens if s.logprob is not None], "refusal": None}
    return {"tokens": [text(s.token) for s in tokens],
            "token_logprobs": [None if s.logprob is None else s.logprob.logprob for s in tokens],
            "top_logprobs": [None if s.logprob is None else
                             {**{text(i): v for i, v in s.logprob.top}, text(s.token): s.logprob.logprob}
                             for s in tokens],
            "text_offset": [s.offset for s in tokens]}


def _usage(finals: list[dict], n: int = 1) -> dict:
    """One request's usage: its answers' added up (one answer: its own), each prompt counted once, as OpenAI counts
    it, however many (n) answers it has (answer i answers prompt i // n)."""
    if len(finals) == 1:
        return finals[0]["usage"]
    prompt = sum(f["usage"]["prompt_tokens"] for f in finals[::n])
    new = sum(f["usage"]["completion_tokens"] for f in finals)
    usage = {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}
    steps = sum(f["usage"]["selfspec"]["steps"] for f in finals)
    seconds = sum(f["usage"]["selfspec"]["seconds"] for f in finals)
    usage["selfspec"] = {"steps": steps, "mean_accepted_tokens": round(new / max(steps, 1), 4),
                         "seconds": round(seconds, 4), "tokens_per_s": round(new / seconds, 2) if seconds else 0.0}
    return usage


def complete(session: Session, r: Request, gone: Gone = never) -> dict:
    """The whole answer (n choices per prompt) as one OpenAI response object; with a batching session its choices
    decode together. ``gone``: whether the client went away (every choice then stops at its next step, and
    ClientGone is raised)."""
    choices, finals = [], []
    count = len(r.prompts) * r.n
    if session.batcher is not None and count > 1:  # every choice decodes at once, in the running batch
        with ThreadPoolExecutor(max_workers=count) as pool:
            answers = list(pool.map(lambda index: list(session.pieces(r, index, gone)), range(count)))
    else:
        answers = [list(session.pieces(r, index, gone)) for index in range(count)]
    for index, pieces in enumerate(answers):
        parts, tokens, final = [], [], {}
        for piece in pieces:
            parts.append(piece.text)
            tokens.extend(piece.tokens)
            final = piece.end or final
        text = "".join(parts)
        choice: dict[str, Any] = {"index": index, "finish_reason": final["finish_reason"],
                                  "logprobs": _logprobs(session, r, tokens)}
        choice.update({"message": {"role": "assistant", "content": text}} if r.chat else {"text": text})
        choices.append(choice)
        finals.append(final)
    return {**_envelope(session, r.chat), "choices": choices, "usage": _usage(finals, r.n)}


def chunks(session: Session, r: Request, include_usage: bool = False, gone: Gone = never) -> Iterator[dict]:
    """The answer as OpenAI stream chunks (the first carries the role, the last of each choice its finish reason);
    ClientGone once ``gone()``."""
    kind = "chat.completion.chunk" if r.chat else "text_completion"
    head = {**_envelope(session, r.chat), "object": kind}

    def chunk(index: int, text: str | None, finish: str | None, tokens: tuple[Scored, ...] = (),
              role: bool = False) -> dict:
        lps = _logprobs(session, r, tokens) if tokens else None
        if r.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}]}
        return {**head, "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": lps}]}

    finals = []
    for index in range(len(r.prompts) * r.n):
        pieces = session.pieces(r, index, gone)
        try:
            first = next(pieces)  # the request's own errors (an empty or too long prompt) come before the first chunk
            if r.chat:
                yield chunk(index, None, None, role=True)
            for piece in itertools.chain([first], pieces):
                if piece.end is None:
                    yield chunk(index, piece.text, None, piece.tokens)
                else:
                    yield chunk(index, None, piece.end["finish_reason"])
                    finals.append(piece.end)
        finally:
            pieces.close()  # a client that went away: decoding stops here and the next request's turn comes
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(finals, r.n)}
