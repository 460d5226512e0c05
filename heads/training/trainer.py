"""The accelerate training loop for a draft on a frozen target, whatever kind it is (heads/training/kind.py: Medusa
or Hydra heads, an exit head, an EAGLE head; heads/kinds.py finds the recipe's).

``train(cfg)`` reads as its steps:

  1. the frozen target (eval mode, no gradients, outside any DDP / DeepSpeed engine)
  2. accelerator (CPU / GPU / DDP / DeepSpeed from ``accelerate launch``), trackers, seed, the data (train / held-out
     rows), the draft module the kind builds (its draft vocabulary counted on the training rows)
  3. loaders: rows with their dataset index (the key of the hidden-state cache)
  4. AdamW over the draft only, warm-up + schedule (transformers' ``get_scheduler``); ``accelerator.prepare``; what the
     kind reads of the target (hidden states, computed or cached; its logits for a KL loss)
  5. resume: ``load_state`` (draft, optimizer, scheduler, RNG, progress), metrics.jsonl cut back to the resumed step,
     and skip the batches already seen
  6. the loop: target hidden states -> the kind's loss (the draft runs at scored positions only) -> backward,
     accumulate, step; a NaN / inf loss stops with the step and the last good checkpoint; SIGINT / SIGTERM save and
     stop cleanly; log, evaluate held-out accuracy and save atomic checkpoints every N steps
  7. the end: measure acc[k][r] on held-out data; the kind saves the draft with it (Medusa and Hydra heads with the
     tree built from it), on the main process only
  8. publish the saved checkpoint to the Hub when the recipe names a repo (publish.repo_id)

Checkpoints, resuming and signals: heads/training/state.py. The run folder tied to its recipe (checked before step 1):
heads/training/run_folder.py. Cached target hidden states: heads/training/hidden_cache.py.

Shapes: K predictions per position, B batch, T time, D hidden size, V vocabulary, R measured ranks.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

from heads.checkpoints.hub import find_token
from heads.draft_types import push_folder
from heads.kinds import kind_for
from heads.training.base_model import load_base
from heads.training.config import TrainConfig, to_dict
from heads.training.data import build_datasets
from heads.training.engine import build_accelerator, check_zero3, optimizer_and_schedule, tracker_params
from heads.training.evaluate import heads_loss, run_eval
from heads.training.hidden_cache import TargetStates, make_caches
from heads.training.kind import HeadKind
from heads.training.loaders import loader
from heads.training.losses import MedusaLoss
from heads.training.metrics import Window, emit
from heads.training.run_folder import check_run_folder, claim_run_folder, trim_metrics
from heads.training.state import Progress, StopFlag, check_intact, load_progress, resolve_resume, save_checkpoint

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


@dataclass
class Run:
    """What a run holds once prepared (step 4): the prepared draft, optimizer, schedule and loaders, the target's
    states, and where it stands."""

    cfg: TrainConfig
    kind: HeadKind
    accelerator: Accelerator
    heads: torch.nn.Module
    """the draft module as prepared (wrapped by DDP / DeepSpeed where they are in use)."""
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_dl: torch.utils.data.DataLoader
    eval_dl: torch.utils.data.DataLoader | None
    states: TargetStates
    total_steps: int
    progress: Progress = field(default_factory=Progress)
    last_ckpt: Path | None = None
    """the last checkpoint written or resumed from."""
    deadline: float | None = None
    """time.monotonic() at which optim.max_minutes ends the run (None: no limit)."""

    @property
    def ckpt_root(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return Path(self.cfg.output_dir) / "metrics.jsonl"

    def evaluate(self, ranks: int) -> dict:
        return run_eval(self.cfg, self.accelerator, self.heads, self.eval_dl, self.states, ranks)


def train(cfg: TrainConfig) -> TrainResult:
    kind = kind_for(cfg.method)
    check_run_folder(cfg)  # output_dir holds this recipe's run or none, before anything loads
    # 1. the frozen target, loaded before the accelerator exists: under DeepSpeed ZeRO-3 transformers would otherwise
    #    partition it at load time (zero.Init); it stays a plain module outside the engine
    model, tokenizer = load_base(cfg.model)

    check_publish(cfg)

    # 2. accelerator, trackers, seed, data, the draft module (its draft vocabulary is read off the training rows)
    accelerator = build_accelerator(cfg)
    claim_run_folder(cfg, accelerator.is_main_process)  # run.json; with overwrite, the old run deleted
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    if cfg.logging.log_with:
        accelerator.init_trackers(cfg.logging.project or kind.project, config=tracker_params(to_dict(cfg)))
    model.to(accelerator.device)
    with accelerator.main_process_first():
        train_rows, eval_rows = build_datasets(cfg.data, tokenizer)
    module, config = kind.build(cfg, model, train_rows, tokenizer)

    # 3. loaders, 4. optimizer, schedule, prepare, the target's states
    run = prepare(cfg, kind, accelerator, model, module, train_rows, eval_rows, tokenizer.pad_token_id)

    # 5. resume
    resume(run)

    # 6. the loop
    stopped = train_loop(run)
    if stopped is not None:
        accelerator.end_training()
        log.warning("stopped by signal %d at step %d; checkpoint saved to %s; rerun with checkpoint.resume_from=latest "
                    "to continue", stopped, run.progress.step, run.last_ckpt)
        return TrainResult("interrupted", run.progress.step, run.last_ckpt, None, None, signal=int(stopped))

    # 7. measure acc[k][r], save the draft with it (Medusa and Hydra heads: and the tree built from it)
    accuracy = final_accuracy(run)
    heads_dir = kind.save(cfg, accelerator, run.heads, config, model, accuracy)
    accelerator.end_training()

    # 8. publish: all files in one commit, or a PublishError saying what the repo holds; the draft stays saved
    published = None
    if cfg.publish.repo_id is not None and accelerator.is_main_process:
        published = push_folder(heads_dir, cfg.publish.repo_id, private=cfg.publish.private,
                                revision=cfg.publish.revision).url
        log.info("published %s to %s", heads_dir, published)
    return TrainResult("done", run.progress.step, run.last_ckpt, heads_dir, accuracy, published=published)


def check_publish(cfg: TrainConfig) -> None:
    """A recipe that publishes needs a Hub token: refuse it before training, not after hours of it."""
    if cfg.publish.repo_id is not None and find_token()[0] is None:
        raise ValueError(f"publish.repo_id={cfg.publish.repo_id} is set but no Hub token was found: set HF_TOKEN or "
                         "run `hf auth login`, or drop publish.repo_id and publish later with python -m heads.publish")


# -------------------------------------------------------------------------------------------------- the steps
def prepare(cfg: TrainConfig, kind: HeadKind, accelerator: Accelerator, model, module: torch.nn.Module, train_rows,
            eval_rows, pad_id: int) -> Run:
    """Steps 3 and 4: the loaders (a fixed held-out subset with eval.max_batches), AdamW and its schedule, the draft
    prepared by accelerate (the target stays outside: only the draft is trained / wrapped), and the target's states
    (hidden states, from the cache when it has them) that the kind reads."""
    train_dl = loader(train_rows, cfg.optim.batch_size, True, pad_id)
    if cfg.eval.max_batches is not None:  # a fixed held-out subset, always read to its end (see run_eval)
        keep = cfg.eval.max_batches * cfg.eval.batch_size * accelerator.num_processes
        eval_rows = eval_rows.select(range(min(len(eval_rows), keep)))
    eval_dl = loader(eval_rows, cfg.eval.batch_size, False, pad_id) if len(eval_rows) else None
    optimizer, scheduler, total_steps = optimizer_and_schedule(cfg, accelerator, module, len(train_rows))
    check_zero3(accelerator, module)
    prepared = accelerator.prepare(module, optimizer, train_dl, scheduler, *([eval_dl] if eval_dl else []))
    heads, optimizer, train_dl, scheduler = prepared[:4]
    eval_dl = prepared[4] if eval_dl else None
    needs = kind.hidden_pass(cfg, heads)
    caches = make_caches(cfg, accelerator, model, {"train": train_rows, "eval": eval_rows}, layer=needs.layer,
                         feature_layers=needs.feature_layers)
    states = TargetStates(model, accelerator.device, accelerator.autocast, "kl" if needs.target_logits else "ce",
                          caches, cfg.hidden_cache.dtype, layer=needs.layer, feature_layers=needs.feature_layers,
                          logit_vocab=needs.logit_vocab)
    uses_deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    log.info("process %d/%d on %s: %d train rows, %d batches per epoch, %d optimizer steps in all%s",
             accelerator.process_index, accelerator.num_processes, accelerator.device, len(train_rows), len(train_dl),
             total_steps, " (DeepSpeed: heads only in the engine)" if uses_deepspeed else "")
    return Run(cfg, kind, accelerator, heads, optimizer, scheduler, train_dl, eval_dl, states, total_steps)


def resume(run: Run) -> None:
    """Step 5: the draft, optimizer, schedule, RNG and progress of the checkpoint checkpoint.resume_from names."""
    cfg = run.cfg
    run.last_ckpt = resolve_resume(cfg.checkpoint.resume_from, run.ckpt_root)
    if run.last_ckpt is None:
        if cfg.checkpoint.resume_from is not None and run.accelerator.is_main_process:  # afresh: nothing logged stays
            trim_metrics(run.metrics_file, 0)
        return
    check_intact(run.last_ckpt, run.ckpt_root, cfg.checkpoint.resume_from, run.accelerator.process_index)
    run.accelerator.load_state(str(run.last_ckpt))
    run.progress = load_progress(run.last_ckpt)
    if run.accelerator.is_main_process:  # the steps after the checkpoint are trained, and logged, again
        trim_metrics(run.metrics_file, run.progress.step)
    log.info("resumed from %s at step %d (epoch %d, batch %d)", run.last_ckpt, run.progress.step, run.progress.epoch,
             run.progress.batch_in_epoch)


def train_loop(run: Run) -> int | None:
    """Step 6: epochs until the last optimizer step; the signal that stopped it early (after a checkpoint), or None."""
    bar = tqdm(total=run.total_steps, initial=run.progress.step, desc="training heads", dynamic_ncols=True,
               disable=not (run.accelerator.is_main_process and run.cfg.logging.progress_bar))
    window = Window(run.kind.predictions(run.cfg))
    stopped = None
    if run.cfg.optim.max_minutes is not None:
        run.deadline = time.monotonic() + 60 * run.cfg.optim.max_minutes
    with StopFlag() as stop:
        while run.progress.step < run.total_steps and stopped is None:
            stopped = train_epoch(run, stop, bar, window)
    bar.close()
    return stopped


def train_epoch(run: Run, stop: StopFlag, bar: tqdm, window: Window) -> int | None:
    """One pass over the training batches (a resumed run skips those its checkpoint has seen), ending early at the
    last optimizer step or a signal; the signal, or None."""
    progress, accelerator = run.progress, run.accelerator
    epoch_start = time.perf_counter()
    run.train_dl.set_epoch(progress.epoch)
    batches = run.train_dl
    if progress.batch_in_epoch:  # resumed mid-epoch: skip the batches the checkpoint has already seen
        batches = accelerator.skip_first_batches(run.train_dl, progress.batch_in_epoch)
    stopped = None
    for batch in batches:
        out, signalled, late = train_step(run, batch, stop)
        progress.batch_in_epoch += 1
        window.add(out, run.states.take_seconds())
        if not accelerator.sync_gradients:
            continue
        if late:  # optim.max_minutes: this optimizer step is the last
            run.total_steps = bar.total = progress.step + 1
        stopped = after_step(run, bar, window, stop if signalled else None)
        if stopped is not None or progress.step >= run.total_steps:
            break
    else:
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
    emit(accelerator, run.metrics_file, {
        "step": progress.step, "epoch_seconds": time.perf_counter() - epoch_start,
        "target_seconds_total": run.states.seconds_total, "cache_hits": run.states.cache_hits})
    return stopped


def train_step(run: Run, batch: dict, stop: StopFlag) -> tuple[MedusaLoss, bool, bool]:
    """One micro-batch: the loss, backward, and the optimizer step when the accumulated batches are complete; (the
    loss, whether a signal arrived on any process, whether any process is past optim.max_minutes)."""
    cfg, progress, accelerator = run.cfg, run.progress, run.accelerator
    # training accuracy is measured on the batches of each logged step only (for an EAGLE head it is a
    # full-vocabulary pass, a sizeable share of a step on a CPU); the loss is logged for every batch
    logged = (progress.step + 1) % cfg.logging.every == 0 or progress.step + 1 == run.total_steps
    with accelerator.accumulate(run.heads):
        # under autocast as the heads' forward is: a kind's loss runs the draft's LM head (and the target's, on the
        # draft vocabulary) outside that forward, the largest matrix products of a step (docs/benchmarks/log.md §53)
        with accelerator.autocast():
            out = heads_loss(cfg, run.heads, run.states, batch, "train", ranks=5 if logged else 0)
        # every process learns of a NaN or a signal on any of them, before backward's all-reduce
        late = run.deadline is not None and time.monotonic() >= run.deadline
        flags = torch.tensor([float(not torch.isfinite(out.total)), float(stop.signum is not None), float(late)])
        flags = accelerator.reduce(flags.to(accelerator.device), "sum")
        if flags[0] > 0:
            raise TrainingDiverged(
                f"the loss became {out.total.item()} at step {progress.step + 1} (epoch {progress.epoch}, "
                f"batch {progress.batch_in_epoch}); last good checkpoint: {run.last_ckpt or 'none'}. "
                f"Resume from it with checkpoint.resume_from={run.last_ckpt or 'latest'} and a lower "
                f"optim.lr, or look for bad rows.")
        accelerator.backward(out.total)
        if accelerator.sync_gradients and cfg.optim.max_grad_norm is not None:
            accelerator.clip_grad_norm_(run.heads.parameters(), cfg.optim.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return out, bool(flags[1] > 0), bool(flags[2] > 0)


def after_step(run: Run, bar: tqdm, window: Window, signalled: StopFlag | None) -> int | None:
    """After an optimizer step: progress, the logged window, periodic held-out accuracy, a checkpoint every N steps
    and on a signal (``signalled``: the flag that caught it, on any process); the signal, or None."""
    cfg, progress, accelerator = run.cfg, run.progress, run.accelerator
    progress.step += 1
    bar.update(1)
    if progress.batch_in_epoch == len(run.train_dl):  # epoch complete: a checkpoint here resumes at the next
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
    if progress.step % cfg.logging.every == 0 or progress.step == run.total_steps:
        record = window.flush(accelerator, progress.step, run.scheduler.get_last_lr()[0])
        bar.set_postfix(loss=f"{record['loss']:.4f}", top1=f"{record['top1'][0]:.3f}")
        emit(accelerator, run.metrics_file, record)
    periodic_eval = cfg.eval.every > 0 and run.eval_dl is not None  # the end always measures (step 7)
    if periodic_eval and progress.step % cfg.eval.every == 0 and progress.step < run.total_steps:
        emit(accelerator, run.metrics_file, {"step": progress.step, **run.evaluate(5)})
    if signalled is not None or (cfg.checkpoint.every and progress.step % cfg.checkpoint.every == 0):
        run.last_ckpt = save_checkpoint(accelerator, run.ckpt_root, progress.step, cfg.checkpoint.keep, progress)
    if signalled is not None:
        return signalled.signum or signal.SIGTERM
    return None


def final_accuracy(run: Run) -> list[list[float]] | None:
    """Step 7's measure: acc[k][r] (r < eval.ranks) on the held-out rows, logged; None without held-out rows."""
    if run.eval_dl is None:
        log.warning("no held-out rows (data.eval_fraction=0): the heads are saved without measured accuracy or tree")
        return None
    result = run.evaluate(run.cfg.eval.ranks)
    emit(run.accelerator, run.metrics_file, {"step": run.progress.step, "final": True, **result})
    return result["accuracy"]
