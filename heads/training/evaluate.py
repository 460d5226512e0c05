"""A batch's loss, asked of the kind of draft being trained (heads/kinds.py), and held-out loss and accuracy acc[k][r]
measured exactly across processes.

Shapes: K predictions per position, R measured ranks, B batch.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from heads.kinds import kind_for
from heads.training.config import TrainConfig
from heads.training.losses import MedusaLoss


def heads_loss(cfg: TrainConfig, heads, states, batch: dict, split: str, ranks: int,
               per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
    """The loss of a batch: the target's states of it (``states``, heads/training/hidden_cache.py ``TargetStates``),
    then the trained kind's loss over them (the heads run only on the positions some head is scored on).

    per_row: a list with one MedusaLoss per row of the batch (for exact held-out counts across processes).
    """
    hidden, target_logits = states(batch, split)  # [B, T, D], [B, T, V] or None
    return kind_for(cfg.method).loss(cfg, heads, hidden, target_logits, batch, ranks, per_row)


@torch.no_grad()
def run_eval(cfg: TrainConfig, accelerator: Accelerator, heads, eval_dl, states, ranks: int) -> dict:
    """Held-out loss and acc[k][r] (r < ranks), exact across processes (duplicated padding rows are dropped)."""
    heads.eval()
    K = kind_for(cfg.method).predictions(cfg)
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
