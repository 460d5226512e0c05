"""A bench run's log on disk, so a run of hours that is interrupted resumes where it was and loses nothing.

    out_dir/run.json       what the run measures (model, questions, methods, dtypes, tokens, repeats, the tree each
                           DRAFT@auto stands for, the target GGUF and the llama-server of llama.cpp's methods) and
                           when each segment of it ran (the machine, the code, llama-server's version); written
                           atomically
    out_dir/answers.jsonl  one line per finished (method, dtype, question): the answer with its token ids, appended and
                           fsync'ed as soon as it exists; a line cut short by a kill is dropped on resume; a log written
                           before an Answer field existed reads with that field empty

``BenchLog.open`` refuses to continue a log written by a run that measured something else, and to overwrite one
unless told to resume: the answer files of a four-hour run are not lost to a typo in ``--out-dir``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from selfspec.core.files import atomic_write
from selfspec.tools.specbench import Answer

MANIFEST = "run.json"
LOG = "answers.jsonl"
SEGMENTS = "segments"  # when and where each segment of the run ran: differs between segments
AUTO_TREES = "auto_trees"  # {method label: {dtype name: --tree}}: what DRAFT@auto resolved to when the run first met it


class BenchLog:
    """Finished answers by (method label, dtype name, question id); ``add`` makes one durable before returning."""

    def __init__(self, out_dir: Path, manifest: dict[str, Any], done: dict[tuple[str, str, Any], Answer]):
        self.out_dir, self.manifest, self.done = out_dir, manifest, done

    @classmethod
    def open(cls, out_dir: str | Path, manifest: dict[str, Any], segment: dict[str, Any], resume: bool) -> BenchLog:
        """Start a run's log in out_dir, or (resume=True) continue the one there. manifest: what the run measures
        (JSON-able); segment: this invocation's machine and start time, appended to the manifest's segments."""
        out_dir = Path(out_dir)
        path = out_dir / MANIFEST
        done: dict[tuple[str, str, Any], Answer] = {}
        segments: list[dict[str, Any]] = []
        orphans = [p.name for p in (out_dir / LOG, out_dir / "summary.json") if p.is_file()]
        if orphans and not path.is_file():
            raise FileExistsError(f"{out_dir} holds {' and '.join(orphans)} of a bench run but no {MANIFEST} (a run of an "
                                  f"older selfspec, or a damaged one): choose another --out-dir, or delete {out_dir}")
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        finished = _read_log(out_dir / LOG) if old is not None else {}
        if old is not None and not resume and not finished:
            old = None  # a run that failed before its first answer (a bad tree, a crash in the warm-up): start again
        if old is not None:
            if not resume:
                raise FileExistsError(
                    f"{out_dir} already holds a bench run ({len(finished)} answers logged): pass --resume to continue "
                    f"it, or choose another --out-dir (or delete {out_dir} to start over)")
            changed = {k: (old.get(k), manifest.get(k)) for k in {*old, *manifest} - {SEGMENTS, AUTO_TREES}
                       if old.get(k) != manifest.get(k)}
            if changed:
                lines = "; ".join(f"{k}: the run has {was!r}, this command {now!r}" for k, (was, now) in sorted(changed.items()))
                raise ValueError(f"--resume: {out_dir} holds a run that measures something else ({lines}). Pass the "
                                 f"same options to continue it, or choose another --out-dir")
            done = finished
            segments = old.get(SEGMENTS, [])
            auto = old.get(AUTO_TREES, {})
        else:
            auto = {}
        out_dir.mkdir(parents=True, exist_ok=True)
        log = cls(out_dir, {**manifest, AUTO_TREES: auto, SEGMENTS: [*segments, segment]}, done)
        atomic_write(path, json.dumps(log.manifest, indent=1) + "\n")
        atomic_write(out_dir / LOG, "".join(_line(k, a) for k, a in done.items()))  # drops a torn last line
        return log

    def auto_tree(self, method: str, dtype: str, resolve: Callable[[], str]) -> str:
        """The --tree that ``method``'s 'auto' stands for in ``dtype`` in this run: the one recorded when the run first
        resolved it (a resumed run keeps measuring the tree it started with, even if tune-tree has chosen another
        since), else ``resolve()``, recorded now."""
        trees = self.manifest[AUTO_TREES].setdefault(method, {})
        if dtype not in trees:
            trees[dtype] = resolve()
            atomic_write(self.out_dir / MANIFEST, json.dumps(self.manifest, indent=1) + "\n")
        return trees[dtype]

    def warmed_up(self, method: str, dtype: str, seconds: float) -> None:
        """Record how long ``method``'s untimed warm-up took in ``dtype``, in this segment (each segment warms up
        anew): a compiled target's compiling is there, not in any answer's time."""
        segment = self.manifest[SEGMENTS][-1]
        segment.setdefault("warmup_s", {}).setdefault(dtype, {})[method] = round(seconds, 1)
        atomic_write(self.out_dir / MANIFEST, json.dumps(self.manifest, indent=1) + "\n")

    def has(self, method: str, dtype: str, question_id: Any) -> bool:
        return (method, dtype, question_id) in self.done

    def add(self, method: str, dtype: str, answer: Answer) -> None:
        key = (method, dtype, answer.question_id)
        with open(self.out_dir / LOG, "a", encoding="utf-8") as f:
            f.write(_line(key, answer))
            f.flush()
            os.fsync(f.fileno())
        self.done[key] = answer


def read_answers(out_dir: str | Path) -> dict[tuple[str, str, Any], Answer]:
    """A run's logged answers by (method label, dtype name, question id)."""
    return _read_log(Path(out_dir) / LOG)


def _line(key: tuple[str, str, Any], answer: Answer) -> str:
    return json.dumps({"method": key[0], "dtype": key[1], "answer": asdict(answer)}, ensure_ascii=False) + "\n"


def _read_log(path: Path) -> dict[tuple[str, str, Any], Answer]:
    done: dict[tuple[str, str, Any], Answer] = {}
    if not path.is_file():
        return done
    lines = path.read_text(encoding="utf-8").split("\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # the last line, cut short by a kill: that answer is simply redone
                continue
            raise ValueError(f"{path}:{n} is not JSON: the bench log is damaged; delete the line or the directory")
        answer = Answer(**row["answer"])
        done[(row["method"], row["dtype"], answer.question_id)] = answer
    return done
