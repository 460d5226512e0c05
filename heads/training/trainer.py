"""The accelerate training loop for drafts on a frozen target: Medusa or Hydra heads, an exit head or an EAGLE head.

``train(cfg)`` reads as its steps:

  1. the frozen target (eval mode, no gradients, outside any DDP / DeepSpeed engine)
  2. accelerator (CPU / GPU / DDP / DeepSpeed from ``accelerate launch``), trackers, seed, the data (train / held-out
     rows), the draft module (an EAGLE head's draft vocabulary is counted on the training rows)
  3. loaders: rows with their dataset index (the key of the hidden-state cache)
  4. AdamW over the heads only, warm-up + schedule (transformers' ``get_scheduler``); ``accelerator.prepare``
  5. resume: ``load_state`` (heads, optimizer, scheduler, RNG, progress) and skip the batches already seen
  6. the loop: target hidden states (computed or cached) -> heads (at scored positions only) -> Medusa loss ->
     backward, accumulate, step;
     a NaN / inf loss stops with the step and the last good checkpoint; SIGINT / SIGTERM save and stop cleanly;
     log, evaluate held-out accuracy and save atomic checkpoints every N steps
  7. the end: measure acc[k][r] on held-out data, build the tree from it, save the heads (main process only)
  8. publish the saved checkpoint to the Hub when the recipe names a repo (publish.repo_id)

Checkpoints, resuming and signals: heads/training/state.py. Cached target hidden states:
heads/training/hidden_cache.py.

Shapes: K heads, B batch, T time, D hidden size, V vocabulary, R measured ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from heads.checkpoints.files import write_checkpoint
from heads.checkpoints.hub import find_token
from heads.draft_types import push_folder
from heads.eagle.config import EagleConfig
from heads.eagle.loss import eagle_loss
from heads.eagle.model import EagleHead, eagle_card
from heads.exit_head.model import ExitHead, ExitHeadConfig, ExitLogits, final_norm
from heads.hydra.model import HydraConfig, HydraHeads, following
from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads
from heads.training.base_model import UnsupportedModel, load_base
from heads.training.config import TrainConfig, to_dict
from heads.training.data import build_datasets
from heads.training.draft_vocab import count_vocabulary, draft_vocab_size
from heads.training.hidden_cache import TargetStates, make_caches
from heads.training.losses import IGNORE_INDEX, gather_scored, scored_loss
from heads.training.metrics import Window, emit
from heads.training.state import Progress, StopFlag, check_intact, load_progress, resolve_resume, save_checkpoint
from heads.tree_search import best_choices
from selfspec.core.draft_vocab import DraftVocab

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass(frozen=True)
class TrainResult:
    status: str
    """"done" or "interrupted" (by SIGINT / SIGTERM, after saving a checkpoint)."""
    step: int
    """optimizer steps completed."""
    checkpoint: Path | None
    """the last checkpoint written or resumed from."""
    heads_dir: Path | None
    """where the final heads were saved (None when interrupted)."""
    accuracy: list[list[float]] | None
    """acc[k][r] measured on the held-out split at the end (None when interrupted or without held-out data)."""
    signal: int | None = None
    """the signal that interrupted the run."""
    published: str | None = None
    """the Hub URL the final checkpoint was published to (publish.repo_id), else None."""


# --------------------------------------------------------------------------------------------------------- data
class IndexedRows(torch.utils.data.Dataset):
    """A datasets.Dataset of (input_ids, labels) rows, each returned with its index."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {"index": i, "input_ids": row["input_ids"], "labels": row["labels"]}


class Collate:
    """Right-pads a list of rows: index [B], lengths [B], input_ids / attention_mask / labels [B, T]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items: list[dict]) -> dict:
        lengths = [len(it["input_ids"]) for it in items]
        T = max(lengths)
        ids = torch.full((len(items), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), T), -100, dtype=torch.long)
        mask = torch.zeros((len(items), T), dtype=torch.long)
        for b, (it, n) in enumerate(zip(items, lengths)):
            ids[b, :n] = torch.tensor(it["input_ids"])
            labels[b, :n] = torch.tensor(it["labels"])
            mask[b, :n] = 1
        return {"index": torch.tensor([it["index"] for it in items]), "lengths": torch.tensor(lengths),
                "input_ids": ids, "attention_mask": mask, "labels": labels}


def loader(rows, batch_size: int, shuffle: bool, pad_id: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(IndexedRows(rows), batch_size=batch_size, shuffle=shuffle,
                                       collate_fn=Collate(pad_id))


# --------------------------------------------------------------------------------------------------- the loop
def build_accelerator(cfg: TrainConfig) -> Accelerator:
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = cfg.cpu if cfg.cpu is not None else (not torch.cuda.is_available() and not uses_deepspeed)
    if uses_deepspeed and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op when it starts (minutes on a small CPU),
        # even for a single process, which has nothing to reduce: mark the op unavailable so it falls back to gloo.
        import deepspeed.ops  # optional heavy dependency: only under DeepSpeed, whose import costs seconds

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return Accelerator(
        cpu=cpu, mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.optim.grad_accum,
        log_with=cfg.logging.log_with or None, project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested recipe -> flat {a.b: scalar} (lists and None as text) for trackers' hyper-parameter tables."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


def train(cfg: TrainConfig) -> TrainResult:
    # 1. the frozen target, loaded before the accelerator exists: under DeepSpeed ZeRO-3 transformers would otherwise
    #    partition it at load time (zero.Init); it stays a plain module outside the engine
    model, tokenizer = load_base(cfg.model)

    check_publish(cfg)

    # 2. accelerator, trackers, seed, data, the heads (an EAGLE head's draft vocabulary is read off the data)
    accelerator = build_accelerator(cfg)
    set_seed(cfg.seed)
    out_dir, ckpt_root = Path(cfg.output_dir), Path(cfg.output_dir) / "checkpoints"
    if cfg.logging.log_with:
        project = cfg.logging.project or {"medusa": "medusa", "hydra": "hydra", "exit_head": "exit", "eagle": "eagle"}[cfg.method]
        accelerator.init_trackers(project, config=_flat(to_dict(cfg)))
    model.to(accelerator.device)
    with accelerator.main_process_first():
        train_rows, eval_rows = build_datasets(cfg.data, tokenizer)
    heads, mcfg = build_drafts(cfg, model, train_rows, tokenizer)
    K, _, layer = outputs(cfg)

    # 3. loaders
    train_dl = loader(train_rows, cfg.optim.batch_size, True, tokenizer.pad_token_id)
    if cfg.eval.max_batches is not None:  # a fixed held-out subset, always read to its end (see run_eval)
        keep = cfg.eval.max_batches * cfg.eval.batch_size * accelerator.num_processes
        eval_rows = eval_rows.select(range(min(len(eval_rows), keep)))
    eval_dl = loader(eval_rows, cfg.eval.batch_size, False, tokenizer.pad_token_id) if len(eval_rows) else None

    # 4. optimizer, schedule, prepare (the target stays outside: only the heads are trained / wrapped)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    batches_per_epoch = math.ceil(len(train_rows) / (cfg.optim.batch_size * accelerator.num_processes))
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.optim.grad_accum)
    total_steps = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    # a prepared scheduler steps once per process per optimizer step (accelerate's convention)
    scheduler = get_scheduler(cfg.optim.scheduler, optimizer,
                              num_warmup_steps=cfg.optim.warmup_steps * accelerator.num_processes,
                              num_training_steps=total_steps * accelerator.num_processes)
    check_zero3(accelerator, heads)
    prepared = accelerator.prepare(heads, optimizer, train_dl, scheduler, *([eval_dl] if eval_dl else []))
    heads, optimizer, train_dl, scheduler = prepared[:4]
    eval_dl = prepared[4] if eval_dl else None
    progress = Progress()
    caches = make_caches(cfg, accelerator, model, {"train": train_rows, "eval": eval_rows})
    # an EAGLE head's loss computes the target's logits itself, on the draft vocabulary only; so does the KL of
    # Medusa and Hydra heads read on theirs (loss.vocab)
    states = TargetStates(model, accelerator.device, accelerator.autocast,
                          "ce" if cfg.method == "eagle" else cfg.loss.kind, caches, cfg.hidden_cache.dtype, layer=layer,
                          feature_layers=cfg.feature_layers, logit_vocab=loss_vocab(cfg, heads))
    uses_deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    log.info("process %d/%d on %s: %d train rows, %d batches per epoch, %d optimizer steps in all%s",
             accelerator.process_index, accelerator.num_processes, accelerator.device, len(train_rows), len(train_dl),
             total_steps, " (DeepSpeed: heads only in the engine)" if uses_deepspeed else "")

    # 5. resume
    last_ckpt = resolve_resume(cfg.checkpoint.resume_from, ckpt_root)
    if last_ckpt is not None:
        check_intact(last_ckpt, ckpt_root, cfg.checkpoint.resume_from, accelerator.process_index)
        accelerator.load_state(str(last_ckpt))
        progress = load_progress(last_ckpt)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", last_ckpt, progress.step, progress.epoch,
                 progress.batch_in_epoch)

    # 6. the loop
    def evaluate(ranks: int) -> dict:
        return run_eval(cfg, accelerator, heads, eval_dl, states, ranks)

    metrics_file = out_dir / "metrics.jsonl"
    bar = tqdm(total=total_steps, initial=progress.step, desc="training heads", dynamic_ncols=True,
               disable=not (accelerator.is_main_process and cfg.logging.progress_bar))
    window = Window(K)
    periodic_eval = cfg.eval.every > 0 and eval_dl is not None  # the end always measures (step 7)
    stopped = None
    with StopFlag() as stop:
        while progress.step < total_steps and stopped is None:
            epoch_start = time.perf_counter()
            train_dl.set_epoch(progress.epoch)
            batches = train_dl
            if progress.batch_in_epoch:  # resumed mid-epoch: skip the batches the checkpoint has already seen
                batches = accelerator.skip_first_batches(train_dl, progress.batch_in_epoch)
            for batch in batches:
                # training accuracy is measured on the batches of each logged step only (for an EAGLE head it is a
                # full-vocabulary pass, ~18% of a step on the 2-core CPU); the loss is logged for every batch
                logged = (progress.step + 1) % cfg.logging.every == 0 or progress.step + 1 == total_steps
                with accelerator.accumulate(heads):
                    out = heads_loss(cfg, heads, states, batch, "train", ranks=5 if logged else 0)
                    # every process learns of a NaN or a signal on any of them, before backward's all-reduce
                    flags = torch.tensor([float(not torch.isfinite(out.total)), float(stop.signum is not None)])
                    flags = accelerator.reduce(flags.to(accelerator.device), "sum")
                    if flags[0] > 0:
                        raise TrainingDiverged(
                            f"the loss became {out.total.item()} at step {progress.step + 1} (epoch {progress.epoch}, "
                            f"batch {progress.batch_in_epoch}); last good checkpoint: {last_ckpt or 'none'}. "
                            f"Resume from it with checkpoint.resume_from={last_ckpt or 'latest'} and a lower "
                            f"optim.lr, or look for bad rows.")
                    accelerator.backward(out.total)
                    if accelerator.sync_gradients and cfg.optim.max_grad_norm is not None:
                        accelerator.clip_grad_norm_(heads.parameters(), cfg.optim.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                progress.batch_in_epoch += 1
                window.add(out, states.take_seconds())
                if not accelerator.sync_gradients:
                    continue
                progress.step += 1
                bar.update(1)
                if progress.batch_in_epoch == len(train_dl):  # epoch complete: a checkpoint here resumes at the next
                    progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                if progress.step % cfg.logging.every == 0 or progress.step == total_steps:
                    record = window.flush(accelerator, progress.step, scheduler.get_last_lr()[0])
                    bar.set_postfix(loss=f"{record['loss']:.4f}", top1=f"{record['top1'][0]:.3f}")
                    emit(accelerator, metrics_file, record)
                if periodic_eval and progress.step % cfg.eval.every == 0 and progress.step < total_steps:
                    emit(accelerator, metrics_file, {"step": progress.step, **evaluate(5)})
                if flags[1] > 0 or (cfg.checkpoint.every and progress.step % cfg.checkpoint.every == 0):
                    last_ckpt = save_checkpoint(accelerator, ckpt_root, progress.step, cfg.checkpoint.keep, progress)
                if flags[1] > 0:
                    stopped = stop.signum or signal.SIGTERM
                    break
                if progress.step >= total_steps:
                    break
            else:
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            emit(accelerator, metrics_file, {
                "step": progress.step, "epoch_seconds": time.perf_counter() - epoch_start,
                "target_seconds_total": states.seconds_total, "cache_hits": states.cache_hits})
    bar.close()
    if stopped is not None:
        accelerator.end_training()
        log.warning("stopped by signal %d at step %d; checkpoint saved to %s; rerun with checkpoint.resume_from=latest "
                    "to continue", stopped, progress.step, last_ckpt)
        return TrainResult("interrupted", progress.step, last_ckpt, None, None, signal=int(stopped))

    # 7. measure acc[k][r], build the tree, save the heads
    accuracy = None
    if eval_dl is not None:
        result = evaluate(cfg.eval.ranks)
        emit(accelerator, metrics_file, {"step": progress.step, "final": True, **result})
        accuracy = result["accuracy"]
    else:
        log.warning("no held-out rows (data.eval_fraction=0): the heads are saved without measured accuracy or tree")
    if cfg.method in ("medusa", "hydra"):
        heads_dir = save_final(accelerator, heads, mcfg, model, accuracy, cfg.tree.budget, cfg.final_dir)
    elif cfg.method == "eagle":
        heads_dir = save_eagle(accelerator, heads, mcfg, model, accuracy, cfg.final_dir)
    else:
        heads_dir = save_exit_head(accelerator, heads, mcfg, accuracy, cfg.final_dir)
    accelerator.end_training()
    published = None
    if cfg.publish.repo_id is not None and accelerator.is_main_process:
        # 8. publish: all files in one commit, or a PublishError saying what the repo holds; the heads stay saved
        published = push_folder(heads_dir, cfg.publish.repo_id, private=cfg.publish.private,
                                revision=cfg.publish.revision).url
        log.info("published %s to %s", heads_dir, published)
    return TrainResult("done", progress.step, last_ckpt, heads_dir, accuracy, published=published)


def check_publish(cfg: TrainConfig) -> None:
    """A recipe that publishes needs a Hub token: refuse it before training, not after hours of it."""
    if cfg.publish.repo_id is not None and find_token()[0] is None:
        raise ValueError(f"publish.repo_id={cfg.publish.repo_id} is set but no Hub token was found: set HF_TOKEN or "
                         "run `hf auth login`, or drop publish.repo_id and publish later with python -m heads.publish")


def outputs(cfg: TrainConfig) -> tuple[int, int, int | None]:
    """(K predictions per position, the first one's look-ahead, the target layer whose input they read) of the
    method: Medusa and Hydra heads predict t+2..t+1+K from the final hidden state (Hydra heads also read tokens
    t+1..t+k); an exit head predicts t+1 from layer E's input; an EAGLE head predicts t+2 at each of its unrolled
    steps, from the final hidden states (heads/eagle/loss.py)."""
    if cfg.method in ("medusa", "hydra"):
        return cfg.heads.num_heads, 1, None
    if cfg.method == "eagle":
        return cfg.eagle.unroll, 1, None
    return 1, 0, cfg.exit.layer


def build_drafts(cfg: TrainConfig, model, train_rows=None,
                 tokenizer=None) -> tuple[torch.nn.Module, MedusaConfig | HydraConfig | ExitHeadConfig | EagleConfig]:
    """The module trained on the frozen target and its config: Medusa heads and an exit head map hidden [N, D] to
    logits [K, N, V]; an EAGLE head unrolls over whole rows (EagleHead.forward). The draft vocabulary of every
    kind of head is counted on ``train_rows``."""
    lm_head = model.get_output_embeddings()
    if cfg.method == "eagle":
        e = cfg.eagle
        ecfg = EagleConfig.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_layers=e.num_layers,
            draft_vocab_size=e.draft_vocab, feature_layers=e.feature_layers, depth=e.depth, topk=e.topk,
            budget=e.budget, recipe=to_dict(cfg))
        head = EagleHead(ecfg, model.get_input_embeddings(), lm_head)
        count_vocabulary(head.draft_vocab, train_rows, tokenizer)
        return head, ecfg
    if cfg.method == "hydra":
        hcfg = HydraConfig.for_model(model, base_model=cfg.model.name, base_revision=cfg.model.revision,
                                     num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers,
                                     draft_vocab_size=draft_vocab_size(cfg.heads.draft_vocab, lm_head), recipe=to_dict(cfg))
        heads = HydraHeads(hcfg, model.get_input_embeddings(), lm_head)
    elif cfg.method == "medusa":
        mcfg = MedusaConfig.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_heads=cfg.heads.num_heads,
            num_layers=cfg.heads.num_layers, projection=cfg.heads.projection, lora_rank=cfg.heads.lora_rank,
            lora_alpha=cfg.heads.lora_alpha, draft_vocab_size=draft_vocab_size(cfg.heads.draft_vocab, lm_head), recipe=to_dict(cfg),
        )
        heads, hcfg = MedusaHeads(mcfg, lm_head), mcfg
    else:
        ecfg = ExitHeadConfig.for_model(
            model, cfg.exit.layer, base_model=cfg.model.name, base_revision=cfg.model.revision,
            num_layers=cfg.exit.num_layers, draft_depth=cfg.exit.draft_depth, stop_below=cfg.exit.stop_below,
            draft_vocab_size=draft_vocab_size(cfg.exit.draft_vocab, lm_head), recipe=to_dict(cfg),
        )
        exit_head = ExitHead(ecfg)
        count_vocabulary(exit_head.draft_vocab, train_rows, tokenizer)
        return ExitLogits(exit_head, final_norm(model), lm_head), ecfg
    count_vocabulary(heads.draft_vocab, train_rows, tokenizer)
    return heads, hcfg


def loss_vocab(cfg: TrainConfig, heads) -> DraftVocab | None:
    """The draft vocabulary that Medusa and Hydra heads read their loss on (loss.vocab "draft", heads with one), or
    None: the whole vocabulary."""
    if cfg.method not in ("medusa", "hydra") or cfg.loss.vocab != "draft":
        return None
    vocab = (heads.module if hasattr(heads, "module") else heads).draft_vocab  # DDP / DeepSpeed wrap them
    return vocab if vocab.tokens is not None else None


def heads_loss(cfg: TrainConfig, heads, states, batch: dict, split: str, ranks: int, per_row: bool = False):
    """The Medusa loss of a batch, running the heads only on the positions some head is scored on.

    per_row: a list with one MedusaLoss per row of the batch (for exact held-out counts across processes).
    """
    K, first, _ = outputs(cfg)
    hidden, target_logits = states(batch, split)  # [B, T, D], [B, T, V] or None
    if cfg.method == "eagle":
        return _eagle_loss(cfg, heads, hidden, batch, ranks, per_row)
    scored, targets, shifted = gather_scored(batch["labels"], K, target_logits, first)  # [B, T], [K, N]
    if cfg.method == "exit_head" and shifted is not None:  # an exit head is scored on agreeing with the target itself
        targets = torch.where(targets == IGNORE_INDEX, targets, shifted[0].argmax(-1)[None])
    vocab = loss_vocab(cfg, heads)
    tokens = None if vocab is None else vocab.tokens  # [V'] the columns of the logits below, or None: every token
    args = dict(on_draft_vocab=True) if vocab is not None else {}
    if cfg.method == "hydra":  # each head also reads the tokens after t (teacher forcing)
        logits = heads(hidden[scored], following(batch["input_ids"], scored, K), **args)  # [K, N, V or V']
    else:
        logits = heads(hidden[scored], **args)  # [K, N, V or V']
    if not per_row:
        return scored_loss(logits, targets, cfg.loss.decay, cfg.loss.kind, shifted, ranks, tokens)
    row_of = scored.nonzero()[:, 0]  # [N]
    outs = []
    for b in range(scored.shape[0]):
        m = row_of == b
        outs.append(scored_loss(logits[:, m], targets[:, m], cfg.loss.decay, cfg.loss.kind,
                                None if shifted is None else [p[m] for p in shifted], ranks, tokens))
    return outs


def _eagle_loss(cfg: TrainConfig, head, states: torch.Tensor, batch: dict, ranks: int, per_row: bool):
    """The EAGLE head's unrolled loss of a batch (one forward of the wrapped head), or one per row. states [B, T, D]
    (the final hidden states), or [B, T, (1 + L) D] with feature layers (the final ones first, see TargetStates)."""
    inner = head.module if hasattr(head, "module") else head  # DDP / DeepSpeed wrap the head
    D = inner.config.hidden_size
    hidden = states[..., :D]  # [B, T, D] what the loss reads
    features = states[..., D:] if inner.config.feature_layers else hidden  # [B, T, F] what the head reads
    outs = head(features, batch["input_ids"], batch["lengths"], cfg.eagle.unroll)  # [U, B, n, D]
    args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, feature_weight=cfg.eagle.feature_weight, ranks=ranks)
    if not per_row:
        return eagle_loss(outs, hidden, batch["labels"], inner, inner.lm_head, **args)
    return [eagle_loss(outs[:, b:b + 1], hidden[b:b + 1], batch["labels"][b:b + 1], inner, inner.lm_head, **args)
            for b in range(hidden.shape[0])]


@torch.no_grad()
def run_eval(cfg: TrainConfig, accelerator: Accelerator, heads, eval_dl, states, ranks: int) -> dict:
    """Held-out loss and acc[k][r] (r < ranks), exact across processes (duplicated padding rows are dropped)."""
    heads.eval()
    K = outputs(cfg)[0]
    totals = torch.zeros(K, ranks + 2, dtype=torch.float64)  # per head: hits at each rank, positions, loss sum
    for batch in eval_dl:  # never broken off: accelerate tracks the active dataloader until its end
        rows = []
        for out in heads_loss(cfg, heads, states, batch, "eval", ranks, per_row=True):
            rows.append(torch.cat([out.hits.double(), out.count.double()[:, None],
                                   (out.per_head.double().cpu() * out.count)[:, None]], dim=1))  # [K, R + 2]
        per_row = accelerator.gather_for_metrics(torch.stack(rows).to(accelerator.device))  # [B_all, K, R + 2]
        totals += per_row.cpu().sum(0)
    states.take_seconds()
    heads.train()
    count = totals[:, ranks].clamp(min=1)
    acc = totals[:, :ranks] / count[:, None]  # [K, R]
    return {"eval_loss": (totals[:, ranks + 1] / count).tolist(), "eval_top1": acc[:, 0].tolist(),
            "eval_top5": acc[:, :5].sum(1).tolist(), "eval_positions": totals[:, ranks].tolist(),
            "accuracy": acc.tolist()}


def save_exit_head(accelerator: Accelerator, module, ecfg: ExitHeadConfig, accuracy, directory: Path) -> Path:
    """The trained exit head with its measured top-1 agreement -> save_pretrained, on the main process only."""
    state = accelerator.get_state_dict(module)  # every process takes part (DeepSpeed gathers partitioned weights)
    if accelerator.is_main_process:
        agreement = None if accuracy is None else float(accuracy[0][0])
        head = ExitHead(replace(ecfg, top1_agreement=agreement))
        prefix = "exit_head."
        head.load_state_dict({k[len(prefix):]: v.float() if v.is_floating_point() else v
                              for k, v in state.items() if k.startswith(prefix)})
        head.save_pretrained(directory)
        log.info("saved the exit head to %s (top-1 agreement with the target %s)", directory, agreement)
    accelerator.wait_for_everyone()
    return directory


def check_zero3(accelerator: Accelerator, heads: torch.nn.Module) -> None:
    """Refuse, before any step, what DeepSpeed ZeRO-3 cannot train: an EAGLE head whose layer is a mixture of experts
    (a module with an ``experts`` child, on an MoE target). ZeRO-3's gradient reduction fails on its experts
    (``assert len(set(p.ds_id ...))``), with or without them as leaf modules; ZeRO-2 and DDP train it."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return
    moe = sorted({type(m).__name__ for m in heads.modules()
                  if isinstance(getattr(m, "experts", None), torch.nn.Module)})
    if moe:
        raise UnsupportedModel(f"DeepSpeed ZeRO-3 cannot train this head: its layer is a mixture of experts "
                               f"({', '.join(moe)}) and ZeRO-3's gradient reduction fails on it; use "
                               "configs/accelerate/deepspeed_zero2.yaml or plain multi-process training (a one-layer "
                               "head fits either)")


def save_eagle(accelerator: Accelerator, head, ecfg: EagleConfig, model, accuracy, directory: Path) -> Path:
    """The trained EAGLE head with its measured per-step agreement -> save_pretrained, on the main process only."""
    state = accelerator.get_state_dict(head)  # every process takes part (DeepSpeed gathers partitioned weights)
    if accelerator.is_main_process:
        agreement = None if accuracy is None else [float(row[0]) for row in accuracy]
        config = replace(ecfg, top1_agreement=agreement)
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        # the gathered tensors (the trained head's own state dict) are written as they are: a fresh head to load them
        # into would be built empty under DeepSpeed ZeRO-3, whose transformers integration partitions every new model
        # (zero.Init); the checkpoint is checked against its config when it is read
        write_checkpoint(directory, state, config.to_dict(), eagle_card(config, str(directory)))
        log.info("saved the EAGLE head to %s (top-1 agreement with the target per step: %s)", directory, agreement)
    accelerator.wait_for_everyone()
    return directory


def save_final(
    accelerator: Accelerator, heads, mcfg: MedusaConfig | HydraConfig, model, accuracy, budget: int, directory: Path
) -> Path:
    """Medusa or Hydra heads with the measured accuracy and the tree built from it -> save_pretrained, on the main
    process only. (Hydra heads' accuracy is measured with the true tokens on the path, which is what the tree search
    assumes: a node is only reached when every token above it was accepted.)"""
    state = accelerator.get_state_dict(heads)  # every process takes part (DeepSpeed gathers partitioned weights)
    if accelerator.is_main_process:
        tree = best_choices(accuracy, budget) if accuracy is not None else None
        final_cfg = replace(mcfg, tree=tree, head_accuracy=accuracy)
        if isinstance(mcfg, HydraConfig):
            final = HydraHeads(final_cfg, model.get_input_embeddings(), model.get_output_embeddings())
        else:
            final = MedusaHeads(final_cfg, model.get_output_embeddings())
        final.load_state_dict({k: v.float() for k, v in state.items()})
        final.save_pretrained(directory)
        log.info("saved the heads to %s (tree of %d nodes from measured accuracy)", directory, len(tree or []))
    accelerator.wait_for_everyone()
    return directory

