"""python -m heads.retree: the checkpoint's tree re-fitted to this machine's measured verify cost."""

from __future__ import annotations

import json

import tiny_chat_model
from heads import retree
from heads.tree_search import expected_accept_length


def test_retree_writes_a_tree_from_the_measured_accuracy(tmp_path, capsys):
    model_dir = tiny_chat_model.build(tmp_path / "model")
    ckpt = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    assert retree.main([str(ckpt), "--model", str(model_dir), "--max-nodes", "6", "--repeats", "1"]) == 2
    assert "stores no measured head_accuracy" in capsys.readouterr().err

    config = json.loads((ckpt / "config.json").read_text())
    config["head_accuracy"] = [[0.9, 0.05], [0.9, 0.05]]  # confident heads: any tree this size pays for itself
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "retreed"
    assert retree.main([str(ckpt), "--model", str(model_dir), "--max-nodes", "6", "--repeats", "1",
                        "--out", str(out)]) == 0
    tree = json.loads((out / "config.json").read_text())["tree"]
    assert [0] in tree and 1 <= len(tree) <= 6 and all(c[:-1] in tree or len(c) == 1 for c in tree)
    assert f"tree of {len(tree)} draft nodes" in capsys.readouterr().out
    assert expected_accept_length(config["head_accuracy"], tree) > 1.8
