"""The training recipe: typed, strict dataclasses loaded from YAML plus ``key=value`` / ``a.b=value`` overrides.

Every field has a type and a one-line docstring. Loading checks every value against its field's type (nested
dataclasses, ``X | None``, ``Literal[...]``, ``list[X]``, ``dict``): an unknown key fails with the closest known names,
a wrong type fails with what was expected and what was found. Overrides are parsed as YAML scalars (``3``, ``1e-3``,
``true``, ``null``, ``[a, b]``), except that a field typed ``str`` keeps the text as written. No exec, no eval.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

import yaml

from heads.data import DataConfig

T = TypeVar("T")
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
FINAL_DIRS = {"medusa": "heads", "hydra": "hydra_heads", "exit_head": "exit_head", "eagle": "eagle_head"}
"""method -> the subdirectory of output_dir the trained draft is saved to."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """the frozen target: a built-in name, a local directory, a Hub id, a .gguf file, or "tiny-random-llama" (tests)."""
    revision: str | None = None
    """the Hub revision of the target (recorded in the heads' config.json)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the frozen target is loaded in; the heads always train in float32 (see mixed_precision)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation of the target."""
    config: dict | None = None
    """a transformers config dict (with "model_type") to build a randomly initialised target instead of loading name."""
    seed: int = 0
    """seed of the random initialisation when the target is random ("tiny-random-llama" or config)."""


@dataclass
class HeadsConfig:
    num_heads: int = 4
    """K: head k (1..K) at position t predicts token t+1+k."""
    num_layers: int = 1
    """residual blocks per head (distinct modules)."""
    projection: Literal["shared", "own", "lora"] = "shared"
    """vocabulary projection: the frozen LM head ("shared"), a trained copy per head ("own"), or a LoRA on it."""
    lora_rank: int = 16
    """LoRA rank when projection == "lora"."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (delta scaled by lora_alpha / lora_rank)."""
    draft_vocab: int = 8192
    """V': at inference Medusa and Hydra heads draft only from the V' tokens most frequent in the training data,
    reading that many LM-head rows instead of all (heads/draft_vocab.py); 0 or >= the vocabulary: every token."""


@dataclass
class LossConfig:
    kind: Literal["ce", "kl"] = "ce"
    """"ce": cross-entropy on the data's tokens; "kl": KL(target || head) to the target's own distribution."""
    decay: float = 0.8
    """head k's loss weight is decay**(k-1)."""
    vocab: Literal["draft", "full"] = "draft"
    """Medusa and Hydra heads with a draft vocabulary (heads.draft_vocab): "draft" reads their loss and accuracy on it,
    as they draft (5-7x less LM-head work per step on a CPU, heads/losses.py); "full": over the whole vocabulary. An
    EAGLE head always trains on its draft vocabulary, an exit head on the whole one."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    scheduler: str = "cosine"
    """a transformers scheduler name (get_scheduler): cosine, linear, constant_with_warmup, ..."""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up."""
    max_grad_norm: float | None = 1.0
    """gradient clipping norm (null: no clipping)."""
    batch_size: int = 4
    """sequences per micro-batch per process."""
    grad_accum: int = 1
    """micro-batches accumulated into one optimizer step."""
    epochs: int = 1
    """passes over the training split."""
    max_steps: int | None = None
    """stop after this many optimizer steps (null: run all epochs)."""

    def __post_init__(self) -> None:
        # what torch's AdamW, transformers' get_scheduler and clipping would refuse (or misread) after the model loaded
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optim.lr: expected a finite value > 0, found {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optim.weight_decay: expected a finite value >= 0, found {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas: expected two numbers in [0, 1), found {self.betas}")
        if self.scheduler not in usable_schedulers():
            raise ValueError(f"optim.scheduler: expected one of {usable_schedulers()} (transformers' schedules that "
                             f"need only a warm-up and a length), found {self.scheduler!r}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"optim.max_grad_norm: expected null (no clipping) or a finite value > 0, found "
                             f"{self.max_grad_norm}")
        for name in ("batch_size", "grad_accum", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"optim.{name}: expected a value >= 1, found {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps: expected a value >= 0, found {self.warmup_steps}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"optim.max_steps: expected null or a value >= 1, found {self.max_steps}")


@functools.cache
def usable_schedulers() -> list[str]:
    """The names in transformers' ``SchedulerType`` whose schedule ``get_scheduler`` builds from a warm-up and a length
    alone and that step without a metric, as the trainer drives them (not reduce_lr_on_plateau, cosine_with_min_lr,
    ...): each is built on a one-parameter optimizer and stepped once."""
    import torch
    from transformers import SchedulerType, get_scheduler

    usable = []
    for kind in SchedulerType:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        try:
            scheduler = get_scheduler(kind.value, optimizer, num_warmup_steps=1, num_training_steps=2)
            optimizer.step()
            scheduler.step()
        except (TypeError, ValueError):  # an argument the recipe cannot give, or a metric step() needs
            continue
        usable.append(kind.value)
    return usable


@dataclass
class EvalConfig:
    every: int = 100
    """evaluate per-head accuracy on the held-out split every this many optimizer steps (0: only at the end)."""
    batch_size: int = 4
    """sequences per held-out batch."""
    max_batches: int | None = None
    """held-out batches per evaluation and process (null: the whole split)."""
    ranks: int = 10
    """candidate ranks measured per head at the end (acc[k][r] for r < ranks), the tree search's input."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """save a checkpoint (accelerate state) every this many optimizer steps (0: never)."""
    keep: int = 2
    """keep the last this many checkpoints."""
    resume_from: str | None = None
    """"latest" (the newest checkpoint in output_dir; a fresh start when there is none), a checkpoint path, or null."""


@dataclass
class LoggingConfig:
    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers (tensorboard, wandb, ...); [] for none."""
    every: int = 10
    """log training metrics every this many optimizer steps: the loss averaged over them, the heads' training top-1 /
    top-5 measured on the last one's batches (measuring is a full-vocabulary pass for an EAGLE head)."""
    project: str | None = None
    """tracker project / run name (null: the method: "medusa", "hydra", "exit" or "eagle"; TensorBoard writes to
    <output_dir>/<project>)."""
    progress_bar: bool = True
    """show a tqdm progress bar on the main process."""


@dataclass
class HiddenCacheConfig:
    enabled: bool = False
    """store the frozen target's final hidden states (half precision, memory-mapped) and reuse them in later epochs."""
    dir: str | None = None
    """where the cache lives (null: <output_dir>/hidden_cache); one subdirectory per model + data fingerprint."""
    dtype: Literal["float16", "bfloat16"] = "float16"
    """storage dtype of the cached hidden states."""


@dataclass
class PublishConfig:
    repo_id: str | None = None
    """publish the final draft checkpoint to this Hub repo ('owner/name') when training ends (null: do not)."""
    private: bool = False
    """create the repo private."""
    revision: str | None = None
    """the branch to commit to (null: main)."""


@dataclass
class ExitConfig:
    layer: int | None = None
    """E: the exit head reads layer E's input and drafting runs layers 0..E-1 (required with method exit_head)."""
    num_layers: int = 1
    """residual blocks in the exit head."""
    draft_depth: int = 4
    """tokens the exit head drafts per step, stored in its checkpoint."""
    stop_below: float = 0.0
    """stop drafting once the draft's top probability falls below this, stored in its checkpoint (0: never)."""
    draft_vocab: int = 8192
    """V': the head drafts from the V' tokens most frequent in the training data, reading that many LM-head rows per
    drafted token instead of all (heads/draft_vocab.py); 0 or >= the vocabulary: every token."""


@dataclass
class EagleSection:
    num_layers: int = 1
    """decoder layers (of the target's own architecture) in the EAGLE head."""
    unroll: int = 3
    """drafting steps unrolled in training: step u learns to draft depth u + 1 from its own u earlier drafts."""
    draft_vocab: int = 8192
    """V': the head drafts the V' tokens most frequent in the training data (0: the whole vocabulary)."""
    feature_weight: float = 0.1
    """weight of the smooth-L1 regression of the head's features onto the target's (EAGLE's feature loss; EAGLE-3
    drops it: 0)."""
    feature_layers: list[int] | None = None
    """EAGLE-3's multi-layer features: the target's hidden states the head fuses for the committed text
    (transformers' ``hidden_states`` indices: 0 the embeddings, i the output of decoder layer i; EAGLE-3 takes a low,
    a middle and a high one; on a 135M model keep the final one as the high one, e.g. [2, 15, 30] of SmolLM2's 30
    layers); null: the final hidden state alone (EAGLE-1/2)."""
    depth: int = 6
    """drafting default stored in the checkpoint: tokens drafted along a path."""
    topk: int = 8
    """drafting default stored in the checkpoint: nodes expanded per depth and children per node."""
    budget: int = 32
    """drafting default stored in the checkpoint: draft nodes kept per step (the most probable)."""


@dataclass
class TreeConfig:
    budget: int = 64
    """draft nodes of the tree built at the end from the measured head accuracy."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/medusa"
    """where checkpoints, logs, the hidden cache and the trained draft go; by method, the draft is saved to
    <output_dir>/heads (medusa), hydra_heads (hydra), exit_head (exit_head) or eagle_head (eagle)."""
    seed: int = 0
    """seed of the heads' initialisation, data order and everything random."""
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None
    """autocast of the heads' forward (null: whatever `accelerate launch` / its config says, else "no")."""
    cpu: bool | None = None
    """force CPU (null: CPU when no GPU is present, unless DeepSpeed is in use)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the frozen target."""
    method: Literal["medusa", "hydra", "exit_head", "eagle"] = "medusa"
    """what is trained on the frozen target: Medusa heads (section heads), Hydra heads (Medusa heads that also read
    the tokens drafted before them; section heads, heads/hydra.py), an early-exit head (section exit) or an EAGLE-style
    sequential head (section eagle)."""
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    """the Medusa or Hydra heads being trained (method medusa / hydra; Hydra heads use the shared LM head)."""
    exit: ExitConfig = field(default_factory=ExitConfig)
    """the exit head being trained (method exit_head; heads/exit_head.py)."""
    eagle: EagleSection = field(default_factory=EagleSection)
    """the EAGLE-style head being trained (method eagle; heads/eagle.py)."""
    data: DataConfig = field(default_factory=DataConfig)
    """training data (heads/data.py)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """the Medusa loss (heads/losses.py)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer, schedule, batch sizes, length of training."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out accuracy."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """atomic checkpoints and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """trackers and progress bar."""
    hidden_cache: HiddenCacheConfig = field(default_factory=HiddenCacheConfig)
    """cached target hidden states."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """the draft tree built from measured accuracy."""
    publish: PublishConfig = field(default_factory=PublishConfig)
    """the Hub repo the final checkpoint goes to (the token: HF_TOKEN or a saved `hf auth login`)."""

    @property
    def feature_layers(self) -> list[int] | None:
        """The target layers whose hidden states the trained draft reads besides the final ones (an EAGLE-3 head's)."""
        return self.eagle.feature_layers if self.method == "eagle" else None

    @property
    def final_dir(self) -> Path:
        """Where the trained draft is saved: <output_dir>/heads, hydra_heads, exit_head or eagle_head (by method)."""
        return Path(self.output_dir) / FINAL_DIRS[self.method]

    def __post_init__(self) -> None:
        e, x = self.eagle, self.exit
        positive = {
            "heads.num_heads": self.heads.num_heads, "heads.lora_rank": self.heads.lora_rank,
            "eval.batch_size": self.eval.batch_size, "eval.ranks": self.eval.ranks,
            "checkpoint.keep": self.checkpoint.keep,
            "logging.every": self.logging.every, "tree.budget": self.tree.budget,
            "exit.draft_depth": x.draft_depth, "eagle.num_layers": e.num_layers, "eagle.unroll": e.unroll,
            "eagle.depth": e.depth, "eagle.topk": e.topk, "eagle.budget": e.budget,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name}: expected a value >= 1, found {value}")
        non_negative = {"eval.every": self.eval.every, "checkpoint.every": self.checkpoint.every,
                        "heads.num_layers": self.heads.num_layers, "heads.draft_vocab": self.heads.draft_vocab,
                        "exit.num_layers": x.num_layers, "exit.draft_vocab": x.draft_vocab,
                        "eagle.draft_vocab": e.draft_vocab, "eagle.feature_weight": e.feature_weight}
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name}: expected a value >= 0, found {value}")
        if not 0 <= self.seed < 2**32:  # numpy's seed range (accelerate's set_seed)
            raise ValueError(f"seed: expected a value in [0, 2**32), found {self.seed}")
        if not 0.0 < self.loss.decay <= 1.0:
            raise ValueError(f"loss.decay: expected a value in (0, 1], found {self.loss.decay}")
        if self.method == "hydra" and self.heads.projection != "shared":
            raise ValueError(f"heads.projection: Hydra heads read the base's own LM head (shared), found "
                             f"{self.heads.projection!r}; set heads.projection=shared")
        if self.method == "exit_head":
            if self.exit.layer is None or self.exit.layer < 1:
                raise ValueError(f"exit.layer: method exit_head needs the exit layer E >= 1 (drafting runs layers "
                                 f"0..E-1), found {self.exit.layer}")
            if self.hidden_cache.enabled and self.loss.kind == "kl":
                raise ValueError("hidden_cache.enabled with method exit_head and loss.kind kl: the KL loss needs the "
                                 "target's final hidden states as well as layer E's, and the cache stores one; "
                                 "set hidden_cache.enabled=false or loss.kind=ce")
        if not 0.0 <= x.stop_below < 1.0:
            raise ValueError(f"exit.stop_below: expected a probability in [0, 1), found {x.stop_below}")
        check_feature_layer_list(e.feature_layers, "eagle.feature_layers")
        if self.publish.repo_id is not None:
            from heads.hub import check_repo_id

            check_repo_id(self.publish.repo_id)  # a bad id fails now, not after hours of training
        if self.eval.ranks < 5:
            raise ValueError(f"eval.ranks: expected >= 5 (top-5 accuracy is reported), found {self.eval.ranks}")


# ------------------------------------------------------------------------------------------------ strict loading
def check_feature_layer_list(layers: list[int] | None, where: str) -> None:
    """An EAGLE-3 head's feature layers: null, or distinct hidden-state indices >= 0 (the model's own range is checked
    where the model is known, heads.eagle.check_feature_layers)."""
    if layers is not None and (not layers or min(layers) < 0 or len(set(layers)) != len(layers)):
        raise ValueError(f"{where}: expected null or distinct hidden-state indices >= 0, found {layers}")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + "/".join(repr(a) for a in args)
    if isinstance(tp, type) and not args:
        return tp.__name__
    return str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, where: str) -> Any:
    """value (from YAML) checked against annotation tp -> the value to store (nested dicts become dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            found = f"{type(value).__name__} {value!r:.80}"
            raise ValueError(f"{where}: expected a section (a mapping of {where}.* keys), found {found}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in args:
            try:
                return _check(value, option, where)
            except ValueError as err:
                errors.append(err)
        raise ValueError(f"{where}: expected {_type_name(tp)}, found {type(value).__name__} {value!r:.80}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}: expected one of {list(args)}, found {value!r:.80}")
        return value
    if origin in (list, Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, found {type(value).__name__} {value!r:.80}")
        item = args[0] if args else Any
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping, found {type(value).__name__} {value!r:.80}")
        return dict(value)
    if tp is type(None):
        if value is not None:
            raise ValueError(f"{where}: expected null, found {value!r:.80}")
        return None
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # PyYAML (YAML 1.1) reads 1e-4 and 3E5 as text
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"{where}: config fields of type {_type_name(tp)} are not supported")
    if not ok:
        raise ValueError(f"{where}: expected {_type_name(tp)}, found {type(value).__name__} {value!r:.80}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping, strictly: unknown keys and wrong types raise ValueError."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in known:
            close = [prefix + c for c in difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)]
            close += [p for p in _leaf_paths(cls, prefix) if p.rsplit(".", 1)[-1] == key]  # a key in the wrong section
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            section = f"in section {where!r}" if where else "at the top level"
            raise ValueError(f"unknown key {prefix + str(key)!r}{hint} (expected one of {known} {section})")
    values = {key: _check(value, hints[key], prefix + key) for key, value in data.items()}
    return cls(**values)


def _leaf_paths(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every field below dataclass cls."""
    paths = []
    for name, tp in typing.get_type_hints(cls).items():
        paths.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            paths.extend(_leaf_paths(tp, f"{prefix}{name}."))
    return paths


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _field_type(cls: type, path: list[str]) -> Any:
    """The annotation at a dotted path through nested dataclasses (None when the path leaves them)."""
    tp: Any = cls
    for key in path:
        candidates = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if not candidates:
            return None
        hints = typing.get_type_hints(candidates[0])
        if key not in hints:
            return None
        tp = hints[key]
    return tp


def apply_overrides(data: dict, overrides: Sequence[str], cls: type = None) -> dict:
    """``a.b=value`` strings applied to a nested dict (a copy). Values are YAML scalars unless the field is a str."""
    cls = cls or TrainConfig
    data = yaml.safe_load(yaml.safe_dump(data)) or {}  # a deep copy
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. optim.lr=3e-4)")
        path = key.strip().split(".")
        tp = _field_type(cls, path)
        if tp in (str, str | None) and text.strip() not in ("null", "~", ""):
            value = text  # a str field keeps what was written ("001" stays "001")
        else:
            try:
                value = yaml.safe_load(text) if text.strip() else None
            except yaml.YAMLError as err:
                raise ValueError(f"override {item!r}: expected a YAML value (3, 1e-3, true, null, [a, b], ...), found "
                                 f"{text!r}, which YAML cannot read: {yaml_problem(err)}") from err
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(path[: i + 1])} is {child!r}, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The recipe at ``path`` (YAML; None: all defaults) with ``key=value`` overrides applied, checked strictly."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: expected a YAML mapping of recipe sections, found text YAML cannot read: "
                             f"{yaml_problem(err)}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping of recipe sections, found {type(data).__name__}")
    return from_dict(TrainConfig, apply_overrides(data, overrides))


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's own problem and where it is, on one line (its message spans several, quoting the text)."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return " ".join(str(err).split())

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    text = f"{err.problem or 'invalid YAML'}" + (f" at {at(err.problem_mark)}" if err.problem_mark else "")
    if err.context:
        text += f" ({err.context}" + (f" that starts at {at(err.context_mark)}" if err.context_mark else "") + ")"
    return text


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line docstring (read from the source), for --help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def describe(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted name, type, default, docstring (what ``train.py --help`` prints)."""
    lines = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {docs.get(f.name, '')}")
    return lines
