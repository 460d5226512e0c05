"""python -m heads.retree: the checkpoint's tree re-fitted to this machine's measured verify cost."""

from __future__ import annotations

import json

import pytest

import tiny_chat_model
from heads import retree
from heads.tree_search import expected_accept_length
from selfspec.tools.costs import VerifyCost


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


def accurate_heads(tmp_path):
    """(model directory, a heads checkpoint with measured head_accuracy) on the tiny chat model."""
    model_dir = tiny_chat_model.build(tmp_path / "model")
    ckpt = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    config = json.loads((ckpt / "config.json").read_text())
    config["head_accuracy"] = [[0.9, 0.05], [0.9, 0.05]]
    (ckpt / "config.json").write_text(json.dumps(config))
    return model_dir, ckpt


def test_no_tree_that_beats_one_token_decoding_is_not_saved(tmp_path, capsys, monkeypatch):
    model_dir, ckpt = accurate_heads(tmp_path)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def verify_costs(target, sizes, repeats, progress):  # each extra node costs a whole step: no tree pays off
        return [VerifyCost(nodes=n, median_ms=10.0 * n, relative=float(n)) for n in sizes]

    monkeypatch.setattr(retree, "verify_costs", verify_costs)
    assert retree.main([str(ckpt), "--model", str(model_dir), "--max-nodes", "8"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: no tree of 1 to 8 draft nodes is predicted to beat one-token decoding in float32 on this machine "
        f"(a verify of 2 tokens takes 20.0 ms, of 1 token 10.0 ms); {ckpt} was not written: decode without the heads "
        "in float32 here, or re-fit for another --dtype or machine")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # untouched, no "tree": [] saved


@pytest.mark.parametrize("option", ["--max-nodes", "--repeats"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_sizes_are_refused_when_parsing(option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        retree.main(["anything", option, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m heads.retree: error: argument {option}: expected an integer >= 1, found {value!r}")


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        retree.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: float32)", "draft nodes (default: 64)", "per tree size (default: 10)",
                    "(default: the checkpoint itself)"):
        assert default in text


def test_wrong_inputs_are_one_error_line(tmp_path, capsys):
    model_dir, ckpt = accurate_heads(tmp_path)
    cases = {
        (str(tmp_path / "missing"),): f"the directory {tmp_path / 'missing'} does not exist: expected a local "
                                      "checkpoint directory (or a Hub repo id 'owner/name'); check the path",
        (str(model_dir),): f"{model_dir} holds a transformers model directory, not Medusa heads (draft_type 'medusa'); "
                           "heads.retree re-fits the tree of Medusa heads",
        (str(ckpt), "--out", str(model_dir)): f"--out {model_dir} already holds a transformers model directory, not a "
                                              "selfspec medusa checkpoint; writing there would overwrite its files: "
                                              "choose another path or delete it",
    }
    hydra = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "hydra").mkdir()
    (tmp_path / "hydra" / "config.json").write_text(json.dumps({**hydra, "draft_type": "hydra"}))
    cases[(str(tmp_path / "hydra"),)] = (f"{tmp_path / 'hydra'} holds a selfspec hydra checkpoint, not Medusa heads "
                                         "(draft_type 'medusa'); heads.retree re-fits the tree of Medusa heads")
    model_files = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    capsys.readouterr()  # building the fixtures' progress bars
    for argv, message in cases.items():
        assert retree.main([*argv, "--model", str(model_dir)]) == 2, argv
        assert capsys.readouterr().err == f"error: {message}\n"
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == model_files


def test_out_may_be_another_medusa_checkpoint(tmp_path, capsys):
    model_dir, ckpt = accurate_heads(tmp_path)
    other = tiny_chat_model.build_heads(model_dir, tmp_path / "other")
    assert retree.main([str(ckpt), "--model", str(model_dir), "--max-nodes", "2", "--repeats", "1",
                        "--out", str(other)]) == 0
    assert json.loads((other / "config.json").read_text())["head_accuracy"] == [[0.9, 0.05], [0.9, 0.05]]
