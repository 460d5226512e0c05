"""The speculative decoding loop, batch size 1 (a batch of sequences: selfspec/core/batch.py, the same steps per row).

    prompt ─ 1. prefill ─▶ root token x0 (the target's own)
    loop:    2. draft      drafter.draft(state)            → tree of N candidates rooted at the last token
             3. verify     target.verify(tree)             → logits [N, V], hidden [N, D]   (one forward)
             4. accept     greedy / lossless sampling      → accepted path + bonus token (each node's scores
                                                               processed for its own text: a logit bias, the
                                                               repetition / presence / frequency penalties, the
                                                               end-of-sequence block of min_new_tokens); greedy on
                                                               unprocessed scores runs the LM head itself, on the
                                                               nodes it needs (head_rows)
             5. commit     cache keeps root + accepted path, drops the rest
             6. update     drafter.update(draft, acceptance)
             7. emit       accepted drafts + bonus, cut at EOS, a stop string and max_new_tokens (where plain
                                                               decoding stops); their log-probabilities if asked

Shapes: T tokens so far, N tree nodes, V vocabulary, D hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from selfspec.core.accept import Acceptance, greedy_accept, sample_accept, typical_accept
from selfspec.core.drafter import Draft, Drafter, DraftState, LayerStates
from selfspec.core.head_rows import greedy_from_hidden
from selfspec.core.logprobs import TokenLogprob, token_logprobs
from selfspec.core.request import AcceptRule, Decoding, GenerationOptions, as_decoding, check_max_new_tokens
from selfspec.core.sampling import Sampling, next_token, path_scores, process_logits, unprocessed
from selfspec.core.stopping import Criterion, first_stop
from selfspec.core.target import Target

T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    tokens: tuple[int, ...]
    """the tokens this step adds to the output (accepted drafts, then the target's bonus token)."""
    tree_size: int
    """nodes verified this step (0 for the prefill)."""
    verify_s: float
    """seconds in the target's forward."""
    other_s: float
    """seconds in the rest of the step (drafting, acceptance, cache commit)."""
    draft_s: float = 0.0
    """seconds of ``other_s`` in the drafter's ``draft`` (0 for the prefill)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """the target's log-probability of each of ``tokens`` (and its likeliest alternatives), when asked for."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """the prefill's step, when asked for: the log-probability of each prompt token after the first."""


@dataclass
class Output:
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    @property
    def accept_lengths(self) -> list[int]:
        """Tokens gained per target forward (Spec-Bench's ``accept_lengths``; the prefill counts as one)."""
        return [len(s.tokens) for s in self.steps]

    @property
    def mean_accepted(self) -> float:
        lengths = self.accept_lengths
        return sum(lengths) / max(len(lengths), 1)

    @property
    def seconds(self) -> float:
        return sum(s.verify_s + s.other_s for s in self.steps)


def check_request(target: Target, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """Refuse requests plain decoding could not serve either, saying what was expected and what was found (the options
    alone were checked when they were made: ``GenerationOptions``)."""
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"this loop decodes one sequence (batch size 1); found batch size {input_ids.shape[0]}: "
                             "decode a batch with selfspec.core.batch (generate_batch), one Job per sequence")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"expected input_ids of shape [T] or [1, T], found {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: expected at least one token")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"expected token ids (an integer tensor), found {input_ids.dtype}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= target.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside this model's vocabulary (0..{target.vocab_size - 1})")
    check_max_new_tokens(max_new_tokens)
    t = input_ids.numel()
    if t >= target.max_length:
        raise ValueError(f"the prompt has {t} tokens; this model's context holds {target.max_length}: shorten the prompt")
    if t + max_new_tokens > target.max_length:
        raise ValueError(
            f"prompt ({t} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {target.max_length}; "
            f"use max_new_tokens <= {target.max_length - t}"
        )
    if target.window_limit is not None and t + max_new_tokens >= target.window_limit:
        room = target.window_limit - t - 1
        raise ValueError(
            f"prompt + max_new_tokens = {t + max_new_tokens} reaches this model's local attention window "
            f"({target.window_limit}), which a tree's mask cannot express for this architecture: tree verification "
            "beyond the window is not supported for it; "
            + (f"use max_new_tokens <= {room}" if room >= 1 else "shorten the prompt")
        )


def stream(target: Target, drafter: Drafter, input_ids: torch.Tensor, decoding: Decoding | int | None = None,
           **keywords: Any) -> Iterator[Step]:
    """Yield each step's new tokens as soon as the target has accepted them. input_ids [T] or [1, T].

    decoding: the request bound to this model (``selfspec.core.request.Decoding``: its options, end-of-sequence
    tokens, stopping criteria, logits processors, generator and acceptance rule); or max_new_tokens, with any of
    ``Decoding.of``'s keywords (``stream(target, drafter, ids, 64, sampling=Sampling(temperature=0.7), logprobs=3)``).
    Stopping criteria are checked after every new token as ``generate`` checks them; end-of-sequence tokens are blocked
    until min_new_tokens are out; logprobs = k: each step also carries the target's log-probability of each new token
    and its k likeliest alternatives (``selfspec.core.logprobs``); prompt_logprobs = k: the prefill's step carries the
    same for every prompt token after the first."""
    d = as_decoding(decoding, keywords)
    o, sampling, eos = d.options, d.sampling, d.eos
    check_request(target, input_ids, o.max_new_tokens)
    prompt = input_ids.reshape(-1).to(target.device)
    cache = target.new_cache()
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    head = target.plain_head() if sampling.greedy and unprocessed(sampling, d.processors) else None  # for head_rows

    # 1. prefill: the prompt in one causal forward; the target's own first token becomes the root
    t0 = time.perf_counter()
    pre = target.prefill(prompt, cache, every_logit=o.prompt_logprobs is not None)
    root = root_token(pre.logits[-1:], prompt, d)
    sync()
    tokens = torch.cat([prompt, prompt.new_tensor([root])])  # [T]
    hidden, new_hidden = pre.hidden[-1], pre.hidden  # [D], [T, D]
    new_states = None if pre.states is None else LayerStates.of(pre.states)  # every layer, every prompt position
    yield prefill_step(pre, prompt, root, o, time.perf_counter() - t0)
    produced = 1
    if produced >= o.max_new_tokens or first_stop(d.stopping_criteria, tokens, 1, set(eos), new=[root]) is not None:
        return

    while True:
        t_step = time.perf_counter()
        start = tokens.shape[0] - 1  # cache length: everything but the root
        # 2. draft a tree rooted at the last token; never deeper than the tokens still wanted or the context allows
        state = DraftState(tokens=tokens, prompt_length=prompt.shape[0], hidden=hidden, cache=cache, sampling=sampling,
                           new_hidden=new_hidden, new_states=new_states, generator=d.generator)
        proposed, draft_s = timed(sync, drafter.draft, state)
        draft = fit_draft(proposed, target, start, o.max_new_tokens - produced - 1)

        # 3. verify every node in one forward of the target (greedy on unprocessed scores: without the LM head)
        rows = head is not None and produced >= d.min_new_tokens
        out, verify_s = timed(sync, target.verify, draft.tree, draft.tokens, cache, not rows)

        # 4. accept: the longest path the target agrees with, plus the target's own next token (each node's scores
        #    processed for the text before it: penalties, a logit bias, no EOS while it is shorter than min_new_tokens;
        #    or, greedy on unprocessed scores, the LM head run on the nodes the path needs)
        if rows:
            acc, path_logits = greedy_from_hidden(draft.tree, draft.tokens, out.hidden, *head)  # [P, V]
        else:
            acc = judge(draft, out.logits, tokens, prompt.shape[0], produced, d)
            path_logits = out.logits[list(acc.path)]  # [P, V]

        # 5. commit: the cache keeps the root and the accepted drafts, in order
        target.commit(cache, start, acc.path)

        # 6. let the drafter learn what was kept
        drafter.update(draft, acc)

        # 7. emit, stopping exactly where plain decoding would: at EOS, a stop string, or max_new_tokens
        tokens, new, stop = extend(tokens, draft, acc, o.max_new_tokens - produced, d.stopping_criteria, eos)
        produced += len(new)
        hidden, new_hidden = out.hidden[acc.path[-1]], out.hidden[list(acc.path)]  # [D], [A, D]
        new_states = None if out.states is None else LayerStates.of(out.states, list(acc.path))
        # new[j] follows path node j (the bonus follows the last): its log-probability is that node's, unprocessed
        yield Step(tokens=tuple(new), tree_size=len(draft.tree), verify_s=verify_s,
                   other_s=time.perf_counter() - t_step - verify_s, draft_s=draft_s,
                   logprobs=scored(path_logits[: len(new)], tokens[-len(new):], o.logprobs))
        if stop is not None or produced >= o.max_new_tokens:
            return


def prefill_step(pre: Any, prompt: torch.Tensor, root: int, options: GenerationOptions, seconds: float) -> Step:
    """Step 1's output: the root token, the prefill's ``seconds``, and the log-probabilities ``options`` ask for
    (the root's from the prefill's last logits, the prompt's from the others)."""
    return Step(tokens=(root,), tree_size=0, verify_s=seconds, other_s=0.0,
                logprobs=scored(pre.logits[-1:], prompt.new_tensor([root]), options.logprobs),
                prompt_logprobs=scored(pre.logits[:-1], prompt[1:], options.prompt_logprobs))


def root_token(logits: torch.Tensor, prompt: torch.Tensor, d: Decoding) -> int:
    """The first new token, from the prefill's logits [1, V] after the prompt [T]: processed as ``generate`` processes
    them (no end-of-sequence token if min_new_tokens > 0), then the argmax or a draw."""
    last = path_scores(logits, d.sampling, prompt, prompt.shape[0], eos=d.eos, processors=d.processors,
                       short=eos_blocked(0, torch.zeros(1, dtype=torch.long), d.min_new_tokens))  # [1, V]
    return next_token(last[0], d.sampling, d.generator)


def judge(draft: Draft, logits: torch.Tensor, tokens: torch.Tensor, prompt_length: int, produced: int,
          d: Decoding) -> Acceptance:
    """Step 4 for one sequence: the target's logits [N, V] at each node of ``draft`` (rooted at tokens[-1], after
    ``produced`` new tokens) processed for each node's own text (penalties, a logit bias, no EOS while shorter than
    min_new_tokens), then the acceptance rule."""
    short = eos_blocked(produced, draft.tree.on(logits.device).depth, d.min_new_tokens)  # [N] or None
    scores = path_scores(logits, d.sampling, tokens, prompt_length, draft.tree, draft.tokens, short=short, eos=d.eos,
                         processors=d.processors)  # [N, V]
    return accept(draft, scores, d.sampling, d.accept_rule, d.generator)


def extend(tokens: torch.Tensor, draft: Draft, acc: Acceptance, room: int, criteria: Sequence[Criterion],
           eos: list[int]) -> tuple[torch.Tensor, list[int], int | None]:
    """Step 7 for one sequence: tokens [T] with the accepted drafts and the bonus token, no more than ``room``, cut
    after the first EOS or stop string -> (tokens [T + len(new)], new, where it stopped in new or None)."""
    drafts = acc.drafts if acc.drafts is not None else draft.tokens[list(acc.path[1:])].tolist()  # read with the path
    new = (list(drafts) + [acc.bonus])[:room]
    tokens = torch.cat([tokens, tokens.new_tensor(new)])
    stop = first_stop(criteria, tokens, len(new), set(eos), new=new)
    if stop is not None:
        tokens, new = tokens[: tokens.shape[0] - len(new) + stop + 1], new[: stop + 1]
    return tokens, new, stop


def eos_blocked(produced: int, depths: torch.Tensor, min_new_tokens: int) -> torch.Tensor | None:
    """[N] bool: the nodes (at ``depths`` [N] below a root that follows ``produced`` new tokens) from which no
    end-of-sequence token may follow yet (``min_new_tokens``); None when no node is held back."""
    return None if produced >= min_new_tokens else produced + depths < min_new_tokens


def timed(sync: Callable[[], None], fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took, the device synchronised (``sync``) before the clock stops."""
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - t0


def scored(logits: torch.Tensor, tokens: torch.Tensor, k: int | None) -> tuple[TokenLogprob, ...]:
    """The log-probabilities of ``tokens`` [n] under ``logits`` [n, V] with their k likeliest alternatives, or ()
    when none are asked for (k None)."""
    return () if k is None else tuple(token_logprobs(logits, tokens, k))


def fit_draft(draft: Draft, target: Target, start: int, wanted: int) -> Draft:
    """``draft`` cut to what this step may verify: no deeper than the ``wanted`` tokens still to come beyond the bonus
    or the context's room after the ``start`` cached tokens; inside a local attention window the mask cannot express
    (GPT-Neo's local layers count a node by its index), the whole tree stays inside it (``check_request`` guarantees
    that the root alone does)."""
    draft = draft.truncated(min(wanted, target.max_length - start - 1))
    while target.window_limit is not None and start + len(draft.tree) > target.window_limit - 1:
        draft = draft.truncated(draft.tree.depth - 1)
    return draft


def accept(draft: Draft, logits: torch.Tensor, sampling: Sampling, rule: AcceptRule,
           generator: torch.Generator | None) -> Acceptance:
    """The acceptance rule of a step, on the processed scores [N, V]: greedy (exact), lossless tree rejection sampling
    (``exact``, with the draft's q where it has one) or typical acceptance."""
    if sampling.greedy:
        return greedy_accept(draft.tree, draft.tokens, logits)
    p_target = process_logits(logits, sampling)  # [N, V]
    if rule == "exact":
        return sample_accept(draft.tree, draft.tokens, p_target, draft.q, generator)
    return typical_accept(draft.tree, draft.tokens, p_target, generator=generator)


def generate(target: Target, drafter: Drafter, input_ids: torch.Tensor, decoding: Decoding | int | None = None,
             **keywords: Any) -> Output:
    """Run ``stream`` to the end (the same arguments); Output.tokens holds the new tokens only."""
    t = input_ids.reshape(-1).shape[0]
    out = Output(prompt_length=t)
    for step in stream(target, drafter, input_ids, decoding, **keywords):
        out.steps.append(step)
        out.tokens.extend(step.tokens)
    return out
