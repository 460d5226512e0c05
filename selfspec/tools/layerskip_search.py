"""Which layers to skip: a greedy search that maximises measured tokens per second through the real decoding loop.

Start from skipping nothing; each round tries adding every remaining candidate layer (or a random ``per_round`` of
them, SWIFT-style) and keeps the one whose skip set decodes the calibration prompts fastest. Skipping few layers makes
drafts right but nearly as slow as the target; skipping many makes them cheap but wrong; the search stops after
``patience`` rounds without a new best and returns the fastest set seen. Each trial decodes the calibration prompts
greedily with ``LayerSkipDrafter``; plain decoding through the same loop is measured once for reference.

Calibrate on prompts of your own (``CALIBRATION_PROMPTS``), not on the evaluation set.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from selfspec.core import hf
from selfspec.core.drafter import Drafter, NoDrafter
from selfspec.core.generate import generate
from selfspec.drafts.layerskip import LayerSkipConfig, LayerSkipDrafter, check_stop_below
from selfspec.core.target import Target
from selfspec.core.text_stream import Rates

CALIBRATION_PROMPTS = (
    "Explain how a refrigerator keeps food cold, in a few short paragraphs.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Give examples.",
    "Give me five tips for preparing for a job interview.",
    "Summarise the causes of the French Revolution for a high-school student.",
    "Write a polite email asking a colleague to review a document by Friday.",
    "How do vaccines train the immune system?",
    "Plan a three-day trip to a city known for its museums, with a schedule for each day.",
)
"""Generic chat requests (written for this project, in the style of ShareGPT) for calibrating drafters."""


def calibration_inputs(tokenizer: PreTrainedTokenizerBase, n: int = 4,
                       texts: Sequence[str | list[dict[str, str]]] = CALIBRATION_PROMPTS) -> list[torch.Tensor]:
    """The first n of ``texts`` (default: the built-in calibration prompts; a text, or a chat's messages ending with
    the user turn to answer) as token ids [T], through the chat template when the tokenizer has one."""
    if not 1 <= n <= len(texts):
        raise ValueError(f"the number of calibration prompts must be in 1..{len(texts)} (the prompts there are), "
                         f"found {n}")
    out = []
    for text in texts[:n]:
        chat = text if isinstance(text, list) else [{"role": "user", "content": text}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        elif isinstance(text, list):
            raise ValueError("a calibration prompt given as chat messages needs a tokenizer with a chat template; "
                             f"{type(tokenizer).__name__} has none: give plain-text prompts")
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


@dataclass(frozen=True)
class Measurement(Rates):
    new_tokens: int
    seconds: float
    steps: int
    """target forwards (the prefill included)."""


def measure(target: Target, drafter: Drafter, prompts: Sequence[torch.Tensor], max_new_tokens: int) -> Measurement:
    """Greedy decoding of every prompt through the loop; wall time of the decoding only."""
    tokens = steps = 0
    seconds = 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        out = generate(target, drafter, prompt, max_new_tokens)
        seconds += time.perf_counter() - t0
        tokens, steps = tokens + len(out.tokens), steps + len(out.steps)
    return Measurement(new_tokens=tokens, seconds=seconds, steps=steps)


@dataclass(frozen=True)
class SearchResult:
    skip_layers: tuple[int, ...]
    """the fastest skip set found."""
    best: Measurement
    plain: Measurement
    """plain decoding (no draft) through the same loop, on the same prompts."""
    trials: tuple[tuple[tuple[int, ...], Measurement], ...]
    """every skip set tried, in order, with its measurement."""

    def config(self, base_model: str, num_hidden_layers: int, draft_depth: int, stop_below: float = 0.0) -> LayerSkipConfig:
        """The checkpoint config of the result (``.save(directory)`` writes it)."""
        measured = {
            "tokens_per_s": self.best.tokens_per_s, "mean_accepted": self.best.mean_accepted,
            "plain_tokens_per_s": self.plain.tokens_per_s, "speedup": self.best.tokens_per_s / self.plain.tokens_per_s,
            "new_tokens": self.best.new_tokens, "trials": len(self.trials),
        }
        return LayerSkipConfig(base_model=base_model, num_hidden_layers=num_hidden_layers, skip_layers=self.skip_layers,
                               draft_depth=draft_depth, stop_below=stop_below, measured=measured)


Score = Callable[[tuple[int, ...]], Measurement]


def search_skip_layers(
    target: Target,
    prompts: Sequence[torch.Tensor],
    *,
    depth: int = 4,
    stop_below: float = 0.0,
    max_new_tokens: int = 64,
    candidates: Sequence[int] | None = None,
    max_skip: int | None = None,
    per_round: int | None = None,
    patience: int = 1,
    seed: int = 0,
    score: Score | None = None,
    progress: bool = False,
) -> SearchResult:
    """Greedy forward search for the skip set with the most tokens per second.

    candidates: the layers that may be skipped (default: all). max_skip: the largest set tried (default: all but one
    layer). per_round: try only this many random candidates per round (default: all). score: measures a skip set
    (default: ``measure`` with a ``LayerSkipDrafter`` of ``depth`` / ``stop_below`` on ``prompts``); tests pass their own.
    progress: a progress bar of the trials (stderr), with the best skip set so far.
    """
    num_layers = len(hf.decoder_layers(target.model))
    pool = sorted({int(i) for i in (range(num_layers) if candidates is None else candidates)})
    bad = [i for i in pool if not 0 <= i < num_layers]
    if bad or not pool:
        raise ValueError(f"candidate layers must be a non-empty subset of 0..{num_layers - 1}, found {list(candidates or [])}")
    max_skip = min(num_layers - 1, len(pool)) if max_skip is None else max_skip
    if not 1 <= max_skip <= min(num_layers - 1, len(pool)):
        raise ValueError(f"max_skip must be in 1..{min(num_layers - 1, len(pool))} (layers - 1, candidates), found {max_skip}")
    if patience < 1 or (per_round is not None and per_round < 1) or not prompts:
        raise ValueError(f"expected patience >= 1, per_round >= 1 and at least one prompt; found {patience}, {per_round}, "
                         f"{len(prompts)} prompts")
    check_stop_below(stop_below)
    if score is None:
        def score(skip: tuple[int, ...]) -> Measurement:
            return measure(target, LayerSkipDrafter(target, skip, depth=depth, stop_below=stop_below), prompts, max_new_tokens)

    generate(target, NoDrafter(), prompts[0], 2)  # warm-up: first-call costs stay out of every measurement
    plain = measure(target, NoDrafter(), prompts, max_new_tokens)
    rng = random.Random(seed)
    trials: list[tuple[tuple[int, ...], Measurement]] = []
    current: tuple[int, ...] = ()
    best: tuple[tuple[int, ...], Measurement] | None = None
    stale = 0
    bar = tqdm(desc="search-skip", unit="trial", disable=not progress, leave=False)
    while len(current) < max_skip:
        options = [i for i in pool if i not in current]
        if per_round is not None and len(options) > per_round:
            options = sorted(rng.sample(options, per_round))
        measured = []
        for skip in (tuple(sorted(current + (i,))) for i in options):
            measured.append((skip, score(skip)))
            bar.update()
        trials.extend(measured)
        current, fastest = max(measured, key=lambda t: t[1].tokens_per_s)  # first fastest on ties
        if best is None or fastest.tokens_per_s > best[1].tokens_per_s:
            best, stale = (current, fastest), 0
            bar.set_postfix_str(f"best skip {list(current)}: {fastest.tokens_per_s / plain.tokens_per_s:.2f}x plain")
        else:
            stale += 1
            if stale >= patience:
                break
    bar.close()
    assert best is not None  # max_skip >= 1: at least one round ran
    return SearchResult(skip_layers=best[0], best=best[1], plain=plain, trials=tuple(trials))
