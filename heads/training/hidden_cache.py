"""Cached target hidden states: the target is frozen, so its final hidden state for a row never changes (nor do the
hidden states of the layers an EAGLE-3 head reads, stored beside it).

The first time a row is seen its hidden states are computed by the target and written here; every later epoch (and a
resumed run) reads them instead of running the target. Rows are keyed by their index in the dataset (the dataset order),
and a directory holds one dataset split for one target: its name is a hash of everything the hidden states depend on
(the model and its weights, the dtype the target ran in, the exact token ids of every row, the storage dtype), so a
changed recipe never reads stale states.

Layout of ``<root>/<fingerprint hash>/``:

    meta.json     the fingerprint, in words
    offsets.npy   int64 [N + 1]  row i's tokens are hidden[offsets[i] : offsets[i + 1]]
    hidden.bin    half precision [total tokens, W], memory-mapped (bfloat16 is stored as its uint16 bit pattern); W
                  (meta.json's hidden_size) is D, or (1 + S) D: the final states, then those of the S feature layers
                  an EAGLE-3 head reads other than the final one (which is stored once)
    filled.bin    uint8 [N]      1 once row i's hidden states are written (set after the states themselves)

The trainer rounds freshly computed hidden states to the storage dtype before using them (``round_trip``), so a run
reads exactly the numbers it would have computed: caching never changes a loss. Several processes may fill one cache
concurrently (they write disjoint rows); the main process creates the files before the others open them.

``TargetStates`` is what the trainer calls for a batch: it reads the cache when every row of the batch is filled, and
otherwise runs the target (decoder stack only) and fills the cache. The KL loss needs the target's logits too; they are
not stored: they are exactly the LM head applied to the final hidden state, one matmul per token (what a single head
costs), so they are recomputed from the cached states instead of filling the disk with [T, V] or top-k tables.

Shapes: N rows, B batch, T time, D hidden size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, ContextManager

import numpy as np
import torch

import pyarrow.compute as pc

from heads.base import base_sizes
from heads.training.base_model import (expand_feature_states, final_and_layer_states, final_hidden,
                                       layer_and_final_hidden, lm_logits, stored_feature_layers)

log = logging.getLogger(__name__)
STORAGE = {"float16": (np.float16, torch.float16), "bfloat16": (np.uint16, torch.bfloat16)}


def fingerprint_hash(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def round_trip(hidden: torch.Tensor, dtype: str) -> torch.Tensor:
    """hidden rounded to the storage dtype and back: exactly what a later read returns. Raises on overflow."""
    stored = hidden.to(STORAGE[dtype][1])
    if not torch.isfinite(stored).all():
        raise ValueError(f"target hidden states overflow {dtype} (max |h| = {hidden.abs().max().item():.3g}): "
                         "set hidden_cache.dtype=bfloat16")
    return stored.to(hidden.dtype)


class HiddenCache:
    def __init__(self, directory: Path, offsets: np.ndarray, hidden_size: int, dtype: str):
        self.directory, self.offsets, self.hidden_size, self.dtype = directory, offsets, hidden_size, dtype
        np_dtype, self.torch_dtype = STORAGE[dtype]
        total = int(offsets[-1])
        self.hidden = np.memmap(directory / "hidden.bin", dtype=np_dtype, mode="r+", shape=(total, hidden_size))
        self.filled = np.memmap(directory / "filled.bin", dtype=np.uint8, mode="r+", shape=(len(offsets) - 1,))

    # ------------------------------------------------------------------------------------------------ creation
    @staticmethod
    def directory_for(root: str | Path, fingerprint: dict) -> Path:
        return Path(root) / fingerprint_hash(fingerprint)

    @classmethod
    def create(cls, root: str | Path, fingerprint: dict, lengths: list[int], hidden_size: int, dtype: str) -> Path:
        """Make a cache's files (main process only; a no-op when a matching cache exists); returns its directory."""
        if dtype not in STORAGE:
            raise ValueError(f"hidden cache dtype: expected one of {sorted(STORAGE)}, found {dtype!r}")
        directory = cls.directory_for(root, fingerprint)
        if (directory / "meta.json").exists():
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        np.save(directory / "offsets.npy", offsets)
        np_dtype = STORAGE[dtype][0]
        # sparse files of the right size: pages are only allocated as rows are written
        with open(directory / "hidden.bin", "wb") as f:
            f.truncate(int(offsets[-1]) * hidden_size * np.dtype(np_dtype).itemsize)
        with open(directory / "filled.bin", "wb") as f:
            f.truncate(len(lengths))
        meta = {"fingerprint": fingerprint, "rows": len(lengths), "tokens": int(offsets[-1]),
                "hidden_size": hidden_size, "dtype": dtype}
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the cache complete
        return directory

    @classmethod
    def open(cls, root: str | Path, fingerprint: dict) -> "HiddenCache":
        directory = cls.directory_for(root, fingerprint)
        meta_file = directory / "meta.json"
        if not meta_file.exists():
            raise FileNotFoundError(f"no hidden cache at {directory}: expected HiddenCache.create to have made it")
        meta = json.loads(meta_file.read_text())
        if meta["fingerprint"] != fingerprint:
            raise ValueError(f"hidden cache {directory} was built for {meta['fingerprint']}, expected {fingerprint}")
        return cls(directory, np.load(directory / "offsets.npy"), meta["hidden_size"], meta["dtype"])

    # ------------------------------------------------------------------------------------------------ rows
    def __len__(self) -> int:
        return len(self.filled)

    def has(self, indices: list[int]) -> bool:
        return bool(all(self.filled[i] for i in indices))

    @property
    def fraction_filled(self) -> float:
        return float(np.asarray(self.filled).mean()) if len(self) else 1.0

    def _check_row(self, i: int, length: int) -> None:
        stored = int(self.offsets[i + 1] - self.offsets[i])
        if stored != length:
            raise ValueError(f"hidden cache row {i} holds {stored} tokens, the batch has {length}: the dataset changed "
                             f"under {self.directory}")

    def read(self, indices: list[int], lengths: list[int], max_len: int) -> torch.Tensor:
        """-> [B, max_len, D] in the storage dtype, rows right-padded with zeros."""
        out = torch.zeros(len(indices), max_len, self.hidden_size, dtype=self.torch_dtype)
        for b, (i, n) in enumerate(zip(indices, lengths)):
            self._check_row(i, n)
            rows = np.asarray(self.hidden[self.offsets[i] : self.offsets[i + 1]])  # [T_i, D]
            out[b, :n] = torch.from_numpy(rows).view(self.torch_dtype)
        return out

    def write(self, indices: list[int], lengths: list[int], hidden: torch.Tensor) -> None:
        """hidden [B, T, D] (row b's first lengths[b] positions are real) -> stored; rows marked filled afterwards."""
        stored = hidden.detach().to("cpu", self.torch_dtype)
        if self.torch_dtype == torch.bfloat16:
            stored = stored.view(torch.uint16)
        for b, (i, n) in enumerate(zip(indices, lengths)):
            self._check_row(i, n)
            self.hidden[self.offsets[i] : self.offsets[i + 1]] = stored[b, :n].numpy()
        self.hidden.flush()
        for i in indices:
            self.filled[i] = 1
        self.filled.flush()


# ------------------------------------------------------------------------------------- where hidden states come from
def rows_fingerprint(rows) -> tuple[dict, list[int]]:
    """The exact token ids of a dataset split, hashed in order (row i of the cache is row i of this split)."""
    if rows._indices is not None:
        rows = rows.flatten_indices()
    column = rows.data.column("input_ids").combine_chunks()
    ids = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    h = hashlib.sha256(lengths.tobytes())
    h.update(ids.tobytes())
    return {"rows": len(rows), "tokens": int(lengths.sum()), "ids_sha256": h.hexdigest()}, lengths.tolist()


def model_fingerprint(model) -> dict:
    """What a target's hidden states depend on: its config, dtype, and a checksum of its weights."""
    with torch.no_grad():
        checksum = sum(float(p.double().sum()) for p in model.parameters())
    config_sha = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    return {"config_sha256": config_sha, "dtype": str(model.dtype), "weights_sum": repr(checksum)}


def make_caches(cfg, accelerator, model, splits: dict, layer: int | None = None,
                feature_layers: list[int] | None = None) -> dict[str, HiddenCache]:
    """One cache per dataset split when cfg.hidden_cache.enabled (created by the main process, opened by all), of
    what the trained draft reads (``TargetStates``): the final hidden states, or layer ``layer``'s input (an exit
    head), with the states of ``feature_layers`` beside them (an EAGLE-3 head)."""
    if not cfg.hidden_cache.enabled:
        return {}
    root = Path(cfg.hidden_cache.dir or Path(cfg.output_dir) / "hidden_cache")
    target = {"name": cfg.model.name, "revision": cfg.model.revision, **model_fingerprint(model),
              "autocast": accelerator.mixed_precision, "attn_implementation": cfg.model.attn_implementation}
    if layer is not None:  # layer E's input, not the final hidden state
        target["layer_input"] = layer
    layers = feature_layers
    stored = stored_feature_layers(model, layers) if layers else []
    if layers:  # the final hidden states, then those of the EAGLE-3 head's other feature layers
        target["feature_layers"] = list(layers)
        if stored != list(layers):  # the final state listed among them is stored once (a layout of its own)
            target["stored_layers"] = stored
    layer_width, final_width = base_sizes(model, at="layers")[0], base_sizes(model)[0]
    first = layer_width if layer is not None else final_width  # layer E's input, or the final states
    width = first + layer_width * len(stored)
    fingerprints = {}
    for split, rows in splits.items():
        if len(rows) == 0:
            continue
        data_fp, lengths = rows_fingerprint(rows)
        fingerprints[split] = {"version": 1, "target": target, "data": data_fp, "dtype": cfg.hidden_cache.dtype}
        if accelerator.is_main_process:
            HiddenCache.create(root, fingerprints[split], lengths, width, cfg.hidden_cache.dtype)
    accelerator.wait_for_everyone()
    caches = {split: HiddenCache.open(root, fp) for split, fp in fingerprints.items()}
    for split, cache in caches.items():
        log.info("hidden cache (%s): %s, %.0f%% filled", split, cache.directory, 100 * cache.fraction_filled)
    return caches


class TargetStates:
    """A batch -> the frozen target's hidden states [B, T, D] (float32) that the drafts read, from the cache when it
    has them, and for the KL loss the target's logits [B, T, V] computed from its final hidden states.

    layer None: the final hidden states (Medusa heads); E: layer E's input (an exit head), not cached with the KL loss
    (the config refuses that combination: the logits need the final states too). feature_layers (an EAGLE-3 head):
    [B, T, (1 + L) D], the final hidden states then the states at those ``hidden_states`` indices, concatenated (the
    cache holds the final state once, ``expand_feature_states`` repeats it where it is a feature layer). logit_vocab
    (a DraftVocab): the KL loss reads the target's logits on that draft vocabulary only: [B, T, V']
    (heads/training/losses.py)."""

    def __init__(self, model, device: torch.device, autocast: Callable[[], ContextManager], loss_kind: str,
                 caches: dict[str, HiddenCache], cache_dtype: str, layer: int | None = None,
                 feature_layers: list[int] | None = None, logit_vocab=None):
        """autocast: a context-manager factory the target forward runs under (``accelerator.autocast``)."""
        self.model, self.device, self.autocast, self.loss_kind = model, device, autocast, loss_kind
        self.caches, self.cache_dtype, self.layer = caches, cache_dtype, layer
        self.feature_layers, self.logit_vocab = feature_layers, logit_vocab
        self.seconds, self.seconds_total, self.cache_hits = 0.0, 0.0, 0

    @torch.no_grad()
    def __call__(self, batch: dict, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        start = time.perf_counter()
        cache = self.caches.get(split)
        index, lengths = batch["index"].tolist(), batch["lengths"].tolist()
        T = batch["input_ids"].shape[1]
        final = None
        if cache is not None and cache.has(index):
            hidden = cache.read(index, lengths, T).to(self.device).float()  # [B, T, D]
            self.cache_hits += 1
        else:
            with self.autocast():
                if self.feature_layers:
                    hidden = final_and_layer_states(self.model, batch["input_ids"], batch["attention_mask"],
                                                    stored_feature_layers(self.model, self.feature_layers)
                                                    ).float()  # [B, T, (1 + S) D]
                elif self.layer is None:
                    hidden = final_hidden(self.model, batch["input_ids"], batch["attention_mask"]).float()
                else:
                    hidden, final = layer_and_final_hidden(self.model, batch["input_ids"], batch["attention_mask"],
                                                           self.layer)
                    hidden, final = hidden.float(), final.float()  # [B, T, D] each
            if cache is not None:
                hidden = round_trip(hidden, self.cache_dtype)
                cache.write(index, lengths, hidden)
        if self.feature_layers:
            hidden = expand_feature_states(hidden, self.model, self.feature_layers)  # [B, T, (1 + L) D]
        if self.layer is None:
            final = hidden[..., : base_sizes(self.model)[0]]  # [B, T, D]
        target_logits = lm_logits(self.model, final, self.logit_vocab) if self.loss_kind == "kl" else None  # [B, T, V]
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.seconds_total += elapsed
        return hidden, target_logits

    def take_seconds(self) -> float:
        """Seconds spent producing hidden states since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
