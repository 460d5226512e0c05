"""Tree: constructors, the tensors a verification needs, refusals; Draft.truncated; check_tree."""

from __future__ import annotations

import pytest
import torch

from selfspec import Draft, Tree, check_tree

# root, two candidates at depth 1, two children under the first, one under the second
CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def test_chain():
    t = Tree.chain(3)
    assert t.parents == (-1, 0, 1, 2) and t.ranks == (0, 0, 0, 0)
    assert t.depths == (0, 1, 2, 3) and t.depth == 3 and t.max_rank == 0 and len(t) == 4
    assert torch.equal(t.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert t.leaf_paths.tolist() == [[0, 1, 2, 3]]
    assert t.choices == ((0,), (0, 0), (0, 0, 0))


def test_chain_of_zero_is_the_root_alone():
    t = Tree.chain(0)
    assert t.parents == (-1,) and t.depth == 0 and t.leaf_paths.tolist() == [[0]]
    assert t.ancestor_mask.tolist() == [[True]]


def test_from_choices():
    t = Tree.from_choices(CHOICES)
    assert t.parents == (-1, 0, 0, 1, 1, 2)
    assert t.ranks == (0, 0, 1, 0, 1, 0)
    assert t.depths == (0, 1, 1, 2, 2, 2)
    assert t.depth_tensor.tolist() == [0, 1, 1, 2, 2, 2]
    assert t.parent_tensor.tolist() == [0, 0, 0, 1, 1, 2]  # the root points at itself
    assert t.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert t.leaf_paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert t.path_to(4) == [0, 1, 4]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(t.ancestor_mask, expected)
    assert t.choices == tuple(CHOICES)


def test_from_choices_ignores_order_duplicates_and_the_empty_path():
    shuffled = [(1, 0), (0,), (0, 1), (), (1,), (0, 0), (0,)]
    assert Tree.from_choices(shuffled) == Tree.from_choices(CHOICES)


def test_from_choices_refuses_orphans_and_negative_ranks():
    with pytest.raises(ValueError, match=r"choice \[1, 0\] has no parent: add \[1\] to the choices"):
        Tree.from_choices([(0,), (1, 0)])
    with pytest.raises(ValueError, match=r"choice \[-1\] has a negative rank"):
        Tree.from_choices([(-1,)])


def test_uneven_leaf_paths_are_padded():
    t = Tree.from_choices([(0,), (1,), (0, 0), (0, 0, 0)])
    assert t.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]


def test_from_parents():
    t = Tree.from_parents([-1, 0, 0, 1])
    assert t.ranks == (0, 0, 1, 0)
    assert t == Tree.from_choices([(0,), (1,), (0, 0)])
    # explicit ranks decide the order in which siblings are tried, whatever their index
    u = Tree.from_parents([-1, 0, 0], ranks=[0, 1, 0])
    assert u.children[0] == (2, 1)
    assert u.choices == ((1,), (0,))


def test_full():
    t = Tree.full([2, 3])
    assert len(t) == 1 + 2 + 6 and t.depth == 2 and t.max_rank == 2
    assert [len(t.children[i]) for i in t.children[0]] == [3, 3]
    assert len(t.leaf_paths) == 6
    assert Tree.full([1, 1, 1]) == Tree.chain(3)


@pytest.mark.parametrize(
    "parents, ranks, message",
    [
        ((), (), r"a tree needs a root at index 0 with parent -1; found parents=\[\]"),
        ((0, 0), (0, 0), r"a tree needs a root at index 0 with parent -1; found parents=\[0, 0\]"),
        ((-1, 0), (0,), r"ranks has 1 entries, expected one per node \(2\)"),
        ((-1, 2, 0), (0, 0, 1), r"node 1 has parent 2; expected a parent index in \[0, 1\) \(topological order\)"),
        ((-1, 0, 0), (0, 0, 0), r"node 2 repeats rank 0 under parent 0"),
    ],
)
def test_malformed_trees_are_refused(parents, ranks, message):
    with pytest.raises(ValueError, match=message):
        Tree(parents=parents, ranks=ranks)


def test_negative_chain_is_refused():
    with pytest.raises(ValueError, match="chain length must be >= 0, got -1"):
        Tree.chain(-1)


def test_check_tree():
    tree = Tree.from_choices(CHOICES)  # depth 2, ranks up to 1 (top-2)
    assert check_tree(tree, max_depth=2, max_topk=2, drafter="medusa heads") is tree
    deep = r"the tree is 2 levels deep, but 1 is the most the medusa heads can draft; use a tree of depth <= 1"
    with pytest.raises(ValueError, match=deep):
        check_tree(tree, max_depth=1, max_topk=4, drafter="medusa heads")
    wide = r"asks for the top-2 candidate, but top-1 is the most the medusa heads can offer; use ranks < 1"
    with pytest.raises(ValueError, match=wide):
        check_tree(tree, max_depth=4, max_topk=1, drafter="medusa heads")


def test_truncated_draft():
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])  # nodes: 0 | 1 2 | 3 4 | 5
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    q = torch.arange(6 * 4, dtype=torch.float).reshape(6, 4)
    d = Draft(tree=tree, tokens=tokens, q=q)
    assert d.truncated(3) is d and d.truncated(7) is d
    two = d.truncated(2)
    assert two.tree == Tree.from_choices([(0,), (1,), (0, 0), (0, 1)])
    assert two.tokens.tolist() == [10, 11, 12, 13, 14] and torch.equal(two.q, q[:5])
    one = d.truncated(1)
    assert one.tree == Tree.from_choices([(0,), (1,)]) and one.tokens.tolist() == [10, 11, 12]
    root = Draft(tree=tree, tokens=tokens).truncated(0)
    assert root.tree == Tree.chain(0) and root.tokens.tolist() == [10] and root.q is None


def test_truncated_draft_keeps_ranks_and_remaps_parents():
    # nodes not in depth order: the second depth-1 candidate comes after a depth-2 node
    tree = Tree.from_parents([-1, 0, 1, 0, 3], ranks=[0, 1, 0, 0, 0])
    d = Draft(tree=tree, tokens=torch.tensor([5, 6, 7, 8, 9])).truncated(1)
    assert d.tree.parents == (-1, 0, 0) and d.tree.ranks == (0, 1, 0)
    assert d.tokens.tolist() == [5, 6, 8]


def test_draft_needs_one_token_per_node():
    with pytest.raises(ValueError, match=r"a draft needs one token per tree node \(3\), found \(2,\)"):
        Draft(tree=Tree.chain(2), tokens=torch.tensor([1, 2]))


def test_is_chain():
    assert Tree.chain(0).is_chain and Tree.chain(5).is_chain
    assert not Tree.from_choices([(0,), (1,)]).is_chain
    assert not Tree.from_parents([-1, 0, 0, 1]).is_chain
