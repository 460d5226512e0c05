"""What an OpenAI request body asks for: its fields checked, one by one, into a ``Request`` (prompts and the
``GenerationOptions`` each answer decodes with), or a ``RequestError`` (HTTP 400) that names the field at fault and
says what was expected and what was found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfspec.api import unicode_problem
from selfspec.core.logprobs import MAX_TOP
from selfspec.core.request import GenerationOptions

CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "seed", "stop", "stream", "stream_options", "repetition_penalty", "min_tokens", "n", "logprobs",
               "top_logprobs", "frequency_penalty", "presence_penalty", "user", "logit_bias", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"}
COMPLETION_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                    "response_format", "parallel_tool_calls"}) | {"prompt", "echo", "suffix"}
NEUTRAL = {"tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
           "parallel_tool_calls": (None, False, True), "suffix": (None, "")}
"""fields selfspec cannot honour, with the values that ask for nothing (accepted, as clients send them by default)."""


class RequestError(ValueError):
    """A request the server refuses (HTTP 400, or ``status``: 404 for a model it does not serve), with the field at
    fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def check_text(text: str, where: str) -> str:
    """``text`` if it is Unicode text a tokenizer can read; a JSON string may escape a lone surrogate (\\ud800), which
    no UTF-8 text holds (a client that read bytes that were not UTF-8 with errors="surrogateescape" sends them so):
    refused as the Python API refuses them (``selfspec.api.unicode_problem``)."""
    problem = unicode_problem(text)
    if problem is not None:
        raise RequestError(f"'{where}': {problem}", where.split("[")[0].split(".")[0])
    return text


@dataclass(frozen=True)
class Request:
    """A validated request: the prompts, and the options ``SpecModel.stream`` decodes each answer with."""

    prompts: tuple[Any, ...]
    """chat messages (one), or texts / token-id lists fed without the chat template (one choice each)."""
    stream: bool
    max_new_tokens: int | None
    """None: the server's default, capped to the room the context leaves after the prompt."""
    options: GenerationOptions
    """temperature, top_p, top_k, min_p, seed, penalties, logit bias, min_new_tokens, stop (None: the model's own),
    logprobs and chat; its max_new_tokens is set per answer (``max_new_tokens`` above, or the room the context
    leaves)."""
    stops: tuple[str, ...]
    """the stop strings, cut from the answer's text."""
    echo: bool = False
    """a completion's text and log-probabilities start with the prompt's."""
    n: int = 1
    """answers per prompt (choice i answers prompt i // n; with a seed, answer j of a prompt samples with seed + j)."""

    @property
    def chat(self) -> bool:
        """a chat completion (the chat template applied), else a text completion."""
        return self.options.chat

    @property
    def logprobs(self) -> int | None:
        """report each answer token's log-probability with this many alternatives (None: none)."""
        return self.options.logprobs


def _number(body: dict, key: str, kind: type, default: Any, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (kind is float or float(value).is_integer())
    if not ok:
        raise RequestError(f"'{key}': expected {'an integer' if kind is int else 'a number'}, found {value!r}", key)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        expected = f"a value in [{low}, {high}]" if high is not None else f"a value >= {low}"
        raise RequestError(f"'{key}': expected {expected}, found {value}", key)
    return value


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""the message roles OpenAI's chat API takes; the model's chat template decides what each becomes."""


def chat_messages(body: dict) -> list[dict[str, str]]:
    """A body's ``messages``: {role, content} objects, content parts joined (text parts only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages': expected a non-empty list of {role, content} objects, found "
                           f"{messages!r:.80}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"'messages[{i}]': expected an object with 'role' and 'content', found {m!r:.80}",
                               "messages")
        if m["role"] not in ROLES:
            raise RequestError(f"'messages[{i}].role': expected one of {', '.join(ROLES)} (OpenAI's), found "
                               f"{m['role']!r:.40}", "messages")
        content = m["content"]
        if isinstance(content, list):  # content parts: text only
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                raise RequestError(f"'messages[{i}].content': only text parts are supported, found "
                                   f"{sorted(map(str, kinds))}", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(f"'messages[{i}].content': expected a string, found {content!r:.80}", "messages")
        out.append({"role": m["role"], "content": check_text(content, f"messages[{i}].content")})
    return out


def parse_request(body: Any, chat: bool, default_temperature: float = 0.0) -> Request:
    """A JSON body -> Request; raises RequestError naming the field at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"expected a JSON object, found {type(body).__name__}")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)} (this endpoint takes "
                           f"{', '.join(sorted(known))})", unknown[0])
    for key, neutral in NEUTRAL.items():
        if key in body and key in known and body[key] not in neutral:
            raise RequestError(f"'{key}': selfspec serves text without tools, structured output or suffixes; expected "
                               f"{neutral[0]!r}, found {body[key]!r:.80}", key)
    if chat:
        prompts: tuple[Any, ...] = (chat_messages(body),)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise RequestError("'top_logprobs': needs 'logprobs': true", "top_logprobs")
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise RequestError(f"'logprobs': expected true or false, found {body['logprobs']!r:.80}", "logprobs")
        logprobs = _number(body, "top_logprobs", int, 0, 0, MAX_TOP) if body.get("logprobs") else None
    else:
        prompts = _prompts(body.get("prompt"))
        logprobs = _number(body, "logprobs", int, None, 0, MAX_TOP)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f"'echo': expected true or false, found {echo!r:.80}", "echo")
    stop = body.get("stop")
    stops = tuple(stop) if isinstance(stop, list) else () if stop is None else (stop,)  # a wrong type fails below
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop': expected a non-empty string or a list of them, found {stop!r:.80}", "stop")
    for i, s in enumerate(stops):
        check_text(s, f"stop[{i}]" if isinstance(stop, list) else "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream': expected true or false, found {stream!r}", "stream")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    decoding: dict[str, Any] = dict(
        temperature=_number(body, "temperature", float, default_temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", int, 0, -1),
        min_p=_number(body, "min_p", float, 0.0, 0.0, 1.0),
        seed=_number(body, "seed", int, None, -2**63, 2**63 - 1),  # what torch's generators take
        repetition_penalty=_number(body, "repetition_penalty", float, None, 0.0),
        min_new_tokens=_number(body, "min_tokens", int, None, 0),
        presence_penalty=_number(body, "presence_penalty", float, 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        stop=list(stops) if stop is not None else None,  # none given: the model's own (its generation config's)
    )
    if decoding["top_k"] < 0:  # vLLM's "-1 = off"
        decoding["top_k"] = 0
    if decoding["top_p"] == 0.0:
        raise RequestError("'top_p': expected a value in (0, 1], found 0.0", "top_p")
    options = GenerationOptions(chat=chat, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                                **decoding)
    return Request(prompts=prompts, stream=stream, options=options, stops=stops,
                   max_new_tokens=_number(body, key, int, None, 1), echo=echo,
                   n=_number(body, "n", int, 1, 1, 128))


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]}."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(f"'logit_bias': expected an object mapping token ids to biases, found {bias!r:.80}",
                           "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(value, bool) or \
                not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"'logit_bias': expected token ids (as strings) mapped to biases in [-100, 100], found "
                               f"{key!r}: {value!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _prompts(prompt: Any) -> tuple[Any, ...]:
    """A completion's ``prompt`` as OpenAI takes it: text, token ids, or a non-empty list of either."""
    def one(p: Any) -> bool:
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in p))

    if one(prompt):
        return (check_text(prompt, "prompt") if isinstance(prompt, str) else prompt,)
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return tuple(check_text(p, f"prompt[{i}]") if isinstance(p, str) else p for i, p in enumerate(prompt))
    raise RequestError("'prompt': expected a string, a list of token ids, or a non-empty list of either, found "
                       f"{prompt!r:.80}", "prompt")

