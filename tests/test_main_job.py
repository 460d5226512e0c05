"""``python infer.py main-job``: the README's main job as one resumable command. Its steps are checked without running
them (--dry-run), and run with the child processes replaced by stubs that write what the real ones write."""

from __future__ import annotations

import io
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from selfspec.tools import cli, main_job

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = "ngram:depth=6,max_nodes=8,copy_depth=12"
POPEN = subprocess.Popen


def expected(recipe: str, draft: str, train: str = "train.py", infer: str = "infer.py") -> list[str]:
    """The README's main job of before this subcommand, step by step, for a recipe whose drafter lands in ``draft``."""
    merge = f"{LOOKUP}+{draft}+skip_after=3"
    return [f"python {train} --config {recipe} checkpoint.resume_from=latest",
            f"python {infer} tune-tree --draft {draft} --dtype fp32,bf16",
            f"python {infer} tune-tree --draft {merge} --dtype fp32,bf16",
            f"python {infer} bench --methods plain,pld,{LOOKUP},{draft}@auto,{merge}@auto --dtype fp32,bf16 "
            "--per-category 2 --max-new-tokens 128 --resume --out-dir outputs/bench"]


def dry_run(*argv: str) -> tuple[list[str], list[str]]:
    """(the commands, the comment line above each) that --dry-run prints."""
    out = io.StringIO()
    assert main_job.main(["--dry-run", *argv], out=out) == 0
    lines = out.getvalue().splitlines()
    return [x for x in lines if not x.startswith("#")], [x for x in lines if x.startswith("#")]


def recipe_file(tmp_path: Path, method: str = "block") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "method": method, "seed": 0}))
    return path


def test_the_dry_run_prints_the_readme_steps_for_the_default_recipe(monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = main_job.RECIPE
    draft = f"{yaml.safe_load((ROOT / recipe).read_text())['output_dir']}/block_head"
    commands, notes = dry_run()
    assert commands == expected(recipe, draft)
    assert [n.split(" (")[0] for n in notes] == ["# 1. train", "# 2. tune the drafter",
                                                 "# 2. tune its merge with prompt lookup", "# 3. bench"]


def test_the_draft_folder_follows_the_recipes_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: the scripts are named by their paths
    recipe = recipe_file(tmp_path)
    commands, notes = dry_run("--recipe", str(recipe))
    assert commands == expected(str(recipe), f"{tmp_path}/run/block_head", train=str(ROOT / "train.py"),
                                infer=str(ROOT / "infer.py"))
    assert all(n.endswith("(runs)") for n in notes)


def test_a_recipe_of_another_kind_or_no_file_is_refused_before_anything_runs(tmp_path, capsys):
    assert cli.main(["main-job", "--recipe", str(recipe_file(tmp_path, method="eagle")), "--dry-run"]) == 2
    assert "expected a recipe with method: block" in capsys.readouterr().err
    assert cli.main(["main-job", "--recipe", str(tmp_path / "none.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("output_dir: [unclosed\n")
    assert cli.main(["main-job", "--recipe", str(tmp_path / "bad.yaml")]) == 2
    assert "not YAML that can be read" in capsys.readouterr().err


class Children:
    """subprocess.Popen for the steps: records each command; train writes the drafter, tune-tree a cached tree."""

    def __init__(self, cache: Path, fail: str | None = None):
        self.cache, self.fail, self.ran = cache, fail, []

    def __call__(self, argv: list[str], **kwargs):
        if argv[0] != sys.executable:  # another child (platform.processor() runs uname)
            return POPEN(argv, **kwargs)
        command = argv[1:]
        self.ran.append(command)
        self.rc = 1 if self.fail and self.fail in command else 0
        if self.rc == 0 and command[0].endswith("train.py"):
            draft = Path(yaml.safe_load(Path(command[2]).read_text())["output_dir"]) / "block_head"
            draft.mkdir(parents=True)
            (draft / "model.safetensors").write_bytes(b"weights")
        if self.rc == 0 and command[1] == "tune-tree":
            (self.cache / "tuning").mkdir(parents=True, exist_ok=True)
            for dtype in command[-1].split(","):
                (self.cache / "tuning" / f"tree-{len(self.ran)}-{dtype}.json").write_text("{}")
        return self

    def wait(self) -> int:
        return self.rc


def test_each_step_runs_once_and_a_second_run_only_resumes_the_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    children = Children(tmp_path / "cache")
    monkeypatch.setattr(subprocess, "Popen", children)
    recipe = str(recipe_file(tmp_path))
    err = io.StringIO()
    assert main_job.main(["--recipe", recipe], err=err) == 0
    assert [c[1] if c[1] != "--config" else "train" for c in children.ran] == ["train", "tune-tree", "tune-tree",
                                                                                "bench"]
    assert "done: the tables are in outputs/bench/summary.md" in err.getvalue()
    children.ran.clear()
    assert main_job.main(["--recipe", recipe], err=io.StringIO()) == 0
    assert [c[1] for c in children.ran] == ["bench"]  # --resume: it answers what is left and prints the tables
    _, notes = dry_run("--recipe", recipe)
    assert [n.split("(")[1] for n in notes] == [f"skipped: {tmp_path}/run/block_head holds the trained drafter)",
                                                "skipped: tuned for these weights on this machine)",
                                                "skipped: tuned for these weights on this machine)", "runs)"]


def test_a_tuning_is_done_again_for_new_weights_or_when_its_trees_are_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    children = Children(tmp_path / "cache")
    monkeypatch.setattr(subprocess, "Popen", children)
    recipe = str(recipe_file(tmp_path))
    assert main_job.main(["--recipe", recipe], err=io.StringIO()) == 0
    (tmp_path / "run" / "block_head" / "model.safetensors").write_bytes(b"retrained")
    _, notes = dry_run("--recipe", recipe)
    assert [n.endswith("(runs)") for n in notes] == [False, True, True, True]
    assert main_job.main(["--recipe", recipe], err=io.StringIO()) == 0  # tuned again for the new weights
    assert [c[1] for c in children.ran][4:] == ["tune-tree", "tune-tree", "bench"]
    for tree in (tmp_path / "cache" / "tuning").glob("tree-6-*.json"):  # the merge's trees of this second run
        tree.unlink()
    _, notes = dry_run("--recipe", recipe)
    assert [n.endswith("(runs)") for n in notes] == [False, False, True, True]


def test_a_failed_step_stops_the_job_and_says_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    children = Children(tmp_path / "cache", fail="tune-tree")
    monkeypatch.setattr(subprocess, "Popen", children)
    recipe = str(recipe_file(tmp_path))
    err = io.StringIO()
    assert main_job.main(["--recipe", recipe], err=err) == 1
    assert [c[1] for c in children.ran][1:] == ["tune-tree"]  # nothing after the step that failed
    assert f"`{shlex.join(['python', 'infer.py', 'main-job', '--recipe', recipe])}` again resumes" in err.getvalue()
    assert not (tmp_path / "run" / "main-job.json").exists()  # a failed tuning is not recorded as done


def test_help_names_each_step_and_its_time(capsys):
    with pytest.raises(SystemExit):
        main_job.main(["--help"])
    text = capsys.readouterr().out
    assert all(f"{i}. {name}" in text for i, name in ((1, "train"), (2, "tune"), (3, "bench")))
    assert "18 min" in text and "8 min" in text and "30 min" in text
