"""The accelerate side of training: the accelerator (CPU / GPU / DDP / DeepSpeed from ``accelerate launch``), the
trackers' hyper-parameter table, AdamW and its schedule over the trained module only, and what DeepSpeed ZeRO-3 cannot
train."""

from __future__ import annotations

import json
import logging
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from transformers import get_scheduler

from heads.training.base_model import UnsupportedModel
from heads.training.config import TrainConfig
from selfspec.core.models import bf16_emulated, bf16_warning

logger = logging.getLogger(__name__)


def build_accelerator(cfg: TrainConfig) -> Accelerator:
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = cfg.cpu if cfg.cpu is not None else (not torch.cuda.is_available() and not uses_deepspeed)
    if uses_deepspeed and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op when it starts (minutes on a small CPU),
        # even for a single process, which has nothing to reduce: mark the op unavailable so it falls back to gloo.
        import deepspeed.ops  # optional heavy dependency: only under DeepSpeed, whose import costs seconds

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    precision = mixed_precision(cfg.mixed_precision, cpu)
    if cpu and precision == "bf16" and bf16_emulated("cpu"):
        logger.warning(bf16_warning(
            "mixed_precision=bf16 trains several times slower than fp32 here (the block drafter's recipe on a 2-core "
            "AVX2 EPYC: 56 s a step against 8.3 s); pass mixed_precision=auto (or null) to train in fp32"))
    elif cfg.mixed_precision == "auto":
        logger.info(f"mixed_precision=auto: {precision} on this machine")
    return Accelerator(
        cpu=cpu, mixed_precision=precision, gradient_accumulation_steps=cfg.optim.grad_accum,
        log_with=cfg.logging.log_with or None, project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )


def mixed_precision(wanted: str | None, cpu: bool) -> str | None:
    """The recipe's mixed_precision for accelerate: 'auto' -> 'bf16' where bf16 is computed in hardware (a CUDA GPU
    that supports it; a CPU with AVX512-BF16 or AMX), else 'no'; anything else as written."""
    if wanted != "auto":
        return wanted
    if not cpu and torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "no" if bf16_emulated("cpu") else "bf16"


def tracker_params(d: dict, prefix: str = "") -> dict:
    """Nested recipe -> flat {a.b: scalar} (lists and None as text) for trackers' hyper-parameter tables."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(tracker_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


def optimizer_and_schedule(cfg: TrainConfig, accelerator: Accelerator, module: torch.nn.Module,
                           train_rows: int) -> tuple[torch.optim.Optimizer, object, int]:
    """(AdamW over the module's trainable parameters only, its warm-up + schedule (transformers' ``get_scheduler``),
    the optimizer steps of the whole run) for ``train_rows`` training rows."""
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    batches_per_epoch = math.ceil(train_rows / (cfg.optim.batch_size * accelerator.num_processes))
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.optim.grad_accum)
    total_steps = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    # a prepared scheduler steps once per process per optimizer step (accelerate's convention)
    scheduler = get_scheduler(cfg.optim.scheduler, optimizer,
                              num_warmup_steps=cfg.optim.warmup_steps * accelerator.num_processes,
                              num_training_steps=total_steps * accelerator.num_processes)
    return optimizer, scheduler, total_steps


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
