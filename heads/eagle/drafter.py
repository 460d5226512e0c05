"""An EAGLE-style head as a selfspec Drafter: autoregressive drafting over its own KV cache, a dynamic tree per step.

Each step:

    1. extend  the head's cache with the pairs (f_j, x_{j+1}) the target committed since the last step (true features);
               the last one's output f̂ gives the depth-1 candidates
    2. expand  depth by depth: the ``topk`` best nodes of the newest depth (by cumulative draft log-probability) each
               run one pair (f̂ of its parent, its token) through the head in one batched call, attending to the true
               pairs and its own ancestors' pairs (a tree mask over the head's cache); each offers its ``topk`` children
    3. rerank  keep the ``budget`` nodes of highest cumulative log-probability (EAGLE-2); every kept node's parent is kept
    4. tree    topological order, siblings best first; the speculative cache entries are dropped at the next step

Drafts are deterministic (q = None): greedy acceptance is exact, and ``sample_accept`` treats each node as a point mass,
which keeps sampling lossless too. The head's cache holds one entry per committed pair: it is rebuilt from the prompt
when a new request starts (the first draft sees the whole prompt's hidden states) and refuses to run out of step.

Shapes: T tokens so far, A newly committed positions, Q nodes expanded at a depth, S head-cache length, D hidden size,
V' draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from heads.checkpoints.files import CONFIG, resolve
from heads.decoder.features import head_features, new_positions
from heads.decoder.speculators_config import is_speculators
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.model import EagleHead
from selfspec.core import hf
from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState
from selfspec.core.files import read_json_object
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree, cut_logp, read_candidates


class EagleDrafter(Drafter):
    def __init__(self, head: EagleHead | Eagle3Head, depth: int, topk: int, budget: int, min_prob: float = 0.0):
        for name, value in (("depth", depth), ("topk", topk), ("budget", budget)):
            if value < 1:
                raise ValueError(f"EAGLE drafting: expected {name} >= 1, found {value}")
        self.head = head.eval()
        self.depth, self.topk, self.budget = depth, min(topk, head.config.draft_vocab_size), budget
        self.min_prob, self.min_logp = min_prob, cut_logp(min_prob)
        self.cache: DynamicCache | None = None
        self.committed = 0  # true pairs in the head's cache

    @classmethod
    def with_tree(cls, head: EagleHead | Eagle3Head, tree: Tree | DynamicTree | None) -> "EagleDrafter":
        """tree None: the checkpoint's defaults; DynamicTree(N): N nodes; a chain of K: the greedy path of K tokens."""
        c = head.config
        if tree is None:
            return cls(head, c.depth, c.topk, c.budget)
        if isinstance(tree, DynamicTree):
            return cls(head, tree.depth or c.depth, c.topk, tree.budget, tree.min_prob)
        if isinstance(tree, Tree) and tree.is_chain and tree.depth >= 1:
            return cls(head, tree.depth, 1, tree.depth)
        raise ValueError(f"an EAGLE head grows its own tree each step: use --tree dynamic:N (N nodes, depth "
                         f"{c.depth}) or chain:K (its greedy path of K tokens), found a static tree of {len(tree)} nodes")

    def resized(self, depth: int, budget: int) -> "EagleDrafter":
        return EagleDrafter(self.head, depth, self.topk, budget, self.min_prob)

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        tokens, T, A = state.tokens, state.tokens.shape[0], new_positions(state, "the EAGLE drafter")
        if self.cache is None or state.starts_request:  # the first draft sees the whole prompt
            self.cache, self.committed = DynamicCache(config=self.head.decoder.config), 0
        elif self.committed + A != T - 1:
            raise RuntimeError(f"the EAGLE drafter is out of step: its cache holds {self.committed} committed positions "
                               f"and {A} new ones arrived, but the text has {T - 1} before the root")
        hf.cache_truncate(self.cache, self.committed)  # drop the last step's speculative pairs
        head, device = self.head, tokens.device

        # 1. extend: the newly committed pairs (f_j, x_{j+1}), j = committed .. T-2, plain causal attention (an EAGLE-3
        #    head reads the fusion of its feature layers' states instead of f_j)
        positions = torch.arange(self.committed, T - 1, device=device)
        true = head.true_features(head_features(head.config.feature_layers, state, "EAGLE head"))  # [A, D]
        out = head.step(true[None], tokens[self.committed + 1:][None], positions[None], None, self.cache)[0]  # [A, D]
        self.committed = T - 1
        base = T - 1  # head-cache entries that are true pairs

        # nodes: index 0 is the root; lists hold token, parent, cumulative log-probability, depth, the f̂ that drafted it
        tok, parent, score, depth = [int(tokens[-1])], [-1], [0.0], [0]
        feat: list[torch.Tensor] = [out[-1]]
        entry: dict[int, int] = {}  # expanded node -> its pair's index in the head's cache
        layer = self._children(head, out[-1:], [0], tok, parent, score, depth, feat, d=1)

        # 2. expand the best nodes of the newest depth, one batched call per depth
        for d in range(2, self.depth + 1):
            expand = sorted(layer, key=lambda i: -score[i])[: self.topk]
            S, Q = hf.cache_length(self.cache), len(expand)
            allowed = torch.zeros(Q, S + Q, dtype=torch.bool)
            allowed[:, :base] = True
            for q, i in enumerate(expand):
                a = parent[i]
                while a > 0:
                    allowed[q, entry[a]] = True
                    a = parent[a]
                allowed[q, S + q] = True
            mask = hf.additive_mask(allowed.to(device), head.fc.weight.dtype)  # [1, 1, Q, S + Q]
            pos = torch.full((1, Q), base + d - 2, device=device)
            f = torch.stack([feat[i] for i in expand])[None]  # [1, Q, D]
            ids = torch.tensor([tok[i] for i in expand], device=device)[None]  # [1, Q]
            out = head.step(f, ids, pos, mask, self.cache)[0]  # [Q, D]
            entry.update({i: S + q for q, i in enumerate(expand)})
            layer = self._children(head, out, expand, tok, parent, score, depth, feat, d=d)

        # 3. rerank: the budget best nodes, parents before children (a child never scores above its parent)
        # 4. the tree: by depth, siblings best first
        tree, kept = Tree.best_scored(parent, score, depth, self.budget, self.min_logp)
        draft_tokens = torch.tensor([tok[0]] + [tok[i] for i in kept], dtype=tokens.dtype, device=device)
        scores = torch.tensor([0.0] + [score[i] for i in kept])
        return Draft(tree=tree, tokens=draft_tokens, scores=scores)

    def _children(self, head: EagleHead | Eagle3Head, out: torch.Tensor, nodes: list[int], tok, parent, score, depth, feat,
                  d: int) -> list[int]:
        """out [Q, D]: f̂ after each of ``nodes``; adds each node's topk children (depth d) and returns their indices."""
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [Q, V']
        top = logp.topk(self.topk, dim=-1)
        ids, values = read_candidates(head.base_ids(top.indices), top.values)  # [Q][k] base token ids, log-probs
        added = []
        for q, node in enumerate(nodes):
            for r in range(self.topk):
                added.append(len(tok))
                tok.append(ids[q][r])
                parent.append(node)
                score.append(score[node] + values[q][r])
                depth.append(d)
                feat.append(out[q])
        return added

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


def load_drafter(path_or_repo_id: str | Path, target: Target, revision: str | None = None,
                 tree: Tree | DynamicTree | None = None) -> EagleDrafter:
    """The ``eagle`` entry point of ``selfspec.drafters``: the head on ``target`` as an EagleDrafter. tree: None (the
    checkpoint's depth / topk / budget), ``dynamic:N`` (budget N), or ``chain:K`` (one greedy path of K tokens).

    Both EAGLE formats: selfspec's own head (config.json with draft_type "eagle", heads/eagle/model.py), and an
    EAGLE-3 draft in the format of vLLM's speculators library (config.json with speculators_model_type "eagle3",
    heads/eagle/eagle3.py; its drafting defaults: depth = its speculative_tokens, 8 per depth, 32 nodes)."""
    config = read_json_object(resolve(path_or_repo_id, revision) / CONFIG, "the EAGLE draft's config")
    cls = Eagle3Head if is_speculators(config) else EagleHead
    head = cls.from_pretrained(path_or_repo_id, target.model, revision=revision)
    return EagleDrafter.with_tree(head, tree)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""an EAGLE head (selfspec's, or a speculators EAGLE-3 draft; entry point ``eagle`` of ``selfspec.drafters``): fixed
and dynamic trees, tuned by ``infer.py tune-tree``."""
