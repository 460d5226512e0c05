"""The trainer's data loaders: rows of (input_ids, labels), each with its dataset index (the key of the hidden-state
cache, heads/training/hidden_cache.py), right-padded into batches.

Shapes: B batch, T time (the longest row of the batch).
"""

from __future__ import annotations

import torch


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
