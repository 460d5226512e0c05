"""Cached target hidden states: exact round trip, rows keyed by dataset index, fingerprinted, and the target is not run
again for cached rows; a training run reads the cache in its second epoch."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from heads.training.base_model import final_hidden, load_base
from heads.training.config import ModelConfig
from selfspec.core.draft_vocab import DraftVocab
from heads.training.hidden_cache import HiddenCache, TargetStates, round_trip, rows_fingerprint

REPO = Path(__file__).resolve().parents[2]
D = 8


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_round_trip_exactly_by_index(tmp_path, dtype):
    fp = {"test": dtype}
    lengths = [3, 5, 2]
    HiddenCache.create(tmp_path, fp, lengths, D, dtype)
    cache = HiddenCache.open(tmp_path, fp)
    assert not cache.has([0]) and cache.fraction_filled == 0.0
    hidden = round_trip(torch.randn(2, 5, D), dtype)  # rows 2 and 1 of the dataset, padded to 5
    cache.write([2, 1], [2, 5], hidden)
    assert cache.has([1, 2]) and not cache.has([0, 1])
    again = HiddenCache.open(tmp_path, fp)  # another process / a resumed run sees the same rows
    read = again.read([1, 2], [5, 2], 6).float()  # [2, 6, D]
    assert torch.equal(read[0, :5], hidden[1]) and torch.equal(read[1, :2], hidden[0, :2])
    assert read[0, 5:].abs().sum() == 0 and read[1, 2:].abs().sum() == 0
    with pytest.raises(ValueError, match="row 0 holds 3 tokens, the batch has 4"):
        again.read([0], [4], 4)


def test_another_fingerprint_is_another_cache(tmp_path):
    HiddenCache.create(tmp_path, {"model": "a"}, [2], D, "float16")
    with pytest.raises(FileNotFoundError, match="no hidden cache at"):
        HiddenCache.open(tmp_path, {"model": "b"})


def test_fp16_overflow_is_refused_with_a_way_out():
    with pytest.raises(ValueError, match="overflow float16.*hidden_cache.dtype=bfloat16"):
        round_trip(torch.tensor([1.0, 1e6]), "float16")


def test_rows_fingerprint_sees_every_token():
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[1, 2, 3], [4, 5]]})
    changed = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 6]], "labels": [[1, 2, 3], [4, 5]]})
    (fp, lengths), (fp2, _) = rows_fingerprint(rows), rows_fingerprint(changed)
    assert lengths == [3, 2] and fp["tokens"] == 5
    assert fp["ids_sha256"] != fp2["ids_sha256"]
    assert rows_fingerprint(rows.select([0, 1]))[0] == fp  # an index mapping is resolved first


def test_cached_rows_skip_the_target_and_give_identical_hidden_states(tmp_path):
    model, _ = load_base(ModelConfig(name="tiny-random-llama"))
    calls = []
    model.get_decoder().register_forward_hook(lambda *args: calls.append(1))
    HiddenCache.create(tmp_path, {"t": 1}, [6, 4], model.config.hidden_size, "float16")
    states = TargetStates(model, torch.device("cpu"), contextlib.nullcontext, "kl",
                          {"train": HiddenCache.open(tmp_path, {"t": 1})}, "float16")
    ids = torch.randint(3, 200, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    batch = {"index": torch.tensor([0, 1]), "lengths": torch.tensor([6, 4]), "input_ids": ids, "attention_mask": mask}
    first, first_logits = states(batch, "train")
    assert len(calls) == 1 and states.cache_hits == 0
    second, second_logits = states(batch, "train")
    assert len(calls) == 1 and states.cache_hits == 1  # the target did not run again
    assert torch.equal(first[0], second[0]) and torch.equal(first[1, :4], second[1, :4])
    assert torch.equal(first_logits[0], second_logits[0])
    states(batch, "eval")
    assert len(calls) == 2  # a split without a cache runs the target
    direct = final_hidden(model, ids, mask)
    assert torch.allclose(first[0], direct[0], atol=1e-2)  # only fp16 rounding between the cache and the target
    rows = torch.tensor([0, 7, 42, 199])  # a draft vocabulary: the KL loss reads the target's logits there only
    vocab = DraftVocab(len(rows), model.config.vocab_size)
    vocab.set(rows)
    on_rows = TargetStates(model, torch.device("cpu"), contextlib.nullcontext, "kl",
                           {"train": HiddenCache.open(tmp_path, {"t": 1})}, "float16", logit_vocab=vocab)
    _, rows_logits = on_rows(batch, "train")
    assert rows_logits.shape == (2, 6, 4)
    torch.testing.assert_close(rows_logits, second_logits[..., rows], rtol=1e-5, atol=1e-6)


def test_training_reads_the_cache_in_its_second_epoch_with_the_kl_loss(tmp_path):
    out = tmp_path / "cached"
    cmd = [sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", f"output_dir={out}",
           "hidden_cache.enabled=true", "loss.kind=kl", "optim.max_steps=null", "optim.epochs=2",
           "data.max_conversations=48",
           "checkpoint.every=0", "eval.every=0", "logging.log_with=[]"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "epoch_seconds" in line]
    assert len(epochs) == 2
    assert epochs[0]["cache_hits"] == 0  # first epoch: every batch ran the target and filled the cache
    # second epoch: every training batch read the cache (the count is cumulative and includes no eval batches)
    train_rows = max(json.loads(p.read_text())["rows"] for p in out.glob("hidden_cache/*/meta.json"))
    assert epochs[1]["cache_hits"] == int(np.ceil(train_rows / 4))  # optim.batch_size = 4
    assert "hidden cache (train)" in result.stderr
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert all(np.isfinite(losses)) and min(losses) >= 0.0  # a KL divergence
