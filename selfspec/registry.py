"""The one place a draft spec becomes a drafter: ``--draft`` / ``--tree`` strings parsed and checked before any model is
loaded, then built on the loaded target.

    1. parse    ``parse_draft`` (a ``--draft``, with a ``--tree``), ``parse_draft_at`` ('DRAFT@TREE': bench methods,
                costs' --loop-draft, policy arms), ``split_drafts`` (comma-separated lists of them) -> DraftSpec,
                model-free: a checkpoint's config.json is read, no weights; a bad tree, or one the draft cannot take,
                fails here
    2. check    ``selfspec.base_check.check_drafts``: draft checkpoints trained for another base model are refused,
                from the target's config alone
    3. build    ``build``: the tree resolved ('auto': what ``infer.py tune-tree`` cached for this machine,
                ``selfspec.tuned``), the drafter constructed on the target

``--draft`` accepts:

- ``none``                          plain decoding through the speculative loop (``NoDrafter``)
- ``ngram`` / ``ngram:depth=8,max_nodes=24``   prompt lookup over a trie (``NGramDrafter``), no training
- ``early-exit:layer=E`` (optionally ``,depth=4,stop_below=0.3``)   the first E layers + the final norm and LM head
  (``EarlyExitDrafter``), no training
- ``model:<dir or Hub id>``         a separate draft model: any causal LM with the target's tokenizer drafts a chain or
  a tree from its own cache (``ModelDrafter``), e.g. one ``train.py`` distilled (``method: draft_model``); a
  transformers model directory given without ``model:`` is the same (kind 'model': an entry point like the others)
- a local directory or a Hub id whose ``config.json`` says ``"draft_type": X``: loaded by the function registered
  under entry-point group ``selfspec.drafters``, name X, called as ``load(path_or_repo_id, target, revision=, tree=)``.
  selfspec never imports the package that trains drafts; that package registers its loaders in its pyproject. What an
  entry point names is the kind's ``DraftKind`` (its loader and what it can do: ``kind_of``), read when a spec is
  checked, before any model loads; the drafts ``--draft`` builds itself declare theirs in ``BUILT_IN``.
  A checkpoint of vLLM's ``speculators`` library names no draft_type but ``"speculators_model_type": T``: its kind is
  ``SPECULATORS_KINDS[T]`` (``eagle3`` -> ``eagle``, ``dflash`` -> ``block``: those loaders read both formats), so
  it drafts, takes trees and is tuned as that kind is

- ``A+B`` (any number of parts)    the drafts of A and B verified as one tree each step (``merge.MergedDrafter``),
  e.g. ``runs/eagle_head+ngram``: a trained head and prompt lookup; ``--tree`` applies to the first checkpoint part
  (``auto``: the budget ``infer.py tune-tree --draft A+B`` tuned inside this merge, else the one tuned for the part);
  a trailing ``+skip_after=K`` lets a part sit out the steps where an earlier part had K of its tokens accepted
  (``ngram+runs/eagle_head+skip_after=3``: the head rests while prompt lookup is copying), ``+skip_match=K`` the
  steps where prompt lookup's draft continues a match of K of the text's last tokens (judged at the step itself),
  ``+skip_unpaid=P`` the steps where it is measured, while decoding, to add fewer tokens than the time it costs
  (per match length; every P-th such step it drafts anyway, to measure again)

``--tree`` accepts ``chain:K``, ``full:3,2,1`` (children per level), Medusa-style JSON choices ``[[0], [0, 0], [1]]``
or a ``.json`` file holding such a list, ``dynamic:N`` / ``dynamic:N,depth=D``, and ``auto``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from selfspec import tuned
from selfspec.core.drafter import NO_DRAFT, DraftKind, Drafter, NoDrafter
from selfspec.core.files import read_json_object
from selfspec.core.models import looks_local, unreachable_hub
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree
from selfspec.drafts import early_exit, ngram
from selfspec.drafts.early_exit import EarlyExitDrafter
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.ngram import NGramDrafter
from selfspec.drafts.policy import PolicyDrafter, read_policy

ENTRY_POINT_GROUP = "selfspec.drafters"
# a trailing option of 'A+B': '+skip_after=3' (MergedDrafter)
MERGE_OPTION = re.compile(r"(skip_after|skip_match|skip_unpaid)=\d+")
NGRAM_KEYS = ("max_ngram", "min_ngram", "depth", "max_nodes", "max_matches", "copy_depth")
EARLY_EXIT_KEYS = {"layer": int, "depth": int, "stop_below": float}
ACCEPTED = (
    "'none', 'ngram' (optionally 'ngram:depth=8,max_nodes=24' with keys " + ", ".join(NGRAM_KEYS) + "), "
    "'early-exit:layer=E' (optional keys depth, stop_below), 'model:<dir or Hub id>' (a separate draft model with the "
    "target's tokenizer), or a local directory / Hub id of a draft checkpoint whose config.json has \"draft_type\""
)
SPECULATORS_KINDS = {"eagle3": "eagle", "dflash": "block"}
"""speculators_model_type (config.json of a vLLM ``speculators`` checkpoint) -> the draft kind whose entry point loads
it."""
BUILT_IN: dict[str, DraftKind] = {"none": NO_DRAFT, "ngram": ngram.KIND, "early-exit": early_exit.KIND}
"""the drafts ``--draft`` builds from its own options (no checkpoint), by kind -> what each declares; every other kind
is a checkpoint's, found by name in entry-point group ``selfspec.drafters`` (``kind_of``)."""
TreeArg = str | Tree | DynamicTree | None
"""a --tree: its string ('chain:3', 'dynamic:16', 'auto', ...), a Tree or a DynamicTree; None: the draft's own."""


# ------------------------------------------------------------------------------------------------------ 1. parse
@dataclass(frozen=True)
class DraftSpec:
    """A parsed ``--draft``: what kind of drafter, where its checkpoint is, what its config.json says, and the tree it
    is to draft (validated, unresolved: 'auto' stays 'auto' until a target is loaded)."""

    kind: str
    """'none', 'ngram', or a checkpoint's draft_type."""
    location: str | None = None
    """the checkpoint directory or Hub id (None for 'none' / 'ngram')."""
    config: dict[str, Any] = field(default_factory=dict)
    """the checkpoint's config.json, or the n-gram options."""
    revision: str | None = None
    parts: tuple["DraftSpec", ...] = ()
    """for kind 'merged' (``A+B``): the drafts whose trees are merged, the first one taking ``--tree``."""
    tree: TreeArg = None
    """its --tree ('DRAFT@TREE', or ``parse_draft``'s tree); None: the drafter's or checkpoint's own."""

    @property
    def capabilities(self) -> DraftKind:
        """What its kind declares it can do (``kind_of``); a merged draft's: those of the part --tree applies to."""
        return tree_part(self).capabilities if self.parts else kind_of(self.kind)

    @property
    def label(self) -> str:
        """A short name for file names and tables: 'none', 'ngram' or 'ngram:depth=6' (the options as given, so two
        configurations never share a name), the checkpoint's directory name, or 'A+B' of the parts' labels; then
        '@TREE' where it has a --tree string ('DRAFT@TREE')."""
        return self._name + (f"@{self.tree}" if isinstance(self.tree, str) else "")

    @property
    def text(self) -> str:
        """The ``--draft`` string that parses to this spec (a checkpoint by its directory or Hub id), without its tree."""
        if self.parts:
            return "+".join([p.text for p in self.parts] + [f"{k}={v}" for k, v in self.config.items()])
        if self.kind == "model":
            return f"model:{self.location}"
        return self.location or self._name

    @property
    def _name(self) -> str:
        if self.parts:
            return "+".join([p.label for p in self.parts] + [f"{k}={v}" for k, v in self.config.items()])
        if self.location is None:
            options = ",".join(f"{k}={v}" for k, v in self.config.items())
            return f"{self.kind}:{options}" if options else self.kind
        return Path(self.location.rstrip("/")).name or self.kind


def _read_hub_config(repo_id: str, revision: str | None) -> dict[str, Any]:
    if reason := unreachable_hub(repo_id, "config.json", revision):
        raise FileNotFoundError(f"--draft {repo_id!r} is not a local directory, and its config.json cannot come from "
                                f"the Hub: {reason}. Expected {ACCEPTED}.")
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision)
    except (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OSError) as err:
        raise FileNotFoundError(
            f"--draft {repo_id!r} is not a local directory, and its config.json could not be fetched from the Hub "
            f"({type(err).__name__}: {err}). Expected {ACCEPTED}."
        ) from err
    return read_json_object(Path(path), f"the config.json of Hub repo {repo_id}")


def _options(what: str, text: str, keys: dict[str, type]) -> dict[str, Any]:
    """'depth=8,max_nodes=24' -> {'depth': 8, 'max_nodes': 24} for the keys ``keys`` names, of the types it gives;
    unknown keys and values of another type fail naming ``what``."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"bad {what} option {item!r}: expected key=value with key one of {', '.join(keys)}")
        try:
            out[key] = keys[key](value)
        except ValueError:
            kind = "an integer" if keys[key] is int else "a number"
            raise ValueError(f"{what} option {key} must be {kind}, found {value!r}") from None
    return out


def parse_ngram(options: str) -> dict[str, int]:
    """'depth=8,max_nodes=24' -> {'depth': 8, 'max_nodes': 24}; unknown keys and non-integers fail."""
    out = _options("n-gram", options, dict.fromkeys(NGRAM_KEYS, int))
    NGramDrafter(**out)  # validates the ranges now, not after the model is loaded
    return out


def parse_early_exit(options: str) -> dict[str, Any]:
    """'layer=15,depth=4,stop_below=0.3' -> {'layer': 15, 'depth': 4, 'stop_below': 0.3}; layer is required."""
    out = _options("early-exit", options, EARLY_EXIT_KEYS)
    if "layer" not in out:
        raise ValueError("early-exit needs the exit layer: --draft early-exit:layer=E with 1 <= E < the number of layers")
    return out


def parse_draft(spec: str, revision: str | None = None, tree: TreeArg = None) -> DraftSpec:
    """Parse and validate a ``--draft`` string, reading a checkpoint's config.json but no weights; with ``tree`` (its
    --tree), the tree too, and that the draft can take it."""
    if tree is not None and tree != "":
        return with_tree(parse_draft(spec, revision), tree)
    if "+" in spec and not Path(spec).expanduser().exists():
        pieces = spec.split("+")
        options = {}
        while pieces and MERGE_OPTION.fullmatch(pieces[-1]):
            key, _, value = pieces.pop().partition("=")
            options[key] = int(value)
        options = dict(sorted(options.items()))  # one name (and one tuning cache key) however they were given
        parts = tuple(parse_draft(p, revision) for p in pieces)
        if len(parts) < 2:
            raise ValueError(f"--draft {spec!r}: expected at least two drafts joined by '+', found {len(parts)}")
        for p in parts:
            if p.kind == "none" or p.parts:
                raise ValueError(f"--draft {spec!r}: a merged draft joins drafts that draft something; found {p.kind!r}")
        return DraftSpec(kind="merged", parts=parts, config=options)
    if spec == "none":
        return DraftSpec(kind="none")
    if spec == "ngram" or spec.startswith("ngram:"):
        return DraftSpec(kind="ngram", config=parse_ngram(spec[len("ngram:"):]))
    if spec == "early-exit" or spec.startswith("early-exit:"):
        return DraftSpec(kind="early-exit", config=parse_early_exit(spec[len("early-exit:"):]))
    if spec == "model" or spec.startswith("model:"):
        return parse_draft_model(spec[len("model:"):], revision)
    if looks_local(spec):
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"draft checkpoint directory {path} does not exist. --draft expects {ACCEPTED}.")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a draft checkpoint directory (config.json + weights)")
        config = read_json_object(path / "config.json", "the draft checkpoint's config")
        location = str(path)
    elif "/" in spec:
        config = _read_hub_config(spec, revision)
        location = spec
    else:
        raise ValueError(f"unknown --draft {spec!r}: expected {ACCEPTED}")
    draft_type = checkpoint_kind(config, location)
    loaders = drafter_loaders()
    if draft_type not in loaders:
        known = ", ".join(sorted(loaders)) or "none registered: is the package that trains heads installed (pip install -e .)?"
        raise ValueError(
            f"{location} is a {draft_type!r} draft, but no loader is registered for it under entry-point group "
            f"{ENTRY_POINT_GROUP!r} (registered: {known})"
        )
    return DraftSpec(kind=draft_type, location=location, config=config, revision=revision)


def parse_draft_model(where: str, revision: str | None) -> DraftSpec:
    """'model:<dir or Hub id>': a separate draft model, its config.json read (no weights)."""
    if not where:
        raise ValueError("--draft model: expected the draft model after the colon: model:<directory or Hub id>")
    if looks_local(where):
        path = Path(where).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--draft model:{where}: {path} is not a model directory (expected a transformers "
                                    "model directory with config.json)")
        config, location = read_json_object(path / "config.json", "the draft model's config"), str(path)
    else:
        config, location = _read_hub_config(where, revision), where
    if "draft_type" in config or "speculators_model_type" in config:
        raise ValueError(f"--draft model:{where} is a draft checkpoint, not a model: pass it as --draft {where}")
    return DraftSpec(kind="model", location=location, config=config, revision=revision)


def checkpoint_kind(config: dict[str, Any], location: str) -> str:
    """The kind of draft a checkpoint's config.json names: its "draft_type", or for a checkpoint of vLLM's speculators
    library its speculators_model_type's kind (``SPECULATORS_KINDS``), or 'model' for a transformers causal LM (a
    separate draft model)."""
    draft_type = config.get("draft_type")
    if isinstance(draft_type, str):
        return draft_type
    speculators = config.get("speculators_model_type")
    if isinstance(speculators, str):
        if speculators not in SPECULATORS_KINDS:
            raise ValueError(f"{location} is a speculators {speculators!r} checkpoint; selfspec drafts with speculators' "
                             f"{', '.join(SPECULATORS_KINDS)} checkpoints")
        return SPECULATORS_KINDS[speculators]
    if isinstance(config.get("model_type"), str) and any(str(a).endswith("ForCausalLM")
                                                         for a in config.get("architectures") or ()):
        return "model"  # a transformers causal LM: a separate draft model
    raise ValueError(f"{location}/config.json has no \"draft_type\" string (found {draft_type!r}) and no "
                     f"\"speculators_model_type\"; expected {ACCEPTED}")


def parse_draft_at(text: str, revision: str | None = None) -> DraftSpec:
    """'DRAFT' or 'DRAFT@TREE' (a bench method, costs' --loop-draft, a policy arm): the draft as ``--draft`` takes it,
    with TREE as its ``--tree``, both validated."""
    draft, _, tree = text.partition("@")
    return parse_draft(draft, revision, tree or None)


_OPTION = re.compile(r"[a-z_]+=[\w.\-]+([+@].*)?")  # 'max_nodes=8', 'depth=3', 'max_nodes=8@auto', 'max_nodes=8+runs/h'


def split_drafts(text: str) -> tuple[str, ...]:
    """A comma-separated list of drafts ('DRAFT@TREE' allowed) or bench methods:
    'plain,ngram:depth=6,max_nodes=8,runs/h@dynamic:12,depth=3' -> ('plain', 'ngram:depth=6,max_nodes=8',
    'runs/h@dynamic:12,depth=3'): a bare 'key=value' piece is an option of the one before it, not a draft."""
    out: list[str] = []
    for piece in (s.strip() for s in text.split(",")):
        if not piece:
            continue
        if out and _OPTION.fullmatch(piece):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return tuple(out)


# ------------------------------------------------------------------------------------------------------ 2. trees
MAX_TREE_NODES = 1024
"""the most draft nodes a --tree may verify a step: every step verifies them all, as a prompt that long would cost (a
verify's cost grows with its nodes; the sizes of the trees that pay are measured in docs/benchmarks/log.md, "What a
step costs"), so a bound far above them refuses a typo, not a choice."""


def _count(text: str, what: str) -> int:
    """A --tree size: a whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{what}: expected a whole number >= 1, found {text!r}")
    return int(text)


def _nodes(nodes: int) -> int:
    """A tree's draft node count, refused above MAX_TREE_NODES."""
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"{nodes:,} draft nodes, more than the {MAX_TREE_NODES} a step may verify (each step verifies "
                         f"them all, as a prompt that long would cost); trees that pay are far smaller (docs/"
                         f"benchmarks/log.md, \"What a step costs\"), 'auto' picks this machine's")
    return nodes


def parse_tree(spec: str | None) -> Tree | DynamicTree | None:
    """A ``--tree`` string -> Tree, or DynamicTree for 'dynamic:N' (None keeps the drafter's or checkpoint's own)."""
    if spec is None or spec == "":
        return None
    if spec == "auto":
        raise ValueError("--tree auto is resolved with the draft and the target (registry.resolve_tree), not alone")
    forms = ("expected 'chain:K', 'full:3,2,1', 'dynamic:N', 'dynamic:N,depth=D' or 'dynamic:N,depth=D,min_prob=P' (N "
             "nodes grown each step by draft probability, none below P), 'auto' (the budget tuned for this machine by "
             "infer.py tune-tree), "
             "JSON choices like '[[0],[0,0],[1]]', or a .json file of choices")
    try:
        if spec.startswith("dynamic:"):
            return _dynamic_tree(spec[len("dynamic:"):])
        if spec.startswith("chain:"):
            return Tree.chain(_nodes(_count(spec[len("chain:"):], "K")))
        if spec.startswith("full:"):
            widths = [_count(k, "each width") for k in spec[len("full:"):].split(",")]
            _nodes(sum(math.prod(widths[: i + 1]) for i in range(len(widths))))  # before a tree that size is built
            return Tree.full(widths)
        text = spec
        if spec.endswith(".json"):
            path = Path(spec).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"tree file {path} does not exist; {forms}")
            text = path.read_text()
        if text.lstrip().startswith("["):
            choices = json.loads(text)
            if not all(isinstance(c, list) and all(isinstance(r, int) for r in c) for c in choices):
                raise ValueError(f"tree choices must be a list of lists of integers, found {text[:80]!r}")
            _nodes(len(choices))
            return Tree.from_choices(choices)
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"bad --tree {spec!r}: {err}; {forms}") from err
    raise ValueError(f"unknown --tree {spec!r}: {forms}")


def _dynamic_tree(text: str) -> DynamicTree:
    """'N[,depth=D][,min_prob=P]' -> DynamicTree."""
    budget, *options = text.split(",")
    given: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in ("depth", "min_prob") or key in given:
            raise ValueError(f"dynamic tree option {option!r}: expected depth=D or min_prob=P, each at most once")
        given[key] = value
    try:
        min_prob = float(given.get("min_prob", 0.0))
    except ValueError:
        raise ValueError(f"min_prob: expected a probability such as 0.05, found {given['min_prob']!r}") from None
    return DynamicTree(_nodes(_count(budget, "N")), depth=_count(given["depth"], "D") if "depth" in given else None,
                       min_prob=min_prob)


def resolve_tree(tree: TreeArg, spec: DraftSpec, target: Target, model_id: str) -> Tree | DynamicTree | None:
    """A --tree value for ``spec`` on ``target``: 'auto' is the (budget, depth) that ``infer.py tune-tree`` measured
    fastest for this draft, target (``model_id``), dtype and machine (``tuned.auto_tree``); anything else as
    ``parse_tree``. For a merged draft, the tree of its first checkpoint part."""
    if tree == "auto":
        return tuned.auto_tree(spec, target, model_id, tree_part(spec) if spec.parts else None)
    _check_tree_type(tree)
    return parse_tree(tree) if isinstance(tree, str) else tree


def _check_tree_type(tree: Any) -> None:
    if not (tree is None or isinstance(tree, (str, Tree, DynamicTree))):
        raise TypeError(f"tree: expected a --tree string ('chain:3', 'dynamic:16', 'auto', ...), a Tree or a "
                        f"DynamicTree, found {type(tree).__name__} {tree!r:.60}")


def tree_part(spec: DraftSpec) -> DraftSpec:
    """The part of a merged draft that --tree applies to: its first checkpoint (else its first part)."""
    return next((p for p in spec.parts if p.location is not None), spec.parts[0])


def _ngram_size(tree: DynamicTree) -> dict[str, int]:
    """'dynamic:N,depth=D' (or a tuned tree) for prompt lookup: max_nodes N, depth D."""
    return {"max_nodes": tree.budget, **({"depth": tree.depth} if tree.depth is not None else {})}


def check_tree_applies(spec: DraftSpec, tree: Tree | DynamicTree | None) -> None:
    """Refuse a tree the draft cannot take (the part of a merge --tree applies to), from the specs alone: nothing
    needs to be loaded for it."""
    if spec.parts:
        return check_tree_applies(tree_part(spec), tree)
    can = spec.capabilities
    if spec.kind == "ngram" and isinstance(tree, DynamicTree):
        if tree.min_prob > 0:
            raise ValueError(f"--tree {tree.spec}: prompt lookup's drafts have no probabilities for min_prob to cut "
                             "by; size its trie with depth and max_nodes alone")
        if clash := sorted(_ngram_size(tree).keys() & spec.config.keys()):
            raise ValueError(f"--tree {tree.spec} sizes prompt lookup's trie, and --draft {spec.text} sets "
                             f"{' and '.join(clash)} too: give the size once")
    elif tree is not None and not can.fixed_trees and not (can.dynamic_trees and isinstance(tree, DynamicTree)):
        hint = ("ngram grows its own trie: size it with 'ngram:depth=8,max_nodes=24' or --tree dynamic:24,depth=8"
                if spec.kind == "ngram" else "")
        raise ValueError(f"--tree does not apply to --draft {spec.kind}; {hint or 'it drafts nothing'}")
    elif isinstance(tree, DynamicTree) and not can.dynamic_trees:
        raise ValueError(f"--tree dynamic:{tree.budget} needs a drafter whose candidates at each depth have their own "
                         f"probabilities (its kind declares dynamic_trees); --draft {spec.kind} takes a fixed tree such "
                         "as chain:4")


def with_tree(spec: DraftSpec, tree: TreeArg) -> DraftSpec:
    """``spec`` to draft ``tree``, refused now if the draft cannot take it ('auto' is checked once a target is loaded)."""
    _check_tree_type(tree)
    if tree != "auto":
        check_tree_applies(spec, parse_tree(tree) if isinstance(tree, str) else tree)
    return replace(spec, tree=tree)


# ------------------------------------------------------------------------------------------------------ 3. build
def drafter_loaders() -> dict[str, Any]:
    """The registered checkpoint kinds: entry-point name -> EntryPoint (not imported yet)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def kind_of(kind: str) -> DraftKind:
    """What draft kind ``kind`` declares it can do: a built-in's (``BUILT_IN``), else the DraftKind its entry point
    names, imported now (an entry point naming a bare loader function declares the defaults: fixed trees only, not
    tuned, its base checked)."""
    if kind in BUILT_IN:
        return BUILT_IN[kind]
    loaders = drafter_loaders()
    if kind not in loaders:
        known = ", ".join(sorted(loaders)) or "none registered: is the package that trains heads installed (pip install -e .)?"
        raise ValueError(f"no loader is registered for a {kind!r} draft under entry-point group {ENTRY_POINT_GROUP!r} "
                         f"(registered: {known})")
    entry = loaders[kind]
    try:
        declared = entry.load()
    except ImportError as err:
        raise ImportError(f"the {kind!r} drafter is registered as {entry.value} but cannot be imported: {err}") from err
    return declared if isinstance(declared, DraftKind) else DraftKind(load=declared)


def build_drafter(spec: DraftSpec, target: Target, tree: Tree | DynamicTree | None = None) -> Drafter:
    """Construct the drafter a DraftSpec names, for this target (loads the checkpoint's weights, if any)."""
    if spec.parts:
        takes_tree = tree_part(spec)
        return MergedDrafter([build_drafter(p, target, tree if p is takes_tree else None) for p in spec.parts],
                             skip_after=spec.config.get("skip_after"), skip_match=spec.config.get("skip_match"),
                             skip_unpaid=spec.config.get("skip_unpaid"))
    check_tree_applies(spec, tree)
    if spec.kind == "ngram":
        return NGramDrafter(**spec.config, **(_ngram_size(tree) if isinstance(tree, DynamicTree) else {}))
    if spec.kind == "none":
        return NoDrafter()
    if spec.kind == "early-exit":
        opts = dict(spec.config)
        return EarlyExitDrafter(target, opts.pop("layer"), tree=tree, **opts)
    loader: Callable[..., Drafter] | None = kind_of(spec.kind).load
    where = drafter_loaders()[spec.kind].value
    if loader is None:
        raise TypeError(f"{where} declares a {spec.kind!r} draft with no loader (DraftKind.load)")
    drafter = loader(spec.location, target, revision=spec.revision, tree=tree)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"{where} returned {type(drafter).__name__}, expected a selfspec Drafter (draft + update)")
    return drafter


def build(spec: str | DraftSpec, target: Target, model_id: str, tree: TreeArg = None,
          revision: str | None = None) -> Drafter:
    """The drafter ``spec`` names, on ``target`` (``model_id``: the name the target was loaded by, which tuned trees
    are cached under): a string is parsed as ``parse_draft_at`` (at ``revision``); its tree is ``tree`` where given,
    else the spec's own, resolved ('auto': tune-tree's for this machine) before the drafter is built."""
    if isinstance(spec, str):
        spec = parse_draft_at(spec, revision)
    resolved = resolve_tree(spec.tree if tree is None else tree, spec, target, model_id)
    return build_drafter(spec, target, resolved)


def load_policy(path_or_repo_id: str | Path, target: Target, revision: str | None = None,
                tree: TreeArg = None) -> PolicyDrafter:
    """A local policy directory (``selfspec.drafts.policy``); each arm is built as ``--draft`` builds it
    (``DRAFT@TREE``: the arm's own tree, 'auto' as tuned for this machine)."""
    policy = read_policy(path_or_repo_id, target, tree)
    return PolicyDrafter(policy, [build(arm, target, policy.base_model) for arm in policy.arms])


POLICY = DraftKind(load=load_policy)
"""draft_type "policy" (entry point ``policy`` of ``selfspec.drafters``; declared here because its arms are built by
``build``): not tuned as a whole; a --tree is refused by ``read_policy`` itself, which says each arm carries its own."""
