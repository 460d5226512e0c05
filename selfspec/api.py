"""The Python API: load a target and a draft in one call, then ``generate`` or ``stream``.

    import selfspec.api as ss
    m = ss.load("smollm2-135m-instruct", draft="ngram")
    out = m.generate("Write a haiku about the sea.", max_new_tokens=64)
    print(out.text, out.stats)
    for piece in m.stream("And one about the mountains."):
        print(piece, end="", flush=True)

A request's options are one object, ``GenerationOptions`` (re-exported here), as transformers' ``GenerationConfig``:
``m.generate(prompt, GenerationOptions(max_new_tokens=64, temperature=0.7))``, or its fields as keywords
(``m.generate(prompt, max_new_tokens=64)``), or both (the keywords replace the object's fields). They mirror
transformers' ``generate``: ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``stop`` (its ``stop_strings``), ``min_new_tokens``, and OpenAI's ``presence_penalty``,
``frequency_penalty`` and ``logit_bias``; ``seed`` makes a sampled run repeatable;
``logprobs=k`` / ``prompt_logprobs=k`` add the target's log-probability of every new (prompt) token and its k likeliest
alternatives (``selfspec.core.logprobs``).
``generate_plain`` runs the same request through ``model.generate`` (plain decoding, or a transformers peer such as
``prompt_lookup_num_tokens=10``) and reports the same statistics. What they hand back (``Result``, ``Stats``,
``TextStream``, ``IncrementalDecoder``, ``StepCounter``) is defined in ``selfspec.core.text_stream`` and importable from
here.
"""

from __future__ import annotations

import contextlib
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from selfspec import registry
from selfspec.base_check import check_drafts

from selfspec.core import processors
from selfspec.core.batch import Job, stream_batch
from selfspec.core.drafter import Drafter, fork, verifier_for
from selfspec.core.generate import check_request, stream as spec_stream
from selfspec.core.logprobs import TokenLogprob, token_logprobs
from selfspec.core.models import DEFAULT_MODEL, load_model
from selfspec.core.request import Decoding, GenerationOptions, options_from, split_options
from selfspec.core.sampling import PresencePenalty
from selfspec.core.stopping import first_stop, stop_strings
from selfspec.core.target import Target
from selfspec.core.text_stream import (  # noqa: F401 - IncrementalDecoder: re-exported, the API's own name
    BatchStream, IncrementalDecoder, Result, Stats, StepCounter, TextStream)
from selfspec.core.tree import DynamicTree, Tree

Prompt = str | Sequence[dict[str, str]] | Sequence[int] | torch.Tensor
"""text (the chat template is applied when chat=True), a list of chat messages, or token ids."""


def is_batch(prompt: Any) -> bool:
    """A list of prompts (texts, chats, token id lists or tensors), or token ids [B, T] with B > 1, rather than one."""
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2 and prompt.shape[0] != 1
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt)


UNAPPLIED = {"top_h": None, "watermarking_config": None, "remove_invalid_values": False, "renormalize_logits": False}
"""logits processors a generation config may ask for that selfspec does not apply, with their neutral values (the
others: ``selfspec.core.sampling``, ``selfspec.core.stopping`` and ``selfspec.core.processors``)."""


def unapplied_processors(generation_config: Any) -> dict[str, Any]:
    """The settings of ``generation_config`` that model.generate would apply and selfspec does not."""
    found = {k: getattr(generation_config, k, None) for k in UNAPPLIED}
    return {k: v for k, v in found.items() if v is not None and v != UNAPPLIED[k] and v != []}


class SpecModel:
    """A target model, its tokenizer and a drafter; decoding is always lossless (exact acceptance)."""

    def __init__(self, target: Target, tokenizer: PreTrainedTokenizerBase, drafter: Drafter, name: str = "",
                 repetition_penalty: float | None = None, tree: Tree | DynamicTree | None = None,
                 max_batch: int | None = 8):
        """repetition_penalty: what ``stream`` / ``generate`` / ``generate_plain`` apply unless told otherwise; None
        takes the model's generation config's, as ``model.generate`` does. tree: the tree the drafter was built with
        (``load``: the --tree, 'auto' as resolved on this machine), None for the draft's own. max_batch: the most
        prompts of a list that decode together (the rest wait and join as others finish; None: all at once)."""
        self.max_batch = max_batch
        # the drafter's own verifier where it has one (early exit: reuses the early layers' work from drafting)
        self.target, self.tokenizer, self.drafter, self.name = verifier_for(drafter, target), tokenizer, drafter, name
        self.tree = tree
        self.model: PreTrainedModel = target.model
        model = target.model
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_token_id: list[int] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # the checkpoint's own repetition penalty, as model.generate applies it (Qwen2.5's instruct models: 1.05)
        own = float(model.generation_config.repetition_penalty or 1.0)
        self.repetition_penalty = own if repetition_penalty is None else repetition_penalty
        # and its stop strings and minimum lengths, as model.generate applies them
        gen = model.generation_config
        strings = getattr(gen, "stop_strings", None)
        self.stop_strings: tuple[str, ...] = (strings,) if isinstance(strings, str) else tuple(strings or ())
        self.min_new_tokens, self.min_length = int(gen.min_new_tokens or 0), int(gen.min_length or 0)
        # stop strings -> their criterion (building one scans the whole vocabulary: cached per set of stop strings)
        self._criteria: dict[tuple[str, ...], list] = {}
        unapplied = unapplied_processors(model.generation_config)
        if unapplied:
            warnings.warn(f"the generation config of {name or 'this model'} asks for "
                          f"{', '.join(f'{k}={v!r}' for k, v in unapplied.items())}, which selfspec does not apply: "
                          "its output can differ from model.generate's", stacklevel=2)

    # ---------------------------------------------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: bool = True) -> torch.Tensor:
        """-> long [T] on the target's device. Token ids: a list of ints, or an integer tensor [T] or [1, T] (one
        sequence: ``generate`` and ``stream`` take a list of prompts, or [B, T], as a batch). Text that UTF-8 cannot
        hold (bytes that were not UTF-8, read with surrogateescape) is a ValueError naming the byte and its offset
        (``unicode_problem``), not the tokenizer's own message."""
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.dtype == torch.bool or prompt.is_complex():
                raise TypeError(f"expected token ids (an integer tensor), found a {prompt.dtype} tensor")
            if prompt.dim() == 2 and prompt.shape[0] != 1:
                raise ValueError(f"encode takes one prompt; found a batch of {prompt.shape[0]} prompts "
                                 f"{tuple(prompt.shape)}: encode each row (generate and stream take the batch whole)")
            if prompt.dim() not in (1, 2):
                raise ValueError(f"expected token ids of shape [T] or [1, T], found {tuple(prompt.shape)}")
            return prompt.reshape(-1).to(self.target.device, torch.long)
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict)):
            return torch.tensor(self._encode_text(prompt, chat), dtype=torch.long, device=self.target.device)
        items = list(prompt) if isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, dict)) \
            else None
        wrong = [i for i in items or () if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
        if items is None or wrong:  # ints, numpy's included; not bytes (its ints are not token ids), floats or bools
            found = f"{wrong[0]!r} ({type(wrong[0]).__name__}) among its items" if wrong else \
                f"{type(prompt).__name__} {prompt!r:.60}"
            raise TypeError(f"expected a prompt as text (str), chat messages (a list of {{'role', 'content'}} dicts) "
                            f"or token ids (a list of ints, or a tensor), found {found}")
        return torch.tensor([int(i) for i in items], dtype=torch.long, device=self.target.device)

    def _encode_text(self, prompt: str | Sequence[dict[str, str]], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            check_unicode(prompt, "the prompt")
        if isinstance(prompt, str) and not chat:
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, str):
            check_message(prompt)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.name or 'this model'} has no chat template (a base model?): "
                             "feed the prompt as plain text (infer.py --no-chat; chat=False in Python) or as token ids")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        for n, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {n}: expected {{'role': str, 'content': str}}, found {m!r:.80}")
            check_unicode(m["content"], f"message {n}'s content")
            check_unicode(m["role"], f"message {n}'s role")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # --------------------------------------------------------------------------------------------------- decoding
    def _request(self, prompt: Prompt, options: GenerationOptions) -> "_Request":
        """What one request decodes with: the options' None fields take the generation config's value, as
        ``model.generate`` does; what depends on this model (the logit bias's token ids) is checked here."""
        ids = self.encode(prompt, options.chat)
        if any(k >= self.target.vocab_size for k, _ in options.logit_bias):
            raise ValueError(f"logit_bias names token {max(k for k, _ in options.logit_bias)}; this model's vocabulary "
                             f"has {self.target.vocab_size} (0..{self.target.vocab_size - 1})")
        o = options.replace(**self._defaults(options, ids.shape[0]))
        for s in o.stop:
            check_unicode(s, "a stop string")
        if o.stop not in self._criteria:
            if len(self._criteria) >= 16:  # a server's clients may each send their own: keep the latest few
                self._criteria.pop(next(iter(self._criteria)))
            self._criteria[o.stop] = stop_strings(self.tokenizer, o.stop)
        generator = None if o.seed is None else torch.Generator(device=self.target.device).manual_seed(o.seed)
        # the generation config's other processors (no_repeat_ngram_size, bad_words_ids, ...), as generate builds them
        procs = processors.from_config(self.model.generation_config, ids.shape[0], o.max_new_tokens,
                                       self.eos_token_id, self.target.device)
        return _Request(ids, Decoding(o, eos_token_id=tuple(self.eos_token_id), stopping_criteria=self._criteria[o.stop],
                                      processors=procs, generator=generator))

    def _defaults(self, o: GenerationOptions, prompt_length: int) -> dict[str, Any]:
        """The options ``o`` leaves to the model (None), as this model's generation config sets them: its repetition
        penalty, sampling warpers (which generate applies alongside the call's settings), stop strings and minimum
        length (min_new_tokens, and min_length, which counts the prompt)."""
        gen = self.model.generation_config
        model = dict(repetition_penalty=self.repetition_penalty, typical_p=float(gen.typical_p or 1.0),
                     epsilon_cutoff=float(gen.epsilon_cutoff or 0.0), eta_cutoff=float(gen.eta_cutoff or 0.0),
                     stop=self.stop_strings, min_new_tokens=max(self.min_new_tokens, self.min_length - prompt_length))
        return {k: v for k, v in model.items() if getattr(o, k) is None}

    def _steps(self, r: "_Request") -> Iterator:
        return spec_stream(self.target, self.drafter, r.ids, r.decoding)

    def stream(self, prompt: Prompt, options: GenerationOptions | None = None,
               **overrides: Any) -> TextStream | BatchStream:
        """Text pieces as they are accepted; the returned TextStream holds .text, .tokens and .stats afterwards.

        ``options`` (``selfspec.core.request.GenerationOptions``; None: its defaults), with any of its fields given
        as keywords on top: ``m.stream(prompt, max_new_tokens=64, temperature=0.7)``. As ``model.generate``:
        temperature (0 = greedy), top_p, top_k, min_p sample; repetition_penalty (1.0 is off), stop (stop strings:
        decoding ends after the token that completes one, which stays in the output; [] for none) and min_new_tokens
        (no end-of-sequence token before that many) default, when None, to the model's generation config's (its
        repetition_penalty, stop_strings, min_new_tokens and min_length). presence_penalty and frequency_penalty
        (OpenAI's: on the answer's tokens) and logit_bias ({token id: bias}) as OpenAI applies them;
        ``generate_plain`` applies the same through transformers. logprobs = k: the stream's ``logprobs`` holds the
        target's log-probability of each new token and its k likeliest alternatives (prompt_logprobs = k:
        ``prompt_logprobs`` the same for the prompt's tokens after the first); None: none.
        A list of prompts (``is_batch``) decodes as a batch: a ``BatchStream`` of (prompt index, text piece), its
        ``streams[i]`` one TextStream per prompt."""
        o = options_from(options, overrides)
        if is_batch(prompt):
            return BatchStream(self._batch_steps([self._request(p, o) for p in prompt]), len(prompt), self.tokenizer)
        return TextStream(self._steps(self._request(prompt, o)), self.tokenizer)

    def generate(self, prompt: Prompt, options: GenerationOptions | None = None,
                 **overrides: Any) -> Result | list[Result]:
        """Generate to the end; the text is decoded once, after timing stops. Arguments as ``stream``; a list of
        prompts decodes as a batch (at most ``max_batch`` at once) -> one Result per prompt, each with its own
        statistics (its seconds: from the batch's start to its own end)."""
        o = options_from(options, overrides)
        if is_batch(prompt):
            requests = [self._request(p, o) for p in prompt]
            parts = [_Collected() for _ in requests]
            t0 = time.perf_counter()
            for i, step, _ in self._batch_steps(requests):
                parts[i].add(step, time.perf_counter() - t0)
            return [part.result(self.decode, o) for part in parts]
        r = self._request(prompt, o)
        part = _Collected()
        t0 = time.perf_counter()
        for step in self._steps(r):
            part.add(step)
        part.seconds = time.perf_counter() - t0
        return part.result(self.decode, o)

    def _batch_steps(self, requests: list["_Request"]) -> Iterator[tuple[int, Any, bool]]:
        """(prompt index, Step, done) of ``requests`` decoded together, each with a drafter of its own; one at a time
        where the drafter cannot batch (it runs the target's layers on its cache)."""
        if not self.drafter.batchable:
            for i, r in enumerate(requests):
                last = None
                for step in self._steps(r):
                    if last is not None:
                        yield i, last, False
                    last = step
                yield i, last, True
            return
        yield from stream_batch(self.target, [self._job(r) for r in requests], self.max_batch)

    def job(self, prompt: Prompt, options: GenerationOptions | None = None, **overrides: Any) -> Job:
        """One request as a sequence of a batch (``selfspec.core.batch.Job``: what ``Batch.add`` takes), with a copy
        of the drafter of its own; arguments as ``stream``'s for one prompt."""
        return self._job(self._request(prompt, options_from(options, overrides)))

    def _job(self, r: "_Request") -> Job:
        """Request ``r`` as one sequence of a batch, with a copy of the drafter of its own (weights shared)."""
        return Job(r.ids, fork(self.drafter), r.decoding)

    @torch.inference_mode()
    def generate_plain(self, prompt: Prompt, options: GenerationOptions | None = None,
                       **kwargs: Any) -> Result | list[Result]:
        """The same request through transformers' ``model.generate``: ``options`` and keyword overrides of its fields
        as ``stream`` takes them; other keywords (e.g. prompt_lookup_num_tokens=10) go to ``model.generate``.
        accept_lengths are the tokens each of its steps added, as its streamer sees them; logprobs from its
        ``output_logits``, prompt_logprobs from a forward over the prompt (outside the timing). A list of prompts
        (``is_batch``) goes to ``model.generate`` as one left-padded batch -> one Result per prompt (``_plain_batch``)."""
        overrides, hf_kwargs = split_options(kwargs)
        o = options_from(options, overrides)
        if is_batch(prompt):
            return self._plain_batch([self._request(p, o) for p in prompt], hf_kwargs)
        r = self._request(prompt, o)
        check_request(self.target, r.ids, o.max_new_tokens)  # as stream
        ids = r.ids[None]  # [1, T]
        counter = StepCounter()
        out, seconds = self._hf_generate(r, ids, torch.ones_like(ids),
                                         {**self._plain_kwargs(r), **hf_kwargs, "streamer": counter})
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        lps = None if o.logprobs is None else token_logprobs(torch.cat(out.logits), out.sequences[0, ids.shape[1]:],
                                                             o.logprobs)
        prompt_lps = None
        if o.prompt_logprobs is not None:
            prompt_lps = token_logprobs(self.model(ids).logits[0, :-1], ids[0, 1:], o.prompt_logprobs)
        return Result(text=self.decode(tokens), tokens=tokens,
                      stats=Stats(new_tokens=len(tokens), seconds=seconds, accept_lengths=tuple(counter.lengths)),
                      logprobs=lps, prompt_logprobs=prompt_lps)

    def _hf_generate(self, r: "_Request", ids: torch.Tensor, mask: torch.Tensor,
                     kwargs: dict[str, Any]) -> tuple[Any, float]:
        """``model.generate`` on ids [B, T] with request ``r``'s settings -> (its output, seconds). min-p, the stop
        strings and the minimum length as selfspec decodes with them are set on the generation config for the call:
        generate takes an argument of None (min_p=0, stop=[]) as "unset" and falls back to the config's; min_length
        None, not 0 (min_new_tokens already counts it): a min_length beside min_new_tokens makes it warn."""
        d, o = r.decoding, r.decoding.options
        with _set(self.model.generation_config, min_p=(o.min_p or None) if o.sampled else None,
                  stop_strings=list(o.stop or ()) or None, min_length=None, min_new_tokens=d.min_new_tokens or None):
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=mask, output_logits=o.logprobs is not None,
                                      return_dict_in_generate=True, **kwargs)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    def _plain_batch(self, requests: list["_Request"], hf_kwargs: dict[str, Any]) -> list[Result]:
        """``requests`` (the same options) through ``model.generate`` as one batch, left-padded with the pad token and
        masked: transformers' static batching, the peer of ``generate``'s batch (every row waits for the batch's
        longest; a seeded sampled batch draws from one generator, so its rows are not those of one-at-a-time runs).
        Each row's answer ends where plain decoding of it alone would (its first end-of-sequence token or stop string,
        ``first_stop``; what follows is padding); every row's seconds are the batch's."""
        first, o = requests[0], requests[0].decoding.options
        for r in requests:
            check_request(self.target, r.ids, o.max_new_tokens)
        least = {r.decoding.min_new_tokens for r in requests}
        if len(least) > 1:  # only the generation config's min_length does this
            raise ValueError(f"the prompts need different min_new_tokens ({sorted(least)}"
                             ", from the generation config's min_length): one padded batch takes one; decode them "
                             "one at a time, or give min_new_tokens")
        kwargs = {**self._plain_kwargs(first), **hf_kwargs}
        pad = kwargs["pad_token_id"]
        if pad is None:
            raise ValueError(f"{self.name or 'this model'} has no pad or end-of-sequence token to pad a batch with: "
                             "set model.generation_config.pad_token_id")
        width = max(r.ids.shape[0] for r in requests)
        ids = torch.full((len(requests), width), pad, dtype=torch.long, device=self.target.device)  # [B, T]
        mask = torch.zeros_like(ids)
        for b, r in enumerate(requests):  # left padding: every row's next token at the same column
            ids[b, width - r.ids.shape[0]:], mask[b, width - r.ids.shape[0]:] = r.ids, 1
        if o.presence_penalty or o.frequency_penalty:  # the answer starts after the padded prompt in every row
            kwargs["logits_processor"] = LogitsProcessorList(
                [PresencePenalty(width, o.presence_penalty, o.frequency_penalty)])
        out, seconds = self._hf_generate(first, ids, mask, kwargs)
        new = out.sequences[:, width:]  # [B, N]
        eos = set(self.eos_token_id or ())
        results = []
        for b, r in enumerate(requests):
            end = first_stop(first.decoding.stopping_criteria, torch.cat([r.ids, new[b]]), new.shape[1], eos)
            tokens = new[b, : new.shape[1] if end is None else end + 1].tolist()
            lps = prompt_lps = None
            if o.logprobs is not None:
                lps = token_logprobs(torch.stack([step[b] for step in out.logits[: len(tokens)]]),
                                     new[b, : len(tokens)], o.logprobs)
            if o.prompt_logprobs is not None:
                prompt_lps = token_logprobs(self.model(r.ids[None]).logits[0, :-1], r.ids[1:], o.prompt_logprobs)
            results.append(Result(text=self.decode(tokens), tokens=tokens,
                                  stats=Stats(new_tokens=len(tokens), seconds=seconds,
                                              accept_lengths=(1,) * len(tokens)),
                                  logprobs=lps, prompt_logprobs=prompt_lps))
        return results

    def _plain_kwargs(self, r: "_Request") -> dict[str, Any]:
        """``model.generate``'s arguments for request ``r`` (seeding torch's global generator when it samples with a
        seed, as plain decoding draws from it)."""
        o, sampling = r.decoding.options, r.decoding.sampling
        kwargs: dict[str, Any] = dict(do_sample=o.sampled, max_new_tokens=o.max_new_tokens,
                                      repetition_penalty=sampling.repetition_penalty)
        if o.sampled:  # the warpers: this request's, else the generation config's (as generate would read them)
            kwargs.update(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, typical_p=o.typical_p,
                          epsilon_cutoff=o.epsilon_cutoff, eta_cutoff=o.eta_cutoff)
            if o.seed is not None:
                torch.manual_seed(o.seed)
        else:  # neutralise any sampling defaults of the checkpoint's generation_config
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if o.stop:
            kwargs["tokenizer"] = self.tokenizer
        if sampling.logit_bias:  # transformers' one-token sequence biases are a logit bias
            kwargs["sequence_bias"] = {(k,): v for k, v in sampling.logit_bias}
        if o.presence_penalty or o.frequency_penalty:
            kwargs["logits_processor"] = LogitsProcessorList(
                [PresencePenalty(r.ids.shape[0], o.presence_penalty, o.frequency_penalty)])
        if self.eos_token_id:  # the stop tokens selfspec uses (the tokenizer's where the generation config has none)
            kwargs["eos_token_id"] = self.eos_token_id
        pad = self.model.generation_config.pad_token_id
        kwargs["pad_token_id"] = pad if pad is not None else (self.eos_token_id or [None])[0]
        return kwargs

    def decode(self, tokens: list[int]) -> str:
        """Token ids -> text, as answers are decoded (special tokens skipped)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@contextlib.contextmanager
def _set(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of a block, then put the old values back."""
    old = {k: getattr(obj, k) for k in values}
    try:
        for k, v in values.items():
            setattr(obj, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def unicode_problem(text: str) -> str | None:
    """None if ``text`` can be written as UTF-8, else what is wrong with it: expected vs found, and where.

    Python reads command-line arguments (and stdin, as infer.py's chat reads it) with errors='surrogateescape': a byte
    that is not UTF-8 arrives as a lone surrogate U+DC80..U+DCFF, named here as that byte at its offset in the bytes
    given. Any other lone surrogate (a JSON string may escape one, as \\ud800) is named by its character index."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as err:
        i = err.start
    after = f" (after {text[max(0, i - 20):i]!r})" if i else ""
    if 0xDC80 <= ord(text[i]) <= 0xDCFF:  # a byte surrogateescape stood in for; the text before it is clean
        offset = len(text[:i].encode("utf-8", "surrogateescape"))
        return (f"expected UTF-8 text, found the byte 0x{ord(text[i]) - 0xDC00:02x} at byte {offset}{after}, which is "
                "not UTF-8: give the text as UTF-8")
    return f"expected Unicode text, found a lone surrogate {text[i]!r} at character {i}{after}, which no UTF-8 text holds"


def check_unicode(text: str, where: str) -> str:
    """``text`` if it can be written as UTF-8 (what a tokenizer reads), else a one-line ValueError naming ``where``
    and the first byte or character that cannot (``unicode_problem``)."""
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return text


def check_message(text: str) -> None:
    """Refuse an empty or blank user message given as the prompt: the chat template would still wrap it into a prompt
    of its own, and it would be answered."""
    if not text.strip():
        raise ValueError(f"the prompt is empty: expected a message with text, found {text!r}")


class _Collected:
    """One answer's steps gathered into a Result."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.prompt_lps: list[TokenLogprob] = []
        self.drafting = self.seconds = 0.0

    def add(self, step: Any, seconds: float | None = None) -> None:
        """One step of the loop; ``seconds``: the time since the decoding began (a batch's), when known."""
        self.drafting += step.draft_s
        self.tokens.extend(step.tokens)
        self.lengths.append(len(step.tokens))
        self.lps.extend(step.logprobs)
        self.prompt_lps.extend(step.prompt_logprobs)
        if seconds is not None:
            self.seconds = seconds

    def result(self, decode: Any, o: GenerationOptions) -> Result:
        return Result(text=decode(self.tokens), tokens=self.tokens,
                      stats=Stats(new_tokens=len(self.tokens), seconds=self.seconds,
                                  accept_lengths=tuple(self.lengths), draft_seconds=self.drafting),
                      logprobs=None if o.logprobs is None else self.lps,
                      prompt_logprobs=None if o.prompt_logprobs is None else self.prompt_lps)


@dataclass(frozen=True)
class _Request:
    ids: torch.Tensor
    """long [T]: the prompt."""
    decoding: Decoding
    """its options with this model's defaults filled in, and what the model makes of them."""


def load(model: str = DEFAULT_MODEL, draft: str = "ngram", dtype: str | torch.dtype = "float32",
         tree: str | Tree | None = None, device: str = "cpu", revision: str | None = None,
         draft_revision: str | None = None, allow_other_base: bool = False,
         trust_remote_code: bool = False, compile: bool = False) -> SpecModel:
    """Target + tokenizer + drafter in one call. The draft and the tree are checked against the target's config
    before any weights are loaded (a draft for another base model fails here, fast). trust_remote_code: let a model
    that ships its own Python code run it (off: such a model is refused). compile: compile the target's forward
    (``selfspec.core.compiled``; ``generate_plain`` runs the same compiled forward)."""
    spec = registry.parse_draft(draft, draft_revision, tree)  # a bad draft or tree fails before any loading
    check_drafts(model, [spec], revision, allow_other_base, trust_remote_code)
    hf_model, tokenizer = load_model(model, dtype=dtype, revision=revision, device=device,
                                     trust_remote_code=trust_remote_code, compile=compile)
    target = Target(hf_model)
    resolved = registry.resolve_tree(spec.tree, spec, target, model)  # 'auto': the tree tuned for this machine
    return SpecModel(target, tokenizer, registry.build(spec, target, model, resolved), name=model, tree=resolved)
