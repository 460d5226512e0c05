"""The training recipe: typed, strict dataclasses, one section per concern, with a one-line docstring per field.

heads/training/recipe.py loads it from YAML plus ``key=value`` / ``a.b=value`` overrides, checking every value against
its field's type with selfspec's one config checker (selfspec/core/typed.py); the ``__post_init__`` checks here refuse
values of the right type that training would refuse (or misread) only after the model and data had loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import SchedulerType, get_scheduler

from heads.block.config import check_conditioning
from heads.checkpoints.hub import check_repo_id
from heads.decoder.config import check_feature_layer_list
from heads.kinds import METHODS, kind_for
from heads.training.data import DataConfig


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
    reading that many LM-head rows instead of all (heads/training/draft_vocab.py); 0 or >= the vocabulary: every
    token."""


@dataclass
class LossConfig:
    kind: Literal["ce", "kl", "rkl", "tv", "jsd", "tv_ce"] = "ce"
    """"ce": cross-entropy on the data's tokens (a draft model: on the target's own greedy token); "kl": KL(target ||
    head) to the target's own distribution; methods block and dflash also take "rkl" (KL(head || target)), "tv" (total
    variation: one minus the chance of acceptance), "jsd" (Jensen-Shannon) and "tv_ce" (DSpark's (1 - ce_mix)·TV +
    ce_mix·CE); heads/block/loss.py."""
    ce_mix: float = 0.1
    """loss.kind tv_ce: the cross-entropy's share (DSpark: 0.1)."""
    decay: float = 0.8
    """head k's loss weight is decay**(k-1)."""
    vocab: Literal["draft", "full"] = "draft"
    """Medusa and Hydra heads with a draft vocabulary (heads.draft_vocab): "draft" reads their loss and accuracy on it,
    as they draft (V / V' times less LM-head work per step: 6x for SmolLM2's vocabulary and 8,192 draft tokens);
    "full": over the whole vocabulary. An EAGLE head always trains on its draft vocabulary, an exit head on the whole
    one."""


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
    max_minutes: float | None = None
    """stop at the first optimizer step after this many minutes of training (null: no limit), as at the last step: the
    held-out measure and the draft saved (a lease's time on a GPU; with a schedule that decays over the planned steps,
    the rate has not decayed where the clock stops it: constant_with_warmup fits). A resumed run counts anew."""

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
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise ValueError(f"optim.max_minutes: expected null or a finite value > 0, found {self.max_minutes}")


@functools.cache
def usable_schedulers() -> list[str]:
    """The names in transformers' ``SchedulerType`` whose schedule ``get_scheduler`` builds from a warm-up and a length
    alone and that step without a metric, as the trainer drives them (not reduce_lr_on_plateau, cosine_with_min_lr,
    ...): each is built on a one-parameter optimizer and stepped once."""
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
    """tracker project / run name (null: the method: "medusa", "hydra", "exit", "eagle", "eagle3", "block",
    "dflash" or "draft-model"; TensorBoard writes to <output_dir>/<project>)."""
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
    drafted token instead of all (heads/training/draft_vocab.py); 0 or >= the vocabulary: every token."""


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
class BlockSection:
    num_layers: int = 1
    """decoder layers (of the target's own architecture) in the block drafter."""
    block_size: int = 6
    """K: tokens drafted by one forward: the token after the root (from the last true pair) and K - 1 mask queries."""
    anchors: int = 64
    """A: blocks of K - 1 mask queries trained per row, anchored at pairs drawn one per stratum of the row
    (heads/block/loss.py); each adds K - 1 queries to the row's forward."""
    draft_vocab: int = 8192
    """V': the drafter drafts the V' tokens most frequent in the training data (0: the whole vocabulary)."""
    feature_layers: list[int] | None = None
    """EAGLE-3's multi-layer features (as eagle.feature_layers): the target's hidden states the true pairs fuse; null:
    the final hidden state alone."""
    depth: int | None = None
    """drafting default stored in the checkpoint: the tree's depth (at most block_size; null: the whole block)."""
    budget: int = 16
    """drafting default stored in the checkpoint: draft nodes kept per step (highest product of per-position
    probabilities)."""
    mask_token_id: int | None = None
    """method dflash only: the token whose (the target's) embedding fills the mask slots; null: the tokenizer's mask,
    unknown or padding token."""
    condition_rank: int = 0
    """method block: r of the low-rank Markov logit bias keyed on the token before each block position, chained per
    tree node when drafting and trained on the true token before it (heads/block/condition.py); 0: none."""
    confidence: bool = False
    """method block: a confidence head per block position, trained to predict whether the target accepts its draft;
    it stops unsure branches (confidence_min) and can rank nodes (rank_by)."""
    confidence_weight: float = 0.1
    """weight of the confidence head's binary cross-entropy in each block offset's loss."""
    confidence_min: float = 0.0
    """drafting default stored in the checkpoint: a branch stops where the product of its confidences falls below
    this (0: never)."""
    rank_by: Literal["probability", "confidence"] = "probability"
    """drafting default stored in the checkpoint: the tree budget keeps the nodes of highest path probability, or of
    highest estimated chance of acceptance (the confidence head)."""


@dataclass
class DraftModelSection:
    """A small separate draft model (heads/draft_model/): the target's architecture with some of its layers. Give
    ``layers`` or ``num_layers``, not both (neither wins: both set is refused)."""

    layers: list[int] | None = None
    """the target's decoder layers (0-based, increasing) the student's layers are copied from, one each."""
    num_layers: int | None = None
    """N: copy N evenly spaced target layers, the first and the last included (N = 1: the first)."""
    train_embeddings: bool = False
    """train the student's copies of the embeddings and LM head too (false: frozen, so its vocabulary stays the
    target's and a step skips their weight gradient and AdamW state: SmolLM2's tied 49152 x 576 matrix is 8 layers'
    worth)."""
    draft_vocab: int = 8192
    """V': the draft model drafts only the V' tokens most frequent in the training data, reading only their rows of
    its LM head (stored in its config.json as selfspec_draft_vocab; heads/training/draft_vocab.py); 0 or >= the
    vocabulary: every token. Training and the saved weights are unchanged: only what it proposes is."""

    def __post_init__(self) -> None:
        if self.draft_vocab < 0:
            raise ValueError(f"draft_model.draft_vocab: expected 0 (every token) or a size >= 1, found {self.draft_vocab}")
        if self.layers is not None and self.num_layers is not None:
            raise ValueError(f"draft_model: expected layers or num_layers, found both (layers={self.layers}, "
                             f"num_layers={self.num_layers}); set the other to null")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"draft_model.num_layers: expected null or a value >= 1, found {self.num_layers}")
        if self.layers is not None:
            if not self.layers or self.layers[0] < 0:
                raise ValueError(f"draft_model.layers: expected a non-empty list of layer indices >= 0, found "
                                 f"{self.layers}")
            if any(a >= b for a, b in zip(self.layers, self.layers[1:])):
                raise ValueError(f"draft_model.layers: expected strictly increasing layer indices, found {self.layers}")


@dataclass
class TreeConfig:
    budget: int = 64
    """draft nodes of the tree built at the end from the measured head accuracy."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/medusa"
    """where checkpoints, logs, the hidden cache and the trained draft go; by method, the draft is saved to
    <output_dir>/heads (medusa), hydra_heads (hydra), exit_head (exit_head), eagle_head (eagle), eagle3_head
    (eagle3), block_head (block), dflash_head (dflash) or draft_model (draft_model)."""
    seed: int = 0
    """seed of the heads' initialisation, data order and everything random."""
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] | None = None
    """autocast of the heads' forward and loss (null: whatever `accelerate launch` / its config says, else "no"; auto:
    bf16 where this machine computes in bf16, a CUDA GPU that supports it or a CPU with AVX512-BF16 or AMX, else "no":
    a CPU without them runs bf16 emulated, several times slower than fp32)."""
    cpu: bool | None = None
    """force CPU (null: CPU when no GPU is present, unless DeepSpeed is in use)."""
    overwrite: bool = False
    """start over in an output_dir that holds a run (its checkpoints, metrics.jsonl and trained draft are deleted;
    the hidden-state cache and tracker logs stay); false: such a folder is refused unless checkpoint.resume_from
    resumes it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the frozen target."""
    method: Literal[METHODS] = "medusa"
    """what is trained on the frozen target: Medusa heads (section heads), Hydra heads (Medusa heads that also read
    the tokens drafted before them; section heads, heads/hydra/model.py), an early-exit head (section exit), an
    EAGLE-style sequential head (section eagle), an EAGLE-3 draft of speculators' architecture, saved in the format
    vLLM loads (section eagle, heads/eagle/eagle3.py), a block drafter (section block, heads/block/model.py), a block
    drafter of speculators' DFlash architecture, saved in the format vLLM loads (section block, heads/block/dflash.py),
    or a small separate draft model distilled from it (section draft_model, heads/draft_model/)."""
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    """the Medusa or Hydra heads being trained (method medusa / hydra; Hydra heads use the shared LM head)."""
    exit: ExitConfig = field(default_factory=ExitConfig)
    """the exit head being trained (method exit_head; heads/exit_head/model.py)."""
    eagle: EagleSection = field(default_factory=EagleSection)
    """the EAGLE-style head being trained (method eagle, heads/eagle/model.py; method eagle3, heads/eagle/eagle3.py)."""
    block: BlockSection = field(default_factory=BlockSection)
    """the block drafter being trained (method block, heads/block/model.py; method dflash, heads/block/dflash.py)."""
    draft_model: DraftModelSection = field(default_factory=DraftModelSection)
    """the draft model being distilled (method draft_model; heads/draft_model/)."""
    data: DataConfig = field(default_factory=DataConfig)
    """training data (heads/training/data.py)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """the Medusa loss (heads/training/losses.py)."""
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
    def final_dir(self) -> Path:
        """Where the trained draft is saved: <output_dir>/heads, hydra_heads, exit_head, eagle_head, eagle3_head,
        block_head, dflash_head or draft_model (by method)."""
        return Path(self.output_dir) / kind_for(self.method).final_dir

    def __post_init__(self) -> None:
        kind_for(self.method)  # an unknown method fails first, naming the known ones
        e, x, b = self.eagle, self.exit, self.block
        positive = {
            "heads.num_heads": self.heads.num_heads, "heads.lora_rank": self.heads.lora_rank,
            "eval.batch_size": self.eval.batch_size, "eval.ranks": self.eval.ranks,
            "checkpoint.keep": self.checkpoint.keep,
            "logging.every": self.logging.every, "tree.budget": self.tree.budget,
            "exit.draft_depth": x.draft_depth, "eagle.num_layers": e.num_layers, "eagle.unroll": e.unroll,
            "eagle.depth": e.depth, "eagle.topk": e.topk, "eagle.budget": e.budget,
            "block.num_layers": b.num_layers, "block.anchors": b.anchors, "block.budget": b.budget,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name}: expected a value >= 1, found {value}")
        non_negative = {"eval.every": self.eval.every, "checkpoint.every": self.checkpoint.every,
                        "heads.num_layers": self.heads.num_layers, "heads.draft_vocab": self.heads.draft_vocab,
                        "exit.num_layers": x.num_layers, "exit.draft_vocab": x.draft_vocab,
                        "eagle.draft_vocab": e.draft_vocab, "eagle.feature_weight": e.feature_weight,
                        "block.draft_vocab": b.draft_vocab}
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name}: expected a value >= 0, found {value}")
        if not 0 <= self.seed < 2**32:  # numpy's seed range (accelerate's set_seed)
            raise ValueError(f"seed: expected a value in [0, 2**32), found {self.seed}")
        if not 0.0 < self.loss.decay <= 1.0:
            raise ValueError(f"loss.decay: expected a value in (0, 1], found {self.loss.decay}")
        if not 0.0 <= x.stop_below < 1.0:
            raise ValueError(f"exit.stop_below: expected a probability in [0, 1), found {x.stop_below}")
        check_feature_layer_list(e.feature_layers, "eagle.feature_layers")
        check_feature_layer_list(b.feature_layers, "block.feature_layers")
        if b.block_size < 2:
            raise ValueError(f"block.block_size: expected >= 2 (the token after the root and at least one mask query), "
                             f"found {b.block_size}")
        if b.depth is not None and not 1 <= b.depth <= b.block_size:
            raise ValueError(f"block.depth: expected null or 1..{b.block_size} (block.block_size), found {b.depth}")
        self.check_block_options()
        kind_for(self.method).check_recipe(self)  # what the kind trained needs of the rest (heads/<kind>/kind.py)
        if self.publish.repo_id is not None:
            check_repo_id(self.publish.repo_id)  # a bad id fails now, not after hours of training
        if self.overwrite and self.checkpoint.resume_from is not None:
            raise ValueError(f"overwrite=true starts the run over, checkpoint.resume_from={self.checkpoint.resume_from} "
                             "resumes it: set one of them")
        if self.eval.ranks < 5:
            raise ValueError(f"eval.ranks: expected >= 5 (top-5 accuracy is reported), found {self.eval.ranks}")

    def check_block_options(self) -> None:
        """The conditioned block's options (heads/block/condition.py) and the losses only the block loss computes."""
        b = self.block
        check_conditioning("block.", b.condition_rank, b.confidence, b.confidence_min, b.rank_by)
        if not (math.isfinite(b.confidence_weight) and b.confidence_weight >= 0):
            raise ValueError(f"block.confidence_weight: expected a finite value >= 0, found {b.confidence_weight}")
        if self.loss.kind not in kind_for(self.method).losses:
            raise ValueError(f"loss.kind {self.loss.kind!r}: only the block drafter's loss computes it (methods block "
                             f"and dflash), found method {self.method!r}; use loss.kind ce or kl")
        if not 0.0 <= self.loss.ce_mix <= 1.0:
            raise ValueError(f"loss.ce_mix: expected a share in [0, 1], found {self.loss.ce_mix}")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
