"""A block drafter as a selfspec Drafter: a whole block of K draft positions from one forward of the head, a tree from
the block's per-position candidates.

Each step:

    1. sync     the head's cache holds what it read of the committed text; a new request starts it afresh (as the
                EAGLE drafter does, heads/eagle/drafter.py)
    2. forward  one call of the head (``block``) over the positions committed since the last step and the block:
                K per-position distributions for x_T .. x_{T+K-1}. selfspec's block head (heads/block/model.py)
                runs the new pairs (f_j, x_{j+1}) causally and K - 1 mask queries (the last pair's output and the
                masks' are the block); speculators' DFlash draft (heads/block/dflash.py) adds the new positions'
                context keys and values to its cache and runs [root, mask x K] over them
    3. tree     ``dynamic:N``: the N rank paths of highest product of per-position probabilities (each node's parent
                kept; ``selfspec.core.position_draft.best_first_draft``, shared with Medusa heads), scored for budget
                tuning; a static tree (``chain:k``: the top-1 path) is filled with each position's ranked candidates

A conditioned block (``condition_rank`` / ``confidence`` in its config.json, heads/block/condition.py) grows its tree
depth by depth instead (heads/block/chained.py): each node's children are drafted from the distribution after that
node's own token (the Markov bias), all of one depth's nodes together and read by the host once, and the confidence
head stops unsure branches; still one forward per step.

Drafts are deterministic (q = None): greedy acceptance is exact, and ``sample_accept`` treats each node as a point mass,
which keeps sampling lossless too.

Shapes: T tokens so far, A newly committed positions, K block size (tokens one forward drafts), D hidden size,
V' draft vocabulary, R ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from heads.block.chained import Chain, fill, grow
from heads.block.dflash import DFlashHead
from heads.block.dflash_config import is_dflash
from heads.block.model import BlockHead
from heads.checkpoints.files import CONFIG, resolve
from heads.decoder.features import head_features, new_positions
from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState, check_tree
from selfspec.core.files import read_json_object
from selfspec.core.position_draft import best_first_draft
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree


class BlockDrafter(Drafter):
    """tree: a DynamicTree (its budget best nodes each step, at most its depth deep) or a static tree (a chain of k:
    the block's top-1 path), at most K deep and no wider than the draft vocabulary."""

    def __init__(self, head: BlockHead | DFlashHead, tree: Tree | DynamicTree):
        self.head = head.eval()
        K, V = head.block_size, head.config.draft_vocab_size
        self.dynamic = tree if isinstance(tree, DynamicTree) else None
        if self.dynamic is not None:
            if tree.depth is not None and tree.depth > K:
                raise ValueError(f"--tree dynamic:{tree.budget},depth={tree.depth}: this block drafter drafts blocks of "
                                 f"{K} tokens (block_size {K}), so expected depth <= {K}, found {tree.depth}")
            self.depth, self.ranks = tree.depth or K, min(tree.max_rank, V)
            self._trees: dict[tuple[tuple[int, ...], ...], Tree] = {}  # best_first_draft's memo: choices -> Tree
        else:
            if tree.depth < 1:
                raise ValueError(f"a block drafter drafts at least one token: expected a tree of depth 1..{K}, found "
                                 f"depth {tree.depth}")
            self.tree = check_tree(tree, max_depth=K, max_topk=V, drafter=f"block drafter (blocks of {K} tokens over "
                                                                            f"a {V}-token draft vocabulary)")
            self.depth, self.ranks = tree.depth, tree.max_rank + 1
            # [N - 1] each draft node's block position and candidate rank there
            self._slot = (self.tree.depth_tensor[1:] - 1, torch.tensor(self.tree.ranks[1:]))
        self.cache = None  # the head's (new_cache)
        self.committed = 0  # committed positions the head's cache has read

    @classmethod
    def with_tree(cls, head: BlockHead | DFlashHead, tree: Tree | DynamicTree | None) -> "BlockDrafter":
        """tree None: the checkpoint's defaults (its budget, its depth or the whole block)."""
        if tree is None:
            return cls(head, DynamicTree(head.config.budget, depth=head.config.depth))
        return cls(head, tree)

    @property
    def max_depth(self) -> int:
        """K: one forward drafts a block of K positions, no deeper."""
        return self.head.block_size

    def resized(self, depth: int, budget: int) -> "BlockDrafter":
        return BlockDrafter(self.head, DynamicTree.resized(self.dynamic, budget, depth))

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        block = self._block(state)  # [K, D]
        root = state.tokens[-1:]
        if self.head.chained:  # a conditioned block: the tree grown depth by depth (heads/block/chained.py)
            chain = Chain(self.head, block[: self.depth], self.ranks)
            if self.dynamic is not None:
                return grow(chain, root, self.dynamic.budget, self.depth, self.dynamic.min_logp, self._trees)
            return fill(chain, root, self.tree)
        # 3. the tree from the first ``depth`` positions' top candidates
        logp = torch.log_softmax(self.head.logits(block[: self.depth]).float(), dim=-1)  # [depth, V']
        top = logp.topk(self.ranks, dim=-1)  # [depth, R]
        tokens = self.head.base_ids(top.indices)  # [depth, R] base token ids
        if self.dynamic is not None:
            return best_first_draft(root, top.values, tokens, self.dynamic.budget, self._trees, self.dynamic.min_logp)
        position, rank = self._slot
        nodes = tokens[position.to(tokens.device), rank.to(tokens.device)]  # [N - 1]
        return Draft(tree=self.tree, tokens=torch.cat([root, nodes.to(device=root.device, dtype=root.dtype)]))

    def _block(self, state: DraftState) -> torch.Tensor:
        """Steps 1 and 2: the head's states for the block, [K, D]."""
        tokens, T, A = state.tokens, state.tokens.shape[0], new_positions(state, "the block drafter")
        if A < 1:
            raise ValueError(f"the block drafter drafts after a committed position: expected a text of >= 2 tokens "
                             f"with new hidden states, found {T} tokens and {A} new states")
        if self.cache is None or state.starts_request:  # the first draft sees the whole prompt
            self.cache, self.committed = self.head.new_cache(), 0
        elif self.committed + A != T - 1:
            raise RuntimeError(f"the block drafter is out of step: its cache holds {self.committed} committed positions "
                               f"and {A} new ones arrived, but the text has {T - 1} before the root")
        features = head_features(self.head.config.feature_layers, state, "block drafter")  # [A, D] or [A, L·D]
        out = self.head.block(self.cache, features, tokens)  # [K, D]
        self.committed = T - 1
        return out

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


def load_drafter(path_or_repo_id: str | Path, target: Target, revision: str | None = None,
                 tree: Tree | DynamicTree | None = None) -> BlockDrafter:
    """The ``block`` entry point of ``selfspec.drafters``: the head on ``target`` as a BlockDrafter. tree: None (the
    checkpoint's budget and depth), ``dynamic:N[,depth=D]`` (D <= K), ``chain:k`` (the block's top-1 path, k <= K), or
    any static tree at most K deep.

    Both block formats: selfspec's own block head (config.json with draft_type "block", heads/block/model.py), and a
    DFlash draft in the format of vLLM's speculators library (speculators_model_type "dflash", heads/block/dflash.py;
    its drafting defaults: 16 nodes, the whole block deep)."""
    config = read_json_object(resolve(path_or_repo_id, revision) / CONFIG, "the block draft's config")
    cls = DFlashHead if is_dflash(config) else BlockHead
    head = cls.from_pretrained(path_or_repo_id, target.model, revision=revision)
    return BlockDrafter.with_tree(head, tree)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""a block drafter (selfspec's, or a speculators DFlash draft; entry point ``block`` of ``selfspec.drafters``): fixed
and dynamic trees (no deeper than its block: ``max_depth``), tuned by ``infer.py tune-tree``."""
