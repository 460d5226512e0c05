"""``python infer.py main-job``: the README's main job as one resumable command. It trains a block drafter for the
recipe's target, tunes its tree to this machine in each dtype (alone, and merged with prompt lookup), then benchmarks
both against plain decoding and transformers' prompt lookup on Spec-Bench's MT-bench questions. Each step is one of
the commands ``--dry-run`` prints, run as a child process; a step that is done is skipped, one that was stopped
resumes:

  1. train      ``train.py --config RECIPE checkpoint.resume_from=latest``: skipped when <output_dir>/block_head holds
                a trained drafter (its ``model.safetensors``), else resumed from the run's last checkpoint
  2. tune       ``infer.py tune-tree`` for the drafter and for its merge with prompt lookup: skipped when this job's
                record (<output_dir>/main-job.json) says it tuned these weights on this machine and the trees it
                cached are still there
  3. bench      ``infer.py bench ... --resume``: answers what is not answered yet, then prints the tables

The draft folder follows the recipe's ``output_dir``; the recipe is ``--recipe`` (a block drafter's recipe).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

import torch
import yaml

from selfspec import tuned
from selfspec.core.files import atomic_write
from selfspec.core.models import cache_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "configs/block_smollm2.yaml"
DRAFT_DIR = "block_head"
"""where in its output_dir a block drafter's recipe saves the trained drafter (heads/block/kind.py, ``final_dir``)."""
LOOKUP = "ngram:depth=6,max_nodes=8,copy_depth=12"
DTYPES = "fp32,bf16"
BENCH = ("--per-category", "2", "--max-new-tokens", "128", "--resume")
RECORD = "main-job.json"

STEPS = """steps, and how long each took on a 2-core CPU with bf16 instructions (AMD EPYC Zen 4, docs/BENCHMARKS.md):
  1. train  the recipe's block drafter (18 min; 10 on an Intel Xeon with AMX; a CPU without bf16 instructions
            trains in fp32, 40 min on a 2-core AVX2 EPYC); skipped once <output_dir>/block_head holds it, resumed
            from its last checkpoint after an interruption
  2. tune   tune-tree for the drafter and for its merge with prompt lookup, fp32 and bf16 (8 min); skipped once
            done for these weights on this machine
  3. bench  plain, transformers' prompt lookup (pld), prompt lookup, the drafter @auto and the merge @auto on 16
            MT-bench questions (2 a category), both turns, 128 new tokens, fp32 and bf16 (30 min); resumes where it
            stopped and prints the tables at the end (also in <out-dir>/summary.md)
Run it again after an interruption: finished steps are skipped. --dry-run prints the commands without running them."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    """the command after ``python``: a script and its arguments."""
    done: str | None
    """why the step is skipped (None: it runs)."""


def output_dir(recipe: Path) -> Path:
    """The recipe's ``output_dir``, read from its YAML (a block drafter's recipe: ``method: block``)."""
    if not recipe.is_file():
        raise FileNotFoundError(f"--recipe {recipe}: no such file; expected a block drafter's recipe, e.g. {RECIPE}")
    try:
        data = yaml.safe_load(recipe.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"--recipe {recipe}: not YAML that can be read ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict) or data.get("method") != "block" or not data.get("output_dir"):
        found = data.get("method") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"--recipe {recipe}: the main job trains a block drafter: expected a recipe with method: block "
                         f"and an output_dir, found method {found!r}")
    return Path(data["output_dir"])


def script(name: str) -> str:
    """train.py / infer.py as a user in this directory names it (the steps run in the current directory)."""
    if not (ROOT / name).is_file():
        raise FileNotFoundError(f"{ROOT / name}: the main job runs the scripts of a source checkout (pip install -e .)")
    return name if Path.cwd().resolve() == ROOT else str(ROOT / name)


def draft_specs(draft: Path) -> tuple[str, str]:
    """(the drafter alone, its merge with prompt lookup) as --draft spells them."""
    return str(draft), f"{LOOKUP}+{draft}+skip_after=3"


def tune_state(draft: Path) -> dict:
    """What a tuning is valid for: the drafter's weights and this machine (its CPU and threads)."""
    return {"draft": tuned.draft_stamp(str(draft)), "machine": {**tuned.this_cpu(), "threads": torch.get_num_threads()}}


def read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def tuned_already(record: dict, command: str, draft: Path) -> bool:
    """Whether this job's record says ``command`` ran to its end for these weights on this machine, and the trees it
    cached are still there."""
    entry = record.get(command)
    if not isinstance(entry, dict) or not (draft / "model.safetensors").is_file():
        return False
    trees = entry.get("trees") or []
    return entry.get("state") == tune_state(draft) and bool(trees) and all(Path(t).is_file() for t in trees)


def plan(recipe: Path, out_dir: str) -> list[Step]:
    """The job's steps with what each would do now."""
    run_dir = output_dir(recipe)
    draft = run_dir / DRAFT_DIR
    trained = (draft / "model.safetensors").is_file()
    steps = [Step("1. train", (script("train.py"), "--config", str(recipe), "checkpoint.resume_from=latest"),
                  f"{draft} holds the trained drafter" if trained else None)]
    record = read_record(run_dir / RECORD)
    for what, spec in zip(("the drafter", "its merge with prompt lookup"), draft_specs(draft)):
        argv = (script("infer.py"), "tune-tree", "--draft", spec, "--dtype", DTYPES)
        done = trained and tuned_already(record, shlex.join(argv[1:]), draft)
        steps.append(Step(f"2. tune {what}", argv, "tuned for these weights on this machine" if done else None))
    alone, merged = draft_specs(draft)
    methods = ",".join(["plain", "pld", LOOKUP, f"{alone}@auto", f"{merged}@auto"])
    steps.append(Step("3. bench", (script("infer.py"), "bench", "--methods", methods, "--dtype", DTYPES, *BENCH,
                                "--out-dir", out_dir), None))
    return steps


def tree_files() -> dict[str, int]:
    """The tuned trees cached now, with their modification times."""
    return {str(p): p.stat().st_mtime_ns for p in (cache_dir() / "tuning").glob("tree-*.json")}


def wait(proc: subprocess.Popen) -> int:
    """The child's exit status. Ctrl-C reaches the child too (one process group): it is left to stop itself (training
    saves a checkpoint first), and its status says how it ended."""
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def run_step(step: Step, recipe: Path) -> int:
    """Run one step as a child process; a tune step that ends well is recorded with the trees it cached."""
    tune = step.argv[1] == "tune-tree"
    before = tree_files() if tune else {}
    rc = wait(subprocess.Popen([sys.executable, *step.argv]))
    if rc == 0 and tune:
        run_dir = output_dir(recipe)
        written = sorted(p for p, t in tree_files().items() if before.get(p) != t)
        record = read_record(run_dir / RECORD)
        record[shlex.join(step.argv[1:])] = {"state": tune_state(run_dir / DRAFT_DIR), "trees": written}
        atomic_write(run_dir / RECORD, json.dumps(record, indent=2) + "\n")
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer.py main-job", allow_abbrev=False, epilog=STEPS,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="The README's main job in one resumable command: train a block drafter, "
                                            "tune its tree to this machine, benchmark it.")
    p.add_argument("--recipe", default=RECIPE,
                   help=f"the block drafter's training recipe (default {RECIPE}); the drafter lands in its "
                        "output_dir/block_head")
    p.add_argument("--out-dir", default="outputs/bench", help="the benchmark's folder (default outputs/bench)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each step's command and whether it would run or be skipped; run nothing")
    return p


def main(argv: Sequence[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    a = build_parser().parse_args(argv)
    recipe = Path(a.recipe)
    steps = plan(recipe, a.out_dir)
    for step in steps:
        note = f"skipped: {step.done}" if step.done else "runs"
        if a.dry_run:
            out.write(f"# {step.name} ({note})\npython {shlex.join(step.argv)}\n")
            continue
        err.write(f"\n[main-job] {step.name}: {note}\n$ python {shlex.join(step.argv)}\n")
        err.flush()
        if step.done:
            continue
        rc = run_step(step, recipe)
        if rc != 0:
            again = shlex.join(["python", "infer.py", "main-job", *argv])
            err.write(f"\n[main-job] {step.name} ended with exit status {rc}; `{again}` again resumes: "
                      "finished steps are skipped\n")
            return rc
    if not a.dry_run:
        err.write(f"\n[main-job] done: the tables are in {a.out_dir}/summary.md\n")
    return 0
