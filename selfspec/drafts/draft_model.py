"""A separate draft model: any small causal LM sharing the target's tokenizer drafts a tree each step from its own cache.

The classic form of speculative decoding (Leviathan et al., Chen et al.; transformers' ``assistant_model``), grown
into trees. Each step:

    1. sync     the draft's cache keeps the longest prefix of the text it already holds (what the target committed
                at the last step; a new request sharing a prompt prefix keeps that part) and drops the rest: the last
                step's speculative nodes and any rejected path
    2. extend   the tokens committed since, the root last, in one causal forward: the root's next-token
                distribution gives the depth-1 candidates
    3. expand   depth by depth, the nodes chosen to have children run through the draft in one forward, each
                attending to the committed text and to its own ancestors (a tree mask over the draft's cache)
    4. tree     greedy: each node's top candidates, EAGLE-2's rerank of all of them by cumulative log-probability
                under the node budget (``Tree.best_scored``), or a static tree's ranks; sampling: each node's children
                are drawn from the draft's own distribution q without replacement, and the draft carries, per node,
                the distribution that node was drawn from (q with its earlier siblings removed), so
                ``accept.sample_accept`` accepts with min(1, p/q) — lossless. Every drawn node is kept and how many
                children a node gets is decided before they are drawn: the tree's shape never depends on a node's own
                token, which the acceptance rule's proof needs.

Shapes: T tokens so far, Q nodes run in one forward, S draft-cache length, N tree nodes, V the target's vocabulary.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from selfspec.core import hf
from selfspec.core.accept import Acceptance
from selfspec.core.draft_vocab import check_draft_tokens
from selfspec.core.drafter import Draft, Drafter, DraftState
from selfspec.core.sampling import Sampling, process_logits
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree, read_candidates

DEFAULT_TREE = DynamicTree(8, depth=4)
"""what ``--draft model:DIR`` drafts without a --tree (``dynamic:8,depth=4``): 8 nodes, 4 deep, the top 8 candidates
of each of the 8 best nodes of a depth expanded, as ``--tree dynamic:N`` and ``auto`` grow them."""


@dataclass
class Nodes:
    """The candidates of one step, index 0 the root: token, parent, cumulative draft log-probability, depth; the
    draft-cache entry of every node that was run (``entry``) and, when sampling, the distribution each was drawn
    from (``q``: None for the root)."""

    tok: list[int]
    parent: list[int]
    score: list[float]
    depth: list[int]
    entry: dict[int, int]
    q: list[torch.Tensor | None]

    def add(self, token: int, parent: int, logp: float, q: torch.Tensor | None) -> int:
        self.tok.append(token)
        self.parent.append(parent)
        self.score.append(self.score[parent] + logp)
        self.depth.append(self.depth[parent] + 1)
        self.q.append(q)
        return len(self.tok) - 1


class ModelDrafter(Drafter):
    """Drafts with ``model`` (a causal LM with the target's tokenizer) for ``target``. tree: a static Tree (a chain:K
    is classic speculative decoding; ranks are the draft's top candidates, or its draws when sampling), a DynamicTree
    (N nodes by the draft's own probabilities, EAGLE-2's rule; ``min_prob`` cuts unlikely nodes), or None
    (``DEFAULT_TREE``). draft_vocab: long [V'] the only tokens it may draft (FR-Spec: its LM head is read on their
    rows alone, the others get probability 0, in q too); None: every token."""

    def __init__(self, model: PreTrainedModel, target: Target, tree: Tree | DynamicTree | None = None,
                 draft_vocab: torch.Tensor | None = None):
        check_pair(model, target)
        self.draft_model = Target(model)  # its cache and its checks (a causal LM a tree mask can drive)
        self.target = target
        self.vocab_size = target.vocab_size
        self.draft_vocab = None if draft_vocab is None else check_draft_tokens(
            draft_vocab, len(draft_vocab), min(self.vocab_size, self.draft_model.vocab_size)).to(target.device)
        self._rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the LM head on draft_vocab, when read
        self.tree = DEFAULT_TREE if tree is None else tree
        if isinstance(self.tree, Tree) and self.tree.depth < 1:
            raise ValueError("a draft model's static tree needs at least one draft level; found the root alone")
        self.cache = self.draft_model.new_cache()
        self.fed = torch.zeros(0, dtype=torch.long)  # [S'] the committed tokens whose entries the cache holds

    @property
    def model(self) -> PreTrainedModel:
        return self.draft_model.model

    def resized(self, depth: int, budget: int) -> "ModelDrafter":
        rule = self.tree if isinstance(self.tree, DynamicTree) else None
        with warnings.catch_warnings():  # said once, when this drafter was built
            warnings.simplefilter("ignore")
            return ModelDrafter(self.model, self.target, DynamicTree.resized(rule, budget, depth), self.draft_vocab)

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        tokens, T = state.tokens, state.tokens.shape[0]
        depth = self.tree.depth if isinstance(self.tree, Tree) else (self.tree.depth or DEFAULT_TREE.depth)
        if T + depth > self.draft_model.max_length:  # the draft's own context is full: the root alone
            return Draft(tree=Tree.chain(0), tokens=tokens[-1:].clone())

        # 1. sync: keep the cached prefix the text still starts with (never the root: its logits are needed)
        same = min(common_prefix(self.fed, tokens), T - 1)
        hf.cache_truncate(self.cache, same)
        # 2. extend with the committed tokens since, the root last
        logits = self._forward(tokens[same:], torch.arange(same, T, device=tokens.device), None, last=True)  # [1, V]
        self.fed = tokens.detach().to("cpu", copy=True)
        nodes = Nodes(tok=[int(tokens[-1])], parent=[-1], score=[0.0], depth=[0], entry={}, q=[None])
        sampling = None if state.sampling.greedy else state.sampling
        # 3. expand, 4. the tree
        if isinstance(self.tree, Tree):
            return self._static(nodes, logits, T, sampling, state.generator, tokens)
        return self._dynamic(nodes, logits, T, depth, sampling, state.generator, tokens)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None  # the next draft's sync keeps what the target committed and drops the rest

    # ----------------------------------------------------------------------------------------------- the trees
    def _static(self, nodes: Nodes, logits: torch.Tensor, T: int, sampling: Sampling | None,
                generator: torch.Generator | None, tokens: torch.Tensor) -> Draft:
        """The static tree, its rank-r child of each node the node's r-th best candidate (its r-th draw, sampling)."""
        tree = self.tree
        assert isinstance(tree, Tree)
        node = {0: 0}  # static tree node -> its candidate in ``nodes``
        ran = [0]  # static nodes whose children are drafted next, in the order of ``logits``' rows
        for d in range(1, tree.depth + 1):
            if d > 1:
                ran = [i for i in range(len(tree)) if tree.depths[i] == d - 1 and tree.children[i] and i in node]
                logits = self._run(nodes, [node[i] for i in ran], T)  # [Q, V]
            for row, i in enumerate(ran):
                kids = tree.children[i]
                offered = self._candidates(logits[row], tree.ranks[kids[-1]] + 1, sampling, generator)
                for child in kids:
                    if tree.ranks[child] < len(offered):  # sampling from q with fewer possible tokens: fewer kids
                        token, logp, q = offered[tree.ranks[child]]
                        node[child] = nodes.add(token, node[i], logp, q)
        kept = [i for i in range(1, len(tree)) if i in node]
        if len(kept) < len(tree) - 1:  # cut where q had fewer tokens to draw than the tree has ranks
            index = {0: 0, **{i: j + 1 for j, i in enumerate(kept)}}
            tree = Tree(parents=(-1, *(index[tree.parents[i]] for i in kept)), ranks=(0, *(tree.ranks[i] for i in kept)))
        return self._draft(tree, [node[i] for i in kept], nodes, tokens)

    def _dynamic(self, nodes: Nodes, logits: torch.Tensor, T: int, depth: int, sampling: Sampling | None,
                 generator: torch.Generator | None, tokens: torch.Tensor) -> Draft:
        rule = self.tree
        assert isinstance(rule, DynamicTree)
        width = rule.max_rank
        if sampling is not None:
            return self._sampled(nodes, logits, T, depth, rule, sampling, generator, tokens)
        layer = [nodes.add(t, 0, lp, None) for t, lp, _ in self._candidates(logits[0], width, None, None)]
        for _ in range(2, depth + 1):
            expand = sorted(layer, key=lambda i: -nodes.score[i])[:width]
            logits = self._run(nodes, expand, T)  # [Q, V]
            layer = [nodes.add(t, i, lp, None) for row, i in enumerate(expand)
                     for t, lp, _ in self._candidates(logits[row], width, None, None)]
        tree, kept = Tree.best_scored(nodes.parent, nodes.score, nodes.depth, rule.budget, rule.min_logp)
        return self._draft(tree, kept, nodes, tokens)

    def _sampled(self, nodes: Nodes, logits: torch.Tensor, T: int, depth: int, rule: DynamicTree, sampling: Sampling,
                 generator: torch.Generator | None, tokens: torch.Tensor) -> Draft:
        """Sampling under a node budget: at each depth, the slots (node, r) of highest pre-draw score (the node's
        score + the log of q's r-th largest probability), at most ceil(budget / depth) of them and none below
        min_prob, are filled by draws from each node's q; every draw is kept."""
        quota = math.ceil(rule.budget / depth)
        frontier, q_rows = [0], process_logits(logits, sampling)  # [1, V]
        for d in range(1, depth + 1):
            if d > 1:
                q_rows = process_logits(self._run(nodes, frontier, T), sampling)  # [Q, V]
            slots = []  # (pre-draw score, row, rank)
            for row, i in enumerate(frontier):
                top = q_rows[row].topk(min(rule.max_rank, int((q_rows[row] > 0).sum()))).values.log().tolist()
                slots += [(nodes.score[i] + lp, row, r) for r, lp in enumerate(top)]
            room = min(quota, rule.budget - (len(nodes.tok) - 1))
            slots = [s for s in sorted(slots, reverse=True)[:room] if s[0] >= rule.min_logp]
            counts = Counter(row for _, row, _ in slots)  # children per frontier row, fixed before any draw
            frontier_next = []
            for row, i in enumerate(frontier):
                for token, logp, q in draws(q_rows[row], counts[row], generator):
                    frontier_next.append(nodes.add(token, i, logp, q))
            frontier = frontier_next
            if not frontier:
                break
        kept = list(range(1, len(nodes.tok)))
        tree = Tree.from_parents(nodes.parent)  # siblings ranked in draw order: the order the rule tries them
        return self._draft(tree, kept, nodes, tokens)

    # ----------------------------------------------------------------------------------------------- the pieces
    def _candidates(self, logits: torch.Tensor, k: int, sampling: Sampling | None,
                    generator: torch.Generator | None) -> list[tuple[int, float, torch.Tensor | None]]:
        """(token, log-probability, q it was drawn from) of k children: the top k (greedy: q None), or k draws
        without replacement from the processed distribution (sampling). logits [V]."""
        if sampling is None:
            top = torch.log_softmax(logits.float(), dim=-1).topk(k)
            [ids], [values] = read_candidates(top.indices[None], top.values[None])  # one read
            return [(t, lp, None) for t, lp in zip(ids, values)]
        return draws(process_logits(logits, sampling), k, generator)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 last: bool = False) -> torch.Tensor:
        """The draft's next-token logits [n, V] on the target's vocabulary (n = 1 with ``last``, else every row); with
        a draft vocabulary, its LM head runs on those rows alone and every other token's logit is -inf."""
        if self.draft_vocab is None:
            logits, _ = hf.forward(self.model, ids, positions, mask, self.cache, logits_to_keep=1 if last else 0)
            return on_vocab(logits.float(), self.vocab_size)
        _, hidden = hf.forward_partial(self.model, ids, positions, mask, self.cache, lm_head=False)  # [N, D]
        weight, bias = self._head_rows()
        small = F.linear(hidden[-1:] if last else hidden, weight, bias).float()  # [n, V']
        full = small.new_full((small.shape[0], self.vocab_size), float("-inf"))  # [n, V]
        return full.index_copy_(1, self.draft_vocab, small)

    def _head_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's LM head weight [V', D] and bias (or None) on its draft vocabulary, read once."""
        if self._rows is None:
            head = self.model.get_output_embeddings()
            bias = getattr(head, "bias", None)
            self._rows = (head.weight.detach()[self.draft_vocab],
                          None if bias is None else bias.detach()[self.draft_vocab])
        return self._rows

    def _run(self, nodes: Nodes, run: list[int], T: int) -> torch.Tensor:
        """The nodes ``run`` through the draft in one forward, each attending to the T committed entries and its own
        ancestors' entries -> their next-token logits [Q, V]."""
        device = self.draft_model.device
        S, Q = hf.cache_length(self.cache), len(run)
        allowed = torch.zeros(Q, S + Q, dtype=torch.bool)
        allowed[:, :T] = True
        for row, i in enumerate(run):
            a = nodes.parent[i]
            while a > 0:
                allowed[row, nodes.entry[a]] = True
                a = nodes.parent[a]
            allowed[row, S + row] = True
        nodes.entry.update({i: S + row for row, i in enumerate(run)})
        mask = hf.additive_mask(allowed.to(device), self.model.dtype)  # [1, 1, Q, S + Q]
        ids = torch.tensor([nodes.tok[i] for i in run], device=device)  # [Q]
        positions = torch.tensor([T - 1 + nodes.depth[i] for i in run], device=device)  # [Q]
        return self._forward(ids, positions, mask)

    def _draft(self, tree: Tree, kept: list[int], nodes: Nodes, tokens: torch.Tensor) -> Draft:
        """The Draft of ``tree`` whose node j + 1 is candidate kept[j]."""
        ids = torch.tensor([nodes.tok[0]] + [nodes.tok[i] for i in kept], dtype=tokens.dtype, device=tokens.device)
        scores = torch.tensor([0.0] + [nodes.score[i] for i in kept])
        q = None
        if kept and nodes.q[kept[0]] is not None:
            q = torch.stack([torch.zeros_like(nodes.q[kept[0]])] + [nodes.q[i] for i in kept])  # [N, V], root 0
        return Draft(tree=tree, tokens=ids, q=q, scores=scores)


def draws(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[tuple[int, float, torch.Tensor]]:
    """k draws without replacement from q [V] (Gumbel-top-k: the same law as drawing one at a time, each from q with
    the earlier draws removed), each with log q(token) and the distribution it was drawn from. Fewer when q has fewer
    tokens of positive probability."""
    k = min(k, int((q > 0).sum()))
    if k == 0:
        return []
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64)
    keys = q.double().log() - (-u.clamp(min=1e-300).log()).log()  # [V] log q + Gumbel noise
    out, left = [], q.double().clone()
    for token in keys.topk(k).indices.tolist():
        dist = (left / left.sum()).float()  # [V] what this draw came from
        out.append((token, math.log(float(q[token])), dist))
        left[token] = 0.0
    return out


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens a [n] and b [m] share."""
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n].to(a.device)).nonzero()
    return int(differ[0]) if differ.numel() else n


def on_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits [n, V_d] on the target's vocabulary [n, V]: rows beyond it cut, missing ones -inf (a draft
    model's embedding may be padded to another size than the target's with the same tokenizer)."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def check_pair(model: PreTrainedModel, target: Target) -> None:
    """Refuse a draft model on another device than the target (decoding would fail at the first step), warn when its
    dtype differs or when it is not smaller than the target (it cannot pay for itself). The vocabularies are checked
    where the tokenizers are known (``check_tokenizers``)."""
    device, target_device = next(model.parameters()).device, target.device
    if device != target_device:
        raise ValueError(f"the draft model is on {device}, the target on {target_device}: expected both on one device "
                         f"(load the draft with device={str(target_device)!r})")
    dtype, target_dtype = next(model.parameters()).dtype, next(target.model.parameters()).dtype
    if dtype != target_dtype:
        warnings.warn(f"the draft model is in {dtype}, the target in {target_dtype}: expected one dtype (a float32 "
                      f"draft beside a bfloat16 target drafts slower than it need)", stacklevel=3)
    draft_size, target_size = model.num_parameters(), target.model.num_parameters()
    if draft_size >= target_size:
        warnings.warn(f"the draft model has {draft_size:,} parameters, the target {target_size:,}: a draft at least "
                      "as large as the target costs more per token than it can save", stacklevel=3)
