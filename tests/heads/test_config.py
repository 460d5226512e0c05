"""The training recipe: strict YAML + overrides, errors that say expected vs found, the shipped recipes load."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import SchedulerType

from heads.kinds import every_kind
from heads.training.config import TrainConfig, usable_schedulers
from heads.training.recipe import apply_overrides, describe, load_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["medusa_tiny.yaml", "medusa_smollm2.yaml", "hydra_smollm2.yaml", "exit_smollm2.yaml",
                                  "eagle_smollm2.yaml", "eagle3_smollm2.yaml"])
def test_shipped_recipes_load_and_start_with_their_command(name):
    path = REPO / "configs" / name
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    first = path.read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in first)
    assert any(f"train.py --config configs/{name}" in line for line in first)


def test_yaml_and_overrides_reach_nested_fields(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-4\n  batch_size: 2\nmodel:\n  name: tiny-random-llama\n")
    cfg = load_config(path, ["optim.batch_size=8", "data.max_length=64",
                             "model.config={model_type: llama, hidden_size: 32}",
                             "output_dir=007", "checkpoint.resume_from=latest", "mixed_precision=null"])
    assert cfg.optim.lr == 1e-4  # YAML 1.1 reads 1e-4 as text; a float field takes it as the number
    assert cfg.optim.batch_size == 8 and cfg.data.max_length == 64
    assert cfg.model.config == {"model_type": "llama", "hidden_size": 32}
    assert cfg.output_dir == "007"  # a str field keeps the text as written
    assert cfg.checkpoint.resume_from == "latest" and cfg.mixed_precision is None
    assert cfg.optim.epochs == TrainConfig().optim.epochs  # untouched fields keep their defaults


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.max_step=3", r"unknown key 'optim.max_step'; did you mean 'optim.max_steps'"),
        ("max_steps=3", r"unknown key 'max_steps'; did you mean 'optim.max_steps'\?"),
        ("data.max_lenght=3", r"unknown key 'data.max_lenght'; did you mean 'data.max_length'\?"),
        ("optim.lr=abc", r"optim.lr: expected float, found str 'abc'"),
        ("heads.num_heads=2.5", r"heads.num_heads: expected int, found float 2.5"),
        ("heads.num_heads=true", r"heads.num_heads: expected int, found bool True"),
        ("logging.log_with=tensorboard", r"logging.log_with: expected a list, found str 'tensorboard'"),
        ("heads.projection=full", r"heads.projection: expected one of \['shared', 'own', 'lora'\], found 'full'"),
        ("mixed_precision=fp8", r"mixed_precision: expected one of 'no'/'fp16'/'bf16'/'auto' \| null, found str 'fp8'"),
        ("optim.max_steps=0", r"optim.max_steps: expected null or a value >= 1, found 0"),
        ("loss.decay=1.5", r"loss.decay: expected a value in \(0, 1\], found 1.5"),
        ("optim.lr.peak=1", r"override 'optim.lr.peak=1': optim.lr is 0.001, not a section"),
        ("optim.lr", r"override 'optim.lr': expected key=value"),
    ],
)
def test_bad_recipes_fail_saying_expected_and_found(tmp_path, override, message):
    path = write(tmp_path, "optim:\n  lr: 0.001\n")
    with pytest.raises(ValueError, match=message):
        load_config(path, [override])


SCHEDULERS = usable_schedulers()
# values that passed the recipe and failed only once the model and data had loaded (torch's AdamW, transformers'
# get_scheduler, clipping, set_seed, MedusaConfig), or silently did something else
OUT_OF_RANGE = [
    ("optim.lr=-1", "optim.lr: expected a finite value > 0, found -1.0"),
    ("optim.lr=0", "optim.lr: expected a finite value > 0, found 0.0"),
    ("optim.lr=.nan", "optim.lr: expected a finite value > 0, found nan"),
    ("optim.scheduler=bogus", f"optim.scheduler: expected one of {SCHEDULERS} (transformers' schedules that need only "
                              "a warm-up and a length), found 'bogus'"),
    ("optim.scheduler=reduce_lr_on_plateau", f"optim.scheduler: expected one of {SCHEDULERS} (transformers' schedules "
                                             "that need only a warm-up and a length), found 'reduce_lr_on_plateau'"),
    ("optim.betas=[2,3]", "optim.betas: expected two numbers in [0, 1), found [2.0, 3.0]"),
    ("optim.betas=[0.9, 1]", "optim.betas: expected two numbers in [0, 1), found [0.9, 1.0]"),
    ("optim.betas=[0.9]", "optim.betas: expected two numbers in [0, 1), found [0.9]"),
    ("optim.weight_decay=-0.1", "optim.weight_decay: expected a finite value >= 0, found -0.1"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm: expected null (no clipping) or a finite value > 0, found 0.0"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm: expected null (no clipping) or a finite value > 0, found -1.0"),
    ("seed=-1", "seed: expected a value in [0, 2**32), found -1"),
    ("heads.lora_rank=0", "heads.lora_rank: expected a value >= 1, found 0"),
    ("exit.draft_vocab=-1", "exit.draft_vocab: expected a value >= 0, found -1"),
    ("eagle.topk=0", "eagle.topk: expected a value >= 1, found 0"),
    ("exit.stop_below=1", "exit.stop_below: expected a probability in [0, 1), found 1.0"),
]


@pytest.mark.parametrize("override, message", OUT_OF_RANGE)
def test_out_of_range_values_fail_in_the_recipe_naming_the_key(override, message):
    with pytest.raises(ValueError) as err:
        load_config(REPO / "configs" / "medusa_smollm2.yaml", [override])
    assert str(err.value) == message


def test_schedulers_are_transformers_own_names_that_run_without_extra_arguments():
    assert {"linear", "cosine", "constant_with_warmup"} <= set(SCHEDULERS) <= {s.value for s in SchedulerType}
    assert "reduce_lr_on_plateau" not in SCHEDULERS and "cosine_with_min_lr" not in SCHEDULERS


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_conversations=0", "data.max_conversations: expected null or a value >= 1, found 0"),
        ("data.max_length=1", "data.max_length: expected a value >= 2, found 1"),
        ("data.eval_fraction=1", "data.eval_fraction: expected a value in [0, 1), found 1.0"),
        ("optim.foo=1", "unknown key 'optim.foo' (expected one of ['lr', 'weight_decay', 'betas', 'scheduler', "
                        "'warmup_steps', 'max_grad_norm', 'batch_size', 'grad_accum', 'epochs', 'max_steps', "
                        "'max_minutes'] in section 'optim')"),
        ("optim=0.1", "optim: expected a section (a mapping of optim.* keys), found float 0.1"),
    ],
)
def test_errors_name_the_dotted_key_the_user_typed(override, message):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert str(err.value) == message


@pytest.mark.parametrize(
    "text, problem",
    [
        ("optim:\n  lr: [1\n", "expected ',' or ']', but got '<stream end>' at line 3, column 1 (while parsing a flow "
                               "sequence that starts at line 2, column 7)"),
        ("optim:\n\tlr: 0.1\n", "found character '\\t' that cannot start any token at line 2, column 1 (while scanning "
                               "for the next token)"),
    ],
)
def test_malformed_yaml_file_is_one_message_naming_the_file_and_place(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: expected a YAML mapping of recipe sections, found text YAML cannot read: {problem}"


def test_malformed_override_value_is_one_message_naming_the_override():
    with pytest.raises(ValueError) as err:
        load_config(None, ["optim.betas=[1"])
    assert str(err.value) == ("override 'optim.betas=[1': expected a YAML value (3, 1e-3, true, null, [a, b], ...), "
                              "found '[1', which YAML cannot read: expected ',' or ']', but got '<stream end>' at line 1, "
                              "column 3 (while parsing a flow sequence that starts at line 1, column 1)")
    assert load_config(None, ["output_dir=runs/a: [b"]).output_dir == "runs/a: [b"  # a str field is not parsed


def train_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """train.py's main(argv) in this process, with training (which loads the model and the data) made to fail the
    test if it is reached: (exit status, stderr)."""
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    def loads_anything(cfg):
        raise AssertionError("train.py went on to load the model and the data")

    monkeypatch.setattr(cli, "train", loads_anything)
    status = cli.main(argv)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("override, message", [OUT_OF_RANGE[0], OUT_OF_RANGE[3], OUT_OF_RANGE[5]])
def test_train_py_refuses_bad_values_on_one_line_before_anything_loads(monkeypatch, capsys, override, message):
    status, err = train_cli(["--config", str(REPO / "configs" / "medusa_smollm2.yaml"), override], monkeypatch, capsys)
    assert (status, err) == (2, f"error in the recipe: {message}\n")


def test_train_py_refuses_malformed_yaml_on_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "optim:\n  lr: [1\n")
    status, err = train_cli(["--config", str(path)], monkeypatch, capsys)
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"error in the recipe: {path}: expected a YAML mapping of recipe sections, found text YAML "
                          "cannot read: expected ',' or ']'")
    status, err = train_cli(["optim.betas=[1"], monkeypatch, capsys)
    assert status == 2 and err.count("\n") == 1 and err.startswith("error in the recipe: override 'optim.betas=[1': ")


def test_unknown_section_in_yaml_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'optimizer'; did you mean 'optim'\?"):
        load_config(write(tmp_path, "optimizer:\n  lr: 0.1\n"))
    with pytest.raises(ValueError, match=r"optim: expected a section \(a mapping of optim.\* keys\), found float"):
        load_config(write(tmp_path, "optim: 0.1\n"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_words_yaml_reads_as_booleans_stay_words_or_fail_saying_to_quote_them(tmp_path):
    # the error's own list says 'no': typing mixed_precision=no must give 'no', not YAML 1.1's False
    assert load_config(None, ["mixed_precision=no"]).mixed_precision == "no"
    assert load_config(write(tmp_path, "mixed_precision: 'no'\n")).mixed_precision == "no"
    with pytest.raises(ValueError, match=r"mixed_precision: expected one of 'no'/'fp16'/'bf16'/'auto' \| null, found bool "
                                         r"False \(YAML reads an unquoted no as a boolean: quote it, 'no'\)"):
        load_config(write(tmp_path, "mixed_precision: no\n"))


def test_overrides_do_not_modify_their_input():
    data = {"optim": {"lr": 0.1}}
    assert apply_overrides(data, ["optim.lr=0.2"])["optim"]["lr"] == 0.2
    assert data == {"optim": {"lr": 0.1}}


def test_every_field_is_documented_and_help_lists_them():
    lines = describe()
    assert len(lines) > 40
    undocumented = [line for line in lines if line.rstrip().endswith("):")]
    assert undocumented == []
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # a bound for a hung process, not a speed check: 6.4 s measured on a 2-core EPYC
    assert out.returncode == 0
    assert "optim.lr (float, default 0.001): peak learning rate of AdamW." in out.stdout
    assert "data.seed (int, default 0): seed of the permutation that picks the held-out conversations" in out.stdout


def test_output_dir_help_names_where_every_method_saves_its_draft():
    (line,) = [" ".join(line.split()) for line in describe() if line.strip().startswith("output_dir ")]
    for method, kind in every_kind().items():
        assert f"{kind.final_dir} ({method})" in line, line
    cfg = load_config(None, ["output_dir=runs/x", "method=eagle"])
    assert cfg.final_dir == Path("runs/x/eagle_head")


@pytest.mark.parametrize("precision, emulated, given, warns", [
    ("bf16", True, "bf16", True), ("bf16", False, "bf16", False), (None, True, None, False),
    ("auto", True, "no", False), ("auto", False, "bf16", False)])
def test_bf16_on_a_cpu_without_bf16_instructions_warns_and_auto_trains_in_what_the_cpu_computes(
        monkeypatch, caplog, precision, emulated, given, warns):
    from heads.training import engine

    monkeypatch.setattr(engine, "bf16_emulated", lambda device: emulated)
    built = {}
    # what accelerate is asked for is decided before it is asked: a stand-in records it
    monkeypatch.setattr(engine, "Accelerator", lambda **kwargs: built.update(kwargs))
    cfg = load_config(None, ["cpu=true"] + ([f"mixed_precision={precision}"] if precision else []))
    with caplog.at_level("INFO", logger="heads.training.engine"):
        engine.build_accelerator(cfg)
    assert built["mixed_precision"] == given  # an explicit bf16 is warned about, not changed
    warned = [r.getMessage() for r in caplog.records if "no bf16 instructions" in r.getMessage()]
    assert len(warned) == warns and all("mixed_precision=auto" in w for w in warned)
    if precision == "auto":
        assert any(r.getMessage() == f"mixed_precision=auto: {given} on this machine" for r in caplog.records)


def test_the_shipped_recipes_ask_for_bf16_only_where_the_machine_computes_in_it():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert load_config(path).mixed_precision in ("auto", None), path.name
