"""The GPU run's packing (selfspec/tools/gpu.py): files cut into calls that fit a budget, in order; a directory sent
back in parts and joined again byte for byte. (Its whole path is dry-run on the CPU: python -P selfspec/tools/gpu.py
dry-run; on a GPU it runs there, issue 38.)"""

from __future__ import annotations

import os

import pytest

from selfspec.tools import gpu


def test_calls_keep_the_order_and_the_budget(tmp_path):
    sizes = [40, 30, 30, 4, 60, 1]
    items = []
    for k, size in enumerate(sizes):
        (tmp_path / f"f{k}").write_bytes(b"x" * size)
        items.append(("model", tmp_path / f"f{k}"))
    calls = gpu.plan_calls(items, budget=64)
    assert [[p.name for _, p in call] for call in calls] == [["f0"], ["f1", "f2", "f3"], ["f4", "f5"]]
    assert all(sum(p.stat().st_size for _, p in call) <= 64 for call in calls)
    with pytest.raises(ValueError, match="expected at most"):
        gpu.plan_calls(items, budget=50)


def test_a_directory_sent_back_in_parts_is_joined_byte_for_byte(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(os.urandom(2500))
    (draft / "config.json").write_text('{"draft_type": "eagle"}')
    sent = tmp_path / "out"
    gpu.send_back(draft, sent, part_bytes=1000)
    assert sorted(p.name for p in sent.iterdir()) == ["config.json.000", "model.safetensors.000",
                                                      "model.safetensors.001", "model.safetensors.002", "parts.json"]
    back = gpu.unpack(sent, tmp_path / "back")
    for f in draft.iterdir():
        assert (back / f.name).read_bytes() == f.read_bytes()
