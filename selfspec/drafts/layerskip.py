"""Layer-skip drafting (Draft & Verify, SWIFT): the target drafts with a subset of its own layers, no extra weights.

A draft forward runs the target's own forward with the skipped decoder layers replaced by a passthrough, through the
target's own cache: the kept layers append KV entries for the drafted tokens, the skipped layers' cache never grows.
After drafting every layer is truncated back to the start length, so the verifier finds the cache as it left it.

Drafting fills a static tree level by level (a chain by default): all nodes of depth d that have children are fed in
one forward with a tree mask, and their children get the draft's top-(rank + 1) tokens. Or it grows a dynamic tree
(``DynamicTree``, EAGLE-2's rule): depth by depth the ``max_rank`` best nodes of the newest depth, by cumulative draft
log-probability, are fed in one forward and each offers its ``max_rank`` best children; the ``budget`` best nodes of
all are kept. Drafting stops early (the deeper levels are dropped) when no node of a level has a top-1 draft
probability of at least ``stop_below`` (confidence-based early stop, as in Kangaroo and SWIFT). Drafts are
deterministic (q = None), hence lossless under both greedy and sampled acceptance.

With a draft vocabulary (``vocab``: an exit head's, or a layer-skip checkpoint's ``draft_vocab``, selfspec/core/draft_vocab.py;
``python -m heads.add_vocab`` adds one to either) the draft forward stops at the final norm and
reads only the LM head's V' rows of the most frequent tokens (the target verifies every drafted token, so output is
unchanged; a token outside V' is never proposed). Draft probabilities are then over V' (no logit soft-capping).

Shapes: S cached length (the prefix, root excluded), N tree nodes, F nodes fed so far, E nodes fed in one forward,
V vocabulary, V' draft vocabulary (V without one).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from huggingface_hub import hf_hub_download

from selfspec.core import hf, typed
from selfspec.core.accept import Acceptance
from selfspec.core.draft_vocab import DraftVocab
from selfspec.core.files import read_json_object
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree, read_candidates


def check_skip_layers(skip_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The skip set, sorted; refuses an empty set, every layer, duplicates and indices outside 0..num_layers-1."""
    skip = [int(i) for i in skip_layers]
    if not skip:
        raise ValueError("the skip set is empty: a draft through every layer is the target itself; skip at least one layer")
    bad = sorted({i for i in skip if not 0 <= i < num_layers})
    if bad:
        raise ValueError(f"skip layers {bad} are out of range: this model has {num_layers} layers, expected indices 0..{num_layers - 1}")
    if len(set(skip)) != len(skip):
        raise ValueError(f"the skip set {skip} names a layer twice; list each layer once")
    if len(skip) >= num_layers:
        raise ValueError(f"the skip set names all {num_layers} layers: keep at least one layer to draft with")
    return tuple(sorted(skip))


def check_stop_below(stop_below: float) -> float:
    if not 0.0 <= stop_below < 1.0:
        raise ValueError(f"stop_below (the top-1 draft probability under which drafting stops) must be in [0, 1), found {stop_below}")
    return float(stop_below)


def draft_tree(tree: Tree | DynamicTree | None, depth: int) -> Tree | DynamicTree:
    """A partial-model drafter's tree: None -> a chain of ``depth``; a DynamicTree without a depth -> ``depth`` deep."""
    if isinstance(tree, Tree) or (tree is not None and tree.depth is not None):
        return tree
    if depth < 1:
        raise ValueError(f"depth (draft tokens per step) must be >= 1, found {depth}")
    return Tree.chain(depth) if tree is None else DynamicTree.resized(tree, tree.budget, depth)


class PartialModelDrafter(Drafter):
    """Drafts a static or dynamic tree with the target's forward, some decoder layers replaced (skipped, or an exit
    head).

    replace: decoder layer index -> module standing in for it (``hf.Passthrough`` to skip it).
    tree: a static Tree, or a DynamicTree (with its depth) grown each step.
    vocab: a draft vocabulary to draft from (None: the LM head's every row).
    """

    batchable = False  # it runs the target's layers on the target's cache, which a batch holds as rows

    def __init__(self, target: Target, replace: Mapping[int, torch.nn.Module], tree: Tree | DynamicTree,
                 stop_below: float = 0.0, vocab: DraftVocab | None = None):
        self.target, self.model = target, target.model
        self.vocab = vocab
        self.num_layers = len(hf.decoder_layers(self.model))
        self.replace = dict(replace)
        self.stop_below = check_stop_below(stop_below)
        self.dynamic: DynamicTree | None = tree if isinstance(tree, DynamicTree) else None
        self.tree: Tree | None = None if isinstance(tree, DynamicTree) else tree
        """the static tree (None when a dynamic one is grown)."""
        if self.dynamic is not None and self.dynamic.depth is None:
            raise ValueError("a dynamic tree for a partial-model drafter needs its depth (layerskip.draft_tree)")
        if self.tree is not None and self.tree.depth < 1:
            raise ValueError(f"the draft tree must be at least one level deep, found depth {self.tree.depth}")
        levels = range(self.tree.depth) if self.tree is not None else ()
        self._levels = [[i for i, d in enumerate(self.tree.depths) if d == depth and self.tree.children[i]] for depth in levels]
        self._width = [max((self.tree.ranks[c] + 1 for i in level for c in self.tree.children[i]), default=1)
                       for level in self._levels]
        ranks = max(self._width, default=1) if self.tree is not None else self.dynamic.max_rank
        if vocab is not None and vocab.size is not None and ranks > vocab.size:
            raise ValueError(f"the draft vocabulary holds {vocab.size} tokens, but the tree asks for the {ranks} best "
                             f"at a node: use a tree of at most {vocab.size} ranks, or a larger draft vocabulary")

    def resized(self, depth: int, budget: int) -> "PartialModelDrafter":
        """The same layers (and draft vocabulary) growing a dynamic tree of ``budget`` nodes, ``depth`` deep."""
        return PartialModelDrafter(self.target, self.replace,
                                   DynamicTree.resized(self.dynamic, budget, depth),
                                   self.stop_below, self.vocab)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """tokens [E], positions [E], mask [1, 1, E, S + F + E] -> draft logits [E, V'] (the cache grows by E);
        ``_ids`` maps their columns to token ids."""
        with hf.replaced_layers(self.model, self.replace):
            if self.vocab is None:
                return hf.forward_partial(self.model, tokens, positions, mask, cache)[0]
            _, hidden = hf.forward_partial(self.model, tokens, positions, mask, cache, lm_head=False)  # [E, D] normed
        return self.vocab.linear(self.model.get_output_embeddings(), hidden)

    def _ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of ``_forward``'s logits -> token ids."""
        return columns if self.vocab is None else self.vocab.base_ids(columns)

    def _start(self, state: DraftState) -> int:
        start = state.tokens.shape[0] - 1
        lengths = hf.layer_lengths(state.cache)
        if any(n != start for n in lengths):
            raise RuntimeError(
                f"the target's cache should hold the {start} tokens before the root in every layer; found per-layer lengths {lengths}"
            )
        return start

    def grow(self, state: DraftState) -> tuple[Draft, list[int]]:
        """Fill the tree level by level (or grow the dynamic one); returns the draft and the nodes fed, in cache order
        (for a dynamic tree: candidate indices, not draft nodes).

        The kept layers' cache then holds S + len(fed) entries; the caller must truncate it (``draft`` does).
        """
        if self.dynamic is not None:
            return self._grow_dynamic(state, self.dynamic)
        cache, tree = state.cache, self.tree
        assert tree is not None
        start = self._start(state)
        device = state.tokens.device
        dtype = next(self.model.parameters()).dtype
        tokens = torch.zeros(len(tree), dtype=torch.long, device=device)  # [N]
        tokens[0] = state.tokens[-1]
        ancestors = tree.on(device).ancestors  # [N, N], built on the device once per tree
        fed: list[int] = []
        kept_depth = tree.depth
        for depth, (level, width) in enumerate(zip(self._levels, self._width)):
            if not level:
                kept_depth = depth
                break
            rows = torch.tensor(level, device=device)
            cols = torch.tensor(fed + level, device=device)
            allowed = torch.cat(
                [torch.ones(len(level), start, dtype=torch.bool, device=device), ancestors[rows][:, cols]], dim=1
            )  # [E, S + F + E]
            positions = torch.full((len(level),), start + depth, device=device)  # [E]
            logits = self._forward(tokens[rows], positions, hf.additive_mask(allowed, dtype), cache)  # [E, V]
            fed.extend(level)
            top = logits.float().softmax(-1).topk(width, dim=-1)  # values, indices [E, width]
            if self.stop_below > 0 and float(top.values[:, 0].max()) < self.stop_below:  # read only when asked
                kept_depth = depth
                break
            ids = self._ids(top.indices)  # [E, width] token ids
            for j, node in enumerate(level):
                for child in tree.children[node]:
                    tokens[child] = ids[j, tree.ranks[child]]
        return Draft(tree=tree, tokens=tokens).truncated(kept_depth), fed

    def _grow_dynamic(self, state: DraftState, dyn: DynamicTree) -> tuple[Draft, list[int]]:
        """EAGLE-2 over the partial model: candidates 0 (the root), 1, ... with their parent, token, cumulative draft
        log-probability and depth; each depth feeds the best ``max_rank`` candidates of the newest depth in one forward
        (each attends to the prefix, its fed ancestors and itself), then ``Tree.best_scored`` keeps ``budget``."""
        assert dyn.depth is not None  # __init__ resolved it
        start, device = self._start(state), state.tokens.device
        dtype = next(self.model.parameters()).dtype
        k = dyn.max_rank  # not capped by the budget: the candidates do not depend on it (what budget tuning replays)
        tok, parent, score, depth = [int(state.tokens[-1])], [-1], [0.0], [0]
        fed: list[int] = []  # candidates in cache order
        frontier = [0]
        for d in range(dyn.depth):
            slot = {c: start + j for j, c in enumerate(fed + frontier)}  # candidate -> its cache position
            allowed = torch.zeros(len(frontier), start + len(slot), dtype=torch.bool)  # [E, S + F + E]
            allowed[:, :start] = True
            for row, c in enumerate(frontier):
                while c >= 0:
                    allowed[row, slot[c]] = True
                    c = parent[c]
            ids = torch.tensor([tok[c] for c in frontier], device=device)  # [E]
            positions = torch.full((len(frontier),), start + d, device=device)  # [E]
            logits = self._forward(ids, positions, hf.additive_mask(allowed.to(device), dtype), state.cache)  # [E, V]
            fed.extend(frontier)
            top = logits.float().log_softmax(-1).topk(k, dim=-1)  # values, indices [E, k]
            if self.stop_below > 0 and float(top.values[:, 0].max().exp()) < self.stop_below:  # read only when asked
                break
            indices, values = read_candidates(self._ids(top.indices), top.values)  # [E][k]: one read per depth
            layer = []
            for row, c in enumerate(frontier):
                for r in range(k):
                    layer.append(len(tok))
                    tok.append(indices[row][r])
                    parent.append(c)
                    score.append(score[c] + values[row][r])
                    depth.append(d + 1)
            frontier = sorted(layer, key=lambda c: -score[c])[:k]
        tree, kept = Tree.best_scored(parent, score, depth, dyn.budget, dyn.min_logp)
        tokens = torch.tensor([tok[0]] + [tok[c] for c in kept], dtype=state.tokens.dtype, device=device)  # [N]
        return Draft(tree=tree, tokens=tokens, scores=torch.tensor([0.0] + [score[c] for c in kept])), fed

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        start = state.tokens.shape[0] - 1
        try:
            draft, _ = self.grow(state)
        finally:
            hf.cache_truncate(state.cache, start)
        return draft

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


class LayerSkipDrafter(PartialModelDrafter):
    """Drafts with the target minus ``skip_layers``: a chain of ``depth`` tokens, the given static tree, or a dynamic
    tree (``depth`` deep unless it says otherwise)."""

    def __init__(self, target: Target, skip_layers: Sequence[int], depth: int = 4,
                 tree: Tree | DynamicTree | None = None, stop_below: float = 0.0, vocab: DraftVocab | None = None):
        num_layers = len(hf.decoder_layers(target.model))
        self.skip_layers = check_skip_layers(skip_layers, num_layers)
        super().__init__(target, {i: hf.Passthrough() for i in self.skip_layers}, draft_tree(tree, depth), stop_below,
                         vocab=vocab)


# ------------------------------------------------------------------------------------------------ config checkpoint
CONFIG_NAME = "config.json"
DRAFT_TYPE = "layerskip"


@dataclass(frozen=True)
class LayerSkipConfig:
    """A searched skip set, saved as ``config.json`` in a checkpoint directory (no weights: the target drafts)."""

    base_model: str
    """the model the skip set was searched on (Hub id or name)."""
    num_hidden_layers: int
    """its number of decoder layers; a target with another count is refused."""
    skip_layers: tuple[int, ...]
    """decoder layers the draft skips (0-based)."""
    draft_depth: int
    """draft tokens per step (the chain length) used in the search."""
    stop_below: float = 0.0
    """drafting stops when the draft's top-1 probability falls below this (0 = never)."""
    measured: dict[str, float] = field(default_factory=dict)
    """what the search measured for this skip set (tokens/s, mean accepted tokens, plain tokens/s, ...)."""
    draft_vocab: tuple[int, ...] = ()
    """the token ids the draft proposes (its draft vocabulary: the most frequent in some data, added by ``python -m
    heads.add_vocab``; the draft then reads only their rows of the LM head); empty: every token."""
    draft_type: str = DRAFT_TYPE

    def __post_init__(self) -> None:
        typed.check(self, "", self.wording(type(self).__name__))
        if self.draft_type != DRAFT_TYPE:
            raise ValueError(f"draft_type must be {DRAFT_TYPE!r} for a layer-skip config, found {self.draft_type!r}")
        if self.num_hidden_layers < 2:
            raise ValueError(f"num_hidden_layers must be an integer >= 2, found {self.num_hidden_layers!r}")
        object.__setattr__(self, "skip_layers", check_skip_layers(self.skip_layers, self.num_hidden_layers))
        if self.draft_depth < 1:
            raise ValueError(f"draft_depth must be an integer >= 1, found {self.draft_depth!r}")
        check_stop_below(self.stop_below)
        if any(t < 0 for t in self.draft_vocab) or len(set(self.draft_vocab)) != len(self.draft_vocab):
            raise ValueError(f"draft_vocab must hold distinct token ids >= 0, found {list(self.draft_vocab)[:8]}...")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["skip_layers"] = list(self.skip_layers)
        out["draft_vocab"] = list(self.draft_vocab)
        return {"draft_type": out.pop("draft_type"), **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the config") -> "LayerSkipConfig":
        """Strict: unknown keys, missing keys and wrong JSON types fail, naming the key, the expected and the found
        (selfspec.core.typed)."""
        return typed.from_dict(cls, data, "", cls.wording(source))

    @staticmethod
    def wording(source: str) -> typed.Wording:
        """How a layer-skip config read from ``source`` words its errors (a wrong type is a TypeError)."""
        source = source.replace("{", "{{").replace("}", "}}")
        return typed.Wording(unknown=source + " has unknown keys {unknown}; a layer-skip config has {known}",
                             missing=source + " lacks keys {missing}",
                             wrong_type=source + ": {where} must be {expected}, found {found}", type_error=TypeError)

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/config.json`` (the directory is created); returns the file's path."""
        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path_or_repo_id: str | Path, revision: str | None = None) -> "LayerSkipConfig":
        """From a checkpoint directory, its config.json itself, or a Hub repo id."""
        path = Path(path_or_repo_id).expanduser()
        if path.is_dir():
            path = path / CONFIG_NAME
            if not path.is_file():
                raise FileNotFoundError(f"{path.parent} has no {CONFIG_NAME}: expected a layer-skip checkpoint directory")
        elif not path.is_file():
            if str(path_or_repo_id).startswith((".", "/", "~")) or str(path_or_repo_id).count("/") != 1:
                raise FileNotFoundError(f"layer-skip checkpoint {path_or_repo_id} does not exist (expected a directory, its "
                                        f"{CONFIG_NAME}, or a Hub repo id 'owner/name')")
            path = Path(hf_hub_download(str(path_or_repo_id), CONFIG_NAME, revision=revision))

        return cls.from_dict(read_json_object(path, "the layer-skip config"), source=str(path))


def layerskip_card(config: LayerSkipConfig, location: str) -> str:
    """README.md for a published skip set: Hub metadata, what it skips, what its search measured, and usage."""
    m = config.measured
    measured = (f" Measured by its search: {m['mean_accepted']:.2f} mean accepted tokens per step, "
                f"{m['tokens_per_s']:.1f} tokens/s against {m['plain_tokens_per_s']:.1f} for plain decoding "
                f"({m['tokens_per_s'] / m['plain_tokens_per_s']:.2f}x) on the machine it was searched on."
                if {"mean_accepted", "tokens_per_s", "plain_tokens_per_s"} <= m.keys() else "")
    vocab = (f" Drafts come from a draft vocabulary of {len(config.draft_vocab)} tokens." if config.draft_vocab else "")
    return f"""---
library_name: selfspec
base_model: {config.base_model}
tags: [speculative-decoding, layer-skipping, selfspec]
---
# Layer-skip draft for {config.base_model}

No weights: the base model drafts {config.draft_depth} tokens per step through its own layers, skipping layers
{list(config.skip_layers)} of {config.num_hidden_layers}, and verifies them with all of them, so greedy output is the
base's own.{measured}{vocab}

```python
from selfspec.api import load
model = load("{config.base_model}", draft="{location}")
print(model.generate("Hello!", max_new_tokens=64).text)
```
"""


def load_drafter(
    path_or_repo_id: str | Path, target: Target, revision: str | None = None,
    tree: Tree | DynamicTree | Sequence[Sequence[int]] | None = None,
) -> LayerSkipDrafter:
    """The drafter a layer-skip checkpoint describes, on ``target``; tree=None drafts a chain of its draft_depth, a
    DynamicTree grows one each step (its depth defaulting to draft_depth)."""
    config = LayerSkipConfig.load(path_or_repo_id, revision)
    layers = len(hf.decoder_layers(target.model))
    if layers != config.num_hidden_layers:
        raise ValueError(
            f"this skip set was searched on {config.base_model} with {config.num_hidden_layers} layers, but the target "
            f"has {layers}: pass the model it was searched on, or search a skip set for this one"
        )
    if tree is not None and not isinstance(tree, (Tree, DynamicTree)):
        tree = Tree.from_choices(tree)
    vocab = None
    if config.draft_vocab:
        vocab = DraftVocab(len(config.draft_vocab), target.vocab_size)
        try:
            vocab.set(config.draft_vocab)
        except ValueError as err:
            raise ValueError(f"layer-skip checkpoint {path_or_repo_id}: its draft_vocab does not fit this target: "
                             f"{err}") from None
    return LayerSkipDrafter(target, config.skip_layers, depth=config.draft_depth, tree=tree, stop_below=config.stop_below,
                            vocab=vocab)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""draft_type "layerskip" (entry point ``layerskip`` of ``selfspec.drafters``): fixed and dynamic trees, tuned by
``infer.py tune-tree``."""
