"""What a decoding hands back through the Python API (``selfspec.api``): the text as the target accepts it, piece by
piece (``TextStream`` over the loop's steps, ``IncrementalDecoder`` holding back a piece that ends inside a character),
and then the whole answer (``Result``) with its statistics (``Stats``: new tokens, wall time, tokens gained per step;
``StepCounter`` records them for transformers' ``generate``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from selfspec.core.logprobs import TokenLogprob


class Rates:
    """Tokens per second and tokens per target forward, for anything with ``new_tokens``, ``seconds`` and ``steps``
    (target forwards, the prefill included)."""

    new_tokens: int
    seconds: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(self.steps, 1)


@dataclass(frozen=True)
class Stats(Rates):
    new_tokens: int
    seconds: float
    """wall time of the decoding (prefill included, tokenisation and text decoding excluded)."""
    accept_lengths: tuple[int, ...]
    """tokens gained per target forward (the prefill counts as one); they sum to new_tokens."""
    draft_seconds: float | None = None
    """of ``seconds``, the time in the drafter's ``draft`` (None: not measured, e.g. transformers' generate)."""

    @property
    def draft_ms_per_step(self) -> float | None:
        """Drafting time per drafting step (the prefill drafts nothing), in milliseconds; None when not measured."""
        if self.draft_seconds is None:
            return None
        return 1000 * self.draft_seconds / max(self.steps - 1, 1)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    def __str__(self) -> str:
        drafting = "" if self.draft_seconds is None or self.steps < 2 else \
            f", {self.draft_ms_per_step:.1f} ms drafting per step"
        return (f"{self.new_tokens} new tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tokens/s), "
                f"{self.steps} steps, {self.mean_accepted:.2f} mean accepted tokens per step{drafting}")


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    """the new tokens (EOS included when generation stopped at it)."""
    stats: Stats
    logprobs: list[TokenLogprob] | None = None
    """one per new token, when asked for (logprobs=k)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """one per prompt token after the first, when asked for (prompt_logprobs=k)."""


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces; holds back a piece that ends inside a multi-byte character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        text = self.decode()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # wait for the rest of the character (or for the text to settle)
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def flush(self) -> str:
        text = self.decode()
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece


class TextStream:
    """Iterate for text pieces as the target accepts them; afterwards ``.text``, ``.tokens`` and ``.stats``."""

    def __init__(self, steps: Iterator, tokenizer: PreTrainedTokenizerBase):
        self._steps, self._decoder = steps, IncrementalDecoder(tokenizer)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        """one per token of ``tokens``, when the stream was asked for them."""
        self.prompt_logprobs: list[TokenLogprob] = []
        self._lengths: list[int] = []
        self._seconds = self._draft_seconds = 0.0
        self.done = False

    def __iter__(self) -> Iterator[str]:
        while True:
            t0 = time.perf_counter()
            step = next(self._steps, None)
            self._seconds += time.perf_counter() - t0
            if step is None:
                break
            piece = self.push(step)
            if piece:
                yield piece
        piece = self.finish()
        if piece:
            yield piece

    def push(self, step) -> str:
        """Take one step of the loop (``selfspec.core.generate.Step``) -> the text it completes ('' while a character is
        unfinished). ``__iter__`` pushes its own steps; a batch (``BatchStream``) pushes each sequence's."""
        self.tokens.extend(step.tokens)
        self.logprobs.extend(step.logprobs)
        self.prompt_logprobs.extend(step.prompt_logprobs)
        self._lengths.append(len(step.tokens))
        self._draft_seconds += step.draft_s
        return self._decoder.push(step.tokens)

    def finish(self) -> str:
        """The end of the sequence -> the text held back, if any."""
        self.done = True
        return self._decoder.flush()

    def cancel(self) -> None:
        """Stop the decoding behind the stream (its client went away): the steps' iterator is closed."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    @property
    def text(self) -> str:
        return self._decoder.emitted

    @property
    def stats(self) -> Stats:
        """Statistics of what has been generated so far (all of it once the iteration is over)."""
        return Stats(new_tokens=len(self.tokens), seconds=self._seconds, accept_lengths=tuple(self._lengths),
                     draft_seconds=self._draft_seconds)


class BatchStream:
    """Iterate for (prompt index, text piece) as a batch's sequences are accepted (``SpecModel.stream`` of a list of
    prompts); ``streams[i]`` holds prompt i's ``text``, ``tokens`` and ``stats`` as they grow (its seconds: from the
    batch's start to its last step)."""

    def __init__(self, steps: Iterator, n: int, tokenizer: PreTrainedTokenizerBase):
        """steps: (prompt index, Step, whether that sequence is done), as ``selfspec.core.batch.stream_batch`` yields
        them."""
        self._steps = steps
        self.streams = [TextStream(iter(()), tokenizer) for _ in range(n)]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        t0 = time.perf_counter()
        for i, step, done in self._steps:
            stream = self.streams[i]
            piece = stream.push(step)
            stream._seconds = time.perf_counter() - t0
            if done:
                piece += stream.finish()
            if piece:
                yield i, piece

    def __len__(self) -> int:
        return len(self.streams)


class StepCounter(BaseStreamer):
    """A transformers streamer that records how many tokens each ``generate`` step added (the prompt is skipped)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.lengths.append(int(value.numel()))

    def end(self) -> None:
        return None
