"""The drafter interface: how any draft (heads, early exit, n-grams) plugs into the decoding loop.

In the spirit of transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``), extended to
trees: ``draft(state)`` proposes a tree of candidate tokens rooted at the target's last token, ``update(draft,
acceptance)`` hears what the target kept. The loop never asks which kind of drafter it has.

Shapes: T tokens so far, N tree nodes, V vocabulary, D hidden size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from transformers import Cache, PreTrainedTokenizerBase

from selfspec.core.accept import Acceptance
from selfspec.core.sampling import Sampling
from selfspec.core.target import Target
from selfspec.core.tree import Tree


@dataclass(frozen=True)
class LayerStates:
    """The target's hidden states at every layer for the positions committed since a drafter's last draft, gathered
    only when a drafter asks for some layers (``take``): nothing is copied for drafters that never read them.

    Each part is one forward's states (transformers' ``hidden_states``: L + 1 tensors [N, D], 0 the embeddings, i
    decoder layer i's output, L the final hidden state) and the rows of it that were committed (None: all, a prefill);
    parts are in text order (a merged draft's drafter that sat out steps gets several, ``+``)."""

    parts: tuple[tuple[tuple[torch.Tensor, ...], torch.Tensor | None], ...]

    @classmethod
    def of(cls, states: tuple[torch.Tensor, ...], rows: list[int] | None = None) -> "LayerStates":
        index = None if rows is None else torch.tensor(rows, device=states[0].device)
        return cls(parts=((states, index),))

    def take(self, layers: list[int]) -> torch.Tensor:
        """[A, len(layers) x D]: the states of ``layers`` at the committed positions, concatenated per position."""
        chunks = []
        for states, rows in self.parts:
            picked = [states[i] if rows is None else states[i].index_select(0, rows) for i in layers]  # [A_part, D] each
            chunks.append(torch.cat(picked, dim=-1))
        return torch.cat(chunks)

    def __add__(self, other: "LayerStates") -> "LayerStates":
        return LayerStates(parts=self.parts + other.parts)


@dataclass(frozen=True)
class DraftState:
    tokens: torch.Tensor
    """[T] prompt and generated tokens; tokens[-1] is the root: the target's newest token, not yet in the cache."""
    prompt_length: int
    """how many of ``tokens`` are the prompt."""
    hidden: torch.Tensor
    """[D] the target's final hidden state at tokens[-2], the position whose logits gave the root."""
    cache: Cache
    """the target's cache (holds tokens[:-1]); self-speculative drafters may read it, never change its length."""
    sampling: Sampling
    new_hidden: torch.Tensor | None = None
    """[A, D] the target's final hidden states at the A positions committed since the previous draft, tokens[-1-A:-1]
    (the whole prompt at the first draft of a request; ``hidden`` is new_hidden[-1]): what a sequential draft head
    with its own cache (heads/eagle/drafter.py) extends it with. None when the caller does not track it."""
    new_states: LayerStates | None = None
    """the target's hidden states at every layer at the same A positions (``new_states.take(layers)`` [A, L·D]): what
    an EAGLE-3 head fuses. None when the caller or the verifier does not provide them."""
    generator: torch.Generator | None = None
    """the request's random generator (seeded sampling), for drafters that sample their drafts (a draft model drawing
    from its own q): one seed then reproduces the whole decode. None: torch's global generator."""

    @classmethod
    def after_prefill(cls, target: Target, prompt: torch.Tensor) -> "DraftState":
        """What a drafter sees at the first step of greedy decoding of ``prompt`` [T]: its last token the root, the
        rest prefilled into a new cache, every layer's states (for tools and tests that call a drafter directly)."""
        cache = target.new_cache()
        pre = target.prefill(prompt[:-1], cache)
        return cls(tokens=prompt, prompt_length=len(prompt), hidden=pre.hidden[-1], cache=cache, sampling=Sampling(),
                   new_hidden=pre.hidden, new_states=LayerStates.of(pre.states))

    @property
    def starts_request(self) -> bool:
        """The first draft of a request: new_hidden covers the whole text before the root (the prompt). False when
        the caller does not track new_hidden."""
        return self.new_hidden is not None and self.new_hidden.shape[0] == self.tokens.shape[0] - 1


@dataclass(frozen=True)
class Draft:
    tree: Tree
    tokens: torch.Tensor
    """[N] the token at each tree node; tokens[0] is the root."""
    q: torch.Tensor | None = None
    """[N, V] the distribution each node's token was drawn from (sampling only); None for deterministic drafts."""
    scores: torch.Tensor | None = None
    """[N] each node's cumulative draft log-probability (0 for the root), from drafters that grow their tree by score
    under a budget (EAGLE heads); what budget tuning (selfspec/tools/budget.py) reads. None otherwise."""
    copying: int = 0
    """prompt lookup: how many of the text's last tokens its first continuation matched earlier in the text (0: no
    match, or a drafter that does not copy): the longer the match, the likelier the copy goes on. What a merge's
    ``skip_match`` reads to rest a costlier drafter this step (selfspec/drafts/merge.py)."""

    def __post_init__(self) -> None:
        if self.tokens.shape != (len(self.tree),):
            raise ValueError(f"a draft needs one token per tree node ({len(self.tree)}), found {tuple(self.tokens.shape)}")
        if self.scores is not None and self.scores.shape != (len(self.tree),):
            raise ValueError(f"a draft's scores need one entry per tree node ({len(self.tree)}), found "
                             f"{tuple(self.scores.shape)}")

    def truncated(self, max_depth: int) -> "Draft":
        """The same draft without the nodes deeper than max_depth."""
        if self.tree.depth <= max_depth:
            return self
        return self._kept([i for i, d in enumerate(self.tree.depths) if d <= max_depth])

    def pruned(self, max_nodes: int) -> "Draft":
        """The same draft cut to its first ``max_nodes`` nodes (the root at least): a tree still, nodes being in
        topological order, and the drafter's likeliest first where it orders them so."""
        return self if len(self.tree) <= max_nodes else self._kept(list(range(max(1, max_nodes))))

    def _kept(self, keep: list[int]) -> "Draft":
        """The draft of nodes ``keep`` (ascending, closed under parents)."""
        new_index = {old: new for new, old in enumerate(keep)}
        tree = Tree(
            parents=tuple(new_index[self.tree.parents[i]] if i else -1 for i in keep),
            ranks=tuple(self.tree.ranks[i] for i in keep),
        )
        idx = torch.tensor(keep, dtype=torch.long)
        return Draft(tree=tree, tokens=self.tokens[idx], q=None if self.q is None else self.q[idx],
                     scores=None if self.scores is None else self.scores[idx], copying=self.copying)


@runtime_checkable
class Drafter(Protocol):
    """What the loop asks of any draft. ``draft`` and ``update`` are required; ``verifier``, ``resized`` and
    ``max_depth`` have defaults that a drafter subclassing this protocol inherits (every drafter in selfspec and heads
    does), and override where it can do more."""

    max_depth: int | None = None
    """the deepest tree the drafter can grow (Medusa heads: their number); None: no limit of its own."""

    batchable: bool = True
    """whether copies of it (``fork``) can draft for the sequences of a batch side by side: False for drafters that run
    the target's own layers on its cache (layer skipping, early exit), which holds a batch's rows; a batch of requests
    then decodes one sequence at a time."""

    def draft(self, state: DraftState) -> Draft:
        """Propose a tree of candidates rooted at state.tokens[-1]."""
        ...

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        """Hear which path of the last draft the target accepted (adapt tree size, advance own state)."""
        ...

    def verifier(self) -> Target | None:
        """The Target that verifies this drafter's drafts, when it is not the target decoding with it: early exit's
        reuses the early layers' work done while drafting. None (the default): the target itself."""
        return None

    def resized(self, depth: int, budget: int) -> "Drafter | None":
        """The same draft growing a tree of at most ``budget`` nodes, ``depth`` deep, by score each step (what
        ``infer.py tune-tree`` tries at every depth and budget), or None (the default) when its tree is not grown that
        way. ``depth`` is at most ``max_depth``."""
        return None


@dataclass(frozen=True)
class DraftKind:
    """What a kind of draft can do, declared once where the kind is defined (a ``KIND`` beside its drafter) and read
    by ``selfspec.registry`` from a ``--draft`` spec before any model loads: which trees it takes, whether
    ``infer.py tune-tree`` resizes it, whether its config names its base. The decoding loop never reads it: it drafts
    through ``Drafter``. A checkpoint kind's entry point (group ``selfspec.drafters``) names its DraftKind; a bare
    loader function there declares the defaults."""

    load: Callable[..., Drafter] | None = None
    """``load(path_or_repo_id, target, revision=, tree=) -> Drafter`` for a checkpoint kind; None for the drafts the
    registry builds from ``--draft``'s own options (none, ngram, early-exit)."""
    fixed_trees: bool = True
    """takes a fixed ``--tree`` (chain:K, full:..., choices)."""
    dynamic_trees: bool = False
    """grows ``--tree dynamic:N`` each step from its candidates' own probabilities."""
    tunable: bool = False
    """``infer.py tune-tree`` tunes its budget and depth (``Drafter.resized``), and ``--tree auto`` reads them."""
    checks_base: bool = True
    """its config.json names the base model and sizes it was made for, checked before any weights load
    (``selfspec.base_check``); False: it checks itself as it loads (a draft model: its tokenizer against the
    target's)."""


NO_DRAFT = DraftKind(fixed_trees=False)
"""``--draft none`` (``NoDrafter``): it drafts nothing, so it takes no tree."""


def verifier_for(drafter: Drafter, target: Target) -> Target:
    """The Target that verifies ``drafter``'s drafts: the drafter's own when it has one (``Drafter.verifier``), else
    ``target``."""
    return drafter.verifier() or target


def fork(drafter: Drafter) -> Drafter:
    """The same draft for another sequence of a batch: a deep copy with state of its own (caches, counters, the tree
    it adapts) that shares every module (the weights), model and tokenizer with ``drafter``."""
    check_batchable(drafter)
    shared: dict[int, Any] = {}
    _share(drafter, (torch.nn.Module, PreTrainedTokenizerBase, Target), shared, set())
    return copy.deepcopy(drafter, shared)


def check_batchable(drafter: Drafter, instead: str = "decode its sequences one at a time") -> None:
    """Refuse a drafter that cannot draft beside others in a batch (``Drafter.batchable``), naming the part that
    cannot (a merge's or a policy's) and what to do (``instead``)."""
    if not drafter.batchable:
        culprit = unbatchable_part(drafter)
        where = "" if culprit is drafter else f" (its part {type(culprit).__name__})"
        raise ValueError(f"{type(drafter).__name__}{where} cannot draft for a batch: it runs the target's own layers "
                         f"on the target's cache, which a batch holds as rows; {instead}")


def unbatchable_part(drafter: Drafter) -> Drafter:
    """The innermost part of ``drafter`` (through merges' and policies' ``drafters``) that cannot batch; ``drafter``
    itself when it has no such part."""
    for part in getattr(drafter, "drafters", ()):
        if not part.batchable:
            return unbatchable_part(part)
    return drafter


def _share(obj: Any, kinds: tuple[type, ...], shared: dict[int, Any], seen: set[int]) -> None:
    """Fill ``shared`` (a deepcopy memo) with the objects of ``kinds`` reachable from ``obj``: copied by reference."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, kinds):
        shared[id(obj)] = obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    for item in items:
        _share(item, kinds, shared, seen)


def check_tree(tree: Tree, *, max_depth: int, max_topk: int, drafter: str) -> Tree:
    """Refuse a static tree that asks for deeper or wider drafts than the drafter can make."""
    if tree.depth > max_depth:
        raise ValueError(
            f"the tree is {tree.depth} levels deep, but {max_depth} is the most the {drafter} can draft; "
            f"use a tree of depth <= {max_depth}"
        )
    if tree.max_rank + 1 > max_topk:
        raise ValueError(
            f"the tree asks for the top-{tree.max_rank + 1} candidate, but top-{max_topk} is the most the {drafter} can "
            f"offer; use ranks < {max_topk}"
        )
    return tree


class NoDrafter(Drafter):
    """Drafts nothing: every step verifies the root alone, i.e. plain decoding through the same loop."""

    def draft(self, state: DraftState) -> Draft:
        return Draft(tree=Tree.chain(0), tokens=state.tokens[-1:].clone())

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None
