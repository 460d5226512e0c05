"""What a training run reports: training metrics summed over a logging window (reduced over processes), written to
the accelerate trackers (TensorBoard, ...) and as one JSON line per record to ``<output_dir>/metrics.jsonl``.

Shapes: K heads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator


class Window:
    """Training metrics summed over the micro-batches since the last log line."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.reset()

    def reset(self) -> None:
        self.loss, self.batches, self.start = 0.0, 0, time.perf_counter()
        self.head_loss = torch.zeros(self.num_heads, dtype=torch.float64)
        self.hits = torch.zeros(self.num_heads, 5, dtype=torch.float64)
        self.count = torch.zeros(self.num_heads, dtype=torch.float64)
        self.target_s = 0.0

    def add(self, out, target_seconds: float) -> None:
        self.loss += out.total.item()
        self.batches += 1
        self.head_loss += out.per_head.double().cpu()
        measured = out.hits[:, :5].double()  # [K, R <= 5]; R = 0 when the batch was not measured
        self.hits[:, : measured.shape[1]] += measured
        self.count += out.count.double()
        self.target_s += target_seconds

    def flush(self, accelerator: Accelerator, step: int, lr: float) -> dict:
        packed = torch.cat([torch.tensor([self.loss, self.batches]), self.head_loss, self.hits.flatten(), self.count])
        packed = accelerator.reduce(packed.to(accelerator.device), "sum").cpu()  # over processes
        K = self.num_heads
        loss, batches, head_loss = packed[0].item(), packed[1].item(), packed[2 : 2 + K]
        hits, count = packed[2 + K : 2 + 6 * K].view(K, 5), packed[2 + 6 * K :].clamp(min=1)
        seconds = time.perf_counter() - self.start
        record = {"step": step, "loss": loss / batches, "head_loss": (head_loss / batches).tolist(),
                  "top1": (hits[:, 0] / count).tolist(), "top5": (hits.sum(1) / count).tolist(), "lr": lr,
                  "seconds": seconds, "target_seconds": self.target_s}
        self.reset()
        return record


def emit(accelerator: Accelerator, metrics_file: Path, record: dict) -> None:
    """One metrics record: to the trackers (scalars, per head) and as a JSON line in <output_dir>/metrics.jsonl."""
    if not accelerator.is_main_process:
        return
    scalars = {}
    for key, value in record.items():
        if key in ("step", "accuracy", "final"):
            continue
        if isinstance(value, list):
            scalars.update({f"{key}/head{k + 1}": v for k, v in enumerate(value)})
        else:
            scalars[key] = value
    accelerator.log(scalars, step=record["step"])
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    with open(metrics_file, "a") as f:
        f.write(json.dumps(record) + "\n")
